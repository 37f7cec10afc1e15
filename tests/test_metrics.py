"""What every run reports: throughput per device, the step time split, memory, checkpoint save
time, and the FLOPs count behind MFU."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common.metrics import flops_per_token, model_flops_utilization
from conftest import demo_args, read_metrics, run_step

# CodeLlama-7b's architecture (the hub's config.json)
CODELLAMA_7B = dict(vocab_size=32016, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, rope_theta=1e6, max_position_embeddings=16384)


def test_flops_per_token_of_codellama_7b():
    """6 × (all parameters but the input embedding) + 12 × layers × hidden × seq_len, with the
    parameters counted from the architecture by hand, not by the model."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CODELLAMA_7B))
    h, i, layers, vocab, seq = 4096, 11008, 32, 32016, 4096
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # q k v o, gate up down, two RMSNorms
    non_embedding = layers * per_layer + h + vocab * h  # + final norm + lm_head (a matmul)
    assert non_embedding + vocab * h == sum(p.numel() for p in model.parameters())  # 6.74B, as published
    assert flops_per_token(model, seq) == 6 * non_embedding + 12 * layers * h * seq
    assert 4.5e10 < flops_per_token(model, seq) < 4.7e10  # ≈ 46 GFLOP per token at 4k context


def test_no_mfu_without_a_known_gpu_peak():
    assert model_flops_utilization(1e4, 4.6e10, torch.device("cpu")) == {}


@pytest.mark.quick
def test_a_cpu_process_flushes_denormals_that_slow_its_steps_down():
    """Unflushed, AdamW's decaying moments turn denormal and a long CPU run's step time nearly
    doubles (benchmark/learn_chess.py); every step picks its device through pick_device."""
    probe = ("import torch; from common.device import pick_device; before = torch.tensor([1e-39]).item(); "
             "pick_device('cpu'); print(before, torch.tensor([1e-39]).item())")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    before, after = map(float, result.stdout.split())
    assert before > 0 and after == 0  # representable before; flushed to zero on the training device


def test_a_run_reports_throughput_time_split_memory_and_save_time(demo, tmp_path):
    run_step("ddp", demo_args(demo, tmp_path) + ["--max_steps", 4, "--save_every", 2, "--batch_size_per_device", 2],
             nproc=2)
    records = read_metrics(tmp_path)
    for record in records:
        assert record["tokens_per_s_per_device"] * 2 == pytest.approx(record["tokens_per_s"])
        assert 0 <= record["data_wait_s"] <= record["step_time_s"]
        assert record["peak_rss_mib"] > 100
        assert "mfu" not in record  # CPU: no peak to compare against
    assert [r["step"] for r in records if "checkpoint_save_s" in r] == [2, 4]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert abs(summary["tokens_per_s_per_device"] * 2 - summary["tokens_per_s"]) <= 0.2
    assert 0 <= summary["data_wait_share"] < 1
    assert summary["checkpoint_save_s_max"] > 0
