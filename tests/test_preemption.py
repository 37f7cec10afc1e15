"""Preemption and time limits on a real 2-node Slurm (tests/slurm/local_cluster.sh), end to end:
the signal reaches every rank on both nodes, they save a checkpoint and stop, the job is requeued
and resumes. The result must be the uninterrupted run's: the same final weights, every step in
metrics.jsonl exactly once.

The early warning, USR2, sent the way Slurm does before the time limit (twice in the sbatch job):
* sbatch templates: `#SBATCH --signal=B:USR2@300` signals the batch shell only, which is
  `scancel --batch --signal=USR2 JOB`;
* submit.py: submitit's `--signal=USR2@300` (no B:) signals every process of the job's steps,
  which is `scancel --signal=USR2 JOB` (what submitit's own `job._interrupt(timeout=True)` runs).
The warnings are timed by the run's progress (metrics.jsonl), not by sleeping.

SIGTERM only, as most sites preempt: a real preemption by slurmctld. The cluster's `urgent`
partition preempts its default one (PreemptType=preempt/partition_prio, PreemptMode=REQUEUE,
GraceTime); a job there that needs the GPUs makes slurmctld send SIGTERM to every process of
the running job's steps (not to the batch shell, and no user signal), and SIGKILL GraceTime later.
"""
import datetime
import json
import re
import sys

import pytest

from conftest import QUICK, REPO, assert_same_run, demo_args, run_step

pytestmark = pytest.mark.slurm
pytest_plugins = ["slurm_cluster"]  # the `slurm_cluster` fixture: one local cluster for the session

