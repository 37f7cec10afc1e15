"""benchmark/run.py: the side-by-side benchmark (quick mode: every compared run of the
wide-vocab model at accumulation 2, --accumulate_unsharded too, and that model's bytes) writes
a consistent table, JSON, plots and target checks; the wide-vocab model it builds; the shipped
CodeLlama-7b config. No timing values are asserted: they depend on the machine."""
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from common.notation import game_text
from benchmark import run as benchmark_run
from conftest import REPO, run_python

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_script(script, *args, timeout=300):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return run_python([REPO / script, *args], timeout=timeout, env=env)


def per_device_and_accumulation(extra):
    return extra[extra.index("--batch_size_per_device") + 1], extra[extra.index("--total_batch_size") + 1]


def test_full_benchmark_covers_every_configuration_at_each_accumulation_with_one_global_batch():
    run = benchmark_run
    compared, others = run.configurations(quick=False)
    assert run.MODELS == ["built-in", "wide vocab"] and run.ACCUMULATIONS == [1, 2]
    for model in run.MODELS:
        for accumulation in run.ACCUMULATIONS:
            mine = [r for r in compared if (r.model, r.accumulation) == (model, accumulation)]
            unsharded = ["fsdp FULL_SHARD x2 --accumulate_unsharded"] if accumulation > 1 else []
            muon = ["ddp x2 muon", "fsdp FULL_SHARD x2 muon"] if model == "built-in" else []
            assert [r.name for r in mine] == ["ddp x2", "fsdp FULL_SHARD x2", *unsharded, "hf_trainer fsdp x2",
                                              "hf_trainer fsdp x2 packed", *muon]  # the targets' runs
            names = [r.name for r in mine + [r for r in others if (r.model, r.accumulation) == (model, accumulation)]]
            assert len(set(names)) == len(names)  # each writes its own folder and table row
            for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
                assert {f"fsdp {strategy} x2", f"fsdp {strategy} x4"} <= set(names)
            assert {"single", "ddp x4", "fsdp HYBRID_SHARD x4", "fsdp FULL_SHARD x2 no packing"} <= set(names)
    assert {"tp 2x2", "tp 1x4"} <= set(names)  # step 6 beside FSDP on 4 ranks
    for r in compared + others:
        per_device, total = per_device_and_accumulation(r.extra)
        # a tensor-parallel group of --tp_size ranks shares its rows: the batch is shared by group
        groups = r.ranks // (int(r.extra[r.extra.index("--tp_size") + 1]) if "--tp_size" in r.extra else 1)
        assert total == run.GLOBAL_BATCH_ROWS and per_device * groups * r.accumulation == total, r


