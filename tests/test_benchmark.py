"""benchmark/: the side-by-side benchmark (quick mode) writes a consistent table, JSON, plots and
target checks; the 7B-shape script runs end to end on a shrunk shape on the CPU. No timing values
are asserted: they depend on the machine."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_script(script, *args, timeout=300):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, str(REPO / script), *[str(a) for a in args]], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def test_full_benchmark_covers_every_configuration_with_one_global_batch():
    spec = importlib.util.spec_from_file_location("benchmark_run", REPO / "benchmark" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    compared, others = run.configurations(quick=False)
    configs = compared + others
    assert [name for name, _, _, _ in compared] == ["ddp x2", "fsdp FULL_SHARD x2", "hf_trainer fsdp x2",
                                                   "hf_trainer fsdp x2 packed"]  # the targets' runs
    names = [name for name, _, _, _ in configs]
    assert len(set(names)) == len(names)  # each writes its own folder and table row
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        assert {f"fsdp {strategy} x2", f"fsdp {strategy} x4"} <= set(names)
    assert {"single", "ddp x2", "ddp x4", "fsdp HYBRID_SHARD x4", "fsdp FULL_SHARD x2 no packing",
            "hf_trainer fsdp x2", "hf_trainer fsdp x2 packed"} <= set(names)
    for name, _, ranks, extra in configs:
        micro = extra[extra.index("--batch_size_per_device") + 1]
        accumulation = extra[extra.index("--gradient_accumulation_steps") + 1] \
            if "--gradient_accumulation_steps" in extra else 1
        assert micro * accumulation * ranks == run.GLOBAL_BATCH_ROWS, name


@pytest.fixture(scope="module")
def quick(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark")
    result = run_script("benchmark/run.py", "--quick", "--model", demo / "model", "--data_dir", demo / "data",
                        "--runs_dir", out / "runs", "--out", out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), result.stdout


def test_table_has_a_row_per_configuration(quick):
    out, results, _ = quick
    names = [row["name"] for row in results["runs"]]
    assert names == ["ddp x2", "fsdp FULL_SHARD x2", "hf_trainer fsdp x2", "hf_trainer fsdp x2 packed"]
    table = (out / "results.md").read_text()
    for row in results["runs"]:
        assert row["steps"] == results["steps"]
        assert f"| {row['name']} | `{row['script']}` | {row['ranks']} | {row['tokens_per_s']} |" in table
        assert row["tokens_per_s"] > 0 and row["peak_rss_mib_per_rank"] > 0


def test_useful_tokens_are_counted_alike_for_the_trainer(quick):
    """Packed rows: 16 rows x 127 loss-bearing tokens per step, in our scripts and in the Trainer
    fed the same rows. The baseline's padded rows (one game each) count only their games' tokens:
    fewer per step, and that difference is what useful tokens/s measures. Both Trainer runs
    really ran FSDP, on the CPU too."""
    out, results, _ = quick
    by_name = {row["name"]: row for row in results["runs"]}
    for name in ("ddp x2", "fsdp FULL_SHARD x2", "hf_trainer fsdp x2 packed"):
        assert by_name[name]["tokens_per_step"] == 16 * 127, name
    assert 16 * 10 < by_name["hf_trainer fsdp x2"]["tokens_per_step"] < 16 * 127
    for folder, packing in (("hf_trainer_fsdp_x2", False), ("hf_trainer_fsdp_x2_packed", True)):
        trainer = json.loads((out / "runs" / folder / "summary.json").read_text())
        assert trainer["packing"] is packing
        assert trainer["wrapped_as"].startswith("FSDP"), trainer  # not DDP, which accelerate falls back to on CPU


def test_ddp_and_fsdp_take_the_same_steps(quick):
    _, results, _ = quick
    ddp, fsdp = results["runs"][0], results["runs"][1]
    assert abs(ddp["final_loss"] - fsdp["final_loss"]) <= 1e-3


def test_full_shard_keeps_half_of_ddp_state_per_rank(quick):
    """Measured bytes of parameters, gradients and AdamW state per rank, not assumed."""
    _, results, _ = quick
    ddp, fsdp = results["runs"][0]["state_mib_per_rank"], results["runs"][1]["state_mib_per_rank"]
    assert ddp > 0 and abs(fsdp / (ddp / 2) - 1) <= 0.02


def test_targets_are_checked_and_printed(quick):
    out, results, stdout = quick
    assert [target["met"] is None for target in results["targets"]] == [False, False, True, False]
    table = (out / "results.md").read_text()
    assert "Targets (ratios from this run):" in table
    for target in results["targets"]:
        verdict = "—" if target["met"] is None else "met" if target["met"] else "NOT MET"
        assert f"target {verdict}: {target['target']}: ratio {target['ratio']}" in stdout


def test_plots_are_png_files(quick):
    out, _, _ = quick
    for name in ("tokens_per_s.png", "memory.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000, name


def test_missing_demo_assets_are_one_error_line(tmp_path):
    result = run_script("benchmark/run.py", "--quick", "--model", tmp_path / "nothing", "--out", tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error:") and "download.py --demo" in result.stderr
    assert not (tmp_path / "results.json").exists()


def test_shipped_config_is_codellama_7b():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(REPO / "benchmark" / "codellama-7b-config.json")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.intermediate_size,
            config.vocab_size, config.max_position_embeddings) == (4096, 32, 32, 11008, 32016, 16384)
    assert config.rope_parameters["rope_theta"] == 1e6
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 6_738_546_688


def test_gpu_7b_script_runs_a_shrunk_shape_on_the_cpu(demo, tmp_path):
    result = run_script("benchmark/gpu_7b.py", "--layers", 2, "--hidden", 128, "--heads", 2, "--intermediate", 256,
                        "--steps", 2, "--seq_length", 64, "--gradient_accumulation_steps", 1,
                        "--batch_size_per_device", 2, "--tokenizer", demo / "model", "--data_dir", demo / "data",
                        "--work_dir", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"], config["rope_theta"]) == \
        (2, 128, 32016, 1000000)  # the overrides, the rest CodeLlama-7b's
    results = json.loads((tmp_path / "results.json").read_text())
    assert [run["status"] for run in results["runs"]] == ["ok", "ok"]
    assert [run["activation_checkpointing"] for run in results["runs"]] == [False, True]
    assert all(run["tokens_per_s_per_device"] > 0 and run["mfu"] is None for run in results["runs"])  # no MFU on CPU
    table = (tmp_path / "results.md").read_text()
    assert "| no |" in table and "| yes |" in table
    for name in ("without_checkpointing", "with_checkpointing"):
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert len(records) == 2
        assert not (tmp_path / name / "checkpoints").exists()  # removed: 16 bytes per parameter for 7B
