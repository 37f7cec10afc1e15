"""How much GPU memory will FSDP need? A per-GPU estimate, before you queue for a node.

    python 04_fsdp/estimate_memory.py --gpus_per_node 4 --nodes 1 --max_seq_length 4096
    python 04_fsdp/estimate_memory.py --table --gradient_checkpointing     # 1/2/4/8 GPUs x strategies
    python 04_fsdp/estimate_memory.py --model demo/model --gpus_per_node 2 --max_seq_length 256

The model is described by its config only: a local directory with config.json, a Hugging Face
id already in the local cache, or --config path/to/config.json. Nothing is downloaded. For
codellama/CodeLlama-7b-hf a built-in copy of the config is used when the cache lacks it.

What is counted (per GPU, the way 04_fsdp/train.py trains: fp32 model, FSDP2 `fully_shard` on
every decoder layer and then on the root, MixedPrecisionPolicy(param_dtype=compute dtype,
reduce_dtype=fp32), AdamW created after sharding):

Parameter count. The model is built on the meta device from its config: exact shapes, no memory.

Sharded state (lives the whole run). fp32 parameters 4 B, fp32 gradients 4 B, AdamW exp_avg and
exp_avg_sq 8 B: 16 bytes per parameter, split N ways, N being the shard degree:
    FULL_SHARD, SHARD_GRAD_OP  N = all GPUs (gpus_per_node x nodes)
    HYBRID_SHARD               N = gpus_per_node, or --shard_group_size (sharded inside a node,
                               replicated across nodes)
    NO_SHARD                   N = 1 (every GPU keeps everything, like DDP)
FSDP2 cuts every parameter along dim 0 into N equal pieces, padding dim 0 up to a multiple of N,
so per GPU each parameter costs ceil(dim0 / N) x (product of the other dims) x bytes.

Unsharded working set (forward and backward only), in the compute dtype c (2 B for bf16/fp16,
4 B for fp32):
    parameters  FULL_SHARD, HYBRID_SHARD, NO_SHARD: the root unit (embeddings, final norm,
                lm_head; its forward wraps the whole model, so it is gathered all through forward
                and again all through backward) + two decoder layers (the one running and the
                next one being gathered).
                SHARD_GRAD_OP: layers stay gathered after forward until their backward, so at
                the turn from forward to backward the whole model is there: c x all parameters.
    gradients   the largest unit's gradients in c, plus the fp32 copy that reduce-scatter
                sends: (c + 4) x parameters of the largest unit.

Activations, counted for a Llama decoder layer (the bookkeeping of Korthikanti et al. 2022,
arXiv 2205.05198, redone for Llama's SwiGLU MLP, RMSNorm and no dropout), in bytes per token,
with h = hidden size, kv = key/value width (kv heads x head dim), i = MLP width, a = heads,
s = sequence length, b = batch size per GPU:
    attention  c x (3h + 2kv)   input of q/k/v projections, q, k and v, attention output
    MLP        c x (h + 4i)     input of gate/up, gate output, SiLU output, up output, product
    2 RMSNorms 2 x (4 + c) x h  each keeps its fp32 input and its normalised output
    per layer  bf16: 20h + 4kv + 8i bytes (CodeLlama-7b: 45.5 h, where Korthikanti's GPT layer
               has 34 h); SDPA/flash attention keeps no s x s matrix. With --attention eager add
               a x s x (4 + c) (fp32 softmax and its copy; 4 only for fp32) - Korthikanti's
               5 a s / h term.
    all layers  s x b x layers x per-layer, or with --gradient_checkpointing only each layer's
                input, s x b x layers x c x h, plus one layer's full activations while it is
                recomputed in backward.
    head        s x b x [(4 + 2c) x h + (c + 4 + 4) x vocab]: final norm, lm_head input, the
                logits, their fp32 copy for the loss (none for fp32) and the fp32 log-softmax
                that cross-entropy keeps for backward.

Optimizer step. Multi-tensor (foreach) AdamW, the default on GPU, makes one temporary copy of
exp_avg_sq: 4 B per sharded parameter.

Peak per GPU: the largest of three moments (each part is counted at its own maximum, so the
estimate errs on the high side):
    forward -> backward  parameters + optimizer state + working set + all activations. No
                         gradients yet: train.py frees them after every step (zero_grad with
                         set_to_none); with --gradient_accumulation_steps > 1 they stay.
    end of backward      sharded state (gradients now complete) + working set
    optimizer step       sharded state + optimizer step temporaries
It fits when
    peak + 3 GiB (CUDA context, cuBLAS workspaces, NCCL buffers) + 10% of peak (allocator
    fragmentation, temporaries this model leaves out)  <=  --gpu_memory_gib.

--cpu_offload (FSDP2 CPUOffloadPolicy) keeps the sharded state in host RAM and runs the optimizer
step on the CPU (plain per-tensor loop, no big temporaries): the GPU keeps only the working set
and activations. Host RAM per node is then gpus_per_node x sharded state.
"""
import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared `common` package

