"""What a rank holds between micro-batches of gradient accumulation: the bytes of its parameters
(the shards, plus the gathered copies kept between micro-batches), gradients and AdamW state.
FSDP FULL_SHARD with and without 04_fsdp's --accumulate_unsharded, and DDP with no_sync for
comparison, each measured after the first micro-batch's backward of the second optimiser step
(so AdamW's state exists).

    torchrun --nproc-per-node 2 benchmark/accumulation_bytes.py --model demo/model --out accumulation_bytes.json

Writes {configuration: {"total": [bytes of rank 0, rank 1, ...], "parameters": [...], ...}}.
Tensors only, in fp32 as on the CPU. On a GPU in bf16 the gathered copies take 2 bytes per
parameter and the unsharded gradients 4 (FSDP accumulates them in the reduce dtype, fp32).
"""
import gc
import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from common.arguments import DEMO_DIR, Parser
from common.errors import exit_on_user_error
from common.model import load_model
from launch.steps import load_step

MICRO_BATCHES = 2


def local_bytes(tensor):
    """Bytes of this rank's piece: the local shard of a DTensor, or the whole plain tensor."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def held_bytes(model, optimizer):
    """Every distinct parameter tensor this rank holds (the optimizer holds the shards; while FSDP
    keeps a unit gathered, the module's parameters are the gathered copies), its gradient, and
    AdamW's state."""
    params = {id(p): p for p in [*model.parameters(), *optimizer.param_groups[0]["params"]]}.values()
    parts = {"parameters": sum(local_bytes(p) for p in params),
             "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
             "optimizer": sum(local_bytes(value) for state in optimizer.state.values()
                              for name, value in state.items() if name != "step")}
    return {"total": sum(parts.values()), **parts}


CONFIGURATIONS = ["FULL_SHARD", "FULL_SHARD --accumulate_unsharded", "DDP no_sync"]


def micro_batch(model, configuration, last):
    """The context one micro-batch runs in, set up as the step scripts do it."""
    if configuration == "DDP no_sync":
        return nullcontext() if last else model.no_sync()
    # 04_fsdp/train.py with --accumulate_unsharded (FULL_SHARD): keep the gathered weights and the
    # full gradients until the last micro-batch. Without it, FSDP's defaults: all three on.
    keep = configuration.endswith("--accumulate_unsharded") and not last
    model.set_requires_gradient_sync(not keep)
    model.set_reshard_after_forward(not keep)
    model.set_reshard_after_backward(not keep)
    return nullcontext()


def between_micro_batches(model, optimizer, vocab_size, configuration):
    """Two optimiser steps of MICRO_BATCHES random micro-batches; the bytes held after the first
    micro-batch's backward of the second step."""
    ids = torch.randint(4, vocab_size, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    for step in range(2):
        for i in range(MICRO_BATCHES):
            with micro_batch(model, configuration, last=i == MICRO_BATCHES - 1):
                model(input_ids=ids, labels=ids).loss.backward()
            if step == 1 and i == 0:
                held = held_bytes(model, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return held


def main():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("model", default=str(DEMO_DIR / "model"))
    parser.add("out", required=True, help="JSON file to write (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    fsdp_step = load_step("fsdp")

    results = {}
    for configuration in CONFIGURATIONS:
        torch.manual_seed(0)
        model = load_model(args.model)
        vocab_size = model.config.vocab_size
        if configuration.startswith("DDP"):
            model = DDP(model)
        else:
            mesh = fsdp_step.build_mesh("FULL_SHARD", "cpu", world_size, None)
            fsdp_step.shard_model(model, mesh, "FULL_SHARD",
                                  MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
                                  OffloadPolicy())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after sharding, as the step scripts
        held = between_micro_batches(model, optimizer, vocab_size, configuration)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, held)
        results[configuration] = {part: [p[part] for p in per_rank] for part in held}
        del model, optimizer
        gc.collect()  # a sharded model sits in reference cycles: free it now, before the process group goes
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"world_size": world_size, "micro_batches": MICRO_BATCHES,
                                              "bytes_per_rank": results}, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_user_error(main)
