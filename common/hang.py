"""A hang ends, and says where: a watchdog thread on every rank, for the whole run.

The run tells the watchdog which phase it enters: loading, the untrained evaluation, then training,
evaluation or checkpoint of step N, and the final model. A phase that lasts longer than
--collective_timeout seconds is a hang: a rank stopped (SIGSTOP, a dead node), stuck in I/O, or one
rank skipping a collective the others wait in. Then every rank that can still run
  * writes the Python stacks of all its threads to OUTPUT_DIR/hang/stacks-rankN.txt, and its Flight
    Recorder dump (the collectives it issued) to OUTPUT_DIR/hang/flight_recorder_rankN,
  * records in the job's rendezvous store where it was (waiting in a collective, or busy elsewhere)
    and how many collectives it had issued in each process group, and the last one,
and the lowest such rank prints one line that names the phase, the rank that is behind and what
each rank was doing; a rank with no record did not answer (stopped, or gone), and is killed if it
is on the node. The ranks exit with status 3, and the launcher (launch/torchrun.py) leaves
torchrun's own report out. Checkpoints are
untouched: a checkpoint counts only once its marker is written, which a hung save never reaches.

On a GPU, collectives are asynchronous: every rank queues them and then blocks where it next needs
a result (the step's one read of its figures), so every rank's stack looks the same. What tells the
rank that is behind is what each one issued: PyTorch's Flight Recorder counts every collective a
rank issues, on the host as it is issued (common/process_group.py turns it on, on NCCL and gloo).

The process group's own timeout is set longer (common/process_group.py), so that this watchdog, and
not the backend's error or NCCL's abort, reports the hang.
"""
import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from common.errors import say

HANG_EXIT = 3  # launch/torchrun.py: the rank has said why in one line
RECORD_WAIT_S = 5  # how long the first rank to report waits for the others' records
# Where a rank waits for the others: the functions of torch.distributed and FSDP's collectives.
WAITING_IN = ("torch/distributed/", "torch\\distributed\\")


class Watchdog:
    def __init__(self, folder, timeout_s, phase):
        """`folder`: where the stacks go (OUTPUT_DIR/hang); `timeout_s`: --collective_timeout; `phase`:
        what the run is doing now (it starts watching at once)."""
        self.folder, self.timeout_s = Path(folder), timeout_s
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.where, self.since = phase, time.monotonic()
        self.main_thread = threading.main_thread()
        self.store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        self.changed = threading.Event()
        self.changed.set()
        threading.Thread(target=self.watch, name="hang watchdog", daemon=True).start()

    def phase(self, name, step=None):
        """Called as the run enters a phase: `name`, of optimiser step `step` if given."""
        self.where, self.since = name if step is None else f"{name} of step {step}", time.monotonic()
        self.changed.set()

    @contextlib.contextmanager
    def unwatched(self, name):
        """A phase with no time limit, which holds no collective to hang in: preparing the data can
        take hours, while the other ranks wait on a file lock that a preparer who dies lets go of."""
        where, self.where = self.where, None
        try:
            yield
        finally:
            self.where, self.since = where, time.monotonic()
            self.changed.set()

    def done(self):
        """The run has ended: nothing more to watch."""
        self.where = None
        self.changed.set()

    def watch(self):
        while True:
            self.changed.wait()
            self.changed.clear()
            while self.where is not None:
                left = self.since + self.timeout_s - time.monotonic()
                if left <= 0:
                    self.report()
                if self.changed.wait(left):
                    self.changed.clear()
                    continue

    def report(self):
        where, frame = self.where, sys._current_frames().get(self.main_thread.ident)
        doing = waiting_in(frame)
        unwritable = self.write_stacks(f"rank {self.rank}: {where}, {doing}, after {self.timeout_s} s\n\n")
        if unwritable is None:
            write_flight_recorder(self.folder / f"flight_recorder_rank{self.rank}")
        records = self.exchange({"where": where, "doing": doing, "issued": issued_collectives(),
                                 "unwritable": unwritable})
        if self.rank == min(records):
            failed = [record["unwritable"] for record in records.values() if record.get("unwritable")]
            stacks = (f"every rank's stacks are in {self.folder}/" if not failed else
                      f"the stacks are on standard error above ({self.folder}: {failed[0]})")
            say(f"error: {describe(records, self.world_size, self.timeout_s)}; {stacks}: raise --collective_timeout "
                "if this wait was legitimate", file=sys.stderr)
        # From here a rank's output is noise: the first rank to end closes the others' collectives, and their
        # main threads would print tracebacks. Each rank silences itself, and none ends before all have.
        silence_output()
        self.store_set(f"hang/silent{self.rank}", "1")
        self.store_wait(*(f"hang/silent{rank}" for rank in records))
        end_silent_neighbours(records)
        os._exit(HANG_EXIT)

    def write_stacks(self, header):
        """The Python stacks of all this rank's threads, in its file in the hang folder; on standard error
        where that folder fails (a file in its place, not writable, a full disk): the watchdog goes on, and
        the hang still ends with its line. Returns None, or why the folder failed."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f"stacks-rank{self.rank}.txt", "w") as file:
                file.write(header)
                file.flush()  # a full disk fails here, where faulthandler's own writes would fail silently
                faulthandler.dump_traceback(file, all_threads=True)
            return None
        except OSError as err:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(header)
                sys.stderr.flush()
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
            return err.strerror or type(err).__name__

    def store_set(self, key, value):
        try:
            self.store.set(key, value)
        except Exception:  # no store (one process), or it is gone: nobody waits for the line
            pass

    def store_wait(self, *keys):
        try:
            self.store.wait(list(keys), timedelta(seconds=RECORD_WAIT_S))
        except Exception:  # gone, or the lowest rank could not say it: end anyway
            pass

    def exchange(self, mine):
        """Each reporting rank's record, by rank, from the rendezvous store (only this rank's without one)."""
        if self.store is None:
            return {self.rank: mine}
        key = f"hang/rank{self.rank}"
        try:
            self.store.set(key, json.dumps(mine))
            time.sleep(RECORD_WAIT_S)
            keys = [f"hang/rank{rank}" for rank in range(self.world_size)]
            present = [key for key in keys if self.store.check([key])]
            return {int(key.removeprefix("hang/rank")): json.loads(value)
                    for key, value in zip(present, self.store.multi_get(present))}
        except Exception:  # the store is gone (its host ended): this rank speaks for itself
            return {self.rank: mine}


def silence_output():
    """Standard output and error to /dev/null, for what this process has left to run (flushed first)."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)