STEP = "fsdp"
MAX_STEPS = 20  # room for slurmctld to preempt on a busy machine before the run ends
# 2 nodes × 2 fake GPUs, 2 rows per device: a total batch of 8 is one pass, no accumulation.
WORLD_SIZE, TOTAL_BATCH, PER_DEVICE = 4, 8, 2
LEARNING_RATE = ["--learning_rate", "3e-3"]
TRAINING = ["--max_steps", str(MAX_STEPS), *LEARNING_RATE, *QUICK]  # QUICK: short rows, little evaluation
SMALL_NODE = ["--cpus-per-task=2", "--mem=2G", "--time=10"]
# Quotes, spaces, a command substitution and a `;`: nothing may run, the path must arrive as is.
HOSTILE = "run 'one' \"two\" $(touch injected); `touch injected` & "
START_TIMEOUT_S = 120  # from submission (or requeue) to training steps on both nodes
JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def uninterrupted(demo, tmp_path_factory):
    """The same training in one go, with plain torchrun and the same world size, batch and sharding
    (the jobs run on 2 nodes, where the plan check chooses HYBRID_SHARD: sharded within each node of
    2, which sums the gradients in another order than FULL_SHARD over all 4)."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    run_step(STEP, demo_args(demo, output_dir) + LEARNING_RATE + [  # demo_args has QUICK
        "--max_steps", MAX_STEPS, "--total_batch_size", TOTAL_BATCH, "--batch_size_per_device", PER_DEVICE,
        "--sharding_strategy", "HYBRID_SHARD", "--shard_group_size", 2], nproc=WORLD_SIZE)
    return output_dir


def steps_done(output_dir):
    """The steps in metrics.jsonl so far (a line being written is left out)."""
    try:
        lines = (output_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in lines]


def saved_steps(log):
    return [int(step) for step in re.findall(r"preempted: saved a checkpoint at step (\d+) in ", log)]


def preempt(cluster, job_id, output_dir, read_log, warn, times):
    """Warn once training is under way; after each requeue, once it is under way again (`times`
    warnings in all). Returns the steps at which the training saved and stopped, in time order."""
    saved = []
    for _ in range(times):
        cluster.wait_until(job_id, lambda: max(steps_done(output_dir), default=0) >= (saved[-1] if saved else 0) + 2,
                           START_TIMEOUT_S, f"training steps after {len(saved)} requeue(s)")
        warn()
        cluster.wait_until(job_id, lambda: len(saved_steps(read_log())) == len(saved) + 1, 60,
                           f"a checkpoint after warning {len(saved) + 1}")
        # submit.py keeps one log per node, read in node order, and rank 0 (which reports) may
        # move to the other node after a requeue: the new step is the one not seen before.
        (new,) = set(saved_steps(read_log())) - set(saved)
        saved.append(new)
    return saved


def check_same_as_uninterrupted(output_dir, uninterrupted, saved):
    assert saved == sorted(set(saved)) and 2 <= saved[0] and saved[-1] < MAX_STEPS, saved
    assert steps_done(output_dir) == list(range(1, MAX_STEPS + 1))  # every step exactly once
    assert_same_run(uninterrupted, output_dir, tolerance=1e-6)  # per-step losses and final weights


def test_sbatch_job_survives_two_preemptions(slurm_cluster, demo, uninterrupted):
    output_dir = slurm_cluster.jobs_dir / f"sbatch {HOSTILE}"
    job_id = slurm_cluster.sbatch(
        "--nodes=2", "--gpus-per-node=2", *SMALL_NODE, f"slurm/{STEP}.sh", *TRAINING,
        # --overwrite is for the first start only: a requeued attempt must not delete its checkpoint
        "--overwrite",
        extra_env={"MODEL": str(demo / "model"), "DATA_DIR": str(demo / "data"), "OUTPUT_DIR": str(output_dir),
                   "TOTAL_BATCH_SIZE": str(TOTAL_BATCH), "BATCH_SIZE_PER_DEVICE": str(PER_DEVICE)})
    log = slurm_cluster.jobs_dir / f"{STEP}-{job_id}.out"

    def read_log():
        return log.read_text(errors="replace") if log.exists() else ""

    def warn():  # what `#SBATCH --signal=B:USR2@300` does 300 s before the time limit
        result = slurm_cluster.run(["scancel", "--batch", "--signal=USR2", job_id])
        assert result.returncode == 0, result.stderr

    with slurm_cluster.logs_kept_on_failure():
        saved = preempt(slurm_cluster, job_id, output_dir, read_log, warn, times=2)
        state = slurm_cluster.wait(job_id, JOB_TIMEOUT_S)
        output = read_log()
        assert state == "COMPLETED", output[-4000:]
        # one log for all three attempts (--open-mode=append), each with its own rendezvous
        for restart in range(3):
            assert f"job {job_id} (restart {restart}):" in output
            assert f"rendezvous node1:{20000 + int(job_id)} id {job_id}-{restart}\n" in output
        assert output.count("preemption warning (USR2): forwarding it to the training processes") == 2
        assert output.count(f"the training saved a checkpoint and stopped: requeueing job {job_id}") == 2
        for step in saved:
            assert f"resuming from {output_dir}/checkpoints/step-{step:06d}" in output
        check_same_as_uninterrupted(output_dir, uninterrupted, saved)
        assert not (REPO / "injected").exists() and not list(slurm_cluster.jobs_dir.rglob("injected"))


def test_submit_py_job_survives_a_preemption(slurm_cluster, demo, uninterrupted):
    log_dir = slurm_cluster.jobs_dir / "submitit"
    output_dir = slurm_cluster.jobs_dir / f"submit {HOSTILE}"
    job_name = f"chess {HOSTILE}"
    result = slurm_cluster.run(
        [sys.executable, "submit.py", "--step", STEP, "--gpus", "2", "--nodes", "2", "--job_name", job_name,
         "--total_batch_size", str(TOTAL_BATCH), "--batch_size_per_device", str(PER_DEVICE), "--cpus_per_task", "2",
         "--mem_gb", "2", "--time", "10", "--log_dir", str(log_dir), "--model", str(demo / "model"),
         "--data_dir", str(demo / "data"), "--output_dir", str(output_dir), "--", *TRAINING, "--overwrite"])
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    logs = [log_dir / job_id / f"{job_id}_{node}_log.out" for node in (0, 1)]

    def read_log(node=None):
        """One node's log, or both: rank 0, which reports, may be on either node after a requeue."""
        if node is None:
            return read_log(0) + read_log(1)
        return logs[node].read_text(errors="replace") if logs[node].exists() else ""

    def warn():  # what submitit's `#SBATCH --signal=USR2@300` does 300 s before the time limit
        result = slurm_cluster.run(["scancel", "--signal=USR2", job_id])
        assert result.returncode == 0, result.stderr

    with slurm_cluster.logs_kept_on_failure():
        assert slurm_cluster.run(["squeue", "--noheader", "--states=all", f"--jobs={job_id}",
                                  "--format=%j"]).stdout == job_name + "\n"
        # One warning (the sbatch test above takes two: an attempt that was requeued, requeued again)
        saved = preempt(slurm_cluster, job_id, output_dir, read_log, warn, times=1)
        state = slurm_cluster.wait(job_id, JOB_TIMEOUT_S)
        assert state == "COMPLETED", read_log(0)[-4000:] + "\n" + read_log(1)[-4000:]
        for node in (0, 1):  # one log per node for both attempts, each with its own rendezvous
            for restart in range(2):
                assert re.search(rf"^node {node} \(.*\), restart {restart}: .* --rdzv-id={job_id}-{restart} ",
                                 read_log(node), re.MULTILINE), read_log(node)[-4000:]
        # submitit's checkpoint() runs on the first node only
        assert read_log(0).count("the training saved a checkpoint and stopped: requeueing") == 1
        assert "requeueing" not in read_log(1)
        for step in saved:
            assert f"resuming from {output_dir}/checkpoints/step-{step:06d}" in read_log()
        check_same_as_uninterrupted(output_dir, uninterrupted, saved)
        assert not (REPO / "injected").exists() and not list(slurm_cluster.jobs_dir.rglob("injected"))


