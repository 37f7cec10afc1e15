"""Loading a pretrained model straight into its FSDP shards, with one copy in host memory.

Loading the model on every rank would put N full copies in each node's host memory (8 × 27 GB for
a 7B model in fp32). Instead every rank builds the model on the meta device (shapes, no memory)
and shards it; only rank 0 reads the weights and sends them to the others one tensor at a time;
each rank keeps only its own shard of each.

With FSDP's CPU offload the shards live in host memory (FSDP copies each layer to the GPU when it
runs), so they are made there; the buffers, which FSDP does not offload, go to the GPU.
"""
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from common.model import build_model, load_model


def load_sharded_model(name, config, rank, device, shard, prepare=lambda model: model, cpu_offload=False,
                       trust_remote_code=False):
    """The model `name`, sharded by `shard(model)`. `prepare(model)` runs on the real model (rank 0)
    and on the meta one alike, before sharding, so that both have the same structure. `cpu_offload`:
    `shard` applies FSDP's CPUOffloadPolicy (its check wants every shard on the CPU)."""
    full_model = prepare(load_model(name, trust_remote_code)) if rank == 0 else None
    with torch.device("meta"):
        model = prepare(build_model(config, trust_remote_code))
    shard(model)
    model.to_empty(device="cpu" if cpu_offload else device)  # memory for this rank's shards only, uninitialised
    set_model_state_dict(model, full_model.state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for module in model.modules() if cpu_offload else ():  # the state dict's buffers, made on the CPU too
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer_name not in module._non_persistent_buffers_set:
                module.register_buffer(buffer_name, buffer.to(device))
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
