"""04_fsdp's low host-memory loading: only rank 0 ever holds the whole model in host memory; the
other ranks hold their shards (plus one tensor in flight). And benchmark/random_weights.py runs the
step on a model folder without weights."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import QUICK, REPO, read_metrics, run_python, run_step


def test_only_rank0_holds_a_full_copy_while_loading(tmp_path):
    """measure_loading.py on a random Llama of 232 MiB in fp32 (small vocabulary, so that no single
    tensor is large), 2 ranks: loaded on every rank, rank 1's memory grows by at least the whole
    model; loaded train.py's way, by about its half only, while rank 0 holds it all."""
    done = subprocess.run([sys.executable, str(REPO / "tools/measure_loading.py"), "--ranks", "2",
                           "--hidden_size", "768", "--layers", "8", "--vocab_size", "2000", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["method"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])}
    model_mib = results["every_rank"]["model_mib"]
    assert model_mib > 200
    naive, broadcast = results["every_rank"]["per_rank"], results["rank0_broadcast"]["per_rank"]
    assert naive[1]["peak_mib"] >= 0.9 * model_mib, naive  # the measurement does see a full copy
    assert broadcast[0]["peak_mib"] >= 0.9 * model_mib, broadcast  # rank 0 reads the weights
    assert broadcast[1]["peak_mib"] <= 0.75 * model_mib, broadcast  # its half (0.5) and one tensor
    for rank in broadcast:
        assert abs(rank["shard_mib"] - model_mib / 2) < 0.05 * model_mib


def test_random_weights_need_only_the_config(demo, tmp_path):
    """A model folder with config.json and tokenizer only (the 7B benchmark's case) trains under
    benchmark/random_weights.py."""
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / "model" / name, config_only)

    def args(output_dir):
        return ["--model", config_only, "--data_dir", demo / "data", "--output_dir", output_dir, *QUICK]
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(REPO / "benchmark/random_weights.py"), str(REPO / "04_fsdp/train.py"),
               *map(str, args(out) + ["--max_steps", 3, "--seed", 1])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(out)]
    assert len(losses) == 3 and all(4.5 < loss < 5.2 for loss in losses)  # ln(128) = 4.85: an untrained model
    assert (out / "final/model.safetensors").is_file()
    # Run by itself, the step refuses the same folder: there are no weights to load.
    result = run_step("fsdp", args(tmp_path / "refused") + ["--max_steps", 1], nproc=1, check=False)
    assert result.returncode != 0 and f"error: cannot load the model at {config_only}" in result.stderr


@pytest.mark.quick
@pytest.mark.parametrize("option, value, says", [
    ("--hidden_size", 32, "--hidden_size must be at least 64 (got 32)"),  # was a ZeroDivisionError
    ("--hidden_size", 100, "--hidden_size 100: the random Llama has heads of 64"),
    ("--ranks", 0, "--ranks must be at least 1 (got 0)"),  # was an AssertionError
    ("--layers", 0, "--layers must be at least 1 (got 0)"),  # was measured, a model of no layer
])
def test_bad_options_are_one_error_line(option, value, says):
    """Issue 36: a bad option of a tool is one error line before any work, not a traceback."""
    done = run_python([REPO / "tools/measure_loading.py", option, value], timeout=120)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.startswith(f"error: {says}"), done.stderr[-2000:]
    assert done.stderr.count("\n") == 1
