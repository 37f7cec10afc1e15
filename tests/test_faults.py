"""Rank failure: `kill -9` of one rank, at random moments, including in the middle of a checkpoint
write, and of the torchrun launcher itself.

What a user relies on: the job ends by itself within a bounded time (a dead rank never leaves the
others hanging in a collective, holding the GPUs of a reservation), torchrun names the rank that
died, no process of the job is left behind, the newest complete checkpoint is intact, and
--resume continues from it to exactly the run that was never interrupted.
"""
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, RESUMABLE, RESUMABLE_STEPS, STEP_SCRIPTS, assert_same_run, demo_args, run_python, run_step

STEPS = RESUMABLE_STEPS
SAVE_EVERY = 2  # as in RESUMABLE
RUN = RESUMABLE  # conftest's: the uninterrupted runs are the session's
ENDS_WITHIN_S = 60       # after the kill, torchrun must have exited (no hang)
RANKS_GONE_WITHIN_S = 10  # after the launcher's death, its ranks must be gone
SEED = 5  # the fault plan below is random but reproducible; the moments in time still vary per run


def launch(step, args):
    """torchrun with 2 ranks, as a user starts it; output to a file so a full pipe never blocks it."""
    log = open(Path(args[args.index("--output_dir") + 1]).parent / f"{step}-torchrun.log", "w+")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(STEP_SCRIPTS[step]), *[str(a) for a in args]]
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    return process, log