import torch  # noqa: E402

from common.errors import UserError, exit_on_user_error  # noqa: E402
from common.train_setup import add_flag  # noqa: E402

GiB = 1024 ** 3
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # the dtype FSDP gathers weights in and runs layers in
PARAM_BYTES, GRAD_BYTES, ADAMW_BYTES = 4, 4, 8  # fp32 master weights, fp32 gradients, exp_avg + exp_avg_sq
REDUCE_BYTES = 4  # MixedPrecisionPolicy(reduce_dtype=fp32)
MARGIN_FIXED_GIB, MARGIN_FRACTION = 3.0, 0.10
TABLE_GPUS = [1, 2, 4, 8]
PEAK_MOMENTS = {"forward_to_backward": "fwd->bwd", "end_of_backward": "end of bwd", "optimizer_step": "step"}

# The numbers of codellama/CodeLlama-7b-hf's config.json, so the estimate works with no cache at all.
BUILT_IN_CONFIGS = {
    "codellama/CodeLlama-7b-hf": dict(
        model_type="llama", vocab_size=32016, hidden_size=4096, intermediate_size=11008,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=16384, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2),
}


# ---- the model: config -> parameter shapes ------------------------------------------------------

def load_config(model=None, config_path=None):
    """The model's config and a line saying where it came from. Never touches the network."""
    from transformers import AutoConfig
    if config_path is not None:
        if not Path(config_path).is_file():
            raise UserError(f"--config {config_path}: no such file")
        try:
            return AutoConfig.from_pretrained(config_path), f"config {config_path}"
        except (OSError, ValueError) as err:
            raise UserError(f"--config {config_path}: not a model config ({first_line(err)})") from None
    if Path(model).is_dir():
        if not (Path(model) / "config.json").is_file():
            raise UserError(f"--model {model}: the directory has no config.json")
        return AutoConfig.from_pretrained(model), f"config {Path(model) / 'config.json'}"
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True), f"{model} (local Hugging Face cache)"
    except (OSError, ValueError) as err:
        if model in BUILT_IN_CONFIGS:
            built_in = dict(BUILT_IN_CONFIGS[model])
            return (AutoConfig.for_model(built_in.pop("model_type"), **built_in),
                    f"{model} (not in the local Hugging Face cache: using the built-in copy of its config)")
        raise UserError(f"--model {model}: not a local directory and not in the local Hugging Face cache "
                        f"({first_line(err)}); download it with `python 01_download/download.py --model {model}` "
                        "or pass --config path/to/config.json") from None


def first_line(err):
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


class ModelShape:
    """What the estimate needs to know: parameter shapes per FSDP unit, and the layer sizes."""

    def __init__(self, name, root_shapes, layer_shapes, config):
        self.name = name
        self.root_shapes = root_shapes  # outside the decoder layers: embeddings, final norm, lm_head
        self.layer_shapes = layer_shapes  # one list of shapes per decoder layer
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_size = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim

    @property
    def all_shapes(self):
        return self.root_shapes + [shape for layer in self.layer_shapes for shape in layer]

    @property
    def num_layers(self):
        return len(self.layer_shapes)

    @property
    def num_params(self):
        return count(self.all_shapes)


