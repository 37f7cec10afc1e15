"""What sequence parallelism and the parallel loss buy step 6: the activations a rank keeps, and
the time of a step, for three ways to split the layers over a tensor-parallel group.

    torchrun --nproc-per-node 2 benchmark/tp_layouts.py                 # the demo model's shape, 2 ranks
    torchrun --nproc-per-node 4 benchmark/tp_layouts.py --vocab 20480   # a vocabulary 160 x the hidden size

  plain              q/k/v/gate/up colwise, o/down rowwise, each o and down ending in an all-reduce:
                     the norms, the residual stream and the logits stay whole on every rank
  sequence parallel  06_tp/train.py's layer_plan and ROOT_PLAN, but lm_head's logits gathered whole
                     (an all-gather) and the loss computed on them by every rank
  + parallel loss    06_tp/train.py as it trains: the loss on the vocabulary's parts

All ranks form one tensor-parallel group (no FSDP: it would shard the weights, not the
activations). The activations are what autograd saves in forward (saved_tensors_hooks, each
storage once, the weights left out), on this rank: per decoder layer (the mean over the layers)
and for the rest (embedding, final norm, lm_head and the loss). Random weights, fp32, one thread
per rank; the time is the median of --steps forward and backward passes after a first one.
"""
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from common.arguments import DEMO_DIR, Parser
from common.data import loss_sum
from common.errors import exit_on_user_error
from common.tensor_parallel import check_tp_size
from launch.steps import load_step

PLAIN_LAYER = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
               "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
               "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def build(layout, config, mesh):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    step = load_step("tp")
    if layout == "plain":  # the rest of the model whole on every rank
        for layer in model.model.layers:
            parallelize_module(layer, mesh, PLAIN_LAYER)
        return model
    for number, layer in enumerate(model.model.layers):
        parallelize_module(layer, mesh, step.layer_plan(first=number == 0))
    root = dict(step.ROOT_PLAN)
    if layout == "sequence parallel":  # the logits made whole before the loss
        root["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    parallelize_module(model, mesh, root)
    return model


def saved_activations(model, batch, parallel_loss):
    """(bytes per decoder layer, bytes outside the layers) that autograd saves on this rank."""
    weights = {p.to_local().untyped_storage().data_ptr() if isinstance(p, DTensor) else p.untyped_storage().data_ptr()
               for p in model.parameters()}
    seen, where, totals = set(), ["rest"], {"layers": 0, "rest": 0}

    def pack(tensor):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in weights and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            totals[where[0]] += storage.nbytes()
        return tensor
    hooks = [hook for layer in model.model.layers for hook in (
        layer.register_forward_pre_hook(lambda *_: where.__setitem__(0, "layers")),
        layer.register_forward_hook(lambda *_: where.__setitem__(0, "rest")))]
    with loss_parallel() if parallel_loss else nullcontext():  # the backward too, as in 06_tp's train_step
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = loss_sum(model, batch)
        (loss.to_local() if parallel_loss else loss).backward()
    for hook in hooks:
        hook.remove()
    return totals["layers"] / len(model.model.layers), totals["rest"]


def timed_steps(model, batch, parallel_loss, steps):
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        with loss_parallel() if parallel_loss else nullcontext():
            loss = loss_sum(model, batch)
            (loss.to_local() if parallel_loss else loss).backward()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def main():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("model", default=str(DEMO_DIR / "model"), help="the shape (config.json) to build, random weights")
    parser.add("vocab", type=int, default=None, help="another vocabulary size")
    parser.add("rows", type=int, default=4, help="rows per forward pass (the group's)")
    parser.add("seq_length", type=int, default=512, help="tokens per row")
    parser.add("steps", type=int, default=3, help="timed passes after the first")
    args = parser.parse_args()
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(args.model)
    config.max_position_embeddings = max(config.max_position_embeddings, args.seq_length)
    if args.vocab:
        config.vocab_size = args.vocab
    dist.init_process_group("gloo")
    ranks = dist.get_world_size()
    check_tp_size(ranks, ranks, config, args.model)  # whole heads on every rank
    mesh = init_device_mesh("cpu", (ranks,))
    ids = torch.randint(4, config.vocab_size, (args.rows, args.seq_length), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    rows = []
    for layout in ("plain", "sequence parallel", "+ parallel loss"):
        model = build(layout, config, mesh)
        parallel_loss = layout == "+ parallel loss"
        per_layer, rest = saved_activations(model, batch, parallel_loss)
        model.zero_grad(set_to_none=True)
        rows.append((layout, per_layer, rest, timed_steps(model, batch, parallel_loss, args.steps)))
    if dist.get_rank() == 0:
        print(f"{config.num_hidden_layers} layers x hidden {config.hidden_size}, MLP {config.intermediate_size}, "
              f"vocabulary {config.vocab_size}; {ranks} ranks split each layer (gloo); {args.rows} rows x "
              f"{args.seq_length} tokens; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
        print("| layout | saved per layer, MiB/rank | saved outside the layers, MiB/rank | forward + backward, s |")
        print("|---|---:|---:|---:|")
        for layout, per_layer, rest, seconds in rows:
            print(f"| {layout} | {per_layer / 2**20:.2f} | {rest / 2**20:.2f} | {seconds:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_user_error(main)
