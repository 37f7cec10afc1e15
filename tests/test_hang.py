"""When a job hangs or crawls, the kit says where (issue 24).

A hang: one rank of step 4 frozen with SIGSTOP. The job must end by itself within the collective
timeout the user set, with one `error:` line that names the step, the phase and what each rank was
doing, every live rank's stacks on disk, and the last complete checkpoint intact.
A slow step: --profile_steps writes a trace per rank and a one-screen summary.
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import REPO, STEP_SCRIPTS, demo_args, run_python, run_step, with_changed
from test_faults import ranks_of

TIMEOUT_S = 10


@pytest.mark.parametrize("step", ["fsdp", "tp"])  # tp: step 6, whose ranks also wait in the layers' collectives
def test_a_frozen_rank_ends_the_job_with_one_line_and_every_stack(demo, tmp_path, step):
    # Longer than the other tests' 10 s: this run saves three checkpoints before the freeze, and on a
    # busy machine one of them once took 10 s on a rank (CI, step 6), which the watchdog rightly ended.
    timeout = 30
    out = tmp_path / "run"
    args = demo_args(demo, out) + ["--max_steps", 12, "--save_every", 2, "--total_batch_size", 4,
                                   "--batch_size_per_device", 2, "--collective_timeout", timeout]
    command = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=2",
               str(STEP_SCRIPTS[step]), *map(str, args)]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    ranks = ranks_of(process)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.time() + 300
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):  # past a checkpoint
            if process.poll() is not None:
                pytest.fail(f"the run ended before its third step: {process.stderr.read()[-3000:]}")
            assert time.time() < deadline, "the run did not get going"
            time.sleep(0.2)
        ranks[1].send_signal(signal.SIGSTOP)
        frozen_at = time.time()
        _, stderr = process.communicate(timeout=timeout + 120)
        ended_after = time.time() - frozen_at
    finally:
        for rank in ranks.values():
            try:
                rank.kill()
            except psutil.NoSuchProcess:
                pass
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 3, stderr[-3000:]
    assert ended_after < timeout + 60
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert re.search(rf"no progress for {timeout} s in \w[\w ]* of step \d+", errors[0]), errors[0]
    assert "rank 0 waiting in " in errors[0] and "rank 1 did not answer" in errors[0], errors[0]
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr[-3000:]
    stacks = (out / "hang" / "stacks-rank0.txt").read_text()
    assert "Thread" in stacks and "train.py" in stacks, stacks  # all threads, down to the training script
    # The last complete checkpoint is intact: the run continues from it.
    complete = sorted(out.glob("checkpoints/step-*/COMPLETE"))
    assert complete, "no complete checkpoint"
    saved = int(complete[-1].parent.name.removeprefix("step-"))
    resumed = run_step(step, args[:-2] + ["--resume"], nproc=2)  # with the default timeout
    assert f"resuming from {complete[-1].parent}" in resumed.stdout + resumed.stderr
    assert saved < 12 and (out / "final" / "config.json").is_file()


def start_fsdp(args):
    command = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=2",
               str(STEP_SCRIPTS["fsdp"]), *map(str, args)]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})


def ended_with_one_line(process, after, stderr, ranks):
    """The job ended by itself within the timeout and a little, with one `error:` line, which it returns."""
    try:
        process.wait(timeout=TIMEOUT_S + 120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        for rank in ranks:
            try:
                rank.kill()
            except psutil.NoSuchProcess:
                pass
    stderr = "".join(stderr)
    assert process.returncode == 3, stderr[-3000:]
    assert time.time() - after < TIMEOUT_S + 30, "the job did not end soon after the timeout"
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr[-3000:]
    return errors[0]


def read_in_background(stream):
    """What `stream` has said so far, a list that grows (a thread reads it)."""
    said = []
    threading.Thread(target=lambda: said.extend(iter(lambda: stream.read(1), "")), daemon=True).start()
    return said


def test_a_rank_frozen_while_the_model_loads_ends_the_job(demo, tmp_path):
    """The watchdog runs from the start: rank 0 frozen as it reads the weights (Hugging Face's
    "Loading weights"), which the other rank waits for in the load's broadcast, or, had rank 0 sent
    them already, in the untrained model's evaluation."""
    out = tmp_path / "run"
    process = start_fsdp(demo_args(demo, out) + ["--collective_timeout", TIMEOUT_S])
    ranks = ranks_of(process)
    stderr = read_in_background(process.stderr)
    deadline = time.time() + 300
    while "Loading weights" not in "".join(stderr):
        assert process.poll() is None and time.time() < deadline, "".join(stderr)[-3000:]
        time.sleep(0.01)
    ranks[0].send_signal(signal.SIGSTOP)
    line = ended_with_one_line(process, time.time(), stderr, ranks.values())
    assert re.match(rf"error: no progress for {TIMEOUT_S} s in (loading|untrained evaluation): rank 1 waiting in ",
                    line), line
    assert "rank 0 did not answer (stopped or gone)" in line, line
    assert (out / "hang" / "stacks-rank1.txt").is_file() and not (out / "metrics.jsonl").exists()