def count(shapes):
    return sum(math.prod(shape) for shape in shapes)


def model_shape(config, name):
    """Build the model on the meta device: real shapes, no memory, no weights read."""
    from transformers import AutoModelForCausalLM
    for needed in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"):
        if getattr(config, needed, None) is None:
            raise UserError(f"{name}: the config has no {needed}; this estimate is for Llama-style decoders")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise UserError(f"{name}: no model.model.layers, which 04_fsdp shards one by one")
    in_layers = {id(p) for p in layers.parameters()}
    root_shapes = [tuple(p.shape) for p in model.parameters() if id(p) not in in_layers]
    layer_shapes = [[tuple(p.shape) for p in layer.parameters()] for layer in layers]
    return ModelShape(name, root_shapes, layer_shapes, config)


# ---- sharded state ------------------------------------------------------------------------------

def shard_degree(strategy, gpus_per_node, nodes, shard_group_size=None):
    """Over how many GPUs each tensor is split. HYBRID_SHARD shards inside a group of GPUs, by
    default one node's, and keeps a full replica in every group."""
    return {"FULL_SHARD": gpus_per_node * nodes, "SHARD_GRAD_OP": gpus_per_node * nodes,
            "HYBRID_SHARD": shard_group_size or gpus_per_node, "NO_SHARD": 1}[strategy]


def sharded_bytes(shapes, degree, bytes_per_element):
    """Bytes one GPU holds when every tensor is cut along dim 0 into `degree` pieces.
    FSDP2 pads dim 0 to a multiple of the degree, so every GPU holds ceil(dim0 / degree) rows."""
    total = 0
    for shape in shapes:
        dim0, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        total += math.ceil(dim0 / degree) * rest * bytes_per_element
    return total


def sharded_state_bytes(shape, degree):
    """The per-GPU parameter, gradient and AdamW bytes that live for the whole run."""
    shapes = shape.all_shapes
    return {"parameters": sharded_bytes(shapes, degree, PARAM_BYTES),
            "gradients": sharded_bytes(shapes, degree, GRAD_BYTES),
            "optimizer": sharded_bytes(shapes, degree, ADAMW_BYTES)}


# ---- what exists only while the model runs ------------------------------------------------------

def unsharded_working_set_bytes(shape, strategy, compute_bytes):
    """Full (gathered) copies of some units' parameters, and one unit's full gradients."""
    root = count(shape.root_shapes)
    layers = sorted((count(layer) for layer in shape.layer_shapes), reverse=True)
    if strategy == "SHARD_GRAD_OP":
        gathered = shape.num_params  # nothing is re-sharded after forward
    else:
        gathered = root + sum(layers[:2])  # root stays gathered; one layer runs, the next is gathered
    largest_unit = max([root] + layers)
    return {"unsharded_parameters": gathered * compute_bytes,
            "unsharded_gradients": largest_unit * (compute_bytes + REDUCE_BYTES)}


def layer_activation_bytes_per_token(shape, compute_bytes, attention, seq_length):
    """What one decoder layer keeps for backward, per token (see the module docstring)."""
    h, kv, i, c = shape.hidden_size, shape.kv_size, shape.intermediate_size, compute_bytes
    attention_part = c * (3 * h + 2 * kv)
    mlp_part = c * (h + 4 * i)
    norms = 2 * (4 + c) * h  # RMSNorm computes in fp32 and keeps its fp32 input
    scores = 0
    if attention == "eager":  # softmax in fp32, then cast to c: the s x s matrices per head stay
        scores = shape.num_heads * seq_length * (4 + (c if c < 4 else 0))
    return attention_part + mlp_part + norms + scores


