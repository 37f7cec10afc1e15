"""Tensor parallelism's arithmetic (what must divide, how many ranks split a layer by default) and
the logits made whole outside the loss.

A tensor-parallel group of N ranks splits each decoder layer's matrices N ways (06_tp/train.py):
q, k and v by heads, gate and up by the MLP's width, and o and down along their inputs to match.
Each rank must hold whole heads, whole key-value heads and an equal part of the MLP, so N divides
the attention heads, the key-value heads and the intermediate size. The hidden size and the
vocabulary need not divide: a DTensor splits them unevenly where it must. A group stays inside a
node, on its fast links: N divides the ranks of each node.
"""
import logging

import torch

from common.errors import UserError
from common.model import build_model

# DTensor notes on every rank that the gradient norm's sum (over dp, then over tp) and the final
# model's gather take two collectives each where one would do: a scalar once per step, and the
# export once per run. Both are right as they are; the notes would only fill the log.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def split_sizes(config):
    """{what tensor parallelism splits: its size}, from the model's config."""
    heads = config.num_attention_heads
    return {"attention heads": heads, "key-value heads": getattr(config, "num_key_value_heads", None) or heads,
            "intermediate size": config.intermediate_size}


def fitting_tp_sizes(config, ranks):
    """The group sizes up to `ranks` that divide `ranks` and split the model's layers evenly."""
    return [n for n in range(1, ranks + 1)
            if ranks % n == 0 and all(size % n == 0 for size in split_sizes(config).values())]


def check_tp_size(tp_size, world_size, config, model, ranks_per_node=None):
    """Refuse a --tp_size that the ranks of a node (all `world_size` ranks by default) or the
    model's layers cannot be split by, in one line."""
    ranks_per_node = ranks_per_node or world_size
    if tp_size < 1:
        raise UserError(f"--tp_size must be at least 1 (got {tp_size})")
    choices = ", ".join(map(str, fitting_tp_sizes(config, ranks_per_node)))
    if ranks_per_node % tp_size:
        nodes = world_size // ranks_per_node
        ranks = f"the {ranks_per_node} ranks" + (f" of each of the {nodes} nodes" if nodes > 1 else "")
        raise UserError(f"--tp_size {tp_size} does not divide {ranks} into tensor-parallel groups"
                        + (" (a group stays inside a node, on its fast links)" if nodes > 1 else "")
                        + f": choose one of {choices}")
    uneven = [f"{size} {name}" for name, size in split_sizes(config).items() if size % tp_size]
    if uneven:
        raise UserError(f"--tp_size {tp_size}: {model} has {', '.join(uneven)}, which do not split into {tp_size} "
                        "equal parts (each rank of a tensor-parallel group takes whole heads and an equal part of "
                        f"the MLP): choose one of {choices}")


# What step 6 splits (06_tp/train.py's layer_plan and ROOT_PLAN), as Llama and the models laid out
# like it name them: separate linear layers for q, k, v, o and the MLP's gate, up and down.
SPLIT_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SPLIT_ROOT = ("model.embed_tokens", "model.norm", "lm_head")


def check_model_splits(config, model, trust_remote_code=False):
    """Refuse, before any weight is read, a model that step 6's plan cannot split: one whose layers
    fuse projections (Phi-3's qkv_proj, gate_up_proj) or name them otherwise, and one whose lm_head is
    its input embedding (tie_word_embeddings): the plan splits the embedding by hidden columns and
    lm_head by vocabulary, so the one weight would become two. Step 4 shards any of them."""
    with torch.device("meta"):  # shapes and names only: no memory, nothing read
        built = build_model(config, trust_remote_code)
    modules = dict(built.named_modules())
    layers = getattr(getattr(built, "model", None), "layers", None)
    layer = dict(layers[0].named_modules()) if isinstance(layers, torch.nn.ModuleList) and len(layers) else {}
    missing = [name for name in SPLIT_LINEARS if not isinstance(layer.get(name), torch.nn.Linear)]
    missing += [name for name in SPLIT_ROOT if name not in modules]
    what = f"{model} ({config.model_type}, {type(built).__name__})"
    if missing:
        others = [name for name, module in layer.items() if isinstance(module, torch.nn.Linear)
                  and name not in SPLIT_LINEARS]
        raise UserError(f"step 6 cannot split {what}: it has no {', '.join(missing)}"
                        + (f" (its layers have {', '.join(others)})" if others else "")
                        + "; step 6 splits Llama-style layers (separate q_proj, k_proj, v_proj, o_proj, gate_proj, "
                          "up_proj and down_proj: Llama, Mistral, Qwen2, ...): train this model with step 4")
    if built.lm_head.weight is built.model.embed_tokens.weight:
        raise UserError(f"step 6 cannot split {what}: its lm_head is its input embedding (tie_word_embeddings), "
                        "which step 6 would split two ways (the embedding by hidden columns, lm_head by vocabulary) "
                        "and so untie: train this model with step 4")


def check_step_arguments(args):
    """Step 6 trains with AdamW: common/optim.py's Muon takes matrices cut along one mesh dimension.
    Its loss runs on the logits' vocabulary parts (loss_parallel), not chunked over the tokens. Its
    layers compile for rows of one length: torch 2.13 fails to trace a layer split by sequence whose
    length varies (inside AOT autograd, TypeError: mul expected 2 arguments, got 3)."""
    if args.optimizer == "muon":
        raise UserError("--optimizer muon: step 6 cuts each matrix over both dimensions of its mesh, and the kit's "
                        "Muon orthogonalises matrices that FSDP alone cut: train with Muon in step 4, or AdamW here")
    if args.loss_chunk_size:
        raise UserError(f"--loss_chunk_size {args.loss_chunk_size}: step 6's logits are already split over each "
                        "tensor-parallel group by the vocabulary (loss_parallel), each rank holding its part; leave it "
                        "out here (steps 2 to 5 take it)")
    if args.compile and args.no_packing:
        raise UserError("--compile with --no_packing: step 6's split layers compile for rows of one length, and rows "
                        "of one game each vary; pack the rows (leave out --no_packing), or leave out --compile")


def tp_size_for(args, config, world_size, ranks_per_node, on_gpu):
    """--tp_size, or by default default_tp_size's; refused where the model (check_model_splits) or the
    size (check_tp_size) does not fit. The one check of the step, the plan check and submit.py."""
    check_model_splits(config, args.model, getattr(args, "trust_remote_code", False))
    tp_size = default_tp_size(config, ranks_per_node, on_gpu) if args.tp_size is None else args.tp_size
    check_tp_size(tp_size, world_size, config, args.model, ranks_per_node)
    return tp_size


def default_tp_size(config, ranks_per_node, on_gpu):
    """The GPUs of one node, where the fast links are; on the CPU 2, so that torchrun's 4 processes on
    one machine run both dimensions (2 x 2). Lowered to the largest size that divides the node's
    ranks and splits the model's layers evenly."""
    wanted = ranks_per_node if on_gpu else min(2, ranks_per_node)
    return [n for n in fitting_tp_sizes(config, ranks_per_node) if n <= wanted][-1]


def whole_logits_outside_training(lm_head):
    """In training the logits stay split over the vocabulary, one part per rank of the group, and
    the loss is computed on the parts (loss_parallel). In evaluation and generation they are made
    whole: the greedy move is the best of the whole vocabulary, and the evaluation reads plain tensors."""
    def gather(module, inputs, logits):
        return logits if module.training else logits.full_tensor()
    lm_head.register_forward_hook(gather)
