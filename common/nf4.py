"""QLoRA's 4-bit base model: the decoder's frozen linear weights stored as NF4 (torchao), sharded by FSDP2.

NF4, the QLoRA paper's 4-bit NormalFloat: a weight is cut into blocks of 64 values; each value is
stored as a 4-bit code and each block as one scale (its largest magnitude), and the scales
themselves in 8 bits with one fp32 factor per group of scales (double quantization): about 4.13
bits per weight. A layer dequantizes its weight to the compute dtype as it runs.

torchao's NF4Tensor tells FSDP2 which of its tensors to shard and gather (fsdp_pre_all_gather and
fsdp_post_all_gather), so `fully_shard` shards it like any parameter. bitsandbytes' 4-bit
parameters have no such hooks: under FSDP2 they lose their quantization or compute wrong outputs
(the step's README says more).

FSDP shards by rows, and NF4's three tensors with them: each rank's part must hold whole groups of
scales. The groups are sized so that the factors divide evenly over any power-of-two number of
ranks up to 64 (256 scales per group, QLoRA's size, wherever the shape allows: CodeLlama-7b's
weights everywhere); a weight whose rows or factors do not divide over the ranks stays whole, in
4 bits, on every rank (`kept_whole`). The groups never depend on the number of ranks, so a run
computes with the same weights at any world size.
"""
import torch
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4

BLOCK = 64  # weights per scale
MAX_GROUP = 256  # scales per fp32 factor at most (QLoRA's)
SPLITS = 64  # the factors divide evenly over up to this many ranks (a power of two) where the shape allows


def scale_group(blocks):
    """Scales per factor for a weight of `blocks` blocks: the largest divisor of `blocks`, at most
    MAX_GROUP, that leaves a count of factors divisible by SPLITS (or by the largest power of two
    that divides `blocks`, where that is smaller)."""
    splits = min(SPLITS, blocks & -blocks)
    return max(group for group in range(1, MAX_GROUP + 1) if blocks % group == 0 and blocks // group % splits == 0)


def quantize_frozen_linears(module):
    """Store the frozen weight of every linear layer in `module` (a decoder layer: LoRA's base
    layers, not its adapters) as NF4, quantized from bf16, as checkpoints store the weights."""
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if not isinstance(layer, torch.nn.Linear) or weight.requires_grad or weight.numel() % BLOCK:
            continue
        nf4 = to_nf4(weight.detach().to(torch.bfloat16), BLOCK, scale_group(weight.numel() // BLOCK))
        layer.weight = torch.nn.Parameter(nf4, requires_grad=False)


def is_nf4(tensor):
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return isinstance(local, NF4Tensor)


def kept_whole(module, shard_ranks):
    """The NF4 weights of `module` that FSDP cannot split over `shard_ranks`: their rows or their
    scale factors do not divide, or there is one rank (FSDP2 then copies a parameter instead of
    gathering it, and copies only the first of NF4's tensors). They stay whole on every rank,
    outside FSDP (fully_shard's ignored_params)."""
    return {param for param in module.parameters() if isinstance(param, NF4Tensor)
            and (shard_ranks == 1 or param.shape[0] % shard_ranks or param.quantization_factor.numel() % shard_ranks)}


def stored_bytes(tensor):
    """The bytes a parameter takes on this rank: its shard's, and for NF4 its codes, scales and factors."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if isinstance(local, NF4Tensor):
        parts = (local.quantized_data, local.quantized_scalers, local.quantization_factor)
        return sum(part.numel() * part.element_size() for part in parts)
    return local.numel() * local.element_size()