def activation_bytes(shape, seq_length, batch_size, compute_bytes, gradient_checkpointing, attention):
    """Activations kept for backward: decoder layers, and the head (final norm, logits, loss)."""
    tokens = seq_length * batch_size
    one_layer = tokens * layer_activation_bytes_per_token(shape, compute_bytes, attention, seq_length)
    if gradient_checkpointing:
        # Only each layer's input stays; one layer at a time is recomputed in full in backward.
        layers = shape.num_layers * tokens * compute_bytes * shape.hidden_size + one_layer
    else:
        layers = shape.num_layers * one_layer
    upcast = 4 if compute_bytes < 4 else 0  # the loss runs on an fp32 copy of the logits
    head = tokens * ((4 + 2 * compute_bytes) * shape.hidden_size
                     + (compute_bytes + upcast + 4) * shape.vocab_size)
    return {"activations_layers": layers, "activations_head": head}


# ---- the estimate ---------------------------------------------------------------------------------

def estimate(shape, strategy="FULL_SHARD", gpus_per_node=1, nodes=1, precision="bf16", seq_length=4096,
             batch_size=1, gradient_checkpointing=False, cpu_offload=False, attention="sdpa",
             gradient_accumulation_steps=1, shard_group_size=None):
    """Per-GPU bytes of every part, of the three moments that can be the peak, and the peak;
    host RAM per node for an offloaded state. All in bytes."""
    compute_bytes = COMPUTE_BYTES[precision]
    degree = shard_degree(strategy, gpus_per_node, nodes, shard_group_size)
    state = sharded_state_bytes(shape, degree)
    working_set = unsharded_working_set_bytes(shape, strategy, compute_bytes)
    activations = activation_bytes(shape, seq_length, batch_size, compute_bytes, gradient_checkpointing, attention)
    # foreach AdamW: one temporary the size of exp_avg_sq, i.e. half the optimizer state.
    step_temporaries = 0 if cpu_offload else state["optimizer"] // 2
    on_gpu = 0 if cpu_offload else 1  # offloaded: the sharded state is in host RAM
    grads_during_forward = state["gradients"] if gradient_accumulation_steps > 1 else 0
    moments = {
        "forward_to_backward": on_gpu * (state["parameters"] + state["optimizer"] + grads_during_forward)
        + sum(working_set.values()) + sum(activations.values()),
        "end_of_backward": on_gpu * sum(state.values()) + sum(working_set.values()),
        "optimizer_step": on_gpu * sum(state.values()) + step_temporaries,
    }
    host_per_node = gpus_per_node * sum(state.values()) if cpu_offload else 0
    return {**state, **working_set, **activations, "optimizer_step_temporaries": step_temporaries,
            **moments, "peak": max(moments.values()), "host_per_node": host_per_node, "shard_degree": degree}


def needed_bytes(peak):
    """The peak plus the margin nothing above counts: CUDA context, NCCL, fragmentation."""
    return peak + MARGIN_FIXED_GIB * GiB + MARGIN_FRACTION * peak


def fits(peak, gpu_memory_gib):
    return needed_bytes(peak) <= gpu_memory_gib * GiB


def loading_bytes(shape):
    """The whole fp32 model: what rank 0 alone holds in host RAM while train.py loads it (the
    other ranks build it on the meta device and receive their shards, one tensor at a time)."""
    return sharded_bytes(shape.all_shapes, 1, PARAM_BYTES)


# ---- printing -------------------------------------------------------------------------------------

def gib(n):
    return f"{n / GiB:.2f}"


def setup_line(args):
    checkpointing = "activation checkpointing" if args.gradient_checkpointing else "no activation checkpointing"
    accumulation = (f", {args.gradient_accumulation_steps} micro-batches per step"
                    if args.gradient_accumulation_steps > 1 else "")
    offload = ", CPU offload" if args.cpu_offload else ""
    return (f"{args.precision} compute, sequence {args.max_seq_length}, batch {args.batch_size_per_device} per GPU"
            f"{accumulation}, {checkpointing}, {args.attention} attention{offload}")


def estimate_for(shape, args, strategy, gpus_per_node, nodes, shard_group_size):
    return estimate(shape, strategy, gpus_per_node, nodes, args.precision, args.max_seq_length,
                    args.batch_size_per_device, args.gradient_checkpointing, args.cpu_offload, args.attention,
                    args.gradient_accumulation_steps, shard_group_size)


