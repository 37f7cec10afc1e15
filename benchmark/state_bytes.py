"""Measure what each rank keeps for the whole run: the bytes of its parameters, gradients and
AdamW state, after one real optimiser step. DDP wraps the model as 03_ddp does; each FSDP
strategy shards it with 04_fsdp/train.py's own build_mesh and shard_model, and "LoRA" is
05_lora/train.py's add_lora (its default rank and layers) sharded FULL_SHARD by its shard_model.

    torchrun --nproc-per-node 2 benchmark/state_bytes.py --model demo/model --out state_bytes.json

Writes {configuration: [bytes of rank 0, rank 1, ...]} (parameters + gradients + optimizer) and
the three parts separately. Tensors only: no allocator slack, no DDP gradient buckets.
"""
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from common.arguments import DEMO_DIR, Parser
from common.errors import exit_on_user_error
from common.model import load_model
from common.optim import make_optimizer
from launch.steps import load_step


def local_bytes(tensor):
    """Bytes of this rank's piece: the local shard of a DTensor, or the whole plain tensor."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def one_step_bytes(model, optimizer, vocab_size):
    """Take one AdamW step on a random batch (so AdamW's state exists), then count."""
    ids = torch.randint(4, vocab_size, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    params = list(model.parameters())
    return {"parameters": sum(local_bytes(p) for p in params),
            "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local_bytes(value) for state in optimizer.state.values()
                             for name, value in state.items() if name != "step")}


def main():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("model", default=str(DEMO_DIR / "model"))
    parser.add("shard_group_size", type=int, default=2, help="HYBRID_SHARD: ranks per shard group")
    parser.add("out", required=True, help="JSON file to write (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    fsdp_step, lora_step = load_step("fsdp"), load_step("lora")
    lora_args = lora_step.parse_arguments(["--output_dir", "unused"])  # the step's default LoRA settings

    configurations = {"DDP": None, **{strategy: strategy for strategy in fsdp_step.STRATEGIES}, "LoRA": "FULL_SHARD"}
    if world_size % args.shard_group_size or world_size == args.shard_group_size:
        del configurations["HYBRID_SHARD"]  # no 2-D mesh to make (or it is FULL_SHARD)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)  # the CPU's choice
    results = {}
    for name, strategy in configurations.items():
        torch.manual_seed(0)
        model = load_model(args.model)
        vocab_size = model.config.vocab_size
        step = lora_step if name == "LoRA" else fsdp_step
        if name == "LoRA":
            model = lora_step.add_lora(model, lora_args)
        if strategy is None:
            model = DDP(model)
        else:
            mesh = step.build_mesh(strategy, "cpu", world_size, args.shard_group_size)
            step.shard_model(model, mesh, strategy, fp32, OffloadPolicy())
        optimizer = make_optimizer(model, lora_args)  # after sharding, as the step scripts
        parts = one_step_bytes(model, optimizer, vocab_size)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, parts)
        results[name] = {"total": [sum(p.values()) for p in per_rank],
                         **{part: [p[part] for p in per_rank] for part in parts}}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"world_size": world_size, "bytes_per_rank": results}, indent=1) + "\n")
    del model, optimizer
    gc.collect()  # the sharded models (reference cycles) go before the process group, as in 04_fsdp/train.py
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_user_error(main)
