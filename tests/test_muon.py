"""--optimizer muon: Muon for the decoder's weight matrices (LoRA: the adapters), AdamW for the rest, in every step.

The learning run trains the built-in model from scratch with it (benchmark/learn_chess.py), so it
must be the same optimisation whichever step runs it, and a run stopped by a kill or a preemption
must continue exactly: the checkpoint holds both optimisers' state (DCP's sharded one in step 4).
On FSDP's shards each matrix is orthogonalised whole by one rank, its owner (common/optim.py):
run under torchrun, this file is that check's worker.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from conftest import EQUIVALENCE, REPO, RESUMABLE, assert_same_run, demo_args, read_metrics, run_python, run_step
from test_resume import kill_after_first_checkpoint

MUON = ["--optimizer", "muon"]
SPLIT = ["--total_batch_size", 8, "--batch_size_per_device", 2]


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
    # the groups and state of torch.optim.Muon, which the runs before this optimiser saved
    reference = torch.optim.Muon([some_matrix], lr=3e-3, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    assert saved["param_groups"][0].keys() - {"params", "initial_lr"} == reference.param_groups[0].keys() - {"params"}


@pytest.mark.quick
def test_with_lora_the_adapters_are_muons_and_nothing_is_adamws(demo):
    """Step 5 trains the adapters only: every trainable parameter is a matrix, Muon takes them all
    and there is no AdamW part (it used to fail: `optimizer got an empty parameter list`)."""
    import torch

    from common.model import load_model
    from common.optim import make_optimizer
    from launch.steps import load_step
    lora = load_step("lora")
    args = lora.parse_arguments(["--output_dir", "unused", "--optimizer", "muon"])
    model = lora.add_lora(load_model(str(demo / "model")), args)
    optimizer = make_optimizer(model, args)
    adapters = [p for p in model.parameters() if p.requires_grad]
    assert optimizer.adamw is None and optimizer.parts() == [optimizer.muon]
    assert [p for group in optimizer.param_groups for p in group["params"]] == adapters
    ids = torch.tensor([[1, 2, 3, 4]])
    for _ in range(2):  # B starts at zero: the first step moves B only, the second A too
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(p.abs().sum() > 0 for p in adapters)
    assert len(optimizer.state_dict()["state"]) == len(adapters)


# ---- the owner design, exactly the whole-matrix update on every layout --------------------------------

def sharded_muon_worker():
    """Under torchrun (4 ranks): matrices of awkward shapes (rows fewer than ranks, a rank with no
    rows) as DTensors laid out as FSDP2 lays them out, and whole on every rank as DDP holds them,
    Muon's steps on them against one process's Muon on the whole matrices; also with buckets so
    small that some ranks own nothing in one.
    Rank 0 prints the largest difference per layout as JSON."""
    import argparse

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from common import optim
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    shapes = [(5, 7), (16, 3), (3, 16), (1, 9), (128, 344), (2, 2)]
    start = [torch.randn(shape) for shape in shapes]
    grads = [[torch.randn(shape) for shape in shapes] for _ in range(3)]
    args = argparse.Namespace(learning_rate=0.01, weight_decay=0.1)
    whole = [torch.nn.Parameter(t.clone()) for t in start]
    optimizer = optim.Muon(whole, args)
    for step_grads in grads:
        for param, grad in zip(whole, step_grads):
            param.grad = grad.clone()
        optimizer.step()
    differences, bucket_sizes = {}, (optim.MUON_BUCKET_ELEMENTS, 40)
    for bucket_elements in bucket_sizes:  # DDP's replicas: each rank its share
        optim.MUON_BUCKET_ELEMENTS = bucket_elements
        replicas = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = optim.Muon(replicas, args, replicas=dist.group.WORLD)
        for step_grads in grads:
            for param, grad in zip(replicas, step_grads):
                param.grad = grad.clone()
            optimizer.step()
        differences[f"replicated (DDP) over 4, buckets of {bucket_elements}"] = max(
            (p - w).abs().max().item() for p, w in zip(replicas, whole))
    layouts = {"FULL_SHARD (Shard(0) over 4)": ((4,), [Shard(0)]), "Shard(1) over 4": ((4,), [Shard(1)]),
               "HYBRID_SHARD (2 x 2)": ((2, 2), [Replicate(), Shard(0)])}
    for bucket_elements in bucket_sizes:
        optim.MUON_BUCKET_ELEMENTS = bucket_elements
        for name, (mesh_shape, placements) in layouts.items():
            mesh = init_device_mesh("cpu", mesh_shape)
            params = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, placements)) for t in start]
            optimizer = optim.Muon(params, args)
            for step_grads in grads:
                for param, grad in zip(params, step_grads):
                    param.grad = distribute_tensor(grad.clone(), mesh, placements)
                optimizer.step()
            differences[f"{name}, buckets of {bucket_elements}"] = max(
                (p.full_tensor() - w).abs().max().item() for p, w in zip(params, whole))
    if dist.get_rank() == 0:
        print(json.dumps(differences))
    dist.destroy_process_group()


def test_sharded_matrices_get_the_whole_matrix_update_exactly():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           __file__], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    differences = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(differences) == 8 and all(d == 0 for d in differences.values()), differences


def test_the_designs_probe_counts_two_all_to_alls_where_dtensor_ran_hundreds():
    """benchmark/muon_step.py on 2 ranks: the kit's step and the gathering one land on one process's
    weights exactly, with 2 all-to-alls and 1 all-gather per step; torch.optim.Muon on the DTensor
    shards ran hundreds of collectives (816 measured)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "benchmark/muon_step.py", "--steps", "1"], capture_output=True, text=True, timeout=300,
                          env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in done.stdout.splitlines()
            if line.startswith("| ") and "ms per step" not in line}
    assert rows["owner (the kit)"][2] == "2: 2 alltoall_base" and rows["gather once"][2] == "1: 1 _allgather_base"
    assert all(rows[name][4].startswith("0.0e+00") for name in ("owner (the kit)", "gather once"))
    assert int(rows["torch.optim.Muon (DTensor, bf16)"][2].split(":")[0]) > 100