def test_a_rank_frozen_in_the_first_evaluation_ends_the_job(demo, tmp_path):
    """Frozen (SIGSTOP) as the untrained model's evaluation starts: the other rank waits for it there."""
    out = tmp_path / "run"
    process = start_fsdp(with_changed(demo_args(demo, out), ["--eval_games", 64]) + ["--collective_timeout", TIMEOUT_S])
    ranks = ranks_of(process)
    stderr = read_in_background(process.stderr)
    for said in process.stdout:  # rank 0 says the batch plan just before the evaluation
        if said.startswith("total batch"):
            break
    assert process.poll() is None, "".join(stderr)[-3000:]
    ranks[1].send_signal(signal.SIGSTOP)
    line = ended_with_one_line(process, time.time(), stderr, ranks.values())
    assert line.startswith(f"error: no progress for {TIMEOUT_S} s in untrained evaluation: rank 0 waiting in "), line
    assert "rank 1 did not answer (stopped or gone)" in line, line
    assert not (out / "metrics.jsonl").exists()  # no step was taken


def test_profile_steps_writes_a_trace_and_a_summary_per_rank(demo, tmp_path):
    out = tmp_path / "run"
    run_step("fsdp", demo_args(demo, out) + ["--max_steps", 4, "--profile_steps", "2-3", "--total_batch_size", 4,
                                             "--batch_size_per_device", 1], nproc=2)
    for rank in (0, 1):
        trace = json.loads((out / "profile" / f"rank{rank}.pt.trace.json").read_text())
        names = {event.get("name", "") for event in trace["traceEvents"]}
        assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names
        summary = (out / "profile" / f"summary-rank{rank}.txt").read_text()
        shares = dict(re.findall(r"^  (communication|optimizer|compute) +([\d.]+)%", summary, re.MULTILINE))
        assert set(shares) == {"communication", "optimizer", "compute"}, summary
        assert 99 <= sum(map(float, shares.values())) <= 101 and float(shares["communication"]) > 0, summary
        assert "top 12 operations by self time" in summary


def test_profile_steps_is_checked_before_anything_runs(demo, tmp_path):
    result = run_step("single", demo_args(demo, tmp_path / "run") + ["--profile_steps", "5-2"], check=False)
    assert result.returncode == 2 and "--profile_steps" in result.stderr and not (tmp_path / "run").exists()


RANKS = '''
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.errors import leave_after_success
from common.hang import Watchdog
from common.process_group import init_process_group

case, folder = sys.argv[1], Path(sys.argv[2])
init_process_group(torch.device("cpu"), 60)  # the kit's: gloo, the Flight Recorder on
rank = dist.get_rank()
watchdog = Watchdog(folder, 3, "loading")
if case == "falls behind":  # as on a GPU: collectives queued, then every rank waits for their results
    watchdog.phase("training", 1)
    work = [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(3 if rank == 0 else 2)]
    for queued in work:
        queued.wait()  # what the step's read of its figures does on a GPU
    time.sleep(600)  # rank 1 never gets to its third (a data loader that never answers, say)
for step in (1, 2, 3):
    watchdog.phase("training", step)
    dist.all_reduce(torch.ones(4))
    if step == 2:
        watchdog.phase("evaluation", step)
        if not (case == "skips the evaluation" and rank == 1):
            dist.all_reduce(torch.ones(2))  # the evaluation's sums
        watchdog.phase("checkpoint", step)
        if case == "sticks in I/O" and rank == 1:
            time.sleep(600)  # a write to a file system that never answers
        dist.barrier()
watchdog.done()
dist.destroy_process_group()
leave_after_success()
'''


