"""Loading a pretrained model straight into its FSDP shards, with one copy in host memory.

Loading the model on every rank would put N full copies in each node's host memory (8 × 27 GB for
a 7B model in fp32). Instead every rank builds the model on the meta device (shapes, no memory)
and shards it; only rank 0 reads the weights and sends them to the others one tensor at a time;
each rank keeps only its own shard of each.
"""
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from common.model import build_model, load_model


def load_sharded_model(name, config, rank, device, shard, prepare=lambda model: model, trust_remote_code=False):
    """The model `name`, sharded by `shard(model)`. `prepare(model)` runs on the real model (rank 0)
    and on the meta one alike, before sharding, so that both have the same structure."""
    full_model = prepare(load_model(name, trust_remote_code)) if rank == 0 else None
    with torch.device("meta"):
        model = prepare(build_model(config, trust_remote_code))
    shard(model)
    model.to_empty(device=device)  # memory for this rank's shards only, uninitialised
    set_model_state_dict(model, full_model.state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers outside the state dict (RoPE's inv_freq) are garbage after to_empty: take rank 0's.
    reference = dict(full_model.named_buffers()) if rank == 0 else {}
    for module_name, module in model.named_modules():
        for buffer_name in module._non_persistent_buffers_set:
            buffer = getattr(module, buffer_name)
            full_name = f"{module_name}.{buffer_name}" if module_name else buffer_name
            buffer = (reference[full_name] if rank == 0 else torch.empty_like(buffer)).to(device)
            dist.broadcast(buffer, src=0)
            module.register_buffer(buffer_name, buffer, persistent=False)
    return model
