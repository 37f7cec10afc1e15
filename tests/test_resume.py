"""Exact resume: a run killed mid-way and resumed with --resume ends where an uninterrupted run
ends (same per-step losses, same final weights), in all three steps. FSDP also resumes on a
different number of ranks, since its checkpoint does not depend on the world size."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO, STEP_SCRIPTS, assert_same_run, demo_args, read_metrics, run_step

STEPS = 6
RUN = ["--max_steps", STEPS, "--save_every", 2, "--keep_checkpoints", 2]


def launch(step, args, nproc):
    if step == "single":
        command = [sys.executable, str(STEP_SCRIPTS[step])]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   str(STEP_SCRIPTS[step])]
    return subprocess.Popen(command + [str(a) for a in args], cwd=REPO, start_new_session=True,
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


@pytest.mark.parametrize("step, nproc, split", [
    ("single", 1, ["--batch_size_per_device", 2, "--gradient_accumulation_steps", 4]),
    ("ddp", 2, ["--batch_size_per_device", 2, "--gradient_accumulation_steps", 2]),
    ("fsdp", 2, ["--batch_size_per_device", 2, "--gradient_accumulation_steps", 2]),
])
def test_killed_and_resumed_run_equals_uninterrupted_run(demo, tmp_path, step, nproc, split):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    run_step(step, demo_args(demo, reference) + RUN + split, nproc=nproc)
    kill_after_first_checkpoint(step, demo_args(demo, interrupted) + RUN + split, nproc, interrupted)
    result = run_step(step, demo_args(demo, interrupted) + RUN + split + ["--resume"], nproc=nproc)
    assert "resuming from" in result.stderr + result.stdout
    assert_same_run(reference, interrupted, tolerance=1e-6)
    kept = sorted(p.name for p in (interrupted / "checkpoints").iterdir())
    assert kept == ["step-000004", "step-000006"], kept


def test_fsdp_resumes_on_more_ranks(demo, tmp_path):
    """Saved on 2 ranks, resumed on 4: DCP reshards. Same global batch (8 rows), so the losses
    match the uninterrupted 2-rank run to float rounding."""
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    two_ranks = ["--batch_size_per_device", 2, "--gradient_accumulation_steps", 2]
    run_step("fsdp", demo_args(demo, reference) + RUN + two_ranks, nproc=2)
    kill_after_first_checkpoint("fsdp", demo_args(demo, interrupted) + RUN + two_ranks, 2, interrupted)
    four_ranks = ["--batch_size_per_device", 2, "--gradient_accumulation_steps", 1, "--resume"]
    run_step("fsdp", demo_args(demo, interrupted) + RUN + four_ranks, nproc=4)
    assert_same_run(reference, interrupted, tolerance=1e-5)
    assert read_metrics(interrupted)[-1]["world_size"] == 4