def end_silent_neighbours(records):
    """Kill the ranks on this node that did not answer (stopped, or stuck where Python cannot run):
    torchrun would give them its 30 s to shut down, which a stopped process never uses."""
    try:
        neighbours = psutil.Process(os.getppid()).children()  # this node's ranks, started by its torchrun
        for process in neighbours:
            rank = process.environ().get("RANK")
            if rank is not None and rank.isdigit() and int(rank) not in records:
                process.kill()
    except psutil.Error:  # gone already, or not ours to see: torchrun ends them in its own time
        pass


def flight_recorder_on():
    return int(os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or 0) > 0


def write_flight_recorder(path):
    """The Flight Recorder's dump of this rank's last collectives, for
    `python -m torch.distributed.flight_recorder.fr_trace OUTPUT_DIR/hang --prefix flight_recorder_rank`."""
    if not flight_recorder_on():
        return
    try:
        path.write_bytes(torch._C._distributed_c10d._dump_fr_trace())
    except Exception as err:  # the hang is reported anyway
        print(f"note: no Flight Recorder dump ({err})", file=sys.stderr, flush=True)


def issued_collectives():
    """{process group: [collectives this rank issued in it, the last one's name]}, from the Flight
    Recorder (what the rank queued, whether or not it has run); {} where it is off."""
    if not flight_recorder_on():
        return {}
    try:
        entries = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False)).get("entries", [])
    except Exception:  # the report goes on without it
        return {}
    issued = {}
    for entry in entries:  # in the order issued
        group = entry.get("process_group", ["?", "?"])[-1]
        if entry.get("collective_seq_id"):
            issued[group] = [entry["collective_seq_id"], entry.get("profiling_name", "?").split(":")[-1]]
    return issued


def waiting_in(frame):
    """What the main thread is doing: `waiting in all_reduce (checkpoint.py:52)` or `busy in ...`."""
    stack = traceback.extract_stack(frame) if frame is not None else []
    kit = next((entry for entry in reversed(stack) if "/torch/" not in entry.filename.replace("\\", "/")), None)
    at = f" ({Path(kit.filename).name}:{kit.lineno})" if kit else ""
    collective = next((entry.name for entry in reversed(stack) if any(part in entry.filename for part in WAITING_IN)),
                      None)
    if collective:
        return f"waiting in {collective}{at}"
    return f"busy in {stack[-1].name}{at}" if stack else "busy"


def behind(records):
    """Which rank is behind, by what the ranks issued: in the first process group where they
    differ, the ranks that issued fewer collectives than the most, or, as many, another last one."""
    for group in sorted({group for record in records.values() for group in record.get("issued", {})}):
        issued = {rank: record["issued"].get(group, [0, "none"]) for rank, record in records.items()}
        most = max(count for count, _ in issued.values())
        fewer = sorted(rank for rank, (count, _) in issued.items() if count < most)
        ahead = [rank for rank in issued if rank not in fewer]
        if fewer:
            last = issued[ahead[0]][1]
            counts = ", ".join(str(issued[rank][0]) for rank in fewer)
            return (f"{ranks_named(fewer)} behind: {counts} collective(s) issued in process group {group}, "
                    f"against {most} by {ranks_named(ahead, verb=False)} (whose last was {last})")
        names = {rank: last for rank, (_, last) in issued.items()}
        if len(set(names.values())) > 1:
            return (f"the ranks issued different collectives as number {most} in process group {group}: "
                    + ", ".join(f"rank {rank} {name}" for rank, name in sorted(names.items())))
    return None


def ranks_named(ranks, verb=True):
    words = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"{words} {'is' if len(ranks) == 1 else 'are'}" if verb else words


def describe(records, world_size, timeout_s):
    wheres = {record["where"] for record in records.values()}
    silent = [rank for rank in range(world_size) if rank not in records]
    parts = [f"rank {rank} {record['doing']}" for rank, record in sorted(records.items())]
    if silent:
        parts.append(f"{'rank' if len(silent) == 1 else 'ranks'} {', '.join(map(str, silent))} did not answer "
                     "(stopped or gone)")
    lagging = behind(records) if len(records) > 1 else None
    return f"no progress for {timeout_s} s in {' / '.join(sorted(wheres))}: " + "; ".join(
        ([lagging] if lagging else []) + parts)
