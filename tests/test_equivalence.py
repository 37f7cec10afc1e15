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

from conftest import EQUIVALENCE, EQUIVALENCE_STEPS, assert_same_run, demo_args, read_metrics, run_step

SPLITS = {  # name: (step, ranks, batch per device, accumulation); 8 rows per optimiser step each
    "ddp_2x2x2": ("ddp", 2, 2, 2),
    "fsdp_2x2x2": ("fsdp", 2, 2, 2),
    "fsdp_4x2x1": ("fsdp", 4, 2, 1),
}


@pytest.fixture(scope="module")
def runs(demo, tmp_path_factory):
    results = {}
    for name, (step, ranks, batch, accumulation) in SPLITS.items():
        out = tmp_path_factory.mktemp(name)
        run_step(step, demo_args(demo, out) + EQUIVALENCE + ["--total_batch_size", ranks * batch * accumulation,
                                                             "--batch_size_per_device", batch], nproc=ranks)
        results[name] = out
    return results


@pytest.mark.parametrize("name", SPLITS)
def test_same_losses_and_weights_as_single_device(single_reference, runs, name):
    assert len(read_metrics(runs[name])) == EQUIVALENCE_STEPS
    assert read_metrics(runs[name])[-1]["world_size"] == SPLITS[name][1]
    assert_same_run(single_reference, runs[name], tolerance=1e-5)


def test_training_moves_the_weights_and_lowers_the_loss(runs, demo):
    losses = [r["loss"] for r in read_metrics(runs["fsdp_2x2x2"])]
    assert losses[-1] < losses[0]
    start = load_file(demo / "model/model.safetensors")
    trained = load_file(runs["fsdp_2x2x2"] / "final/model.safetensors")
    assert all(not torch.equal(start[k], trained[k]) for k in start if k.endswith("q_proj.weight"))


def test_gradient_checkpointing_changes_memory_not_maths(single_reference, demo, tmp_path):
    run_step("single", demo_args(demo, tmp_path) + EQUIVALENCE + [
        "--total_batch_size", 8, "--batch_size_per_device", 2, "--gradient_checkpointing"])
    assert_same_run(single_reference, tmp_path, tolerance=1e-5)


@pytest.mark.quick
def test_every_world_size_shares_out_the_same_global_batch_by_tokens(demo, tmp_path):
    """The sampler on real unpacked rows (one game each, of unequal length): at 1, 2 and 4 ranks each
    step's shares together are exactly the global batch, in the same micro-batches (one process
    accumulating them computes what the ranks do), every rank gets as many rows, and the ranks'
    padded tokens differ by less than one micro-batch's (the ranks wait for the slowest at each
    step). A micro-batch holds rows of similar length: little padding."""
    from transformers import AutoTokenizer

    from common.data import GlobalBatchSampler
    from common.prepare_data import prepared_rows
    tokenizer = AutoTokenizer.from_pretrained(demo / "model")
    rows = prepared_rows(demo / "data", "validation", tokenizer, 1024, False, cache_dir=tmp_path, notation="piece")
    steps, total, micro = 5, 16, 2
    shares, micro_batches = {}, {}
    for ranks in (1, 2, 4):
        per_rank = [list(GlobalBatchSampler(rows, total, micro, rank, ranks, seed=3, max_steps=steps))
                    for rank in range(ranks)]
        per_step = total // ranks // micro  # micro-batches of one rank in one step
        by_step = [[rank[s * per_step: (s + 1) * per_step] for rank in per_rank] for s in range(steps)]
        micro_batches[ranks] = [sorted(sorted(m) for rank in step for m in rank) for step in by_step]
        shares[ranks] = [[sum(rank, []) for rank in step] for step in by_step]
    reference = GlobalBatchSampler(rows, total, micro, 0, 1, seed=3, max_steps=steps)
    for step in range(steps):
        batch = reference.global_batch(step)
        longest = max(rows.row_lengths(batch))
        for ranks, by_step in shares.items():
            mine = by_step[step]
            assert sorted(sum(mine, [])) == sorted(batch) and {len(m) for m in mine} == {total // ranks}
            assert micro_batches[ranks][step] == micro_batches[1][step], ranks
            padded = [sum(micro * max(rows.row_lengths(m[i: i + micro])) for i in range(0, len(m), micro))
                      for m in mine]
            assert max(padded) - min(padded) < micro * longest, (ranks, padded)
    lengths = rows.row_lengths(shares[1][0][0])
    assert lengths == sorted(lengths, reverse=True)  # one rank: its micro-batches go from long to short