@pytest.mark.parametrize("case, said", [
    # rank 1 sleeps in the checkpoint phase: its own watchdog reports it busy there, rank 0 waits
    ("sticks in I/O", r"no progress for 3 s in checkpoint of step 2: rank 1 is behind: 3 collective\(s\) issued in "
                      r"process group default_pg, against 4 by rank 0 \(whose last was barrier\); rank 0 waiting in "
                      r"barrier \(ranks\.py:\d+\); rank 1 busy in <module> \(ranks\.py:\d+\)"),
    # rank 1 skips the evaluation's collective: the ranks wait in different collectives and phases
    ("skips the evaluation", r"no progress for 3 s in checkpoint of step 2 / evaluation of step 2: the ranks issued "
                             r"different collectives as number 3 in process group default_pg: rank 0 all_reduce, "
                             r"rank 1 barrier; rank 0 waiting in all_reduce \(ranks\.py:\d+\); rank 1 waiting in "
                             r"barrier \(ranks\.py:\d+\)"),
    # asynchronous collectives (NCCL's): every rank is busy, none in a collective; what they issued tells
    ("falls behind", r"no progress for 3 s in training of step 1: rank 1 is behind: 2 collective\(s\) issued in "
                     r"process group default_pg, against 3 by rank 0 \(whose last was all_reduce\); rank 0 busy in "
                     r"<module> \(ranks\.py:\d+\); rank 1 busy in <module> \(ranks\.py:\d+\)"),
])
def test_a_rank_that_sticks_or_skips_a_collective_ends_the_job_with_one_line(tmp_path, case, said):
    """The other cases, on the watchdog alone (2 gloo ranks, a 3 s timeout): the rank that is behind is
    named by what each rank issued (the Flight Recorder), whether or not its stack shows it."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    done = run_python(["-m", "launch.torchrun", "--standalone", "--nproc-per-node=2", script, case,
                       tmp_path / "hang"], timeout=120)
    assert done.returncode == 3, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(said, errors[0]), done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "hang").iterdir()) == [
        "flight_recorder_rank0", "flight_recorder_rank1", "stacks-rank0.txt", "stacks-rank1.txt"]


@pytest.mark.parametrize("folder", ["a file", "on a full disk"])
def test_a_hang_folder_that_fails_leaves_the_watchdog_watching(tmp_path, tmpfs, folder):
    """The watchdog's own folder fails (a file in its place, or no byte free): each rank's stacks go to
    standard error instead, and the watchdog still ends the hang, with its one line, which says where they are."""
    if folder == "a file":
        hang = tmp_path / "hang"
        hang.write_text("a user's file\n")
    else:
        disk = tmpfs("64k")
        with contextlib.suppress(OSError):
            (disk / "filler").write_bytes(bytes(1 << 20))
        hang = disk / "hang"
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    done = run_python(["-m", "launch.torchrun", "--standalone", "--nproc-per-node=2", script, "sticks in I/O", hang],
                      timeout=120)
    assert done.returncode == 3, done.stderr[-3000:]  # the watchdog's end (without it: gloo's, after 60 s)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: no progress for 3 s in checkpoint of step 2"), \
        done.stderr[-3000:]
    assert f"the stacks are on standard error above ({hang}: " in errors[0], errors[0]
    assert "Traceback" not in done.stderr and 'File "' in done.stderr, done.stderr[-3000:]  # the stacks
    if folder == "a file":
        assert hang.read_text() == "a user's file\n"  # left as it was
