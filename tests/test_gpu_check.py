"""benchmark/gpu_check.py on the CPU with a shrunk shape, started the way a site starts it, by
slurm/gpu_check.sh: every row is there; the steps, preemption, QLoRA's sharding check and the
7B-shape runs go through gloo; what needs CUDA is skipped with its reason, no GPU figure is made up
(MFU and GPU memory stay empty), and the verdict, the output's last line, is "NOT ready". The
table is written as each row ends, the time limit is checked before each row, --only chooses rows.
The verdict's and QLoRA's rules, and the template's refusals, are checked on their own below."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from benchmark import gpu_check
from common.errors import UserError

ROWS = ["speed levers", "step 2", "step 3", "step 4", "step 5", "step 6, tensor parallel", "preemption, step 4",
        "QLoRA sharding", "7B shape, QLoRA", "7B shape, LoRA", "full fine-tuning", "step 4, CPU offload",
        "step 5, CPU offload", "7B shape, full fine-tuning, CPU offload"]
SHRUNK = ["--layers", "2", "--hidden", "128", "--heads", "2", "--intermediate", "256", "--seq_length", "64",
          "--steps", "2", "--batch_size_per_device", "2"]


def sbatch_environment(nodes=1, gpus=2, **extra):
    """What sbatch gives the template on one node (no Slurm here): the job's variables, and the
    kit's Python first on PATH, as after activating its environment."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM")}
    return {**env, "SLURM_JOB_ID": "17", "SLURM_NNODES": str(nodes), "SLURM_GPUS_ON_NODE": str(gpus),
            "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": "node1",
            "PATH": f"{Path(sys.executable).parent}:{env['PATH']}", **extra}


@pytest.fixture(scope="module")
def cpu_run(demo, tmp_path_factory):
    """One run of the whole check through the template: 2 CPU processes, 2 layers of hidden 128."""
    work_dir = tmp_path_factory.mktemp("gpu_check")
    # Every row gets its turn: 8 minutes, the GPU node's default, can run short on a busy 2-core CPU
    command = [shutil.which("bash"), "slurm/gpu_check.sh", *SHRUNK, "--data_dir", str(demo / "data"),
               "--tokenizer", str(demo / "model"), "--time_limit", "1200"]
    env = sbatch_environment(WORK_DIR=str(work_dir), CUDA_VISIBLE_DEVICES="")  # the CPU path, even with a GPU
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # no GPU: not ready
    return work_dir, done.stdout


def test_the_job_ends_with_the_table_and_the_verdict(cpu_run):
    work_dir, stdout = cpu_run
    assert stdout.startswith(f"job 17: GPU check on node1, 2 GPU(s); table in {work_dir}\n")
    assert stdout.endswith((work_dir / "gpu_check.md").read_text())
    assert stdout.splitlines()[-1] == ("verdict: NOT ready: no usable CUDA GPU here; of the checks that run on the "
                                       "CPU 10 passed")
    assert json.loads((work_dir / "gpu_check.json").read_text())["verdict"] == stdout.splitlines()[-1]


def test_one_table_with_every_row(cpu_run):
    work_dir, stdout = cpu_run
    table = (work_dir / "gpu_check.md").read_text()
    assert table in stdout.replace(f"wrote {work_dir / 'gpu_check.md'} and gpu_check.json\n", "")
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == ROWS
    assert "no CUDA: 2 CPU processes, gloo" in table.splitlines()[0]


