"""Tensor parallelism's arithmetic (what must divide, how many ranks split a layer by default) and
the logits made whole outside the loss.

A tensor-parallel group of N ranks splits each decoder layer's matrices N ways (06_tp/train.py):
q, k and v by heads, gate and up by the MLP's width, and o and down along their inputs to match.
Each rank must hold whole heads, whole key-value heads and an equal part of the MLP, so N divides
the attention heads, the key-value heads and the intermediate size. The hidden size and the
vocabulary need not divide: a DTensor splits them unevenly where it must.
"""
import logging

from common.errors import UserError

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


def check_tp_size(tp_size, world_size, config, model):
    """Refuse a --tp_size that the ranks or the model's layers cannot be split by, in one line."""
    if tp_size < 1:
        raise UserError(f"--tp_size must be at least 1 (got {tp_size})")
    if world_size % tp_size:
        raise UserError(f"--tp_size {tp_size} does not divide the {world_size} ranks into tensor-parallel groups: "
                        f"choose one of {', '.join(map(str, fitting_tp_sizes(config, world_size)))}")
    uneven = [f"{size} {name}" for name, size in split_sizes(config).items() if size % tp_size]
    if uneven:
        raise UserError(f"--tp_size {tp_size}: {model} has {', '.join(uneven)}, which do not split into {tp_size} "
                        "equal parts (each rank of a tensor-parallel group takes whole heads and an equal part of "
                        f"the MLP): choose one of {', '.join(map(str, fitting_tp_sizes(config, world_size)))}")


def check_step_arguments(args):
    """Step 6 trains with AdamW: common/optim.py's Muon takes matrices cut along one mesh dimension.
    Its loss runs on the logits' vocabulary parts (loss_parallel), not chunked over the tokens."""
    if args.optimizer == "muon":
        raise UserError("--optimizer muon: step 6 cuts each matrix over both dimensions of its mesh, and the kit's "
                        "Muon orthogonalises matrices that FSDP alone cut: train with Muon in step 4, or AdamW here")
    if args.loss_chunk_size:
        raise UserError(f"--loss_chunk_size {args.loss_chunk_size}: step 6's logits are already split over each "
                        "tensor-parallel group by the vocabulary (loss_parallel), each rank holding its part; leave it "
                        "out here (steps 2 to 5 take it)")


def tp_size_for(args, config, world_size, ranks_per_node, on_gpu):
    """--tp_size, or by default default_tp_size's; refused where it does not fit (check_tp_size)."""
    tp_size = args.tp_size or default_tp_size(config, ranks_per_node, on_gpu)
    check_tp_size(tp_size, world_size, config, args.model)
    return tp_size


def default_tp_size(config, ranks_per_node, on_gpu):
    """The GPUs of one node, where the fast links are; on the CPU 2, so that torchrun's 4 processes on
    one machine run both dimensions (2 x 2). Lowered to the largest size that divides the node's
    ranks and splits the model's layers evenly."""
    wanted = ranks_per_node if on_gpu else min(2, ranks_per_node)
    return fitting_tp_sizes(config, wanted)[-1]


def whole_logits_outside_training(lm_head):
    """In training the logits stay split over the vocabulary, one part per rank of the group, and
    the loss is computed on the parts (loss_parallel). In evaluation and generation they are made
    whole: the greedy move is the best of the whole vocabulary, and the evaluation reads plain tensors."""
    def gather(module, inputs, logits):
        return logits if module.training else logits.full_tensor()
    lm_head.register_forward_hook(gather)
