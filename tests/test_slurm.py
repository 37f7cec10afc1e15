"""The kit's Slurm path against a real Slurm: the sbatch templates and submit.py, run to
completion on a 2-node cluster with 2 fake GPUs per node (tests/slurm/local_cluster.sh). On 2
nodes the jobs check their shared output folder (common/shared_folder.py: the cluster's nodes share
the file system) and run the sharding the plan check chose.

The cluster is shaped unlike the templates' usual GPU node: 2 GPUs asked for as GRES, 2 CPUs and
4 GB per node, its GPU partition not the default. The training jobs are submitted as a user does
after the one-time step: the site's file (SITE below) loaded by `source slurm/use_site.sh`, nothing
else on sbatch's command line but what the job itself changes (--nodes).

The fake GPUs are not usable by CUDA, so the templates run one CPU process per allocated GPU
with gloo: the very scripts a user submits, with the same torchrun and rendezvous.
"""
import json
import math
import re
import sys
from pathlib import Path

import pytest

from conftest import EQUIVALENCE, QUICK, assert_same_run, read_metrics

pytestmark = pytest.mark.slurm
pytest_plugins = ["slurm_cluster"]  # the `slurm_cluster` fixture: one local cluster for the session

# Short and small: 6 steps of short rows, little evaluation; a learning rate at which the
# tiny demo model's loss falls within those 6 steps.
QUICK_TRAINING = ["--max_steps", "6", "--learning_rate", "3e-3", "--max_seq_length", "64",
                  "--eval_every", "0", "--eval_rows", "8", "--eval_games", "8"]
# Without a site file: sbatch's own options ask for the node (the refusals below).
SMALL_NODE = ["--cpus-per-task=2", "--mem=2G", "--time=10"]
# The file a centre of this shape writes (slurm/site.example.sh): the environment is the tests' Python.
SITE = """\
SITE_PARTITION=gpu
SITE_TIME=00:10:00
SITE_GPUS_PER_NODE=2
SITE_CPUS_PER_NODE=2
SITE_MEM_GB_PER_NODE=3
SITE_GPU_REQUEST=gres
site_environment() {{ export PATH={python_bin}:$PATH; }}
"""
JOB_TIMEOUT_S = 240
# What a user takes from final/: the whole model, or step 5's adapters in peft's format.
FULL_MODEL = ("config.json",)
FINAL_FILES = {"lora": ("adapter_config.json", "adapter_model.safetensors")}


@pytest.fixture(scope="module")
def site(slurm_cluster):
    """The submitting shell after `source slurm/use_site.sh` with the site's file: its SBATCH_* variables."""
    path = slurm_cluster.dir / "site.sh"
    path.write_text(SITE.format(python_bin=Path(sys.executable).parent))
    result = slurm_cluster.run(["bash", "-c", 'source slurm/use_site.sh && for name in "${!SBATCH_@}"; do '
                                'echo "$name=${!name}"; done'], extra_env={"KIT_SITE": str(path)})
    assert result.returncode == 0, result.stderr
    return {"KIT_SITE": str(path), **dict(line.split("=", 1) for line in result.stdout.splitlines())}


def check_allocation(cluster, job_id, nodes, partition="gpu"):
    """Where the job ran and what it held: the site's partition, and each node's 2 GPUs with their CPUs
    (the last attempt's: a job that reached its time limit on a loaded machine was requeued)."""
    record = cluster.accounted(job_id, "Partition", "AllocTRES")[-1]
    assert record["Partition"] == partition, record
    held = record["AllocTRES"].split(",")
    assert f"gres/gpu={2 * nodes}" in held and f"cpu={2 * nodes}" in held, record


def job_output(cluster, name, job_id):
    return (cluster.jobs_dir / f"{name}-{job_id}.out").read_text(errors="replace")


def check_training_run(output_dir, world_size, accumulation, batch_size_per_device, final_files=FULL_MODEL):
    metrics = read_metrics(output_dir)
    assert [m["step"] for m in metrics] == list(range(1, 7))
    for m in metrics:
        assert m["world_size"] == world_size
        assert m["gradient_accumulation_steps"] == accumulation
        assert m["batch_size_per_device"] == batch_size_per_device
        assert math.isfinite(m["loss"])
    assert metrics[-1]["loss"] < metrics[0]["loss"], [m["loss"] for m in metrics]
    for name in final_files:
        assert (output_dir / "final" / name).is_file(), name
    assert json.loads((output_dir / "summary.json").read_text())["steps"] == 6