def test_the_cpu_runs_what_it_can_and_says_why_it_skips_the_rest(cpu_run):
    work_dir, _ = cpu_run
    rows = {row["check"]: row for row in json.loads((work_dir / "gpu_check.json").read_text())["rows"]}
    assert rows["step 2"]["result"] == "skipped: no CUDA GPU here"
    for check in ("step 4, CPU offload", "step 5, CPU offload"):
        assert rows[check]["result"].startswith("skipped: no CUDA GPU here")
    for check in ("step 3", "step 4", "step 5"):
        assert rows[check]["result"] == "ok" and "gloo, CPU" in rows[check]["setup"]
    # Step 6 on the 2 processes, tensor parallel over both: step 4's global batch, so its losses (fp32 here)
    found = re.fullmatch(r"ok: losses within (\S+) of step4's", rows["step 6, tensor parallel"]["result"])
    assert found and float(found.group(1)) <= 1e-4, rows["step 6, tensor parallel"]
    assert rows["step 6, tensor parallel"]["setup"] == "demo model, tensor parallel 2 x FSDP 1, 2 ranks, gloo, CPU"
    # SIGTERM to every process of a run with loader workers: saved, resumed, step 4's losses
    assert re.fullmatch(r"ok: saved a checkpoint at step \d+, resumed; losses within \S+ of step4's",
                        rows["preemption, step 4"]["result"]), rows["preemption, step 4"]
    assert re.fullmatch(r"ok: the same logits to \S+ \(scale \S+\); 14 4-bit weights split, 0 kept whole",
                        rows["QLoRA sharding"]["result"]), rows["QLoRA sharding"]
    # The levers, each against the eager baseline in one process (compiling left out on the CPU): the
    # same losses; the fastest is what the 7B rows run with.
    levers = rows["speed levers"]
    chosen = re.fullmatch(r"ok: chosen ([a-z ]+) \(([^)]*), (\S+)x\); each: .*", levers["result"])
    assert chosen, levers
    assert [found["setting"] for found in levers["levers"]] == [
        "baseline", "selective recomputation", "no recomputation", "chunked loss"]
    assert all(found["same_losses"] and found["loss_difference"] <= 1e-4 for found in levers["levers"]), levers
    fastest = max(levers["levers"], key=lambda found: found["speedup"])
    assert (chosen.group(1), chosen.group(3)) == (fastest["setting"], f"{fastest['speedup']:.2f}")
    assert levers["setup"] == "2 layers of the 7B shape, 1 CPU process, 2 x 64 tokens, 6 steps, against eager with " \
        "every layer recomputed"
    for row_id, check in (("lora", "7B shape, LoRA"), ("qlora", "7B shape, QLoRA"), ("full", "full fine-tuning")):
        assert rows[check]["result"] == "ok (stopped after 2 steps)", rows[check]
        assert f"2 x 64 tokens per GPU, {chosen.group(2)}" in rows[check]["setup"]
        assert not (work_dir / row_id / "checkpoints").exists()  # stopped first
    assert "2 layers, hidden 128" in rows["7B shape, LoRA"]["setup"]
    assert rows["full fine-tuning"]["setup"].startswith("2 of the 7B shape's 2 layers")
    assert rows["7B shape, full fine-tuning, CPU offload"]["result"] == (
        "skipped: fits the GPUs without offload (see full fine-tuning)")
    for row in rows.values():
        assert "mfu" not in row and "peak_allocated_gib" not in row  # nothing measured a GPU
        if row["result"].startswith("ok") and "losses" in row:
            assert row["tokens_per_s_per_gpu"] > 0
    # The plan check's prediction sits next to the runs that FSDP shards, QLoRA's 4-bit model too.
    assert all(rows[check]["planned_peak_gib"] > 0 for check in ("step 4", "step 6, tensor parallel", "7B shape, LoRA",
                                                                   "7B shape, QLoRA", "full fine-tuning"))


