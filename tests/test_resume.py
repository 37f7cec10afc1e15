"""Exact resume: a run killed mid-way, or stopped by a preemption warning (SIGUSR2), and resumed
with --resume ends where an uninterrupted run ends (same per-step losses, same final weights),
in all three steps. FSDP also resumes on a different number of ranks, since its checkpoint does
not depend on the world size."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import (REPO, RESUMABLE, RESUMABLE_STEPS, STEP_SCRIPTS, assert_same_run, demo_args, read_metrics,
                      run_step)

STEPS = RESUMABLE_STEPS


def command(step, args, nproc):
    if step == "single":
        launcher = [sys.executable, str(STEP_SCRIPTS[step])]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    str(STEP_SCRIPTS[step])]
    return launcher + [str(a) for a in args]


def launch(step, args, nproc):
    return subprocess.Popen(command(step, args, nproc), cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def kill_after_first_checkpoint(step, args, nproc, output_dir, timeout=300):
    """Start a run and kill -9 all its processes once its first checkpoint is complete."""
    process = launch(step, args, nproc)
    marker = output_dir / "checkpoints/step-000002/COMPLETE"
    deadline = time.time() + timeout
    while not marker.exists():
        assert process.poll() is None, "the run ended before its first checkpoint"
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    # torchrun starts each worker in a session of its own, so kill the whole process tree
    tree = psutil.Process(process.pid)
    for proc in [tree, *tree.children(recursive=True)]:
        proc.send_signal(signal.SIGKILL)
    process.wait()
    assert len(read_metrics(output_dir)) < STEPS, "killed too late to test anything"


RUN = RESUMABLE[:-4]  # the steps and checkpoints of conftest's RESUMABLE run
SPLIT = RESUMABLE[-4:]  # its global batch of 8: 1 × 2 × 4 or 2 ranks × 2 × 2
SPLITS = {"single": (1, SPLIT), "ddp": (2, SPLIT), "fsdp": (2, SPLIT)}


@pytest.mark.parametrize("step", SPLITS)
def test_killed_and_resumed_run_equals_uninterrupted_run(demo, tmp_path, uninterrupted, step):
    nproc, split = SPLITS[step]
    reference, interrupted = uninterrupted(step), tmp_path / "interrupted"
    kill_after_first_checkpoint(step, demo_args(demo, interrupted) + RUN + split, nproc, interrupted)
    result = run_step(step, demo_args(demo, interrupted) + RUN + split + ["--resume"], nproc=nproc)
    assert "resuming from" in result.stderr + result.stdout
    assert_same_run(reference, interrupted, tolerance=1e-6)
    kept = sorted(p.name for p in (interrupted / "checkpoints").iterdir())
    assert kept == ["step-000004", "step-000006"], kept


@pytest.mark.parametrize("step", SPLITS)
def test_preemption_signal_saves_exits_cleanly_and_resumes_exactly(demo, tmp_path, uninterrupted, step):
    """SIGUSR2 to one process only (the last rank): every rank stops at the same step boundary,
    a checkpoint is saved, the run exits 0, and --resume finishes it as if nothing happened."""
    nproc, split = SPLITS[step]
    preempted = tmp_path / "preempted"
    args = demo_args(demo, preempted) + ["--max_steps", STEPS, "--keep_checkpoints", 2] + split
    process = subprocess.Popen(command(step, args, nproc), cwd=REPO, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while not (preempted / "metrics.jsonl").exists() or not read_metrics(preempted):
        assert process.poll() is None and time.time() < deadline, "no training step in time"
        time.sleep(0.05)
    ranks = [p for p in psutil.Process(process.pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())]
    (ranks or [psutil.Process(process.pid)])[-1].send_signal(signal.SIGUSR2)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    stopped_at = len(read_metrics(preempted))
    assert stopped_at < STEPS, "the signal came too late to test anything"
    assert f"preempted: saved a checkpoint at step {stopped_at}" in output
    assert not (preempted / "final").exists()
    run_step(step, args + ["--resume"], nproc=nproc)
    assert_same_run(uninterrupted(step), preempted, tolerance=1e-6)


def test_fsdp_resumes_on_more_ranks(demo, tmp_path, uninterrupted):
    """Saved on 2 ranks, resumed on 4: DCP reshards. Same global batch (8 rows), so the losses
    match the uninterrupted 2-rank run to float rounding."""
    reference, interrupted = uninterrupted("fsdp"), tmp_path / "interrupted"
    two_ranks = SPLITS["fsdp"][1]
    kill_after_first_checkpoint("fsdp", demo_args(demo, interrupted) + RUN + two_ranks, 2, interrupted)
    four_ranks = ["--total_batch_size", 8, "--batch_size_per_device", 2, "--resume"]
    run_step("fsdp", demo_args(demo, interrupted) + RUN + four_ranks, nproc=4)
    assert_same_run(reference, interrupted, tolerance=1e-5)
    assert read_metrics(interrupted)[-1]["world_size"] == 4


@pytest.mark.parametrize("step", ["ddp", "fsdp"])
def test_sigterm_to_torchrun_saves_and_resumes_exactly(demo, tmp_path, uninterrupted, step):
    """SIGTERM to the launcher, as Slurm sends it at a preemption or at the time limit: torchrun
    passes it to its ranks, which agree, save a complete checkpoint at the end of the step they are
    in and exit; the launcher says nothing more (python -m launch.torchrun). The time from the
    signal to the complete checkpoint is well inside torchrun's 30 s before it kills the ranks."""
    nproc, split = SPLITS[step]
    stopped = tmp_path / "stopped"
    args = demo_args(demo, stopped) + ["--max_steps", STEPS, "--keep_checkpoints", 2] + split
    launcher = [sys.executable, "-m", "launch.torchrun", "--standalone", f"--nproc-per-node={nproc}",
                str(STEP_SCRIPTS[step]), *map(str, args)]
    process = subprocess.Popen(launcher, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while not (stopped / "metrics.jsonl").exists() or not read_metrics(stopped):
        assert process.poll() is None and time.time() < deadline, "no training step in time"
        time.sleep(0.05)
    signalled = time.time()
    process.send_signal(signal.SIGTERM)
    while not any((stopped / "checkpoints").glob("step-*/COMPLETE")):
        assert time.time() < signalled + 30, "no complete checkpoint within 30 s of SIGTERM"
        time.sleep(0.05)
    print(f"{step}: SIGTERM to a complete checkpoint in {time.time() - signalled:.2f} s")
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    stopped_at = len(read_metrics(stopped))
    assert stopped_at < STEPS, "the signal came too late to test anything"
    assert f"preempted: saved a checkpoint at step {stopped_at}" in output and "stopped by SIGTERM" in output
    run_step(step, args + ["--resume"], nproc=nproc)
    assert_same_run(uninterrupted(step), stopped, tolerance=1e-6)


def test_sigterm_to_every_process_with_loader_workers_saves_and_resumes_exactly(demo, tmp_path, uninterrupted):
    """The loader as a GPU run uses it, worker processes that make the next batches (forced on the CPU
    with --data_workers 2), and SIGTERM to every process of the job, as Slurm sends it at a
    preemption: torchrun, its ranks and their workers. The workers leave stopping to their rank
    (PyTorch's own worker dies of a signal its rank did not send, and the rank's next batch then
    fails the step): every rank saves a complete checkpoint and says `preempted:`, and --resume ends
    where the uninterrupted run ends."""
    nproc, split = SPLITS["fsdp"]
    stopped = tmp_path / "stopped"
    args = demo_args(demo, stopped) + ["--max_steps", STEPS, "--keep_checkpoints", 2, "--data_workers", 2] + split
    launcher = [sys.executable, "-m", "launch.torchrun", "--standalone", f"--nproc-per-node={nproc}",
                str(STEP_SCRIPTS["fsdp"]), *map(str, args)]
    process = subprocess.Popen(launcher, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while not (stopped / "metrics.jsonl").exists() or not read_metrics(stopped):
        assert process.poll() is None and time.time() < deadline, "no training step in time"
        time.sleep(0.05)
    job = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    workers = [p for p in job[1:] if p.ppid() != process.pid]
    assert len(workers) >= 2 * nproc, f"expected the loader's workers under each rank: {[p.cmdline() for p in job]}"
    for proc in job:  # every process of the job at once, as slurmstepd signals them
        proc.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "Traceback" not in output and "killed by signal" not in output, output[-3000:]
    stopped_at = len(read_metrics(stopped))
    assert stopped_at < STEPS, "the signal came too late to test anything"
    assert f"preempted: saved a checkpoint at step {stopped_at}" in output and "stopped by SIGTERM" in output
    run_step("fsdp", args + ["--resume"], nproc=nproc)
    assert_same_run(uninterrupted("fsdp"), stopped, tolerance=1e-6)


def templates_launcher():
    """The prefix the Slurm templates start the training with (slurm/preemption.sh's USR2_IGNORED)."""
    define = subprocess.run(["sed", "-n", "/^USR2_IGNORED=(/,/')$/p", "slurm/preemption.sh"], cwd=REPO, text=True,
                            capture_output=True, check=True).stdout
    printed = subprocess.run(["bash", "-c", define + '\nprintf "%s\\0" "${USR2_IGNORED[@]}"'], text=True,
                             capture_output=True, check=True).stdout
    return [sys.executable if part == "python" else part for part in printed.split("\0")[:-1]]


@pytest.mark.parametrize("step", ["single", "tp"])
def test_warning_while_loading_stops_in_the_last_step_and_resume_ends_as_uninterrupted(demo, tmp_path, step):
    """Slurm's warning (USR2) before the training has set its handler, through the templates' launcher:
    step 2 gets it while it loads (after it has taken its output folder), step 6's torchrun at once
    (before or as it starts its ranks). The run saves at its first step boundary, here in its last step,
    before that step's evaluation, and says `preempted:`; --resume then runs the evaluation it skipped and
    ends as an uninterrupted run: the same metrics, final model and summary."""
    nproc = 1 if step == "single" else 2
    reference, preempted = tmp_path / "reference", tmp_path / "preempted"
    one_step = ["--max_steps", 1]
    run_step(step, demo_args(demo, reference) + one_step, nproc=nproc)
    args = [str(a) for a in demo_args(demo, preempted) + one_step]
    script = [str(STEP_SCRIPTS[step])] if step == "single" else [
        "-m", "launch.torchrun", "--standalone", f"--nproc-per-node={nproc}", str(STEP_SCRIPTS[step])]
    process = subprocess.Popen(templates_launcher() + [sys.executable, *script, *args], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    started = (preempted / ".lock").exists if step == "single" else (
        lambda: psutil.Process(process.pid).cmdline()[1:3] == ["-m", "launch.torchrun"])  # the launcher is torchrun
    while not started():
        assert process.poll() is None and time.time() < deadline, "the run did not start in time"
        time.sleep(0.01)
    process.send_signal(signal.SIGUSR2)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    assert "preempted: saved a checkpoint at step 1" in output, output[-3000:]
    assert not (preempted / "final").exists() and "eval_loss" not in read_metrics(preempted)[-1]
    result = run_step(step, [*args, "--resume"], nproc=nproc)
    assert_same_run(reference, preempted, tolerance=1e-6)
    expected, got = read_metrics(reference)[-1], read_metrics(preempted)[-1]
    assert (got["eval_loss"], got["legal_move_rate"]) == (expected["eval_loss"], expected["legal_move_rate"])
    summary = json.loads((preempted / "summary.json").read_text())
    assert summary["eval_loss"] == json.loads((reference / "summary.json").read_text())["eval_loss"]
    assert f"eval_loss={summary['eval_loss']}" in result.stdout
