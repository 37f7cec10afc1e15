"""benchmark/gpu_check.py on the CPU with a shrunk shape: every row is there; steps 3 and 4 and the
7B-shape runs go through gloo; what needs CUDA is skipped with its reason, and no GPU figure is
made up (MFU and GPU memory stay empty)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

ROWS = ["step 2", "step 3", "step 4", "7B shape, LoRA", "7B shape, QLoRA", "7B shape, full fine-tuning"]


@pytest.fixture(scope="module")
def cpu_run(demo, tmp_path_factory):
    """One run of the whole check: 2 CPU processes, 2 layers of hidden 128 in the 7B config."""
    work_dir = tmp_path_factory.mktemp("gpu_check")
    command = [sys.executable, str(REPO / "benchmark/gpu_check.py"), "--layers", "2", "--hidden", "128",
               "--heads", "2", "--intermediate", "256", "--seq_length", "64", "--steps", "2",
               "--data_dir", str(demo / "data"), "--tokenizer", str(demo / "model"), "--work_dir", str(work_dir)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, even on a machine with a GPU
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work_dir, done.stdout


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
    assert rows["7B shape, QLoRA"]["result"] == "skipped: needs CUDA and bitsandbytes"
    for check in ("step 3", "step 4"):
        assert rows[check]["result"] == "ok" and "gloo, CPU" in rows[check]["setup"]
    for check in ("7B shape, LoRA", "7B shape, full fine-tuning"):
        assert rows[check]["result"] == "ok (stopped after 2 steps)", rows[check]
        assert "2 layers, hidden 128" in rows[check]["setup"]
        assert not (work_dir / check.replace(" ", "_").replace(",", "") / "checkpoints").exists()  # stopped first
    for row in rows.values():
        assert "mfu" not in row and "peak_allocated_gib" not in row  # nothing measured a GPU
        if row["result"].startswith("ok"):
            assert row["tokens_per_s_per_gpu"] > 0
    # The plan check's prediction sits next to the runs that FSDP shards.
    assert all(rows[check]["planned_peak_gib"] > 0 for check in ("step 4", "7B shape, LoRA",
                                                                   "7B shape, full fine-tuning"))


def test_the_7b_shape_is_codellamas_with_the_demo_tokenizer(cpu_run):
    work_dir, _ = cpu_run
    config = json.loads((work_dir / "model" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 128, 32016)
    assert not list((work_dir / "model").glob("*.safetensors"))  # random weights: none written
    assert (work_dir / "model" / "tokenizer.json").is_file()