def test_the_7b_shape_is_codellamas_with_the_demo_tokenizer(cpu_run):
    work_dir, _ = cpu_run
    config = json.loads((work_dir / "model" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 128, 32016)
    assert not list((work_dir / "model").glob("*.safetensors"))  # random weights: none written
    assert (work_dir / "model" / "tokenizer.json").is_file()


def check(demo, work_dir, *arguments):
    return subprocess.Popen([sys.executable, "benchmark/gpu_check.py", *SHRUNK, "--data_dir", str(demo / "data"),
                             "--tokenizer", str(demo / "model"), "--work_dir", str(work_dir), *arguments],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_a_run_killed_at_any_moment_leaves_the_rows_done_so_far(demo, tmp_path):
    """--only runs the rows asked for; each row is in gpu_check.md and .json as soon as it ends."""
    process = check(demo, tmp_path, "--only", "step3,step4")
    deadline = time.time() + 300
    while not (tmp_path / "gpu_check.json").exists():
        assert process.poll() is None and time.time() < deadline, process.communicate()[0][-3000:]
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # the whole check, its run of step 4 too
    process.wait()
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [row["check"] for row in report["rows"]] == ["step 3"] and report["rows"][0]["result"] == "ok"
    assert report["verdict"] == "in progress: 1 check(s) done so far"
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| step 3 | demo model, DDP" in table and "| step 4 |" not in table


def test_the_time_limit_is_checked_before_every_run_and_plan_check(demo, tmp_path):
    """A 7B-shape row needs more than a minute and a half: with one left, neither it nor its plan check starts."""
    process = check(demo, tmp_path, "--only", "lora", "--time_limit", "60")
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 1, output[-3000:]
    (row,) = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert row["result"].startswith("not run: it needs about 100 s, ") and "planned_peak_gib" not in row, row
    assert not (tmp_path / "lora").exists()
    # The plans' process asks the clock before each plan check too.
    import queue
    results = queue.Queue()
    gpu_check.plan_each([("lora", "lora", ["--model", "unused"])], 2, time.monotonic() + 59, results)
    assert results.get_nowait() == ("lora", None, "plan check not run: less than a minute of --time_limit left")


@pytest.mark.quick
def test_the_check_works_only_in_a_folder_of_its_own(demo, tmp_path):
    """It replaces WORK_DIR/ROW and WORK_DIR/model on every start: --work_dir W with a user's run in
    W/qlora and a model in W/model used to delete the run and rewrite the model's config.json; a
    file as --work_dir was a FileExistsError traceback. Refused in one line; an empty folder is taken
    and marked, and a marked one taken again."""
    users = tmp_path / "users"
    shutil.copytree(demo / "model", users / "model")
    (users / "qlora" / "final").mkdir(parents=True)
    (users / "qlora" / "notes.txt").write_text("my run\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("mine\n")
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    output, _ = check(demo, users, "--only", "qlora").communicate(timeout=120)
    assert output.startswith(f"error: --work_dir {users} holds files that the GPU check did not write"), output
    assert len(output.splitlines()) == 1, output
    for work_dir, words in [(users / "model", "holds files that the GPU check did not write"), (a_file, "is a file")]:
        with pytest.raises(UserError, match=f"^--work_dir {re.escape(str(work_dir))} {words}"):
            gpu_check.take_work_dir(work_dir)
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before
    for _ in range(2):
        gpu_check.take_work_dir(tmp_path / "new")
        (tmp_path / "new" / "step2").mkdir(exist_ok=True)  # a row's run, replaced on the next start
    assert (tmp_path / "new" / gpu_check.WORK_DIR_MARK).is_file()


def test_offloading_counts_the_memory_the_host_has_available(demo, tmp_path, monkeypatch):
    """Host memory that is in use (page cache, other jobs) is not there to offload to: what counts is
    what is available, not the total."""
    import argparse
    import psutil
    from tools import estimate_memory
    args = argparse.Namespace(**{flag: None for flag in gpu_check.SHAPE_FLAGS}, tokenizer=str(demo / "model"),
                              work_dir=str(tmp_path), time_limit=3600, steps=2, seq_length=2048)
    runner = gpu_check.Runner(args, False, 1, "1 x test GPU")  # on_gpu: the table would ask CUDA for its MFU note
    config = gpu_check.make_model_dir(args, tmp_path / "model")
    memory = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory._replace(total=2 ** 50, available=2 ** 30))
    monkeypatch.setattr(estimate_memory, "gpu_memory_default", lambda: 80.0)
    job = ["--model", tmp_path / "model", "--max_seq_length", 2048, "--batch_size_per_device", 1,
           "--total_batch_size", 1, "--gradient_checkpointing"]
    gpu_check.full_offload(runner, config, job, 1, estimate_memory, tmp_path / "model")
    (row,) = runner.rows
    assert re.fullmatch(r"skipped: offloaded it needs \d+ GiB of host memory, 1 GiB are available", row["result"]), row


# ---- the verdict and QLoRA's comparison with LoRA, on rows as the runs leave them ----------------

CODELLAMA = json.loads((REPO / "benchmark/codellama-7b-config.json").read_text())


def row(check, result="ok (stopped after 4 steps)", **figures):
    return {"check": check, "setup": "", "result": result, **figures}


def test_step_6_is_skipped_on_one_gpu_with_its_reason(tmp_path):
    """The kit's GPU machine has one GPU: tensor parallelism needs two, so the row says so and runs nothing."""
    import argparse
    runner = gpu_check.Runner(argparse.Namespace(work_dir=str(tmp_path), time_limit=480), False, 1, "1 x H100")
    gpu_check.tensor_parallel(runner, [], "nccl", plans=None)
    assert runner.rows == [{"check": "step 6, tensor parallel", "setup": "demo model, tensor parallel 2 x FSDP 0, 1 "
                            "ranks, nccl", "result": "skipped: needs 2 GPUs or more (each layer split over 2)"}]
    assert gpu_check.verdict(runner.rows, True, "1 x H100")[1] == 0  # a skip, not a failure
    assert "skipped: needs 2 GPUs or more" in (tmp_path / "gpu_check.md").read_text()


def test_a_gpu_node_is_ready_only_when_nothing_failed():
    rows = [row("step 2", "ok"), row("7B shape, full fine-tuning", "skipped: does not fit on 1 GPU(s)")]
    assert gpu_check.verdict(rows, True, "8 x H100") == (
        "verdict: ready: 1 checks passed on 8 x H100; skipped: 7B shape, full fine-tuning (does not fit on 1 GPU(s))",
        0)
    for failure in ("out of memory", "failed (exit 1, see x.log)", "stopped: out of time (--time_limit)",
                    "not run: the time limit (--time_limit) is used up", "FAILED: peak 20.0 GiB"):
        line, status = gpu_check.verdict([*rows, row("7B shape, QLoRA", failure)], True, "8 x H100")
        assert (line, status) == ("verdict: NOT ready: 7B shape, QLoRA failed on 8 x H100 (see the table and the "
                                  "logs)", 1)


@pytest.mark.parametrize("qlora_peak, qlora_losses, problem", [
    (12.0, [10.40, 10.38], None),  # 7B on 1 GPU: 26.5 GiB of fp32 weights against 3.3 in 4 bits
    (30.0, [10.40, 10.38], "4-bit weights should save about 21.1 GiB"),  # the quantisation lost
    (12.0, [10.40, 12.0], "mean loss 11.2 against LoRA's 10.39"),
    (12.0, [float("nan"), 10.38], "mean loss nan"),
])
def test_qlora_fails_unless_its_memory_and_loss_are_those_of_4_bit_weights(qlora_peak, qlora_losses, problem):
    lora = row("7B shape, LoRA", peak_allocated_gib=35.0, losses=[10.40, 10.38, 10.5])
    qlora = row("7B shape, QLoRA", peak_allocated_gib=qlora_peak, losses=qlora_losses)
    gpu_check.compare_qlora(qlora, lora, CODELLAMA, 1)
    if problem is None:
        assert qlora["result"] == "ok (stopped after 4 steps)"
    else:
        assert qlora["result"].startswith("FAILED: ") and problem in qlora["result"], qlora["result"]


@pytest.mark.parametrize("environment, words", [
    ({"SLURM_NNODES": "2"}, "this job has 2 node(s) × 2 GPU(s)"),
    ({"SLURM_GPUS_ON_NODE": "0"}, "this job has 1 node(s) × 0 GPU(s)"),
    ({"SLURM_JOB_ID": ""}, "submit this script with sbatch"),
])
def test_the_template_refuses_a_job_that_is_not_one_node_with_gpus(environment, words):
    done = subprocess.run([shutil.which("bash"), "slurm/gpu_check.sh"], capture_output=True, text=True, timeout=60,
                          env=sbatch_environment(**environment), cwd=REPO)
    assert (done.returncode, done.stdout) == (2, "") and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and words in done.stderr


@pytest.mark.quick
@pytest.mark.parametrize("on_gpu, step6_losses, result", [
    (False, [10.4, 10.1], "ok: losses within 9.9e-06 of step4's"),
    (False, [10.4, 10.2], "FAILED: losses differ from step4's by up to 9.9e-03 (relative; at most 1e-04)"),
    (True, [10.4, 10.2], "ok: losses within 9.9e-03 of step4's"),  # bf16's rounding
    (True, [10.4, float("nan")], "FAILED: losses differ from step4's by up to nan (relative; at most 1e-02)"),
    (False, [10.4], "FAILED: 1 steps on record against step4's 2"),
])
def test_step_6_fails_where_its_losses_stray_from_step_4s(on_gpu, step6_losses, result):
    step6 = row("step 6, tensor parallel", "ok", losses=step6_losses)
    gpu_check.compare_with_step4(step6, row("step 4", "ok", losses=[10.4, 10.0999]), on_gpu)
    assert step6["result"] == result


@pytest.mark.quick
def test_a_finished_runs_memory_is_the_largest_over_its_ranks(tmp_path):
    """Rank 0 writes the steps' records with its own peak; summary.json has every rank's largest."""
    from common.run_dir import RunDir
    run = RunDir(tmp_path)
    run.metrics.write_text("".join(json.dumps({"step": step, "loss": 1.0, "tokens_per_s_per_device": 5.0,
                                               "peak_gpu_allocated_mib": 1024.0}) + "\n" for step in (1, 2)))
    assert gpu_check.figures(tmp_path)["peak_allocated_gib"] == 1.0  # stopped early: rank 0's
    run.summary.write_text(json.dumps({"peak_gpu_allocated_mib_per_rank": 3072.0}))
    assert gpu_check.figures(tmp_path)["peak_allocated_gib"] == 3.0


def lever(setting, speedup=1.0, difference=0.0, same=True, **problem):
    return {"setting": setting, "speedup": speedup, "loss_difference": difference, "same_losses": same,
            "out_of_memory": problem.get("out_of_memory"), "error": problem.get("error")}


@pytest.mark.quick
def test_the_levers_row_fails_where_a_lever_changes_the_losses_or_fails():
    choice = {"setting": "all", "options": ["--compile"], "speedup": 1.4,
              "settings": [lever("baseline"), lever("compile", 1.2, 3e-3), lever("all", 1.4, 4e-3),
                           lever("no recomputation", out_of_memory=True, speedup=None)]}
    assert gpu_check.lever_result(choice) == (
        "ok: chosen all (--compile, 1.40x); each: compile 1.20x, losses within 3.0e-03; all 1.40x, losses within "
        "4.0e-03; no recomputation out of memory")
    choice["settings"][1].update(loss_difference=0.5, same_losses=False)  # a lever that changed the maths
    assert gpu_check.lever_result(choice).startswith("FAILED: compile (losses not the baseline's, or failed)")
    choice["settings"][1] = lever("compile", speedup=None, error="InductorError: no C++ compiler")
    assert gpu_check.lever_result(choice).startswith("FAILED: compile (")
    assert "compile failed: InductorError: no C++ compiler" in gpu_check.lever_result(choice)
