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
    """6 × the weights of every matrix multiplication (all but the input embedding and the norms)
    + 12 × layers × hidden × seq_len, with the weights counted from the architecture by hand."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CODELLAMA_7B))
    h, i, layers, vocab, seq = 4096, 11008, 32, 32016, 4096
    matmul_weights = layers * (4 * h * h + 3 * h * i) + vocab * h  # q k v o, gate up down; lm_head
    norms = layers * 2 * h + h
    assert matmul_weights + norms + vocab * h == sum(p.numel() for p in model.parameters())  # 6.74B, as published
    assert flops_per_token(model, seq) == 6 * matmul_weights + 12 * layers * h * seq
    assert 4.5e10 < flops_per_token(model, seq) < 4.7e10  # ≈ 46 GFLOP per token at 4k context


SMALL_LLAMA = dict(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=4, attn_implementation="eager")


def counted_flops_per_token(model, seq):
    """What torch's FLOP counter counts for one training step's forward and backward, per token."""
    from torch.utils.flop_counter import FlopCounterMode
    tokens = torch.randint(0, 256, (2, seq))
    with FlopCounterMode(display=False) as counter:
        model(tokens, labels=tokens).loss.backward()
    return counter.get_total_flops() / tokens.numel()


def test_the_flop_count_of_full_fine_tuning_is_torchs_own():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL_LLAMA))
    assert flops_per_token(model, 64) == pytest.approx(counted_flops_per_token(model, 64), rel=0.01)


def test_lora_frozen_weights_count_4_flops_not_6():
    """LoRA's frozen weights compute no weight gradient: torch's FLOP counter agrees with the
    formula within 4 % (the first layer's q, k, v projections need no input gradient either), and
    counting them at 6 (as for full fine-tuning) would overstate the work by over a third."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(LlamaConfig(**SMALL_LLAMA)),
                           LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"], task_type="CAUSAL_LM"))
    counted = counted_flops_per_token(model, 64)
    assert flops_per_token(model, 64) == pytest.approx(counted, rel=0.04)
    for param in model.parameters():
        param.requires_grad_(True)  # what the old formula assumed
    assert flops_per_token(model, 64) > 1.35 * counted


def test_a_4_bit_weight_counts_its_full_shape():
    """QLoRA's NF4 weights (common/nf4.py) are stored packed, 2 values a byte, with their scales; a
    layer counts by its in and out features, so the same model in 4 bits costs the same FLOPs."""
    from common.nf4 import is_nf4, quantize_frozen_linears
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL_LLAMA))
    for param in model.parameters():
        param.requires_grad_(False)
    unpacked = flops_per_token(model, 64)
    for layer in model.model.layers:
        quantize_frozen_linears(layer)
    assert any(is_nf4(param) for param in model.parameters())
    assert flops_per_token(model, 64) == unpacked


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
                                        ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989),
                                        ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA RTX A6000", None)])
def test_mfu_is_against_the_peak_of_the_exact_gpu_and_says_which(monkeypatch, name, peak):
    """Code path only for the device name (CUDA would give it): the PCIe and NVL H100s are not
    measured against the SXM's peak; an unknown GPU gets no MFU rather than a guess."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    figures = model_flops_utilization(1000.0, 4.6e10, torch.device("cuda", 0))
    if peak is None:
        assert figures == {}
    else:
        assert figures == {"mfu": round(1000 * 4.6e10 / (peak * 1e12), 4), "mfu_peak_tflops": peak}


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