# ---- the same optimisation in every step ------------------------------------------------------------

@pytest.fixture(scope="module")
def muon_runs(demo, tmp_path_factory):
    """Step 2 on one process, step 3 and step 4 (also with --cpu_offload) on 2 ranks, 6 steps each."""
    runs = {}
    for step, nproc, extra in (("single", 1, []), ("ddp", 2, []), ("fsdp", 2, []), ("fsdp", 2, ["--cpu_offload"])):
        name = step + "".join(extra)
        runs[name] = tmp_path_factory.mktemp(name.replace("-", ""))
        run_step(step, demo_args(demo, runs[name]) + EQUIVALENCE + MUON + SPLIT + extra, nproc=nproc)
    return runs


def farthest_from(single, other, start):
    """The largest difference of a tensor from step 2's, as a fraction of what training moved it."""
    return max(((other[name] - single[name]).abs().max() / (single[name] - start[name]).abs().max()).item()
               for name in start)


def test_muon_is_the_same_optimisation_in_every_step(demo, muon_runs):
    """Steps 2 and 3 orthogonalise whole matrices, step 4 each matrix once, on its owner rank, in the
    same precision (fp32 on the CPU). The losses agree to float rounding, as AdamW's do; the weights
    of step 4 are no farther from step 2's than step 3's are, or both within 0.1% of what training
    moved them (measured: 0.03% for both; with bf16 Newton-Schulz and DTensor's own products it was
    7% for step 3 and 15% for step 4). --cpu_offload changes where the state lives, not the maths."""
    start = load_file(demo / "model/model.safetensors")
    weights = {name: load_file(run / "final/model.safetensors") for name, run in muon_runs.items()}
    for name in ("ddp", "fsdp", "fsdp--cpu_offload"):
        assert_same_run(muon_runs["single"], muon_runs[name], tolerance=1e-5, weights=False)
    step3, step4 = (farthest_from(weights["single"], weights[name], start) for name in ("ddp", "fsdp"))
    assert step4 <= max(step3, 1e-3), (step3, step4)
    offloaded = weights["fsdp--cpu_offload"]
    assert all((offloaded[name] - weights["fsdp"][name]).abs().max() == 0 for name in start)


def test_a_killed_muon_run_resumes_exactly_on_2_or_4_ranks(demo, tmp_path):
    """Step 4, killed (kill -9) after its first checkpoint on 2 ranks, resumed on 2 and on 4: DCP
    saves and loads both optimisers' sharded state through the one optimiser (steps 2 and 3 save the
    same state_dict with torch.save) and reshards it for 4 ranks, where other owners orthogonalise."""
    reference, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    run_step("fsdp", demo_args(demo, reference) + RESUMABLE + MUON, nproc=2)
    kill_after_first_checkpoint("fsdp", demo_args(demo, interrupted) + RESUMABLE + MUON, 2, interrupted)
    on_four = tmp_path / "on_four"
    shutil.copytree(interrupted, on_four)
    for run, ranks, tolerance in ((interrupted, 2, 1e-6), (on_four, 4, 1e-5)):
        result = run_step("fsdp", demo_args(demo, run) + RESUMABLE + MUON + ["--resume"], nproc=ranks)
        assert "resuming from" in result.stderr + result.stdout
        assert_same_run(reference, run, tolerance=tolerance)
        assert read_metrics(run)[-1]["world_size"] == ranks


def test_step_5_trains_its_adapters_with_muon(demo, tmp_path):
    """Step 5 with --optimizer muon on 2 ranks (the adapters sharded with their layers), and the
    plan check of that job (issue 36, case 10: both failed with an empty parameter list)."""
    run_step("lora", demo_args(demo, tmp_path) + MUON + ["--max_steps", 3, "--learning_rate", 1e-2], nproc=2)
    losses = [record["loss"] for record in read_metrics(tmp_path)]
    assert losses[-1] < losses[0]
    plan = run_python(["tools/check_plan.py", "--step", "lora", "--gpus_per_node", 2, "--", "--model", demo / "model",
                       "--output_dir", tmp_path / "planned", *MUON], timeout=300)
    assert plan.returncode == 0 and plan.stdout.startswith("plan check: fits: "), plan.stderr[-2000:]


def test_resume_refuses_another_optimizer(demo, tmp_path):
    run_step("single", demo_args(demo, tmp_path) + ["--max_steps", 2, "--save_every", 1] + MUON)
    result = run_step("single", demo_args(demo, tmp_path) + ["--max_steps", 3, "--resume"], check=False)
    assert result.returncode == 2
    assert "optimizer" in result.stderr


if __name__ == "__main__":  # under torchrun: the worker of test_sharded_matrices_get_the_whole_matrix_update_exactly
    sharded_muon_worker()
