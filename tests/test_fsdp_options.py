"""04_fsdp's knobs: every sharding strategy reproduces the single-device run (2 and 4 ranks;
HYBRID_SHARD as 2 groups × 2 shards); mixed precision, CPU offload and activation checkpointing
change how the step is computed, not what it computes. On the CPU, FSDP's reduce-scatter is the
kit's all-to-all and sum, with gloo's gradients."""
import json

import pytest

from conftest import EQUIVALENCE, assert_same_run, demo_args, read_metrics, run_ranks, run_step, with_changed

# 8 rows per optimiser step, as in the single-device reference
SPLIT = {2: ["--total_batch_size", 8, "--batch_size_per_device", 2],  # 2 micro-batches per rank
         4: ["--total_batch_size", 8, "--batch_size_per_device", 2]}  # 1


def fsdp_run(demo, out, ranks, *flags):
    run_step("fsdp", demo_args(demo, out) + EQUIVALENCE + SPLIT[ranks] + [str(f) for f in flags], nproc=ranks)
    return out


@pytest.mark.parametrize("strategy, ranks, extra", [
    # one rank count each (FULL_SHARD runs on 2 and 4 in test_equivalence.py)
    ("SHARD_GRAD_OP", 4, []), ("NO_SHARD", 2, []),
    ("HYBRID_SHARD", 4, ["--shard_group_size", 2]),
])
def test_sharding_strategy_matches_single_device(demo, single_reference, tmp_path, strategy, ranks, extra):
    fsdp_run(demo, tmp_path, ranks, "--sharding_strategy", strategy, *extra)
    assert_same_run(single_reference, tmp_path, tolerance=1e-5)


@pytest.mark.parametrize("ranks, per_device", [(2, 2), (4, 1)])
def test_accumulating_unsharded_keeps_the_maths(demo, single_reference, tmp_path, ranks, per_device):
    """--accumulate_unsharded (FSDP's no_sync) at 2 micro-batches per optimiser step, with evaluations
    and checkpoints in between (the gathered weights must never leak into a save or a step)."""
    args = with_changed(demo_args(demo, tmp_path), ["--eval_every", 2]) + EQUIVALENCE
    run_step("fsdp", args + ["--total_batch_size", 8, "--batch_size_per_device", per_device,
                             "--accumulate_unsharded", "--save_every", 2], nproc=ranks)
    assert {r["gradient_accumulation_steps"] for r in read_metrics(tmp_path)} == {2}
    assert_same_run(single_reference, tmp_path, tolerance=1e-5)


def test_cpu_offload_and_activation_checkpointing_keep_the_maths(demo, single_reference, tmp_path):
    fsdp_run(demo, tmp_path, 2, "--cpu_offload", "--gradient_checkpointing")
    assert_same_run(single_reference, tmp_path, tolerance=1e-5)


@pytest.mark.parametrize("precision", ["bf16"])
def test_mixed_precision_tracks_fp32(demo, single_reference, tmp_path, precision):
    """Low-precision layers give slightly different losses, but the same run."""
    fsdp_run(demo, tmp_path, 2, "--precision", precision)
    assert_same_run(single_reference, tmp_path, tolerance=2e-2, weights=False)
    assert read_metrics(tmp_path)[-1]["loss"] < read_metrics(tmp_path)[0]["loss"]


def test_hybrid_shard_groups_must_divide_the_ranks(demo, tmp_path):
    result = run_step("fsdp", demo_args(demo, tmp_path) + ["--max_steps", 1, "--sharding_strategy", "HYBRID_SHARD",
                                                           "--shard_group_size", 3], nproc=2, check=False)
    assert result.returncode != 0 and "error: HYBRID_SHARD: 2 ranks do not split into groups of 3" in result.stderr


def test_cpu_reduce_scatter_is_one_all_to_all_with_the_librarys_result(tmp_path):
    """gloo's reduce-scatter all-reduces the whole tensor (twice the bytes); the kit's
    (common/process_group.py) is one all-to-all and a local sum. FULL_SHARD over 4 ranks and
    HYBRID_SHARD 2 x 2, shards of uneven rows (FSDP pads them): the same gradients as gloo's own."""
    out = run_ranks(tmp_path, """
        import json, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.profiler import profile
        from common.process_group import reduce_scatter_by_all_to_all
        dist.init_process_group("gloo")
        rank = dist.get_rank()

        def gradients(mesh, by_all_to_all):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            if by_all_to_all:
                reduce_scatter_by_all_to_all(model, torch.device("cpu"))
            torch.manual_seed(1 + rank)  # every rank its own batch
            with profile() as trace:
                model(torch.randn(4, 7)).pow(2).sum().backward()
            collectives = {e.key for e in trace.key_averages() if e.key.startswith("gloo:")}
            return [p.grad.to_local().clone() for p in model.parameters()], collectives

        result = {}
        for name, mesh in [("FULL_SHARD", init_device_mesh("cpu", (4,))),
                           ("HYBRID_SHARD", init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))]:
            ours, used = gradients(mesh, True)
            library, library_used = gradients(mesh, False)
            result[name] = {"largest_difference": max(((a - b).abs().max().item() for a, b in zip(ours, library)
                                                     if a.numel()), default=0.0),  # a rank may hold no rows
                            "ours": sorted(used), "library": sorted(library_used)}
        print(json.dumps(result))
        dist.destroy_process_group()
    """, nproc=4)
    for line in out.splitlines():
        for name, case in json.loads(line).items():
            assert case["largest_difference"] < 1e-6, (name, case)
            assert "gloo:all_to_all" in case["ours"] and "gloo:all_to_all" not in case["library"], (name, case)
            # gloo's reduce-scatter shows as an all-reduce; HYBRID_SHARD all-reduces across its groups too
            assert ("gloo:all_reduce" in case["ours"]) == (name == "HYBRID_SHARD"), (name, case)
