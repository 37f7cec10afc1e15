"""05_lora: adapters (peft) sharded with FSDP. The loss falls; only the adapters are trained,
checkpointed and saved; the saved adapter loads with peft alone and gives the trained model's
validation loss; a LoRA run resumes exactly. QLoRA: tests/test_qlora.py."""
import json
import shutil

import pytest
import torch

from conftest import REPO, demo_args, read_metrics, run_python, run_ranks, run_step

from common.chess_eval import validation_loss_sums
from common.prepare_data import prepared_rows

STEPS = 10
LORA = ["--lora_rank", 8, "--max_steps", STEPS, "--learning_rate", 5e-3, "--save_every", 5,
        "--keep_checkpoints", 2, "--total_batch_size", 8, "--batch_size_per_device", 2]


@pytest.fixture(scope="module")
def lora_run(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    run_step("lora", demo_args(demo, out) + LORA, nproc=2)
    return out


def validation_loss(model, demo, tokenizer, cache_dir):
    """What train.py reports as eval_loss (the QUICK settings: 8 rows of 64 tokens)."""
    rows = prepared_rows(demo / "data", "validation", tokenizer, 64, True, cache_dir, notation="piece")
    total, tokens = validation_loss_sums(model.eval(), rows[:8], 4, tokenizer.pad_token_id, torch.device("cpu"))
    return (total / tokens).item()


def test_lora_lowers_the_loss_and_trains_only_the_adapters(lora_run):
    losses = [r["loss"] for r in read_metrics(lora_run)]
    assert len(losses) == STEPS and sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    from torch.distributed.checkpoint import FileSystemReader
    saved = FileSystemReader(lora_run / f"checkpoints/step-{STEPS:06d}").read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    optimizer_keys = [k for k in saved if k.startswith("optimizer.state.")]
    assert model_keys and optimizer_keys
    assert all(".lora_A." in k or ".lora_B." in k for k in model_keys + optimizer_keys)  # the frozen model stays out


def test_adapter_loads_with_peft_and_gives_the_trained_model(lora_run, demo, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    final = lora_run / "final"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in final.iterdir()}
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at 0: it was trained

    tokenizer = AutoTokenizer.from_pretrained(final)
    base = AutoModelForCausalLM.from_pretrained(demo / "model", dtype=torch.float32)
    base_loss = validation_loss(base, demo, tokenizer, tmp_path)
    tuned = PeftModel.from_pretrained(base, final)
    tuned_loss = validation_loss(tuned, demo, tokenizer, tmp_path)
    trained_loss = read_metrics(lora_run)[-1]["eval_loss"]  # the sharded model's, at the last step
    assert abs(tuned_loss - trained_loss) < 1e-5, (tuned_loss, trained_loss)
    assert tuned_loss < base_loss - 0.01


def test_lora_run_resumes_exactly(lora_run, demo, tmp_path):
    """Back to the step-5 checkpoint (as if the job died after it), then --resume."""
    resumed = tmp_path / "resumed"
    shutil.copytree(lora_run, resumed)
    shutil.rmtree(resumed / f"checkpoints/step-{STEPS:06d}")
    shutil.rmtree(resumed / "final")
    run_step("lora", demo_args(demo, resumed) + LORA + ["--resume"], nproc=2)
    reference, again = read_metrics(lora_run), read_metrics(resumed)
    assert [r["step"] for r in again] == list(range(1, STEPS + 1))
    for ref, got in zip(reference[5:], again[5:]):
        assert abs(ref["loss"] - got["loss"]) <= 1e-6, (ref, got)
    from safetensors.torch import load_file
    ref_adapter = load_file(lora_run / "final/adapter_model.safetensors")
    got_adapter = load_file(resumed / "final/adapter_model.safetensors")
    assert max((ref_adapter[k] - got_adapter[k]).abs().max().item() for k in ref_adapter) <= 1e-6


def test_export_refuses_a_lora_checkpoint(lora_run, tmp_path):
    done = run_python([REPO / "tools/export.py", lora_run / "checkpoints/step-000010", tmp_path / "out"])
    assert done.returncode == 2 and "error:" in done.stderr and "LoRA adapters only" in done.stderr
    assert not (tmp_path / "out").exists()


FROZEN_BASE = """
    import json, torch, torch.distributed as dist
    from launch.steps import load_step
    from common.model import load_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    dist.init_process_group("gloo")
    step = load_step("lora")
    args = step.parse_arguments(["--output_dir", "unused", "--model", MODEL, "--lora_rank", "8"])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ids = torch.randint(4, 80, (2, 48), generator=torch.Generator().manual_seed(0))
    found = {}
    for stored in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = step.add_lora(load_model(MODEL), args, stored)
        for name, param in model.named_parameters():
            if "lora_B" in name:  # zero at the start: something for the adapters to change
                torch.nn.init.normal_(param, std=0.05)
        step.shard_model(model, init_device_mesh("cpu", (1,)), "FULL_SHARD", policy, OffloadPolicy())
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        found[str(stored)] = {"loss": loss.item(),
                              "grads": [p.grad.full_tensor() for p in model.parameters() if p.requires_grad],
                              "frozen_bytes": sum(p.to_local().numel() * p.element_size()
                                                  for p in model.parameters() if not p.requires_grad)}
    fp32, bf16 = found["torch.float32"], found["torch.bfloat16"]
    print(json.dumps({"losses": [fp32["loss"], bf16["loss"]],
                      "frozen_bytes": [fp32["frozen_bytes"], bf16["frozen_bytes"]],
                      "grad_difference": max((a - b).abs().max().item() for a, b in zip(fp32["grads"], bf16["grads"])),
                      "adapters": len(bf16["grads"])}))
    dist.destroy_process_group()
"""


def test_a_bf16_frozen_base_gives_the_losses_of_fp32_weights_in_half_the_memory(demo, tmp_path):
    """With bf16 compute FSDP casts every frozen fp32 weight to bf16 for each use; add_lora stores
    them in bf16 from the start: the same values, so the same loss and adapter gradients, to the
    bit, with the frozen weights in half the bytes."""
    found = json.loads(run_ranks(tmp_path, f"    MODEL = {str(demo / 'model')!r}\n" + FROZEN_BASE, nproc=1))
    assert found["losses"][0] == found["losses"][1] and found["grad_difference"] == 0.0, found
    assert found["adapters"] > 0 and found["frozen_bytes"][1] * 2 == found["frozen_bytes"][0], found
