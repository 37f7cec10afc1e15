"""The speed levers (common/speed.py; the chunked loss in common/data.py) change the speed and the
memory, not the maths: with selective recomputation, the loss 50 tokens at a time and each layer
compiled, the runs take the same optimiser steps as the eager run of step 2 (tests/test_equivalence.py's
global batches of unpacked rows of unequal length), on 2 ranks (DDP, FSDP); compiled, on one process, as
the eager run of packed rows.
Tolerance 1e-5 on each step's loss and on the final weights, as the world sizes are held to: the
chunks' sums are added in another order, and inductor's fused kernels round in theirs (measured:
losses within 1e-6, weights within 2.2e-6). The compiled layers are traced once for the whole run,
one frame for every layer (no recompilation, no graph break: fullgraph), and the evaluation stays eager.
Compiled under FSDP2 and peft (step 5, 2 ranks): the eager run's losses. Step 6's layers split over
2 ranks, recomputed selectively: step 2's run (tests/test_tp.py's layouts); compiled as well, on
packed rows, step 2's eager run (torch 2.13 cannot trace a split layer of varying length: refused).
"""
import re

import pytest

from conftest import EQUIVALENCE, assert_same_run, demo_args, read_metrics, run_step

BATCH = ["--total_batch_size", 8, "--batch_size_per_device", 2]  # single_reference's: 4 micro-batches of 2
LEVERS = ["--gradient_checkpointing", "selective", "--loss_chunk_size", 50]


PACKED = ["--max_steps", 4, "--learning_rate", 1e-4, *BATCH]  # packed rows (the default): one shape


@pytest.fixture(scope="module")
def packed_reference(demo, tmp_path_factory):
    """Step 2, eager and without levers, on packed rows: what the compiled runs must reproduce."""
    output_dir = tmp_path_factory.mktemp("packed") / "eager"
    run_step("single", demo_args(demo, output_dir) + PACKED)
    return output_dir


def assert_compiled_once(stderr, ranks):
    """Under TORCH_LOGS=dynamo,recompiles: each rank traced one frame, speed.py's, which every layer
    runs; nothing compiled again, no graph break (fullgraph would have failed the run)."""
    traced = re.findall(r"torchdynamo start tracing (\S+) (\S+):\d+", stderr)
    assert len(traced) == ranks and all(where.endswith("common/speed.py") for _, where in traced), traced
    assert "Recompiling" not in stderr and "graph break" not in stderr.lower()


def test_every_lever_on_one_process_compiled_once(packed_reference, demo, tmp_path, monkeypatch):
    """Against the eager run without levers. Compiling takes half a minute on a quiet CPU, so the
    suite compiles here, under FSDP and peft, and in step 6 (below) only."""
    monkeypatch.setenv("TORCH_LOGS", "dynamo,recompiles")  # each frame dynamo traces, and why it traces again
    done = run_step("single", demo_args(demo, tmp_path) + PACKED + LEVERS + ["--compile"], timeout=900)
    assert_same_run(packed_reference, tmp_path, tolerance=1e-5)
    assert_compiled_once(done.stderr, ranks=1)
    assert read_metrics(tmp_path)[-1]["eval_loss"] > 0  # evaluated, eager, after the compiled steps


def test_step_6_compiled_split_layers_on_two_ranks(packed_reference, demo, tmp_path, monkeypatch):
    """Each layer split over 2 ranks (tensor parallel, sequence parallel), recomputed selectively and
    compiled: step 2's eager run, each layer's frame traced once per rank (the layers share one mesh
    object: a compiled layer checks its input's mesh by identity)."""
    monkeypatch.setenv("TORCH_LOGS", "dynamo,recompiles")
    split = ["--tp_size", 2, "--gradient_checkpointing", "selective", "--compile"]
    done = run_step("tp", demo_args(demo, tmp_path) + PACKED + split, nproc=2, timeout=900)
    assert_same_run(packed_reference, tmp_path, tolerance=1e-5)
    assert_compiled_once(done.stderr, ranks=2)


@pytest.mark.parametrize("step, ranks", [("ddp", 2), ("fsdp", 2)])
def test_the_levers_on_two_ranks(single_reference, demo, tmp_path, step, ranks):
    run_step(step, demo_args(demo, tmp_path) + EQUIVALENCE + BATCH + LEVERS, nproc=ranks)
    assert_same_run(single_reference, tmp_path, tolerance=1e-5)


def test_compiled_layers_under_fsdp_and_lora_on_two_ranks(demo, tmp_path):
    """Step 5 (step 4's FSDP2 with peft's adapters) with every lever, each layer compiled inside its
    FSDP unit, against the same levers eager: what the GPU check's LoRA and full rows run when its
    levers row chooses compiling. Packed rows: one shape."""
    lora = ["--max_steps", 4, "--learning_rate", 5e-3, "--lora_rank", 8, *BATCH, *LEVERS]
    run_step("lora", demo_args(demo, tmp_path / "eager") + lora, nproc=2)
    run_step("lora", demo_args(demo, tmp_path / "compiled") + lora + ["--compile"], nproc=2, timeout=900)
    assert_same_run(tmp_path / "eager", tmp_path / "compiled", tolerance=1e-5, weights=False)


@pytest.mark.quick
def test_the_chunked_loss_never_holds_the_whole_logits():
    """The same loss and gradients as the whole logits' (to fp32's rounding), and no tensor of more
    than one chunk's logits is ever made, in forward or in backward."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.data import loss_sum

    class LargestLogits(TorchDispatchMode):  # the most elements of any tensor made with a vocabulary dimension
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == vocab:
                    self.largest = max(self.largest, tensor.numel())
            return out

    vocab, rows, length, chunk = 1000, 2, 48, 40  # a chunk of more tokens than lm_head has columns
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=vocab))
    ids = torch.randint(0, vocab, (rows, length))
    batch = {"input_ids": ids, "labels": ids.clone()}
    found = {}
    for chunk_size in (0, chunk):
        with LargestLogits() as watch:
            loss = loss_sum(model, batch, chunk_size)
            loss.backward()
        found[chunk_size] = (loss.item(), [p.grad.clone() for p in model.parameters()], watch.largest)
        model.zero_grad()
    (whole, whole_grads, whole_largest), (chunked, chunked_grads, chunked_largest) = found[0], found[chunk]
    assert chunked == pytest.approx(whole, rel=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(whole_grads, chunked_grads))
    assert whole_largest == rows * length * vocab and chunked_largest == chunk * vocab
    assert type(model.lm_head).forward is model.lm_head.forward.__func__  # the head is itself again


@pytest.mark.quick
def test_step_6_refuses_the_chunked_loss():
    from common.errors import UserError
    from launch.steps import load_step
    with pytest.raises(UserError, match=r"^--loss_chunk_size 64: step 6's logits are already split"):
        load_step("tp").parse_arguments(["--output_dir", "unused", "--loss_chunk_size", "64"])


@pytest.mark.quick
def test_step_6_refuses_to_compile_rows_of_varying_length():
    """torch 2.13 cannot trace a sequence-split layer of a varying length (tests/test_tp.py compiles
    packed rows): one error line before anything runs, not a traceback from every rank."""
    from common.errors import UserError
    from launch.steps import load_step
    with pytest.raises(UserError, match=r"^--compile with --no_packing: step 6's split layers compile for rows of "):
        load_step("tp").parse_arguments(["--output_dir", "unused", "--compile", "--no_packing"])
    assert load_step("tp").parse_arguments(["--output_dir", "unused", "--compile"]).compile