@pytest.mark.parametrize("script, nodes, gpus_per_node, total_batch, per_device, accumulation", [
    ("fsdp", 1, 2, 8, 2, 2),
    ("fsdp", 2, 2, 8, 2, 1),
    ("ddp", 2, 2, 16, 2, 2),
    ("singlegpu", 1, 1, 8, 2, 4),
    ("lora", 1, 2, 8, 2, 2),
])
def test_sbatch_template_trains(slurm_cluster, site, demo, script, nodes, gpus_per_node, total_batch, per_device,
                                accumulation):
    """Each template, with the site's settings only, runs the demo to the end on the site's GPU
    partition with what the site's nodes have (step 2 uses one of the node's GPUs)."""
    output_dir = slurm_cluster.jobs_dir / f"{script}-{nodes}x{gpus_per_node}"
    job_id = slurm_cluster.sbatch(
        *([f"--nodes={nodes}"] if nodes > 1 else []), f"slurm/{script}.sh", *QUICK_TRAINING,
        extra_env={**site, "MODEL": str(demo / "model"), "DATA_DIR": str(demo / "data"), "OUTPUT_DIR": str(output_dir),
                   "TOTAL_BATCH_SIZE": str(total_batch), "BATCH_SIZE_PER_DEVICE": str(per_device)})
    with slurm_cluster.logs_kept_on_failure():
        state = slurm_cluster.wait(job_id, JOB_TIMEOUT_S)
        output = job_output(slurm_cluster, script, job_id)
        assert state == "COMPLETED", output[-4000:]
        check_allocation(slurm_cluster, job_id, nodes)
        if script == "singlegpu":
            assert "step 2 uses the first of this job's 2 GPUs" in output, output[-3000:]
        assert "not usable by CUDA here: running one CPU process per allocated GPU" in output
        assert f"× {accumulation} gradient accumulation steps" in output
        if nodes * gpus_per_node > 1:
            assert f"rendezvous node1:{20000 + int(job_id)} id {job_id}-0" in output
        if script in ("fsdp", "lora"):
            assert "plan check: fits: " in output
            # on several nodes the plan check chooses the sharding, and the run is sharded the way it said
            strategy = "HYBRID_SHARD" if nodes > 1 else "FULL_SHARD"
            assert (f"sharding: HYBRID_SHARD on {nodes} nodes: " in output) == (nodes > 1), output[-3000:]
            assert f"× {accumulation} gradient accumulation steps, {strategy}\n" in output, output[-3000:]
        check_training_run(output_dir, nodes * gpus_per_node, accumulation, per_device,
                           FINAL_FILES.get(script, FULL_MODEL))


def test_tp_template_on_two_nodes_trains_what_one_process_trains(slurm_cluster, site, demo, single_reference):
    """slurm/tp.sh on 2 nodes x 2 GPUs: tensor parallel over each node's 2 ranks (the default, a node's
    GPUs), FSDP across the 2 nodes; with tests/test_equivalence.py's settings its per-step losses and
    final model are step 2's on one process (conftest's single_reference: the same 8 rows a step)."""
    output_dir = slurm_cluster.jobs_dir / "tp-2x2"
    job_id = slurm_cluster.sbatch(
        "--nodes=2", "slurm/tp.sh", *map(str, QUICK + EQUIVALENCE),
        extra_env={**site, "MODEL": str(demo / "model"), "DATA_DIR": str(demo / "data"), "OUTPUT_DIR": str(output_dir),
                   "TOTAL_BATCH_SIZE": "8", "BATCH_SIZE_PER_DEVICE": "2"})
    with slurm_cluster.logs_kept_on_failure():
        state = slurm_cluster.wait(job_id, JOB_TIMEOUT_S)
        output = job_output(slurm_cluster, "tp", job_id)
        assert state == "COMPLETED", output[-4000:]
        assert "plan check: fits: " in output and f"rendezvous node1:{20000 + int(job_id)} id {job_id}-0" in output
        assert ("total batch 8 = 2 per device × 2 data-parallel groups × 2 gradient accumulation steps, FULL_SHARD; "
                "mesh 2 × 2: tensor parallel over 2 ranks\n") in output, output[-3000:]
        assert read_metrics(output_dir)[-1]["world_size"] == 4
        assert_same_run(single_reference, output_dir, tolerance=1e-5)
        assert json.loads((output_dir / "summary.json").read_text())["steps"] == 6


