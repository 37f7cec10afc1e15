"""A hang ends, and says where: a watchdog thread on every rank.

The training loop tells the watchdog which phase it enters (training, evaluation or checkpoint of
step N). A phase that lasts longer than --collective_timeout seconds is a hang: a rank stopped
(SIGSTOP, a dead node), stuck in I/O, or one rank skipping a collective the others wait in. Then
every rank that can still run
  * writes the Python stacks of all its threads to OUTPUT_DIR/hang/stacks-rankN.txt,
  * records in the job's rendezvous store where it was (waiting in a collective, or busy elsewhere),
and the lowest such rank prints one line that names the step, the phase and what each rank was
doing; a rank with no record did not answer (stopped, or gone). The ranks exit with status 3, and
the launcher (launch/torchrun.py) leaves torchrun's own report out. Checkpoints are untouched: a
checkpoint counts only once its marker is written, which a hung save never reaches.

The process group's own timeout is set longer (common/process_group.py), so that this watchdog, and
not the backend's error or NCCL's abort, reports the hang. On NCCL with TORCH_FR_BUFFER_SIZE set,
each rank also writes its Flight Recorder dump there: what its last collectives were.
"""
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from common.errors import say

HANG_EXIT = 3  # launch/torchrun.py: the rank has said why in one line
RECORD_WAIT_S = 5  # how long the first rank to report waits for the others' records
# Where a rank waits for the others: the functions of torch.distributed and FSDP's collectives.
WAITING_IN = ("torch/distributed/", "torch\\distributed\\")


class Watchdog:
    def __init__(self, folder, timeout_s):
        """`folder`: where the stacks go (OUTPUT_DIR/hang); `timeout_s`: --collective_timeout."""
        self.folder, self.timeout_s = Path(folder), timeout_s
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.where, self.since = None, time.monotonic()
        self.main_thread = threading.main_thread()
        self.store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        self.changed = threading.Event()
        threading.Thread(target=self.watch, name="hang watchdog", daemon=True).start()

    def phase(self, name, step):
        """Called as the loop enters a phase: `name` of optimiser step `step`."""
        self.where, self.since = f"{name} of step {step}", time.monotonic()
        self.changed.set()

    def done(self):
        """The loop has ended: nothing more to watch."""
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
        self.folder.mkdir(parents=True, exist_ok=True)
        stacks = self.folder / f"stacks-rank{self.rank}.txt"
        with open(stacks, "w") as file:
            file.write(f"rank {self.rank}: {where}, {doing}, after {self.timeout_s} s\n\n")
            faulthandler.dump_traceback(file, all_threads=True)
        write_flight_recorder(self.folder / f"nccl_trace_rank_{self.rank}")
        records = self.exchange({"where": where, "doing": doing})
        if self.rank == min(records):
            say(f"error: {describe(records, self.world_size, self.timeout_s)}; every rank's stacks are in "
                f"{self.folder}/: raise --collective_timeout if this wait was legitimate", file=sys.stderr)
        os._exit(HANG_EXIT)

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


def write_flight_recorder(path):
    """NCCL's Flight Recorder (TORCH_FR_BUFFER_SIZE > 0): this rank's last collectives, for
    `python -m torch.distributed.flight_recorder.fr_trace`. Only CUDA builds of PyTorch have it."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None or not int(os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")
                               or 0):
        return
    try:
        path.write_bytes(dump())
    except Exception as err:  # the hang is reported anyway
        print(f"note: no Flight Recorder dump ({err})", file=sys.stderr, flush=True)


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


def describe(records, world_size, timeout_s):
    wheres = {record["where"] for record in records.values()}
    silent = [rank for rank in range(world_size) if rank not in records]
    parts = [f"rank {rank} {record['doing']}" for rank, record in sorted(records.items())]
    if silent:
        parts.append(f"{'rank' if len(silent) == 1 else 'ranks'} {', '.join(map(str, silent))} did not answer "
                     "(stopped or gone)")
    return f"no progress for {timeout_s} s in {' / '.join(sorted(wheres))}: {'; '.join(parts)}"