def report(shape, source, args):
    """The human-readable estimate for one setup."""
    est = estimate_for(shape, args, args.sharding_strategy, args.gpus_per_node, args.nodes, args.shard_group_size)
    where = "host RAM" if args.cpu_offload else "fp32"
    share = f"1/{est['shard_degree']}"
    layers = f"{shape.num_layers} decoder layers, {'' if args.gradient_checkpointing else 'not '}checkpointed"
    gathered = "the whole model" if args.sharding_strategy == "SHARD_GRAD_OP" else "root + 2 decoder layers"
    parts = [
        (f"parameters ({where}, {share})", est["parameters"]),
        (f"gradients ({where}, {share})", est["gradients"]),
        (f"optimizer state (AdamW exp_avg + exp_avg_sq, {where}, {share})", est["optimizer"]),
        (f"gathered parameters ({args.precision}: {gathered})", est["unsharded_parameters"]),
        (f"unsharded gradients ({args.precision} + fp32 copy, largest unit)", est["unsharded_gradients"]),
        (f"activations ({layers})", est["activations_layers"]),
        ("activations (final norm, logits, loss)", est["activations_head"]),
        ("optimizer step temporaries (foreach AdamW)" if not args.cpu_offload
         else "optimizer step temporaries (the step runs on the CPU)", est["optimizer_step_temporaries"]),
    ]
    no_grads = "" if args.gradient_accumulation_steps > 1 else " (no gradients yet)"
    moments = [(f"forward -> backward{no_grads}", est["forward_to_backward"]),
               ("end of backward", est["end_of_backward"]), ("optimizer step", est["optimizer_step"])]
    needed = needed_bytes(est["peak"])
    margin = f"margin ({MARGIN_FIXED_GIB:g} GiB CUDA context/NCCL + {MARGIN_FRACTION:.0%} fragmentation)"
    layout = f"{args.sharding_strategy} on {args.nodes} node(s) x {args.gpus_per_node} GPU(s)"
    verdict = "fits" if fits(est["peak"], args.gpu_memory_gib) else "does NOT fit"
    lines = [f"model: {source}: {shape.num_params:,} parameters", f"{layout}; shard degree {est['shard_degree']}",
             setup_line(args), "", f"{'per GPU':62s} {'GiB':>7s}"]
    lines += [f"  {label:60s} {gib(value):>7s}" for label, value in parts]
    lines += ["", "per GPU at the moments that can be the peak:"]
    lines += [f"  {label:60s} {gib(value):>7s}" for label, value in moments]
    lines += [f"  {'peak':60s} {gib(est['peak']):>7s}", f"  {margin:60s} {gib(needed - est['peak']):>7s}",
              f"  {'needed':60s} {gib(needed):>7s}", "", f"verdict: {verdict} in {args.gpu_memory_gib:g} GiB per GPU"]
    if args.cpu_offload:
        lines.append(f"host RAM per node for the offloaded state: {gib(est['host_per_node'])} GiB")
    load = loading_bytes(shape)
    lines.append(f"note: while loading, rank 0 alone holds the whole fp32 model in host RAM: {gib(load)} GiB "
                 "(about 1.5 x that while it reads a bf16 checkpoint); the other ranks hold their shards plus "
                 "one tensor in flight (measured: 04_fsdp/measure_loading.py)")
    return "\n".join(lines)