def test_the_wide_vocab_model_tokenizes_the_games_as_the_demo_and_is_reproducible(demo, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    run = benchmark_run
    first = run.build_wide_vocab_model(demo / "model", tmp_path / "a")
    second = run.build_wide_vocab_model(demo / "model", tmp_path / "b")
    assert run.parameter_count(first) == (6_826_112, 20_480)  # 5.2M of them in embeddings and output layer
    wide, small = AutoTokenizer.from_pretrained(first), AutoTokenizer.from_pretrained(demo / "model")
    moves = json.loads((demo / "data" / "train.jsonl").read_text().splitlines()[0])["text"].split()
    game = game_text("piece", moves)  # as the games are prepared for both (the demo config's notation)
    assert wide(game).input_ids == small(game).input_ids and wide.pad_token_id == small.pad_token_id
    assert small.unk_token_id not in small(game).input_ids
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.fixture(scope="module")
def quick(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark")
    result = run_script("benchmark/run.py", "--quick", "--model", demo / "model", "--data_dir", demo / "data",
                        "--runs_dir", out / "runs", "--out", out, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), result.stdout


def runs_of(results, model, accumulation):
    return {row["name"]: row for row in results["runs"] if (row["model"], row["accumulation"]) == (model, accumulation)}


def test_quick_runs_every_compared_configuration(quick):
    out, results, _ = quick
    compared = ["ddp x2", "fsdp FULL_SHARD x2", "hf_trainer fsdp x2", "hf_trainer fsdp x2 packed"]
    assert benchmark_run.QUICK_BLOCKS == [("wide vocab", 2)]  # the block with every compared run
    assert {(row["model"], row["accumulation"]) for row in results["runs"]} == {("wide vocab", 2)}
    assert list(runs_of(results, "wide vocab", 2)) == compared[:2] + ["fsdp FULL_SHARD x2 --accumulate_unsharded"] \
        + compared[2:]
    assert [results["models"][m]["vocab_size"] for m in ("built-in", "wide vocab")] == [128, 20_480]
    table = (out / "results.md").read_text()
    for row in results["runs"]:
        assert row["steps"] == results["steps"]
        assert row["tokens_per_s"] > 0 and row["peak_rss_mib_per_rank"] > 0
        assert (f"| {row['model']} | {row['accumulation']} | {row['name']} | `{row['script']}` | {row['ranks']} "
                f"| {row['tokens_per_s']} |") in table
        records = [json.loads(line) for line in (Path(row["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
        if row["script"] != "benchmark/hf_trainer_fsdp.py":
            assert {r["gradient_accumulation_steps"] for r in records} == {row["accumulation"]}, row["name"]
    for folder in ("hf_trainer fsdp x2", "hf_trainer fsdp x2 packed"):
        trainer = json.loads((Path(runs_of(results, "wide vocab", 2)[folder]["output_dir"]) / "summary.json")
                             .read_text())
        assert trainer["gradient_accumulation_steps"] == 2


def test_useful_tokens_are_counted_alike_for_the_trainer(quick):
    """Packed rows: 16 full rows per step, in our scripts and in the Trainer fed the same rows, at any
    accumulation (each row's tokens but the first bear a loss). The baseline's padded rows (one game
    each) count only their games' tokens: fewer per step, and that difference is what useful tokens/s
    measures.
    Both Trainer runs really ran FSDP, on the CPU too."""
    _, results, _ = quick
    for model, accumulation in benchmark_run.QUICK_BLOCKS:
        runs, row_tokens = runs_of(results, model, accumulation), benchmark_run.SEQ_LENGTHS[model] - 1
        for name in ("ddp x2", "fsdp FULL_SHARD x2", "hf_trainer fsdp x2 packed"):
            assert runs[name]["tokens_per_step"] == 16 * row_tokens, name
        assert 16 * 10 < runs["hf_trainer fsdp x2"]["tokens_per_step"] < 16 * row_tokens
        for name, packing in (("hf_trainer fsdp x2", False), ("hf_trainer fsdp x2 packed", True)):
            trainer = json.loads((Path(runs[name]["output_dir"]) / "summary.json").read_text())
            assert trainer["packing"] is packing
            assert trainer["wrapped_as"].startswith("FSDP"), trainer  # not DDP, which accelerate falls back to on CPU


def test_ddp_and_fsdp_take_the_same_steps_with_and_without_accumulate_unsharded(quick):
    _, results, _ = quick
    for model, accumulation in benchmark_run.QUICK_BLOCKS:
        runs = runs_of(results, model, accumulation)
        losses = {name: [json.loads(line)["loss"] for line in
                         (Path(row["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
                  for name, row in runs.items() if "hf_trainer" not in name}
        assert len(losses) == (3 if accumulation > 1 else 2)
        for name, got in losses.items():
            assert got == pytest.approx(losses["ddp x2"], abs=1e-4), name


def test_full_shard_keeps_half_of_ddp_state_per_rank(quick):
    """Measured bytes of parameters, gradients and AdamW state per rank, not assumed."""
    _, results, _ = quick
    for model, accumulation in benchmark_run.QUICK_BLOCKS:
        runs = runs_of(results, model, accumulation)
        ddp, fsdp = runs["ddp x2"]["state_mib_per_rank"], runs["fsdp FULL_SHARD x2"]["state_mib_per_rank"]
        assert ddp > 0 and abs(fsdp / (ddp / 2) - 1) <= 0.02


def test_accumulate_unsharded_memory_is_measured_between_micro_batches(quick):
    """On 2 ranks (every dimension even, so shards are exact halves): the option keeps a gathered
    copy of the weights next to the shards (1/2 + 1) and full gradients instead of halves; AdamW's
    state stays sharded. DDP keeps everything whole."""
    out, results, _ = quick
    table = (out / "results.md").read_text()
    for model, held in results["accumulation_bytes_per_rank"].items():
        default, unsharded, ddp = (held[name] for name in ("FULL_SHARD", "FULL_SHARD --accumulate_unsharded", "DDP"))
        assert unsharded["parameters"] == 3 * default["parameters"]
        assert unsharded["gradients"] == 2 * default["gradients"] == ddp["gradients"]
        assert unsharded["optimizer"] == default["optimizer"] == ddp["optimizer"] / 2
        assert all(part["total"] == part["parameters"] + part["gradients"] + part["optimizer"]
                   for part in (default, unsharded, ddp))
    unsharded = runs_of(results, "wide vocab", 2)["fsdp FULL_SHARD x2 --accumulate_unsharded"]
    mib = round(results["accumulation_bytes_per_rank"]["wide vocab"]["FULL_SHARD --accumulate_unsharded"]["total"]
                / 2**20, 2)
    assert f"| wide vocab | fsdp FULL_SHARD x2 --accumulate_unsharded | {unsharded['tokens_per_s']} |" in table
    assert f"| {mib} |" in table


def test_targets_are_checked_and_printed(quick):
    out, results, stdout = quick
    per_block = Counter((target["model"], target["accumulation"]) for target in results["targets"])
    # FULL_SHARD ÷ DDP, ÷ the Trainer, ÷ the Trainer on packed rows; at accumulation 2 also with the option;
    # state bytes once per model (they do not depend on the accumulation)
    assert per_block == {("wide vocab", 2): 6, ("wide vocab", None): 1}
    assert sum("--accumulate_unsharded" in target["target"] for target in results["targets"]) == 3
    for target in results["targets"]:
        assert target["met"] in (True, False), target  # every ratio has a target
    table = (out / "results.md").read_text()
    assert "Targets (ratios from this run" in table
    for target in results["targets"]:
        verdict = "—" if target["met"] is None else "met" if target["met"] else "NOT MET"
        where = target["model"] + ("" if target["accumulation"] is None else f", accumulation {target['accumulation']}")
        assert f"target {verdict}: {target['target']} ({where}): ratio {target['ratio']}" in stdout


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


# ---- issue 36, case 3 and its kin: an earlier benchmark's files are replaced only with --overwrite ------

@pytest.mark.quick
def test_the_default_out_is_not_the_repository_s_figures():
    """`run.py --quick` wrote over benchmark/results.md, results.json and the plots with a 3-step run."""
    args = benchmark_run.parse_arguments(["--quick"])
    assert Path(args.out) == Path(args.runs_dir) == REPO / "runs" / "benchmark"
    assert benchmark_run.parse_arguments(["--out", "benchmark"]).out == "benchmark"


@pytest.mark.quick
@pytest.mark.parametrize("earlier", ["results.json", "runs/wide_vocab_model/config.json"])
def test_an_earlier_benchmark_is_refused_before_anything_runs(demo, tmp_path, earlier):
    (tmp_path / earlier).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / earlier).write_text("mine")
    result = run_script("benchmark/run.py", "--quick", "--model", demo / "model", "--data_dir", demo / "data",
                        "--runs_dir", tmp_path / "runs", "--out", tmp_path)
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {tmp_path / earlier.split('/config')[0]}") and result.stderr.count(
        "\n") == 1 and "pass --overwrite to replace them" in result.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [earlier]


def test_the_bytes_measurement_and_the_trainer_baseline_keep_what_exists(demo, tmp_path):
    """The kin: run.py's own bytes mode under torchrun (--out FILE) and hf_trainer_fsdp.py's run folder."""
    (tmp_path / "bytes.json").write_text("mine")
    bytes_mode = subprocess.run([sys.executable, str(REPO / "benchmark/run.py"), "--model", str(demo / "model"),
                                 "--out", str(tmp_path / "bytes.json")], capture_output=True, text=True, timeout=120,
                                cwd=REPO, env={**os.environ, "RANK": "0"})  # RANK: as under torchrun
    assert bytes_mode.returncode == 2 and bytes_mode.stderr == (
        f"error: --out {tmp_path / 'bytes.json'} exists already: pass --overwrite to replace it, or choose another "
        "--out\n"), bytes_mode.stderr[-2000:]
    (tmp_path / "hf/summary.json").parent.mkdir()
    (tmp_path / "hf/summary.json").write_text("mine")
    trainer = run_script("benchmark/hf_trainer_fsdp.py", "--output_dir", tmp_path / "hf")
    assert trainer.returncode == 2 and trainer.stderr.startswith(f"error: {tmp_path / 'hf'} already holds a run")
    assert (tmp_path / "bytes.json").read_text() == (tmp_path / "hf/summary.json").read_text() == "mine"
