"""Measure what each rank keeps for the whole run: the bytes of its parameters, gradients and
AdamW state, after one real optimiser step. DDP wraps the model as 03_ddp does; each FSDP
strategy shards it with 04_fsdp/train.py's own build_mesh and shard_model.

    torchrun --nproc-per-node 2 benchmark/state_bytes.py --model demo/model --out state_bytes.json

Writes {configuration: [bytes of rank 0, rank 1, ...]} (parameters + gradients + optimizer) and
the three parts separately. Tensors only: no allocator slack, no DDP gradient buckets.
"""
import argparse
import gc
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the shared `common` package

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from common.train_setup import DEMO_DIR, add_flag, load_model  # noqa: E402


def import_fsdp_step():
    """04_fsdp is not a valid package name, so import its train.py by path (main() does not run)."""
    spec = importlib.util.spec_from_file_location("fsdp_train", REPO / "04_fsdp" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
            "gradients": sum(local_bytes(p.grad) for p in params),
            "optimizer": sum(local_bytes(value) for state in optimizer.state.values()
                             for name, value in state.items() if name != "step")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flag(parser, "model", default=str(DEMO_DIR / "model"))
    add_flag(parser, "shard_group_size", type=int, default=2, help="HYBRID_SHARD: ranks per shard group")
    add_flag(parser, "out", required=True, help="JSON file to write (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    fsdp_step = import_fsdp_step()

    configurations = {"DDP": None, **{strategy: strategy for strategy in fsdp_step.STRATEGIES}}
    if world_size % args.shard_group_size or world_size == args.shard_group_size:
        del configurations["HYBRID_SHARD"]  # no 2-D mesh to make (or it is FULL_SHARD)
    results = {}
    for name, strategy in configurations.items():
        torch.manual_seed(0)
        model = load_model(args.model)
        vocab_size = model.config.vocab_size
        if strategy is None:
            model = DDP(model)
        else:
            mesh = fsdp_step.build_mesh(strategy, "cpu", world_size, args.shard_group_size)
            fsdp_step.shard_model(model, mesh, strategy, MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                              reduce_dtype=torch.float32),
                                  OffloadPolicy())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after sharding, as the step scripts
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
    main()
