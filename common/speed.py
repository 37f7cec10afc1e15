"""The levers that make a training step faster on GPUs without changing what it computes.

Each is an option of every step, off by default, so that a step's lesson is the same with or without
it; each gives the same losses as the eager run (tests/test_speed.py):
  --gradient_checkpointing [full|selective]  recompute each decoder layer in backward instead of
        keeping its activations: all of them (full), or only what is cheap to recompute (selective:
        the matmuls' and attention's outputs are kept; norms, RoPE, SiLU and products are recomputed,
        torchtitan's per-operation policy). Selective keeps more memory than full and recomputes
        almost no FLOPs.
  --compile          torch.compile each decoder layer, whole (fullgraph: a graph break is an error),
        for the training steps only: evaluation and generation, whose shapes change from call to call,
        stay eager. Applied after the recomputation and before FSDP (torchtitan's order), so the
        compiled graph holds the layer's recomputation and FSDP's hooks stay outside it.
  --loss_chunk_size N  the loss N tokens at a time (common/data.py, chunked_loss_sum): the whole
        logits, in fp32 for the loss, are never held at once; each chunk's are recomputed in backward.
AdamW's fused kernel on GPUs is common/optim.py's.
"""
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

RECOMPUTATION = ("full", "selective")
# What selective recomputation keeps: the outputs of the matmuls (the linear layers) and of attention,
# the costly operations; every other operation of the layer is recomputed in backward.
_aten = torch.ops.aten
KEPT_OPERATIONS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                   _aten._scaled_dot_product_flash_attention.default,
                   _aten._scaled_dot_product_efficient_attention.default,
                   _aten._scaled_dot_product_cudnn_attention.default,
                   _aten._scaled_dot_product_flash_attention_for_cpu.default}


def keep_costly_outputs(ctx, operation, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if operation in KEPT_OPERATIONS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    return create_selective_checkpoint_contexts(keep_costly_outputs)


def prepare_layers(model, args, compile_layers=None):
    """Each decoder layer of `model` (Hugging Face's GradientCheckpointingLayer: the repeated blocks)
    recomputed in backward as --gradient_checkpointing says, then compiled with --compile:
    torchtitan's order, before FSDP shards them (or DDP wraps the model). The training
    forward (a layer in training mode, with gradients) runs the recomputed, compiled layer; any
    other call (evaluation, generation) the plain eager one. `compile_layers` overrides --compile
    (the plan check runs on fake tensors, eager)."""
    recompute = args.gradient_checkpointing
    compile_layers = args.compile if compile_layers is None else compile_layers
    if recompute:
        model.config.use_cache = False  # nothing to cache while training; HF refuses a cache with recomputation
    if not (recompute or compile_layers):
        return
    from transformers.modeling_layers import GradientCheckpointingLayer
    for layer in [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]:
        training_forward = eager_forward = layer.forward
        if recompute:
            training_forward = recomputed(eager_forward, selective=recompute == "selective")
        if compile_layers:  # packed rows (the default) have one length; unpacked rows, any: dynamic from the start
            training_forward = torch.compile(training_forward, fullgraph=True, dynamic=args.no_packing or None)
        layer.forward = by_mode(layer, training_forward, eager_forward)


def recomputed(forward, selective):
    """`forward` whose activations are recomputed in backward (non-reentrant checkpointing), all of
    them, or with `selective` all but the costly operations' outputs."""
    options = {"context_fn": selective_contexts} if selective else {}

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)
    return run


def by_mode(layer, training_forward, eager_forward):
    def forward(*args, **kwargs):
        training = layer.training and torch.is_grad_enabled()
        return (training_forward if training else eager_forward)(*args, **kwargs)
    return forward
