"""Muon on sharded parameters: the optimiser step three ways, Newton-Schulz's precision, and the bytes.

    torchrun --nproc-per-node 2 benchmark/muon_step.py    # the designs, on the built-in model
    python benchmark/muon_step.py                          # precision on this CPU; bytes for CodeLlama-7b

Under torchrun: the built-in model (--model) sharded as 04_fsdp/train.py shards it (its build_mesh
and shard_model; --sharding_strategy, --shard_group_size), one backward for the gradients, then
one optimiser step of each design from the same weights and gradients:
  * torch.optim.Muon, the kit's Muon until now: the DTensor shards go into Newton-Schulz, whose
    products make DTensor gather what they need (implicit collectives), in bf16;
  * gather once (Moonlight's "Distributed Muon"): one all-gather per bucket brings every matrix
    whole to every rank, which orthogonalises all of them and keeps its own rows;
  * owner (common/optim.py, the kit's): each matrix orthogonalised once, by one rank; an
    all-to-all there and one back per bucket.
For each: the step's time (median of --steps, the slowest rank), the collectives of one step (the
profiler's c10d operations), the bytes a rank sends, and how far the weights land from one
process's Muon on whole matrices (plain tensors, fp32). The whole path must agree to rounding.

Alone: Newton-Schulz over the built-in model's 56 matrices in fp32 and in bf16, one thread, on this
CPU (model name and bf16 flags printed; `ONEDNN_MAX_CPU_ISA=AVX2` in front emulates a CPU without
native bf16), and the bytes each design moves per rank and step for CodeLlama-7b's decoder
matrices on 8 and 16 GPUs (bf16, as on a GPU), from the kit's bucket plan.
"""
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from common.arguments import DEMO_DIR, REPO, Parser
from common.errors import exit_on_user_error
from common.optim import (Muon, buckets, compute_device, local, newton_schulz, newton_schulz_dtype, rows_per_rank,
                          shard_layout)

CODELLAMA = REPO / "benchmark" / "codellama-7b-config.json"
GROUP = {"ns_coefficients": (3.4445, -4.7750, 2.0315), "ns_steps": 5, "eps": 1e-7}


# ---- the bytes of each design ----------------------------------------------------------------------

def owner_bytes(shapes, ranks, element_bytes):
    """Bytes the busiest rank sends per step with the owner design: its pieces of the matrices
    others own, then the others' pieces of the matrices it owns (FSDP's cut along dim 0)."""
    sent = [0] * ranks
    for owned in buckets([math.prod(shape) for shape in shapes], ranks):
        for owner, indices in enumerate(owned):
            for index in indices:
                rows, row = rows_per_rank(shapes[index][0], ranks), math.prod(shapes[index][1:])
                for rank in range(ranks):
                    if rank != owner:
                        sent[rank] += rows[rank] * row * element_bytes  # to the owner
                        sent[owner] += rows[rank] * row * element_bytes  # and back
    return max(sent)


def gather_bytes(shapes, ranks, element_bytes):
    """Bytes a rank receives per step when every rank gathers every matrix (its own rows it has)."""
    return sum(math.ceil(shape[0] / ranks) * math.prod(shape[1:]) * (ranks - 1) for shape in shapes) * element_bytes