def table(shape, source, args):
    """Markdown: 1, 2, 4 and 8 GPUs x each strategy. The GPUs fill nodes of --gpus_per_node;
    HYBRID_SHARD shards inside groups of --shard_group_size (default: a node)."""
    group = args.shard_group_size or args.gpus_per_node
    layout = (f"nodes of {args.gpus_per_node} GPUs; HYBRID_SHARD shards over groups of up to {group}; "
              f"fits = needed <= {args.gpu_memory_gib:g} GiB")
    header = ("| GPUs | strategy | params | grads | AdamW | gathered params + unsharded grads | activations "
              "| peak GiB | peak at | needed GiB | fits |")
    lines = [f"model: {source}: {shape.num_params:,} parameters", f"{setup_line(args)}; {layout}", "",
             header, "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for gpus in TABLE_GPUS:
        per_node, group_here = min(gpus, args.gpus_per_node), min(gpus, group)
        for strategy in STRATEGIES:
            if gpus % per_node or gpus % group_here:
                continue  # these GPUs do not fill whole nodes or groups
            est = estimate_for(shape, args, strategy, per_node, gpus // per_node, group_here)
            cells = [est["parameters"], est["gradients"], est["optimizer"],
                     est["unsharded_parameters"] + est["unsharded_gradients"],
                     est["activations_layers"] + est["activations_head"], est["peak"]]
            peak_at = next(label for key, label in PEAK_MOMENTS.items() if est[key] == est["peak"])
            verdict = "yes" if fits(est["peak"], args.gpu_memory_gib) else "no"
            lines.append(f"| {gpus} | {strategy} | " + " | ".join(f"{c / GiB:.1f}" for c in cells)
                         + f" | {peak_at} | {needed_bytes(est['peak']) / GiB:.1f} | {verdict} |")
    if args.cpu_offload:
        lines += ["", "With --cpu_offload the params, grads and AdamW columns are in host RAM, not on the GPU."]
    return "\n".join(lines)


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="The formulas: 04_fsdp/MEMORY.md, or the top of this file.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flag(parser, "model", default="codellama/CodeLlama-7b-hf",
             help="local directory with config.json, or a Hugging Face id in the local cache")
    add_flag(parser, "config", default=None, help="path to a config.json (instead of --model)")
    add_flag(parser, "gpus_per_node", type=int, default=4, help="GPUs (ranks) per node")
    add_flag(parser, "nodes", type=int, default=1, help="nodes")
    add_flag(parser, "sharding_strategy", choices=STRATEGIES, default="FULL_SHARD",
             help="FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2 (no re-shard after forward), "
                  "HYBRID_SHARD = shard in a node, replicate across nodes, NO_SHARD = replicate (DDP)")
    add_flag(parser, "shard_group_size", type=int, default=None,
             help="HYBRID_SHARD: GPUs per shard group (default: --gpus_per_node), as in train.py")
    add_flag(parser, "precision", choices=list(COMPUTE_BYTES), default="bf16",
             help="compute dtype (MixedPrecisionPolicy param_dtype); weights, grads and AdamW stay fp32")
    add_flag(parser, "max_seq_length", type=int, default=4096, help="tokens per row")
    add_flag(parser, "batch_size_per_device", type=int, default=1, help="rows per forward pass on each GPU")
    add_flag(parser, "gradient_accumulation_steps", type=int, default=1,
             help="micro-batches per optimizer step: above 1, gradients stay on the GPU through forward")
    add_flag(parser, "gradient_checkpointing", action="store_true", help="activation checkpointing per decoder layer")
    add_flag(parser, "cpu_offload", action="store_true", help="FSDP2 CPUOffloadPolicy: sharded state in host RAM")
    add_flag(parser, "attention", choices=["sdpa", "eager"], default="sdpa",
             help="sdpa (the default; flash-style kernels keep no s x s scores) or eager")
    add_flag(parser, "gpu_memory_gib", type=float, default=80.0, help="memory of one GPU")
    add_flag(parser, "table", action="store_true", help="markdown table: 1/2/4/8 GPUs x each strategy")
    return parser.parse_args(argv)


def check_arguments(args):
    for name in ("gpus_per_node", "nodes", "max_seq_length", "batch_size_per_device", "gradient_accumulation_steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.shard_group_size is not None:
        gpus = args.gpus_per_node * args.nodes
        if args.shard_group_size < 1 or gpus % args.shard_group_size:
            raise UserError(f"--shard_group_size {args.shard_group_size} does not divide the {gpus} GPUs")
    if not args.gpu_memory_gib > 0:
        raise UserError(f"--gpu_memory_gib must be positive (got {args.gpu_memory_gib:g})")


def main(argv=None):
    args = parse_arguments(argv)
    check_arguments(args)
    config, source = load_config(args.model, args.config)
    shape = model_shape(config, args.config or args.model)
    print(table(shape, source, args) if args.table else report(shape, source, args))


if __name__ == "__main__":
    exit_on_user_error(main)