@pytest.mark.parametrize("environment, message", [
    ({"TOTAL_BATCH_SIZE": "10", "BATCH_SIZE_PER_DEVICE": "2"},
     "error: --total_batch_size 10 is not a multiple of --batch_size_per_device 2 × 4 ranks = 8"),
    ({"DATA_DIR": "/nonexistent/chess/data"},
     ("error: no train.jsonl in /nonexistent/chess/data",
      "run `python 01_download/download.py --out /nonexistent/chess`")),
    ({"MODEL": "codellama/CodeLlama-7b-hf", "HF_HOME": "/nonexistent/hf"},
     "python 01_download/download.py --model codellama/CodeLlama-7b-hf --out DIR"),
    ({"GPU_MEMORY_GIB": "3"},  # the plan check: the demo model on 4 GPUs of 3 GiB, 3 GiB of margin included
     ("error: plan check: does NOT fit: ", "a GPU has 3 GiB", "(FORCE=1 sbatch runs it anyway)")),
])
def test_sbatch_template_refuses_before_training(slurm_cluster, demo, environment, message):
    """Arithmetic that does not divide, a download step that was not done, and a job too big for
    its GPUs end the job before training with one clear line (from the plan check that runs
    first, or from rank 0 of 4, with no report of torchrun's after it); the allocation's numbers
    (2 nodes × 2 GPUs = 4 ranks) are in the message."""
    settings = {"MODEL": str(demo / "model"), "DATA_DIR": str(demo / "data"), **environment}
    job_id = slurm_cluster.sbatch("--nodes=2", "--gpus-per-node=2", *SMALL_NODE, "slurm/fsdp.sh",
                                  extra_env=settings)
    with slurm_cluster.logs_kept_on_failure():
        # The plan check, or the training script under torchrun: 4 processes import torch first
        # (40-55 s on a loaded 2-core machine, where the template's own check took a second).
        state = slurm_cluster.wait(job_id, 120)
        output = job_output(slurm_cluster, "fsdp", job_id)
        assert state == "FAILED", output
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        parts = message if isinstance(message, tuple) else (message,)
        assert len(errors) == 1 and all(part in errors[0] for part in parts), output
        # nothing of torchrun's after it: no Python traceback, no ChildFailedError report, no C++ stack
        # dump (c10d's, on the node whose rendezvous host has gone)
        for report in ("Traceback", "ChildFailedError", "Exception raised from"):
            assert report not in output, output
        assert [record["State"] for record in slurm_cluster.accounted(job_id)] == ["FAILED"]  # the real sacct