def signal_times(output, signal_number):
    """When torchrun's agents got the signal: the time of each `Received N death signal` warning
    (torch's log format `W1123 14:10:47.877000 PID FILE:LINE] ...`, local time, no year)."""
    pattern = rf"[IWE](\d{{4}}) (\d\d:\d\d:\d\d\.\d+) \d+ \S+\] Received {signal_number} death signal"
    year = datetime.date.today().year
    return [datetime.datetime.strptime(f"{year}{day} {time}", "%Y%m%d %H:%M:%S.%f")
            for day, time in re.findall(pattern, output)]


def test_sbatch_job_survives_sigterm_only_preemption(slurm_cluster, demo, uninterrupted):
    """A job of the `urgent` partition needs the GPUs: slurmctld preempts the training with
    SIGTERM only. Every rank saves at the end of its step, before the grace time runs out; the
    job is requeued, gives the nodes to the urgent job, and resumes after it."""
    output_dir = slurm_cluster.jobs_dir / f"sigterm {HOSTILE}"
    job_id = slurm_cluster.sbatch(
        "--nodes=2", "--gpus-per-node=2", *SMALL_NODE, f"slurm/{STEP}.sh", *TRAINING, "--overwrite",
        extra_env={"MODEL": str(demo / "model"), "DATA_DIR": str(demo / "data"), "OUTPUT_DIR": str(output_dir),
                   "TOTAL_BATCH_SIZE": str(TOTAL_BATCH), "BATCH_SIZE_PER_DEVICE": str(PER_DEVICE)})
    log = slurm_cluster.jobs_dir / f"{STEP}-{job_id}.out"

    def read_log():
        return log.read_text(errors="replace") if log.exists() else ""

    with slurm_cluster.logs_kept_on_failure():
        slurm_cluster.wait_until(job_id, lambda: len(steps_done(output_dir)) >= 2, START_TIMEOUT_S, "training steps")
        # One GPU on each node: it fits only once the training's job has left them (whatever the
        # number of cores here).
        urgent = slurm_cluster.sbatch("--partition=urgent", "--job-name=urgent", "--nodes=2", "--gpus-per-node=1",
                                      "--cpus-per-task=1", "--mem=1G", "--time=1", "--wrap=true")
        slurm_cluster.wait_until(job_id, lambda: len(saved_steps(read_log())) == 1, slurm_cluster.grace_time,
                                 "a checkpoint after SIGTERM")
        assert slurm_cluster.wait(urgent, JOB_TIMEOUT_S) == "COMPLETED"
        state = slurm_cluster.wait(job_id, JOB_TIMEOUT_S)
        output = read_log()
        assert state == "COMPLETED", output[-4000:]

        saved = saved_steps(output)
        assert re.search(rf"preempted: saved a checkpoint at step {saved[0]} in .*\(stopped by SIGTERM\)", output)
        assert "preemption warning (USR2)" not in output  # SIGTERM was the only signal
        # Slurm's SIGTERM reached the torchrun of each node (and, from both, every rank)
        received = signal_times(output, 15)
        assert len(received) == 2, output[-4000:]
        for restart in range(2):  # one log for both attempts, each with its own rendezvous
            assert f"job {job_id} (restart {restart}):" in output
            assert f"rendezvous node1:{20000 + int(job_id)} id {job_id}-{restart}\n" in output
        assert f"resuming from {output_dir}/checkpoints/step-{saved[0]:06d}" in output
        check_same_as_uninterrupted(output_dir, uninterrupted, saved)
        assert not (REPO / "injected").exists() and not list(slurm_cluster.jobs_dir.rglob("injected"))

        # The checkpoint was complete before the grace time ran out (then SIGKILL), and before the
        # urgent job had the nodes; the accounting shows the attempt that was preempted.
        complete = output_dir / f"checkpoints/step-{saved[0]:06d}/COMPLETE"
        complete_at = datetime.datetime.fromtimestamp(complete.stat().st_mtime)
        signal_to_checkpoint = (complete_at - min(received)).total_seconds()
        print(f"SIGTERM to complete checkpoint: {signal_to_checkpoint:.1f} s")
        assert 0 < signal_to_checkpoint < slurm_cluster.grace_time, (min(received), complete_at)
        attempts = slurm_cluster.accounted(job_id, "Partition", "Start", "End")
        assert [a["State"] for a in attempts] in (["REQUEUED", "COMPLETED"], ["PREEMPTED", "COMPLETED"]), attempts
        (urgent_record,) = slurm_cluster.accounted(urgent, "Start")
        assert datetime.datetime.fromisoformat(urgent_record["Start"]) >= complete_at.replace(microsecond=0)