def ranks_of(process, timeout=120):
    """The worker processes of a torchrun, by global rank (they start a moment after torchrun)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        ranks = {}
        for child in psutil.Process(process.pid).children(recursive=True):
            try:
                if "train.py" in " ".join(child.cmdline()) and "RANK" in child.environ():
                    ranks[int(child.environ()["RANK"])] = child
            except psutil.NoSuchProcess:
                pass
        if len(ranks) == 2:
            return ranks
        assert process.poll() is None, "torchrun ended before starting its ranks"
        time.sleep(0.05)
    raise AssertionError("torchrun did not start 2 ranks in time")


def still_running(processes, within):
    """Those of `processes` that have not ended `within` seconds from now (zombies count as ended)."""
    _, still = psutil.wait_procs(processes, timeout=within)
    running = []
    for proc in still:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc)
        except psutil.NoSuchProcess:
            pass
    return running


def kill_everything(processes):
    """Clean-up after a failed assertion, so one broken case does not leave load behind."""
    for proc in processes:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def torchrun_names(output, rank, exitcode):
    """torchrun's failure summary has one block per failed rank:
         rank      : 1 (local_rank: 1)
         exitcode  : -9 (pid: 1234)"""
    return re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\s*\n\s*exitcode\s*: {exitcode} ", output) is not None


def wait_until(condition, process, timeout=180, poll=0.01):
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, "the run ended before the moment to kill it"
        assert time.time() < deadline, "the moment to kill never came"
        time.sleep(poll)


def wait_for_a_save_under_way(output_dir, at_step, process):
    """Return once the checkpoint of step `at_step` is being written: its folder holds files but
    no COMPLETE marker yet. A save of the tiny model takes tens of milliseconds, so the last
    stretch polls without sleeping; if the window is missed anyway, the next save is the target."""
    metrics = output_dir / "metrics.jsonl"
    for target in range(at_step, STEPS, SAVE_EVERY):
        folder = output_dir / "checkpoints" / f"step-{target:06d}"
        wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= target - 1, process)
        while not (folder / "COMPLETE").exists():
            try:
                if os.listdir(folder) and not (folder / "COMPLETE").exists():
                    return target
            except FileNotFoundError:  # not made yet, or being replaced
                pass
            assert process.poll() is None, "the run ended before the moment to kill it"
    raise SaveWindowMissed(f"every save from step {at_step} on finished before it was seen under way")


class SaveWindowMissed(Exception):
    """The test's poller never saw a save under way (a busy machine did not run it in time): no
    fault was injected, so the run neither survived nor failed one."""


def kill_one_rank_during_a_save(step, args, output_dir, victim, at_step, rng, runs=3):
    """kill_one_rank during a save; a run whose every save was missed is run again from scratch."""
    for run in range(1, runs + 1):
        try:
            return kill_one_rank(step, args, output_dir, victim, "during save", at_step, rng)
        except SaveWindowMissed as missed:
            if run == runs:
                raise AssertionError(f"{missed}, in {runs} runs") from None
            shutil.rmtree(output_dir, ignore_errors=True)


def kill_one_rank(step, args, output_dir, victim, moment, at_step, rng):
    """Start a 2-rank run, kill -9 rank `victim` at the chosen moment; return what is needed to
    judge the aftermath."""
    process, log = launch(step, args)
    try:
        ranks = ranks_of(process)
        everyone = [psutil.Process(process.pid), *ranks.values()]
        metrics = output_dir / "metrics.jsonl"
        if moment == "during save":
            at_step = wait_for_a_save_under_way(output_dir, at_step, process)
        else:
            # Somewhere inside the step after `at_step` finished steps: forward, backward or optimiser.
            wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= at_step, process)
            time.sleep(rng.uniform(0, 0.3))
        newest = complete_checkpoints(output_dir)
        killed_at = time.time()
        ranks[victim].send_signal(signal.SIGKILL)
        try:
            process.wait(timeout=ENDS_WITHIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"torchrun still running {ENDS_WITHIN_S} s after rank {victim} was killed")
        ended_after = time.time() - killed_at
        leftovers = still_running(everyone, within=5)
        log.seek(0)
        return {"returncode": process.returncode, "output": log.read(), "ended_after_s": ended_after,
                "leftovers": leftovers, "complete_before_kill": newest,
                "at_step": at_step}
    finally:
        kill_everything([psutil.Process(process.pid)] if process.poll() is None else [])
        for proc in psutil.process_iter(["cmdline"]):  # any straggler of this run
            try:
                if str(output_dir) in " ".join(proc.info["cmdline"] or []):
                    proc.kill()
            except psutil.NoSuchProcess:
                pass
        log.close()


def complete_checkpoints(output_dir):
    return sorted(p.parent.name for p in (output_dir / "checkpoints").glob("step-*/COMPLETE"))


def step_of(names):
    return int(names[0].removeprefix("step-")) if names else 0


def fault_plan(seed):
    """Kills during saves, on either rank: during a save with an earlier checkpoint (DDP's one
    file, FSDP's shards) and during the first save (nothing to resume from yet)."""
    rng = random.Random(seed)
    plan = []
    for step in ("ddp", "fsdp"):
        save_step = rng.choice(range(SAVE_EVERY * 2, STEPS, SAVE_EVERY))  # not the first: a previous one exists
        plan.append((step, rng.randint(0, 1), "during save", save_step))
    plan.append(("fsdp", rng.randint(0, 1), "during save", SAVE_EVERY))  # no complete checkpoint yet
    # (a kill in the middle of a step: test_resume.py's killed-and-resumed runs)
    return plan


def test_fault_injection_loop(demo, tmp_path, uninterrupted):
    """Kill one rank at random moments (seeded), then resume: every fault must be survived."""
    rng = random.Random(SEED)
    survived, failures = 0, []
    plan = fault_plan(SEED)
    for number, (step, victim, moment, at_step) in enumerate(plan):
        output_dir = tmp_path / f"fault-{number}" / "run"
        output_dir.parent.mkdir()
        args = demo_args(demo, output_dir) + RUN
        what = f"{step}: kill -9 rank {victim} {moment} (step {at_step})"
        try:
            outcome = kill_one_rank_during_a_save(step, args, output_dir, victim, at_step, rng)
            what = f"{step}: kill -9 rank {victim} {moment} (step {outcome['at_step']})"
            assert outcome["returncode"] != 0, "torchrun reported success after a rank was killed"
            assert torchrun_names(outcome["output"], victim, -9), outcome["output"][-3000:]
            assert not outcome["leftovers"], f"processes left behind: {outcome['leftovers']}"
            # No complete checkpoint is lost (the one being written may or may not have been finished).
            complete, before = complete_checkpoints(output_dir), outcome["complete_before_kill"]
            assert step_of(complete[-1:]) >= step_of(before[-1:]), (complete, before)
            result = run_step(step, args + ["--resume"], nproc=2)
            said = result.stdout + result.stderr
            if complete:  # the newest complete checkpoint is the one resumed from, read without trouble
                assert f"resuming from {output_dir / 'checkpoints' / complete[-1]}" in said, said[-2000:]
            assert "warning: checkpoint" not in said
            assert_same_run(uninterrupted(step), output_dir, tolerance=1e-6)
            survived += 1
            print(f"survived: {what}; torchrun exited {outcome['ended_after_s']:.1f} s after the kill, "
                  f"resumed from {complete[-1] if complete else 'the start'}")
        except AssertionError as err:
            failures.append(f"{what}: {str(err)[:3000]}")
            print(f"NOT survived: {what}")
    print(f"fault injection: survived {survived} of {len(plan)}")
    assert not failures, f"survived {survived} of {len(plan)}:\n" + "\n\n".join(failures)


@pytest.mark.parametrize("step", ["ddp", "fsdp"])
def test_killing_the_launcher_takes_every_rank_with_it(demo, tmp_path, step):
    """kill -9 of torchrun itself (an OOM killer, a node agent): torchrun starts its ranks in
    sessions of their own, so nothing else would end them; they die with it (PR_SET_PDEATHSIG)."""
    output_dir = tmp_path / "run"
    process, log = launch(step, demo_args(demo, output_dir) + RUN)
    ranks = {}
    try:
        ranks = ranks_of(process)
        wait_until(lambda: (output_dir / "metrics.jsonl").exists(), process)
        process.send_signal(signal.SIGKILL)
        process.wait()
        killed_at = time.time()
        still = still_running(list(ranks.values()), within=RANKS_GONE_WITHIN_S)
        assert not still, f"ranks still running {RANKS_GONE_WITHIN_S} s after torchrun was killed: {still}"
        print(f"{step}: both ranks gone {time.time() - killed_at:.2f} s after torchrun was killed")
    finally:
        kill_everything(list(ranks.values()))
        log.close()


def test_a_finished_rank_leaves_without_the_interpreters_shutdown(tmp_path):
    """A gloo group that outlives destroy_process_group() (step 4's does) still has threads; one of
    them freeing a finished collective's tensors while Python shuts down aborts the rank
    ("terminate called without an active exception": a finished job failed, 5 runs in 30 here).
    So a rank whose main() is over leaves with os._exit: its exit status and all it printed are
    kept, and the interpreter's shutdown (here, an atexit handler) never runs."""
    probe = tmp_path / "probe.py"
    probe.write_text("""import atexit
import torch.distributed as dist
from common.errors import exit_on_user_error

atexit.register(print, "interpreter shutdown ran")


def main():
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
    if dist.get_node_local_rank() == 0:
        print("rank 0 done")  # buffered (stdout is a pipe) and never flushed here


exit_on_user_error(main)
""")
    result = run_step(probe, [], nproc=2)  # fails unless torchrun exits 0
    assert "rank 0 done" in result.stdout, result.stdout[-2000:]
    assert "interpreter shutdown ran" not in result.stdout


def test_a_crash_under_the_launcher_ends_with_torchruns_report(tmp_path):
    """A rank that fails with a traceback (a bug, not the user's mistake) under python -m
    launch.torchrun: the launcher gives back torchrun's report that it held back, and ends. (It
    once held each replayed record back again: the list never ended, and the job never did.)"""
    crash = tmp_path / "crash.py"
    # rank 0 fails, rank 1 waits to be stopped: two ranks failing at once interleave their tracebacks
    # character by character on the one stderr ("RuntimeErrorRuntimeError: : a buga bug")
    crash.write_text('import os, time\n'
                     'if os.environ["RANK"] == "0":\n    raise RuntimeError("a bug")\ntime.sleep(60)\n')
    result = run_python(["-m", "launch.torchrun", "--standalone", "--nproc-per-node=2", crash], timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "RuntimeError: a bug" in result.stderr and "Root Cause (first observed failure)" in result.stderr
    assert "failed (exitcode: 1)" in result.stderr, result.stderr[-3000:]  # one of the records it held back