def test_submit_py_trains_on_two_nodes(slurm_cluster, site, demo):
    """With the site's settings only: its partition, its GPUs (as GRES), CPUs, memory and time."""
    log_dir, output_dir = slurm_cluster.jobs_dir / "submitit", slurm_cluster.jobs_dir / "submit-fsdp-%j"
    result = slurm_cluster.run(
        [sys.executable, "submit.py", "--nodes", "2", "--step", "fsdp",
         "--total_batch_size", "8", "--batch_size_per_device", "2", "--log_dir", str(log_dir),
         "--model", str(demo / "model"), "--data_dir", str(demo / "data"),
         "--output_dir", str(output_dir), "--", *QUICK_TRAINING], extra_env=site, timeout=240)
    with slurm_cluster.logs_kept_on_failure():
        assert result.returncode == 0, result.stderr
        assert "total batch 8 = 2 per device × 4 devices × 1 gradient accumulation steps" in result.stdout
        assert "2 CPUs and 3 GB per node, time limit 00:10:00" in result.stdout
        assert "sharding: HYBRID_SHARD on 2 nodes: " in result.stdout  # and the job runs it (below)
        job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
        for hint in (f"squeue -j {job_id}", f"sacct -j {job_id}", f"tail -f {log_dir}/{job_id}/{job_id}_0_log.out"):
            assert hint in result.stdout
        state = slurm_cluster.wait(job_id, JOB_TIMEOUT_S)
        logs = [(log_dir / job_id / f"{job_id}_{node}_log.out").read_text(errors="replace") for node in (0, 1)]
        assert state == "COMPLETED", logs[0][-4000:] + logs[1][-4000:]
        for log in logs:
            assert f"--nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=node1:{20000 + int(job_id)} " \
                   f"--rdzv-id={job_id}-0" in log
        # rank 0 notes it, on whichever node it is
        assert sum(log.count("not usable by CUDA here") for log in logs) == 1, logs
        assert sum(log.count("× 1 gradient accumulation steps, HYBRID_SHARD\n") for log in logs) == 1, logs
        check_training_run(slurm_cluster.jobs_dir / f"submit-fsdp-{job_id}", 4, 1, 2)
        # what `sacct -j ID` (the hint above) tells: the job, its exit code, its partition and the 4 GPUs it had
        (record,) = slurm_cluster.accounted(job_id, "ExitCode")
        assert record["ExitCode"] == "0:0", record
        check_allocation(slurm_cluster, job_id, 2)


def test_a_request_the_sites_nodes_cannot_hold_is_refused(slurm_cluster, site, demo):
    """4 GPUs on nodes of 2: submit.py names the site's setting before anything is queued; sbatch
    itself refuses the template's job at submission."""
    result = slurm_cluster.run(
        [sys.executable, "submit.py", "--gpus", "4", "--step", "ddp", "--job_name", "four-gpus",
         "--log_dir", str(slurm_cluster.jobs_dir / "four-gpus"), "--model", str(demo / "model"),
         "--data_dir", str(demo / "data")], extra_env=site, timeout=120)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr == (f"error: --gpus 4 is more than a node of this site has: SITE_GPUS_PER_NODE=2 in "
                             f"{site['KIT_SITE']}: use more --nodes\n")
    refused = slurm_cluster.run(["sbatch", "--gres=gpu:4", "slurm/fsdp.sh"], extra_env=site)
    assert refused.returncode != 0 and refused.stderr.count("\n") == 1, refused.stderr
    assert "Requested node configuration is not available" in refused.stderr, refused.stderr


def test_submit_py_refuses_a_job_that_cannot_fit_before_it_is_queued(slurm_cluster, demo):
    """The plan check runs on the login node: nothing reaches the queue or the accounting."""
    result = slurm_cluster.run(
        [sys.executable, "submit.py", "--gpus", "2", "--step", "fsdp", "--job_name", "too-big", "--gpu_memory_gib", "3",
         "--log_dir", str(slurm_cluster.jobs_dir / "too-big"), "--model", str(demo / "model"),
         "--data_dir", str(demo / "data")], timeout=120)
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.startswith("error: plan check: does NOT fit: ") and result.stderr.count("\n") == 1
    accounted = slurm_cluster.run(["sacct", "--allusers", "--noheader", "--name=too-big", "--starttime=2000-01-01"])
    assert accounted.returncode == 0 and accounted.stdout.strip() == "", accounted.stdout
    assert not (slurm_cluster.jobs_dir / "too-big").exists()


def test_submit_py_reports_slurms_own_refusal_in_one_line(slurm_cluster, demo):
    """sbatch itself refuses (a partition that does not exist): its reason, in one error line."""
    result = slurm_cluster.run(
        [sys.executable, "submit.py", "--gpus", "2", "--step", "ddp", "--partition", "no-such-partition",
         "--log_dir", str(slurm_cluster.jobs_dir / "refused"), "--model", str(demo / "model"),
         "--data_dir", str(demo / "data")], timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: Slurm refused the job: sbatch: error: ") and \
        result.stderr.count("\n") == 1, result.stderr
    assert "partition" in result.stderr.lower() and "no-such-partition" in result.stderr or \
        "Invalid partition name" in result.stderr, result.stderr  # the wording differs between Slurm versions
