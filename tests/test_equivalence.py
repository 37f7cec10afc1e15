"""The three steps optimise the same thing: one global batch, however it is split.

02 on one process with 4 micro-batches, 03 and 04 on 2 ranks, 04 on 4 ranks: the per-step
losses and the final weights must agree (CPU, fp32, the same seed and global batch of 8 rows).

Rows are not packed here, so they differ in length: a loss averaged per micro-batch instead of
per token of the global batch would weigh tokens differently and fail this test. The learning
rate is small because AdamW divides each gradient by its own running magnitude: for the rows of
rarely seen tokens, whose gradients are tiny, a last-bit rounding difference in the summation
order becomes a visible weight difference, in proportion to the learning rate.
"""
import pytest
import torch
from safetensors.torch import load_file

from conftest import demo_args, read_metrics, run_step

STEPS = 6
LESSON = ["--max_steps", STEPS, "--no_packing", "--learning_rate", 1e-4]
SPLITS = {  # name: (step, ranks, batch per device, accumulation); 8 rows per optimiser step each
    "single_1x2x4": ("single", 1, 2, 4),
    "ddp_2x2x2": ("ddp", 2, 2, 2),
    "fsdp_2x2x2": ("fsdp", 2, 2, 2),
    "fsdp_4x2x1": ("fsdp", 4, 2, 1),
}


@pytest.fixture(scope="module")
def runs(demo, tmp_path_factory):
    results = {}
    for name, (step, ranks, batch, accumulation) in SPLITS.items():
        out = tmp_path_factory.mktemp(name)
        run_step(step, demo_args(demo, out) + LESSON + ["--batch_size_per_device", batch,
                                                        "--gradient_accumulation_steps", accumulation], nproc=ranks)
        results[name] = out
    return results


@pytest.mark.parametrize("name", [n for n in SPLITS if n != "single_1x2x4"])
def test_same_losses_and_weights_as_single_device(runs, name):
    reference, other = read_metrics(runs["single_1x2x4"]), read_metrics(runs[name])
    assert [r["step"] for r in other] == list(range(1, STEPS + 1))
    assert other[-1]["world_size"] == SPLITS[name][1]
    for ref, got in zip(reference, other):
        assert got["tokens"] == ref["tokens"], "a different global batch"
        assert abs(got["loss"] - ref["loss"]) <= 1e-5, (ref["step"], ref["loss"], got["loss"])
    ref_weights = load_file(runs["single_1x2x4"] / "final/model.safetensors")
    got_weights = load_file(runs[name] / "final/model.safetensors")
    assert ref_weights.keys() == got_weights.keys()
    worst = max((ref_weights[k] - got_weights[k]).abs().max().item() for k in ref_weights)
    assert worst <= 1e-5, worst


def test_training_moves_the_weights_and_lowers_the_loss(runs, demo):
    losses = [r["loss"] for r in read_metrics(runs["fsdp_2x2x2"])]
    assert losses[-1] < losses[0]
    start = load_file(demo / "model/model.safetensors")
    trained = load_file(runs["fsdp_2x2x2"] / "final/model.safetensors")
    assert all(not torch.equal(start[k], trained[k]) for k in start if k.endswith("q_proj.weight"))


def test_gradient_checkpointing_changes_memory_not_maths(runs, demo, tmp_path):
    run_step("single", demo_args(demo, tmp_path) + LESSON + [
        "--batch_size_per_device", 2, "--gradient_accumulation_steps", 4, "--gradient_checkpointing"])
    for ref, got in zip(read_metrics(runs["single_1x2x4"]), read_metrics(tmp_path)):
        assert abs(got["loss"] - ref["loss"]) <= 1e-5
