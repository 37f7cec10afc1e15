"""--optimizer muon: Muon for the decoder's weight matrices, AdamW for the rest, in every step.

The learning run trains the built-in model from scratch with it (benchmark/learn_chess.py), so it
must be the same optimisation whichever step runs it, and a run stopped by a kill or a preemption
must continue exactly: the checkpoint holds both optimisers' state (DCP's sharded one in step 4).
"""
import pytest
from safetensors.torch import load_file

from conftest import EQUIVALENCE, RANKS, RESUMABLE, assert_same_run, demo_args, run_step
from test_resume import kill_after_first_checkpoint

MUON = ["--optimizer", "muon"]


@pytest.mark.quick
def test_muon_takes_the_decoders_matrices_and_adamw_the_rest(demo):
    import argparse

    import torch
    from transformers import AutoModelForCausalLM

    from common.optim import make_optimizer, make_scheduler
    model = AutoModelForCausalLM.from_pretrained(demo / "model")
    args = argparse.Namespace(optimizer="muon", learning_rate=3e-3, weight_decay=0.0, warmup_steps=1, max_steps=10)
    optimizer = make_optimizer(model, args)
    names = {id(param): name for name, param in model.named_parameters()}
    muon = {names[id(p)] for group in optimizer.muon.param_groups for p in group["params"]}
    adamw = {names[id(p)] for group in optimizer.adamw.param_groups for p in group["params"]}
    assert muon == {n for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n}
    assert adamw == set(names.values()) - muon
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adamw
    # one schedule sets both learning rates; one state holds both optimisers' buffers
    scheduler = make_scheduler(optimizer, args)
    model(torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == [3e-3, 3e-3]
    assert len(optimizer.state) == len(names)
    saved = optimizer.state_dict()
    restored = make_optimizer(model, args)
    restored.load_state_dict(saved)
    assert restored.muon.state is restored.state is restored.adamw.state
    some_matrix = model.model.layers[0].mlp.down_proj.weight
    assert torch.equal(restored.muon.state[some_matrix]["momentum_buffer"],
                       optimizer.state[some_matrix]["momentum_buffer"])


@pytest.fixture(scope="module")
def single_muon(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("single-muon")
    run_step("single", demo_args(demo, out) + EQUIVALENCE + MUON + ["--total_batch_size", 8,
                                                                    "--batch_size_per_device", 2])
    return out


@pytest.mark.parametrize("step", ["ddp", "fsdp"])
def test_muon_is_the_same_optimisation_in_every_step(demo, tmp_path, single_muon, step):
    """Step 4 orthogonalises sharded matrices (DTensors: the products gather what they need).
    The losses agree to float rounding, as AdamW's do. The weights agree to a fraction of what
    training moved them: Newton-Schulz raises a matrix's weakest directions to the size of its
    strongest, so a last-bit difference in a summed gradient (another order of summation) along a
    direction with almost no gradient becomes part of the update (measured: at most 7% of the
    largest move of a tensor in step 3, 15% in step 4)."""
    run_step(step, demo_args(demo, tmp_path) + EQUIVALENCE + MUON + ["--total_batch_size", 8,
                                                                    "--batch_size_per_device", 2], nproc=2)
    assert_same_run(single_muon, tmp_path, tolerance=1e-5, weights=False)
    start = load_file(demo / "model/model.safetensors")
    single, other = (load_file(run / "final/model.safetensors") for run in (single_muon, tmp_path))
    for name in start:
        moved = (single[name] - start[name]).abs().max().item()
        assert moved > 0, name
        assert (other[name] - single[name]).abs().max().item() <= moved / 3, name


def test_a_killed_muon_run_resumes_exactly(demo, tmp_path):
    """Step 4: DCP saves and loads both optimisers' sharded state through the one optimiser (steps 2
    and 3 save the same state_dict with torch.save)."""
    step, nproc = "fsdp", RANKS["fsdp"]
    reference, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    run_step(step, demo_args(demo, reference) + RESUMABLE + MUON, nproc=nproc)
    kill_after_first_checkpoint(step, demo_args(demo, interrupted) + RESUMABLE + MUON, nproc, interrupted)
    result = run_step(step, demo_args(demo, interrupted) + RESUMABLE + MUON + ["--resume"], nproc=nproc)
    assert "resuming from" in result.stderr + result.stdout
    assert_same_run(reference, interrupted, tolerance=1e-6)


def test_resume_refuses_another_optimizer(demo, tmp_path):
    run_step("single", demo_args(demo, tmp_path) + ["--max_steps", 2, "--save_every", 1] + MUON)
    result = run_step("single", demo_args(demo, tmp_path) + ["--max_steps", 3, "--resume"], check=False)
    assert result.returncode == 2
    assert "optimizer" in result.stderr
