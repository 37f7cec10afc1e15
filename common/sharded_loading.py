"""Loading a pretrained model straight into its FSDP shards, with one copy in host memory.

Loading the model on every rank would put N full copies in each node's host memory (8 × 27 GB for
a 7B model in fp32). Instead every rank builds the model on the meta device (shapes, no memory)
and shards it; only rank 0 reads the weights and sends them to the others one tensor at a time;
each rank keeps only its own shard of each.

With FSDP's CPU offload the shards live in host memory (FSDP copies each layer to the GPU when it
runs), so they are made there; the buffers, which FSDP does not offload, go to the GPU.

Once sharded, the model's reduce-scatters of CPU gradients go as an all-to-all and a sum
(common/process_group.py: gloo has no reduce-scatter of its own).
"""
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from common.model import build_model, load_model
from common.nf4 import quantize_frozen_linears
from common.process_group import reduce_scatter_by_all_to_all


def load_sharded_model(name, config, rank, device, shard, prepare=lambda model: model, cpu_offload=False,
                       trust_remote_code=False):
    """The model `name`, sharded by `shard(model)`. `prepare(model)` runs on the real model (rank 0)
    and on the meta one alike, before sharding, so that both have the same structure. `cpu_offload`:
    `shard` applies FSDP's CPUOffloadPolicy (its check wants every shard on the CPU)."""
    full_model = prepare(load_model(name, trust_remote_code)) if rank == 0 else None
    with torch.device("meta"):
        model = prepare(build_model(config, trust_remote_code))
    shard(model)
    reduce_scatter_by_all_to_all(model, device)  # on the CPU, half the bytes of gloo's reduce-scatter
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


def load_quantized_sharded_model(name, config, rank, device, shard, prepare, trust_remote_code=False):
    """QLoRA's load: the model `name`, its decoder layers' frozen linear weights in 4 bits (NF4,
    common/nf4.py), sharded by `shard(model, load_unit)`. NF4 is quantized from a whole weight (its
    scales are shared across rows), so the model is loaded unit by unit: `shard` calls `load_unit`
    on each decoder layer, then on the rest, just before FSDP takes it; rank 0 sends the unit's
    weights, every rank quantizes the layer's in the same way, and FSDP keeps this rank's part. One
    layer at a time is whole on a GPU, in full precision."""
    full_model = prepare(load_model(name, trust_remote_code)) if rank == 0 else None
    with torch.device("meta"):
        model = prepare(build_model(config, trust_remote_code))
    sources = {**dict(full_model.named_parameters()), **dict(full_model.named_buffers())} if rank == 0 else {}

    def rank0s(tensor_name, tensor):
        value = torch.empty_like(tensor, device=device)
        if rank == 0:
            value.copy_(sources[tensor_name])
        dist.broadcast(value, src=0)
        return value

    def load_unit(unit):
        give_storage(model, unit, rank0s)
        if unit is not model:
            quantize_frozen_linears(unit)

    shard(model, load_unit)
    reduce_scatter_by_all_to_all(model, device)
    return model


def give_storage(model, unit, make):
    """Replace each parameter and buffer of `unit` (a module of `model`) that is still on the meta
    device by `make(its name in model, it)`; a tensor that two modules share (tied weights) once."""
    prefix = next(name for name, module in model.named_modules() if module is unit)
    made = {}
    for kind in ("parameters", "buffers"):
        for tensor_name, tensor in getattr(unit, f"named_{kind}")(remove_duplicate=False):
            if not tensor.is_meta:  # the root's decoder layers: loaded and sharded already
                continue
            if id(tensor) not in made:
                value = make(f"{prefix}.{tensor_name}" if prefix else tensor_name, tensor)
                made[id(tensor)] = torch.nn.Parameter(value, tensor.requires_grad) if kind == "parameters" else value
            owner_name, _, attribute = tensor_name.rpartition(".")
            owner = unit.get_submodule(owner_name)
            if kind == "parameters":
                setattr(owner, attribute, made[id(tensor)])
            else:
                owner.register_buffer(attribute, made[id(tensor)],
                                      persistent=attribute not in owner._non_persistent_buffers_set)