def decoder_matrices(config_path):
    """The shapes Muon takes: the decoder's weight matrices (meta device: no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_path))
    return [tuple(p.shape) for p in model.model.layers.parameters() if p.ndim == 2]


def bytes_table():
    shapes = decoder_matrices(CODELLAMA)
    elements = sum(math.prod(shape) for shape in shapes)
    lines = [f"CodeLlama-7b: {len(shapes)} decoder matrices, {elements / 1e9:.3f}B elements; bytes per rank and "
             "optimiser step in bf16 (Newton-Schulz's dtype on a GPU), FULL_SHARD:", "",
             "| GPUs | owner: sent (and as much received) | buckets (all-to-alls) | gather once: received | "
             "formula 2 x P x (N-1)/N^2 x 2 B |", "|---:|---:|---:|---:|---:|"]
    for ranks in (8, 16):
        plan = buckets([math.prod(shape) for shape in shapes], ranks)
        formula = 2 * elements * (ranks - 1) / ranks ** 2 * 2
        lines.append(f"| {ranks} | {owner_bytes(shapes, ranks, 2) / 1e9:.2f} GB | {len(plan)} ({2 * len(plan)}) "
                     f"| {gather_bytes(shapes, ranks, 2) / 1e9:.2f} GB | {formula / 1e9:.2f} GB |")
    return "\n".join(lines)


# ---- Newton-Schulz's precision on this CPU ---------------------------------------------------------

def cpu_name():
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = sorted({flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {flag}" in info})
    return f"{name} ({', '.join(flags) or 'no AVX2'})"


def precision_table(model_dir, repeats=5):
    from common.model import load_model
    torch.set_num_threads(1)
    matrices = [p.detach() for p in load_model(model_dir).model.layers.parameters() if p.ndim == 2]
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    lines = [f"Newton-Schulz over the built-in model's {len(matrices)} matrices, one thread, {cpu_name()}"
             + (f", ONEDNN_MAX_CPU_ISA={isa}" if isa else "") + ":", "", "| dtype | ms per optimiser step |",
             "|---|---:|"]
    for dtype in (torch.float32, torch.bfloat16):
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            for matrix in matrices:
                newton_schulz(matrix.to(dtype), GROUP)
            times.append(time.perf_counter() - started)
        lines.append(f"| {str(dtype).removeprefix('torch.')} | {1000 * statistics.median(times[1:]):.1f} |")
    return "\n".join(lines)


# ---- under torchrun: the designs side by side ------------------------------------------------------

class GatherOnceMuon(Muon):
    """The other design, for comparison only: every rank gathers every matrix of a bucket (one
    all-gather of the pieces, padded to FSDP's equal rows), orthogonalises all and keeps its rows."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            process_group, _ = shard_layout(params[0])
            ranks, me = dist.get_world_size(process_group), dist.get_rank(process_group)
            device = compute_device(params[0])
            for owned in buckets([p.numel() for p in params], ranks):
                bucket = [params[index] for indices in owned for index in indices]
                chunks = [math.ceil(p.shape[0] / ranks) for p in bucket]
                padded = [torch.nn.functional.pad(self.momentum_update(p, group), (0, 0, 0, chunk - local(p).shape[0]))
                          for p, chunk in zip(bucket, chunks)]
                mine = torch.cat([t.reshape(-1) for t in padded]).to(device, newton_schulz_dtype(device))
                everyone = mine.new_empty(ranks * mine.numel())
                dist.all_gather_single(everyone, mine, group=process_group)
                per_rank = everyone.view(ranks, -1).split([t.numel() for t in padded], dim=1)
                for p, chunk, gathered in zip(bucket, chunks, per_rank):
                    whole = gathered.reshape(ranks * chunk, -1)[:p.shape[0]]
                    rows = newton_schulz(whole, group)[me * chunk:me * chunk + local(p).shape[0]]
                    scale = 0.2 * math.sqrt(max(p.shape))
                    local(p).mul_(1 - group["lr"] * group["weight_decay"]).add_(rows, alpha=-group["lr"] * scale)


def collectives(step):
    """The c10d operations one call of `step` runs, by name (the profiler's summary)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    counts = {}
    for event in profiler.key_averages():
        if event.key.startswith("c10d::"):
            counts[event.key.removeprefix("c10d::").rstrip("_")] = event.count
    return counts


def designs(args):
    import argparse

    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    from common.model import load_model
    from launch.steps import load_step

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = load_model(args.model)
    fsdp = load_step("fsdp")
    mesh = fsdp.build_mesh(args.sharding_strategy, "cpu", world_size, args.shard_group_size or world_size)
    fsdp.shard_model(model, mesh, args.sharding_strategy, MixedPrecisionPolicy(param_dtype=torch.float32),
                     OffloadPolicy())
    ids = torch.randint(4, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    matrices = [p for p in model.model.layers.parameters() if p.ndim == 2]
    start = [local(p).clone() for p in matrices]
    settings = argparse.Namespace(learning_rate=1e-3, weight_decay=0.1)

    # one process's Muon on whole matrices: the update every design must give
    start_whole = [p.full_tensor() for p in matrices]
    whole = [torch.nn.Parameter(p.clone()) for p in start_whole]
    for p, sharded in zip(whole, matrices):
        p.grad = sharded.grad.full_tensor()
    Muon(whole, settings).step()
    expected = [p.detach() for p in whole]
    moved = max((e - s).abs().max().item() for e, s in zip(expected, start_whole))

    makers = {"torch.optim.Muon (DTensor, bf16)": lambda: torch.optim.Muon(
                  matrices, lr=1e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
              "gather once": lambda: GatherOnceMuon(matrices, settings),
              "owner (the kit)": lambda: Muon(matrices, settings)}
    shapes, shards = [tuple(p.shape) for p in matrices], dist.get_world_size(shard_layout(matrices[0])[0])
    sent = {"torch.optim.Muon (DTensor, bf16)": None, "gather once": gather_bytes(shapes, shards, 4),
            "owner (the kit)": owner_bytes(shapes, shards, 4)}
    rows = []
    for name, make in makers.items():
        @torch.no_grad()
        def reset():
            for p, values in zip(matrices, start):
                local(p).copy_(values)
        reset()
        make().step()  # one step from the same weights, gradients and empty momentum
        difference = max((p.full_tensor() - e).abs().max().item() for p, e in zip(matrices, expected))
        reset()
        optimizer = make()
        times = []
        for _ in range(args.steps + 1):
            dist.barrier()
            started = time.perf_counter()
            optimizer.step()
            dist.barrier()
            times.append(time.perf_counter() - started)
        counts = collectives(optimizer.step)
        rows.append((name, statistics.median(times[1:]), counts, sent[name], difference))
    if rank == 0:
        print(f"{len(matrices)} matrices of {args.model}, {args.sharding_strategy} on {world_size} ranks (gloo, one "
              f"thread each), the step alone, median of {args.steps}; load average "
              f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}:\n")
        print("| design | ms per step | collectives per step | bytes a rank sends (and receives) | largest weight "
              "difference from one process's fp32 Muon |\n|---|---:|---|---:|---:|")
        for name, seconds, counts, nbytes, difference in rows:
            described = f"{sum(counts.values())}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
            print(f"| {name} | {1000 * seconds:.1f} | {described} | {'—' if nbytes is None else f'{nbytes:,}'} "
                  f"| {difference:.1e} (the update moved a weight by at most {moved:.1e}) |")
    model = None
    dist.destroy_process_group()


def main():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("model", default=str(DEMO_DIR / "model"), help="the built-in model (its decoder's matrices)")
    parser.add("steps", type=int, default=20, help="timed optimiser steps per design (under torchrun)")
    parser.add("sharding_strategy", choices=["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"], default="FULL_SHARD")
    parser.add("shard_group_size", type=int, default=None, help="HYBRID_SHARD: ranks per shard group")
    args = parser.parse_args()
    if "RANK" in os.environ:
        designs(args)
    else:
        print(precision_table(args.model) + "\n\n" + bytes_table())


if __name__ == "__main__":
    exit_on_user_error(main)
