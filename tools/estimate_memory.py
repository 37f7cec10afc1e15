"""How much GPU memory will a step-4/5/6 job need? A per-GPU estimate from formulas, before you queue.

    python tools/estimate_memory.py --gpus_per_node 4 --nodes 1 --max_seq_length 4096
    python tools/estimate_memory.py --table --gradient_checkpointing     # 1/2/4/8 GPUs x strategies
    python tools/estimate_memory.py --lora --gpus_per_node 1             # step 5: LoRA adapters
    python tools/estimate_memory.py --tp_size 8 --gpus_per_node 8 --nodes 4 --max_seq_length 16384  # step 6
    python tools/estimate_memory.py --tp_table --model codellama/CodeLlama-70b-hf  # FSDP alone vs 2-D
    python tools/estimate_memory.py --model demo/model --gpus_per_node 2 --max_seq_length 256

The model is described by its config only: a local directory with config.json, a config.json, or
a Hugging Face id already in the local cache. Nothing is downloaded. For codellama/CodeLlama-7b-hf
the kit's copy of its config (benchmark/codellama-7b-config.json) is used when the cache lacks it,
and likewise for codellama/CodeLlama-70b-hf (benchmark/codellama-70b-config.json).
Its twin, tools/check_plan.py, measures the same job by running the training code on fake
tensors; 04_fsdp/MEMORY.md compares the two.

What is counted (per GPU, the way 04_fsdp/train.py and 05_lora/train.py train: fp32 model, FSDP2
`fully_shard` on every decoder layer and then on the root, MixedPrecisionPolicy(param_dtype=compute
dtype, reduce_dtype=fp32), AdamW created after sharding, zero_grad(set_to_none=True) after a step):

Parameter count. The model is built on the meta device from its config: exact shapes, no memory.

Sharded state (lives the whole run). fp32 parameters 4 B, fp32 gradients 4 B, AdamW exp_avg and
exp_avg_sq 8 B: 16 bytes per parameter, split N ways, N being the shard degree:
    FULL_SHARD, SHARD_GRAD_OP  N = all GPUs (gpus_per_node x nodes)
    HYBRID_SHARD               N = gpus_per_node, or --shard_group_size (sharded inside a node,
                               replicated across nodes)
    NO_SHARD                   N = 1 (every GPU keeps everything, like DDP)
FSDP2 cuts every parameter along dim 0 into N equal pieces, padding dim 0 up to a multiple of N,
so per GPU each parameter costs ceil(dim0 / N) x (product of the other dims) x bytes.
With --lora (step 5) the model's own weights are frozen, stored in the compute dtype (2 B each in
bf16, 4 in fp32; sharded), no gradient, no AdamW state; every target linear layer (in x out) gets
adapters A (r x in) and B (out x r), trainable: 16 B per adapter parameter. (At 64 ranks A's
r = 16 rows pad to one row per rank.)
With --qlora the frozen linear layers of the decoder are stored in 4 bits (NF4, torchao), sharded
like the rest with their quantization constants: 0.5 B per weight, one byte of scale per 64
weights and an fp32 factor per 256 scales (common/nf4.py). Embeddings, norms and lm_head are
stored in bf16, QLoRA's compute dtype.

Unsharded working set (forward and backward only), in the compute dtype c (2 B for bf16, 4 B
for fp32):
    parameters  FULL_SHARD, HYBRID_SHARD, NO_SHARD: the root unit (embeddings, final norm,
                lm_head; its forward wraps the whole model) + two decoder layers (the one running
                and the next one being gathered). 4-bit weights are gathered as they are stored.
                SHARD_GRAD_OP: layers stay gathered after forward until their backward, so at
                the turn from forward to backward the whole model is there: c x all parameters.
    gradients   one layer's gradients, copied to fp32 for the reduce-scatter: 4 B x its
                trainable parameters.
    --accumulate_unsharded (with more than one micro-batch per step): until the last micro-batch
                every unit stays gathered (c x all parameters, as SHARD_GRAD_OP) and every
                trainable parameter's gradient is kept whole in fp32, the reduce dtype: + 4 B x
                trainable parameters, on every GPU, whatever the shard degree.

Activations, counted for a Llama decoder layer (the bookkeeping of Korthikanti et al. 2022,
arXiv 2205.05198, redone for Llama's SwiGLU MLP, RMSNorm and no dropout), in bytes per token,
with h = hidden size, kv = key/value width (kv heads x head dim), i = MLP width, a = heads,
s = sequence length, b = batch size per GPU, V = vocabulary:
    attention  c x (3h + 2kv)   input of q/k/v projections, q, k and v, attention output
    MLP        c x (h + 4i)     input of gate/up, gate output, SiLU output, up output, product
    2 RMSNorms 2 x (4 + c) x h  each keeps its fp32 input and its normalised output
    per layer  bf16: 20h + 4kv + 8i bytes (CodeLlama-7b: 45.5 h, where Korthikanti's GPT layer
               has 34 h); SDPA/flash attention keeps no s x s matrix. With --attention eager add
               a x s x (4 + c) (fp32 softmax and its copy; 4 only for fp32) - Korthikanti's
               5 a s / h term.
    LoRA       the frozen norm weights need no normalised output (- 2 c h); a frozen linear
               layer without an adapter needs no input (- c h for q/k/v, gate/up, - c i for
               down); each adapter keeps A's output for B (+ c r).
    kept        s x b x layers x per-layer, or with --gradient_checkpointing only each layer's
                input, s x b x layers x c x h; then one layer's full activations while it is
                recomputed in backward. --gradient_checkpointing selective also keeps each
                layer's matmul and attention outputs (common/speed.py): + s x b x layers x
                c x (4h + 2kv + 2i) (q, k, v, attention, o, gate, up, down).
    head        forward: s x b x [(4 + 2c) x h + (c + 4 + 4) x V]: final norm, lm_head input, the
                logits, their fp32 copy for the loss (none for fp32) and the fp32 log-softmax
                that cross-entropy keeps; at the start of backward the log-softmax, its gradient
                and one temporary: s x b x [(4 + 2c) x h + 12 V]. (LoRA: 4 h instead of
                (4 + 2c) h, the norm and lm_head being frozen.) With --loss_chunk_size n the
                V terms count n tokens, not s x b: one chunk's logits at a time.
    backward   the gradients of one layer's activations: s x b x c x (2h + 4i) (fitted to what
               PyTorch's FSDPMemTracker measures; the kernels decide the exact figure).

Optimizer step. AdamW is fused (common/optim.py): one kernel that updates in place, no temporary.

--optimizer muon: Muon's momentum, 4 B per element of the decoder's trainable matrices (with LoRA
the adapters), AdamW's 8 B for the rest. During the step Muon holds one bucket of whole matrices
at a time (muon_step_bytes; on the GPU also with --cpu_offload): the step's temporary.

Peak per GPU: the largest of four moments. "State" is the sharded parameters and AdamW state,
plus the gradients of earlier micro-batches when accumulating (zero_grad(set_to_none) frees the
last step's):
    end of forward      state + kept activations + the head's (the root is re-sharded once the
                        forward returns; while lm_head runs it is gathered, with the logits only)
    start of backward   state + kept activations + the head's in backward
    backward            state + the root + the larger of (gathered layers + kept activations) at
                        the top layer and (one layer + what is left + the gradients of all layers
                        but the last) at the bottom one, + reduce-scatter buffer + the recomputed
                        layer + the backward temporaries. (Going down the layers, activations and,
                        with SHARD_GRAD_OP, gathered layers are freed as sharded gradients come.)
    optimizer step      sharded parameters, gradients and AdamW state + Muon's bucket
It fits when
    peak + 3 GiB (CUDA context, cuBLAS workspaces, NCCL buffers) + 10% of peak (allocator
    fragmentation, temporaries this model leaves out)  <=  --gpu_memory_gib.

--cpu_offload (FSDP2 CPUOffloadPolicy) keeps the sharded state in host RAM and runs the optimizer
step on the CPU (plain per-tensor loop, no big temporaries): the GPU keeps only the working set
and activations. Host RAM per node is then gpus_per_node x sharded state.

--tp_size t (step 6, 06_tp/train.py: tensor parallel over groups of t GPUs, FSDP over the
GPUs / t groups, FULL_SHARD or SHARD_GRAD_OP). Every parameter is first split by tensor parallelism
(q/k/v/gate/up and lm_head keep 1/t of their rows, o/down 1/t of their columns, the embedding 1/t
of its hidden columns; the norms stay whole on every rank), then that part is sharded by FSDP over
the dp = GPUs / t groups (dim 0 padded to a multiple of dp): the state is about 1/GPUs, as with
FULL_SHARD over all GPUs. Gathered weights and the reduce-scatter buffer are 1/t of a layer's.
Activations per token with sequence parallelism (h, kv, i, c as above):
    attention  c x h + c x (2h + 2kv) / t   the input of q/k/v all-gathered whole; q, k, v and the
                                            attention output of this rank's heads
    MLP        c x h + c x 4i / t           the input of gate/up whole; its part of the MLP
    2 RMSNorms 2 x (4 + c) x h / t          on this rank's part of the sequence
    checkpointed: each layer's input, a part of the sequence (c x h / t), the first layer's whole
    head       the final norm's on 1/t of the sequence, lm_head's input whole, the logits, their
               fp32 copy and log-softmax 1/t of the vocabulary (the loss on the parts); loss parallel's
               log-softmax is unfused: in forward one more fp32 copy (c + 4 + 8 bytes per logit in
               all), at the start of backward 24 bytes per logit where the fused kernel keeps 12
               (fitted to what FSDPMemTracker measures)
    backward   s x b x c x (2h + 4i / t)
At t = 1 these are the formulas above. Rows per forward pass: a tensor-parallel group shares them.
"""
import argparse
import itertools
import math
from collections import namedtuple
from pathlib import Path

import torch

from common.arguments import Parser, at_least
from common.batch import gradient_accumulation_steps
from common.errors import UserError, exit_on_user_error, first_line
from common.model import check_max_seq_length, config_warnings_refused
from common.optim import buckets
from common.speed import RECOMPUTATION
from common.tensor_parallel import check_tp_size

REPO = Path(__file__).resolve().parents[1]
GiB = 1024 ** 3
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
COMPUTE_BYTES = {"bf16": 2, "fp32": 4}  # the dtype FSDP gathers weights in and runs layers in
PARAM_BYTES, GRAD_BYTES, ADAMW_BYTES = 4, 4, 8  # fp32 master weights, fp32 gradients, exp_avg + exp_avg_sq
MUON_BYTES = 4  # --optimizer muon: one fp32 momentum buffer per matrix element
REDUCE_BYTES = 4  # MixedPrecisionPolicy(reduce_dtype=fp32)
# QLoRA: 4 bits per frozen weight, an 8-bit scale per 64 weights and an fp32 per 256 scales, all sharded
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
MARGIN_FIXED_GIB, MARGIN_FRACTION = 3.0, 0.10
TABLE_GPUS = [1, 2, 4, 8]
PEAK_MOMENTS = {"end_of_forward": "end of fwd", "start_of_backward": "start of bwd", "backward": "bwd",
                "optimizer_step": "step"}
MOMENT_LABELS = {"end_of_forward": "end of forward (the loss)", "start_of_backward": "start of backward (the loss's)",
                 "backward": "backward through the layers", "optimizer_step": "optimizer step"}
LORA_RANK, LORA_TARGETS = 16, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # 05_lora's defaults
# Which Llama linear layers need their input kept for backward (to compute their weight's gradient),
# and its width: h (hidden) or i (MLP). o_proj's input, the attention output, is kept by attention anyway.
LINEAR_INPUTS = {("q_proj", "k_proj", "v_proj"): "h", ("gate_proj", "up_proj"): "h", ("down_proj",): "i"}

# For codellama/CodeLlama-7b-hf the kit ships a copy of its config.json, so that the estimate and the
# plan check work with no cache at all.
BUILT_IN_CONFIGS = {"codellama/CodeLlama-7b-hf": REPO / "benchmark" / "codellama-7b-config.json",
                    "codellama/CodeLlama-70b-hf": REPO / "benchmark" / "codellama-70b-config.json"}

# One parameter as FSDP shards it: its shape, whether AdamW trains it, bytes per element as stored.
Param = namedtuple("Param", "shape trainable bytes")


# ---- the model: config -> parameter shapes ------------------------------------------------------

def load_config(model, trust_remote_code=False):
    """The model's config and a line saying where it came from: `model` is a directory with
    config.json, a config.json, or a Hugging Face id in the local cache. Never touches the network.
    A config that needs the model's own Python code (auto_map) is refused, unless trust_remote_code
    (tools/check_plan.py's option): that code is never run, nor asked about on the terminal."""
    from transformers import AutoConfig
    path = Path(model)

    def read(source, **kwargs):
        try:
            with config_warnings_refused(model):
                return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
        except ValueError as err:
            if "trust_remote_code" not in str(err):
                raise
            raise UserError(f"--model {model}: its config.json is for a model type transformers does not know, built "
                            "by the model's own Python code (auto_map), which is not run here: the figures are for "
                            "Llama-style models (tools/check_plan.py --trust_remote_code runs such code, if you "
                            "trust it)") from None

    if path.is_file() or path.is_dir():
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise UserError(f"--model {model}: the directory has no config.json")
        try:  # the model's own code is found in its folder, not beside a config.json alone
            return read(path if trust_remote_code and path.is_dir() else file), f"config {file}"
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise UserError(f"--model {model}: not a model config ({first_line(err)})") from None
    try:
        return read(model, local_files_only=True), f"{model} (local Hugging Face cache)"
    except (OSError, ValueError) as err:
        if model in BUILT_IN_CONFIGS:
            return (AutoConfig.from_pretrained(BUILT_IN_CONFIGS[model]),
                    f"{model} (not in the local Hugging Face cache: the kit's copy of its config, "
                    f"{BUILT_IN_CONFIGS[model].relative_to(REPO)})")
        raise UserError(f"--model {model}: not a local directory or config.json and not in the local Hugging Face "
                        f"cache ({first_line(err)}); download it with `python 01_download/download.py --model "
                        f"{model}`, or pass --model path/to/config.json") from None


class ModelShape:
    """What the estimate needs to know: parameter names and shapes per FSDP unit, and the layer sizes."""

    def __init__(self, name, root, layers, config):
        self.name = name
        self.root = root  # outside the decoder layers: [(parameter name, shape)] of embeddings, final norm, lm_head
        self.layers = layers  # per decoder layer: [(parameter name, shape)]
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_size = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * self.head_dim

    @property
    def root_shapes(self):
        return [shape for _, shape in self.root]

    @property
    def tp_divisible(self):
        """What tensor parallelism splits into equal parts: heads, key-value heads, the MLP's width."""
        return (self.num_heads, self.kv_size // self.head_dim, self.intermediate_size)

    @property
    def layer_shapes(self):
        return [[shape for _, shape in layer] for layer in self.layers]

    @property
    def all_shapes(self):
        return self.root_shapes + [shape for layer in self.layer_shapes for shape in layer]

    @property
    def num_layers(self):
        return len(self.layers)

    @property
    def num_params(self):
        return count(self.all_shapes)


def count(shapes):
    return sum(math.prod(shape) for shape in shapes)


def model_shape(config, name, trust_remote_code=False):
    """Build the model on the meta device: real shapes, no memory, no weights read."""
    from transformers import AutoModelForCausalLM
    for needed in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"):
        if getattr(config, needed, None) is None:
            raise UserError(f"{name}: the config has no {needed}; this estimate is for Llama-style decoders")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise UserError(f"{name}: no model.model.layers, which 04_fsdp shards one by one")
    in_layers = {id(p) for p in layers.parameters()}
    root = [(n, tuple(p.shape)) for n, p in model.named_parameters() if id(p) not in in_layers]
    return ModelShape(name, root, [[(n, tuple(p.shape)) for n, p in layer.named_parameters()]
                                   for layer in layers], config)


def linear_name(parameter_name):
    """"self_attn.q_proj.weight" -> "q_proj"; None for what is not a linear layer's weight."""
    parts = parameter_name.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-1] == "weight" and parts[-2].endswith("proj") else None


# Step 6's split of each parameter over a tensor-parallel group (06_tp/train.py's plans): the
# dimension cut into t parts. Norms (and anything else) stay whole on every rank of the group.
TP_ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")  # colwise: output features
TP_COLUMNS = ("o_proj", "down_proj", "embed_tokens")  # rowwise: input features; the embedding: hidden


def tp_part(name, shape, tp_size):
    """A parameter's shape on one rank of a tensor-parallel group of `tp_size` (the largest part,
    where a dimension does not divide)."""
    module = name.rsplit(".", 2)[-2] if "." in name else name  # "model.embed_tokens.weight": "embed_tokens"
    if module in TP_ROWS and shape:
        dim = 0  # weight and bias alike
    elif module in TP_COLUMNS and len(shape) == 2:
        dim = 1  # a rowwise layer's bias stays whole, like a norm
    else:
        return shape
    return tuple(math.ceil(size / tp_size) if d == dim else size for d, size in enumerate(shape))


def fsdp_units(shape, lora_rank=None, lora_targets=(), qlora=False, tp_size=1, frozen_bytes=PARAM_BYTES):
    """The FSDP units, root first, then one per decoder layer: lists of Params. Full fine-tuning
    trains everything; LoRA freezes the model, stored in the compute dtype (`frozen_bytes` each),
    and adds trainable A (r x in) and B (out x r) beside each target linear layer; QLoRA also
    stores the decoder's frozen linear weights in 4 bits. With tensor parallelism (step 6) each
    parameter is this rank's part of it (tp_part)."""
    lora = lora_rank is not None
    frozen = frozen_bytes if lora else PARAM_BYTES
    units = [[Param(tp_part(n, s, tp_size), not lora, frozen) for n, s in shape.root]]
    for layer in shape.layers:
        unit = []
        for name, (rows, *rest) in ((n, tp_part(n, s, tp_size)) for n, s in layer):
            linear = linear_name(name)
            unit.append(Param((rows, *rest), not lora, NF4_BYTES if qlora and linear else frozen))
            if lora and linear in lora_targets:
                unit += [Param((lora_rank, *rest), True, PARAM_BYTES), Param((rows, lora_rank), True, PARAM_BYTES)]
        units.append(unit)
    return units


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


def muon_matrices(units):
    """The shapes --optimizer muon gives Muon: the trainable matrices of the decoder layers (the
    embedding and the head, in the root unit, map tokens and stay AdamW's: common/optim.py)."""
    return [p.shape for unit in units[1:] for p in unit if p.trainable and len(p.shape) == 2]


def sharded_state_bytes(units, degree, optimizer="adamw"):
    """The per-GPU parameter, gradient and optimizer (AdamW's, or Muon's and AdamW's) bytes that
    live for the whole run."""
    params = [p for unit in units for p in unit]
    trainable = [p.shape for p in params if p.trainable]
    muon = muon_matrices(units) if optimizer == "muon" else []
    adamw = list(trainable)
    for shape in muon:
        adamw.remove(shape)
    stored = sum(sharded_bytes([p.shape], degree, p.bytes) for p in params)
    return {"parameters": int(stored),
            "gradients": sharded_bytes(trainable, degree, GRAD_BYTES),
            "optimizer": sharded_bytes(adamw, degree, ADAMW_BYTES) + sharded_bytes(muon, degree, MUON_BYTES)}


def muon_step_bytes(shapes, degree, compute_bytes):
    """Muon's buffers during its step on the busiest rank (common/optim.py). Sharded (degree > 1):
    per bucket, the whole matrices the rank owns (O elements) twice (received, and cut to go
    back), and Newton-Schulz on the largest (L elements, short side s): the matrix and two
    iterates, the Gram matrix and its update; in Newton-Schulz's dtype (bf16 on a GPU): the most
    of c x (2 O + 3 L + 2 s^2) over the buckets. Whole (degree 1): the fp32 momentum update, its
    cast and Newton-Schulz, one matrix at a time."""
    if not shapes:
        return 0
    if degree == 1:
        return max((PARAM_BYTES + compute_bytes) * math.prod(shape)
                   + compute_bytes * (3 * math.prod(shape) + 2 * min(shape) ** 2) for shape in shapes)
    most = 0
    for owned in buckets([math.prod(shape) for shape in shapes], degree):
        for indices in owned:
            mine = [shapes[i] for i in indices]
            if mine:
                largest = max(mine, key=math.prod)
                most = max(most, compute_bytes * (2 * sum(map(math.prod, mine)) + 3 * math.prod(largest)
                                                  + 2 * min(largest) ** 2))
    return most


# ---- what exists only while the model runs ------------------------------------------------------

def gathered_bytes(unit, compute_bytes):
    """A unit's weights once all-gathered: in the compute dtype, or 4-bit weights as stored."""
    return sum(math.prod(p.shape) * (p.bytes if p.bytes == NF4_BYTES else compute_bytes) for p in unit)


def layer_activation_bytes_per_token(shape, compute_bytes, attention, seq_length, lora_rank=None, lora_targets=(),
                                     tp_size=1):
    """What one decoder layer keeps for backward, per token (see the module docstring); with tensor
    parallelism over tp_size ranks, this rank's part (its heads, its part of the MLP and of the sequence)."""
    h, kv, i, c, t = shape.hidden_size, shape.kv_size, shape.intermediate_size, compute_bytes, tp_size
    attention_part = c * h + c * (2 * h + 2 * kv) / t  # the (gathered) input of q/k/v is whole
    mlp_part = c * h + c * 4 * i / t
    norms = 2 * (4 + c) * h / t  # RMSNorm computes in fp32 and keeps its fp32 input
    scores = 0
    if attention == "eager":  # softmax in fp32, then cast to c: the s x s matrices per head stay
        scores = shape.num_heads * seq_length * (4 + (c if c < 4 else 0)) / t
    total = attention_part + mlp_part + norms + scores
    if lora_rank is not None:
        total -= 2 * c * h  # frozen norm weights: their normalised output is not needed
        for linears, width in LINEAR_INPUTS.items():
            if not set(linears) & set(lora_targets):  # frozen, no adapter: the input is not needed
                total -= c * {"h": h, "i": i}[width]
        layer_linears = {linear_name(name) for name, _ in shape.layers[0]}
        total += c * lora_rank * len(layer_linears & set(lora_targets))  # A's output, kept for B
    return math.ceil(total)


def estimate(shape, strategy="FULL_SHARD", gpus_per_node=1, nodes=1, precision="bf16", seq_length=4096,
             batch_size=1, gradient_checkpointing=False, cpu_offload=False, attention="sdpa", accumulation=1,
             shard_group_size=None, accumulate_unsharded=False, lora_rank=None, lora_targets=(), qlora=False,
             optimizer="adamw", tp_size=1, loss_chunk_size=0):
    """Per-GPU bytes of every part, of the four moments that can be the peak, and the peak; host
    RAM per node for an offloaded state. All in bytes. lora_rank=None: full fine-tuning. The
    moments and their parts are those of the module docstring. tp_size > 1: step 6, FSDP over the
    gpus / tp_size data-parallel groups of this rank's tensor-parallel parts."""
    c, h, i, vocab = COMPUTE_BYTES[precision], shape.hidden_size, shape.intermediate_size, shape.vocab_size
    tokens, layers, lora, t = seq_length * batch_size, shape.num_layers, lora_rank is not None, tp_size
    degree = shard_degree(strategy, gpus_per_node, nodes, shard_group_size) // t
    units = fsdp_units(shape, lora_rank, lora_targets, qlora, t, frozen_bytes=c)
    state = sharded_state_bytes(units, degree, optimizer)
    keep = accumulate_unsharded and accumulation > 1  # until the last micro-batch nothing is re-sharded
    on_gpu = 0 if cpu_offload else 1  # offloaded: the sharded state is in host RAM

    # Gathered weights and whole gradients.
    root, layer = gathered_bytes(units[0], c), max(gathered_bytes(unit, c) for unit in units[1:])
    trainable = [sum(math.prod(p.shape) for p in unit if p.trainable) for unit in units]
    all_gathered = strategy == "SHARD_GRAD_OP" or keep  # no layer re-sharded after its forward
    layers_gathered = layers * layer if all_gathered else 2 * layer  # or: the one running, the next one
    kept_gradients = sum(trainable) * REDUCE_BYTES if keep else 0  # whole, in fp32, between micro-batches
    # In backward: one layer's fp32 reduce-scatter buffer (--accumulate_unsharded: its new gradient).
    unsharded_gradients = max(trainable[1:]) * (c if keep else REDUCE_BYTES)
    layer_gradients = sharded_bytes([p.shape for unit in units[1:] for p in unit if p.trainable], degree, GRAD_BYTES)

    # Activations.
    one_layer = tokens * layer_activation_bytes_per_token(shape, c, attention, seq_length, lora_rank, lora_targets, t)
    layer_input = math.ceil(tokens * c * h / t)  # tensor parallel: a part of the sequence (the first layer's: whole)
    kept_activations = (layers * layer_input + tokens * c * h - layer_input if gradient_checkpointing
                        else layers * one_layer)
    if gradient_checkpointing == "selective":  # and each layer's matmul and attention outputs (common/speed.py)
        kept_activations += layers * math.ceil(tokens * c * (4 * h + 2 * shape.kv_size + 2 * i) / t)
    recomputed = one_layer if gradient_checkpointing else 0  # one layer at a time, in backward (selective: less)
    # the final norm's fp32 input and its output (a part of the sequence), and lm_head's input (whole)
    norm = 4 * h if lora else math.ceil((4 + c) * h / t) + c * h
    upcast = 4 if c < 4 else 0  # the loss runs on an fp32 copy of the logits
    vocab_part = math.ceil(vocab / t)  # the loss on the parts (loss parallel)
    # Loss parallel computes the log-softmax in steps (x - max, its exp, the result: one more fp32 copy)
    # and its backward keeps twice the temporaries of the fused kernel (fitted to FSDPMemTracker's figures).
    parallel_loss = t > 1
    # --loss_chunk_size: the logits of one chunk of tokens at a time, in forward and again in backward
    logit_tokens = min(tokens, loss_chunk_size) if loss_chunk_size else tokens
    # logits, their fp32 copy, the log-softmax
    head_forward = tokens * norm + logit_tokens * (c + upcast + (8 if parallel_loss else 4)) * vocab_part
    lm_head_running = tokens * norm + logit_tokens * c * vocab_part  # logits only, while the root is still gathered
    # the log-softmax, its gradient and temporaries (fp32)
    head_backward = tokens * norm + logit_tokens * (24 if parallel_loss else 12) * vocab_part
    layer_backward = tokens * c * (2 * h + math.ceil(4 * i / t))  # gradients of a layer's output and its MLP's

    # fused AdamW keeps no temporary (common/optim.py); Muon's buckets on the GPU, with or without offload
    muon = muon_matrices(units) if optimizer == "muon" else []
    step_temporaries = muon_step_bytes(muon, degree, c)
    gradients_before = state["gradients"] if accumulation > 1 and not keep else 0  # earlier micro-batches'
    base = on_gpu * (state["parameters"] + state["optimizer"] + gradients_before) + kept_gradients
    growing = 0 if gradients_before or keep else on_gpu * layer_gradients * (layers - 1) // layers
    moments = {
        "end_of_forward": base + kept_activations + (layers * layer + root if all_gathered else 0)
        + max(head_forward, lm_head_running + (0 if all_gathered else root + layers_gathered)),
        "start_of_backward": base + kept_activations + head_backward + (root + layers * layer if all_gathered else 0),
        # Through the layers, top to bottom: gathered weights (and activations) go as gradients come.
        "backward": base + root + max(layers_gathered + kept_activations,
                                      (layers * layer if keep else layer) + kept_activations // layers + growing)
        + unsharded_gradients + recomputed + layer_backward,
        "optimizer_step": on_gpu * sum(state.values()) + step_temporaries,
    }
    host_per_node = gpus_per_node * sum(state.values()) if cpu_offload else 0
    return {**state, "gathered_parameters": root + layers_gathered,
            "unsharded_gradients": unsharded_gradients + kept_gradients, "activations_kept": kept_activations,
            "activations_recomputed": recomputed, "activations_head": max(head_forward, head_backward),
            "backward_temporaries": layer_backward, "optimizer_step_temporaries": step_temporaries, **moments,
            "peak": max(moments.values()), "host_per_node": host_per_node, "shard_degree": degree,
            "trainable_parameters": sum(trainable)}


def estimate_job(shape, args, gpus_per_node, nodes, lora=False, attention="sdpa", tp_size=None):
    """estimate() for a job's training arguments (04_fsdp's, 05_lora's with lora=True, or 06_tp's,
    whose tensor-parallel size is `tp_size` or else args.tp_size)."""
    tp_size = tp_size or getattr(args, "tp_size", None) or 1
    accumulation = gradient_accumulation_steps(args.total_batch_size, args.batch_size_per_device,
                                               gpus_per_node * nodes // tp_size)
    targets = args.lora_target_modules if lora else ()
    return estimate(shape, args.sharding_strategy, gpus_per_node, nodes, args.precision or "bf16",
                    args.max_seq_length, args.batch_size_per_device, args.gradient_checkpointing,
                    getattr(args, "cpu_offload", False), attention, accumulation,
                    getattr(args, "shard_group_size", None), args.accumulate_unsharded,
                    lora_rank=args.lora_rank if lora else None,
                    lora_targets=targets.split(",") if isinstance(targets, str) else targets,
                    qlora=lora and getattr(args, "qlora", False), optimizer=getattr(args, "optimizer", "adamw"),
                    tp_size=tp_size, loss_chunk_size=getattr(args, "loss_chunk_size", 0))


def needed_bytes(peak):
    """The peak plus the margin nothing above counts: CUDA context, NCCL, fragmentation."""
    return peak + MARGIN_FIXED_GIB * GiB + MARGIN_FRACTION * peak


def fits(peak, gpu_memory_gib):
    return needed_bytes(peak) <= gpu_memory_gib * GiB


def gpu_memory_default():
    """The memory of this machine's GPU, or 80 GiB (an A100/H100) where there is none."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB
    return 80.0


def loading_bytes(shape):
    """The whole fp32 model: what rank 0 alone holds in host RAM while train.py loads it (the
    other ranks build it on the meta device and receive their shards, one tensor at a time)."""
    return sharded_bytes(shape.all_shapes, 1, PARAM_BYTES)


# ---- printing -------------------------------------------------------------------------------------

OPTIMIZER_STATE = {"adamw": "AdamW exp_avg + exp_avg_sq", "muon": "Muon momentum, AdamW's moments"}
STEP_TEMPORARIES = {("adamw", False): "fused AdamW: none", ("adamw", True): "the step runs on the CPU",
                    ("muon", False): "Muon's bucket", ("muon", True): "Muon's bucket"}


def gib(n):
    return f"{n / GiB:.2f}"


def setup_line(args, accumulation):
    checkpointing = ("no activation checkpointing" if not args.gradient_checkpointing else
                     "selective activation checkpointing" if args.gradient_checkpointing == "selective"
                     else "activation checkpointing")
    if getattr(args, "loss_chunk_size", 0):
        checkpointing += f", the loss {args.loss_chunk_size} tokens at a time"
    if accumulation is None:  # a table: the accumulation follows from each row's GPU count
        micro = f"total batch {args.total_batch_size}" if args.total_batch_size else "1 micro-batch per step"
    else:
        micro = f"{accumulation} micro-batches per step" if accumulation > 1 else "1 micro-batch per step"
    unsharded = ", --accumulate_unsharded" if args.accumulate_unsharded else ""
    offload = ", CPU offload" if args.cpu_offload else ""
    tuning = "full fine-tuning" + (", Muon" if args.optimizer == "muon" else "")
    if args.lora:
        tuning = (f"{'QLoRA' if args.qlora else 'LoRA'} r={args.lora_rank} on {','.join(args.lora_target_modules)}"
                  + (", Muon" if args.optimizer == "muon" else ""))
    return (f"{tuning}, {args.precision} compute, sequence {args.max_seq_length}, batch "
            f"{args.batch_size_per_device} per GPU, {micro}{unsharded}, {checkpointing}, {args.attention} "
            f"attention{offload}")


def report(shape, source, args):
    """The human-readable estimate for one setup."""
    tp = args.tp_size or 1
    groups = args.gpus_per_node * args.nodes // tp  # the GPUs, or with tensor parallelism their groups
    args = argparse.Namespace(**{**vars(args), "total_batch_size": args.total_batch_size
                                 or args.batch_size_per_device * groups})
    est = estimate_job(shape, args, args.gpus_per_node, args.nodes, args.lora, args.attention)
    accumulation = gradient_accumulation_steps(args.total_batch_size, args.batch_size_per_device, groups)
    where = "host RAM" if args.cpu_offload else "fp32"
    share = f"1/{est['shard_degree']}" + (f" of a 1/{tp} tensor-parallel part" if tp > 1 else "")
    layers = f"{shape.num_layers} decoder layers, {'' if args.gradient_checkpointing else 'not '}checkpointed"
    if args.gradient_checkpointing == "selective":  # their matmul and attention outputs kept
        layers = layers.replace("checkpointed", "selectively checkpointed")
    keep = args.accumulate_unsharded and accumulation > 1
    gathered = "the whole model" if args.sharding_strategy == "SHARD_GRAD_OP" or keep else "root + 2 decoder layers"
    stored = f"{where}, {share}"
    if args.lora:  # the frozen weights in the compute dtype (05_lora/train.py: add_lora), the adapters in fp32
        stored = (("host RAM, " if args.cpu_offload else "") + f"{share}; frozen in {args.precision}"
                  + (", 4-bit linear layers" if args.qlora else "") + "; adapters fp32")
    unsharded = "whole fp32 gradients + one layer's new ones" if keep else "one layer's fp32 reduce-scatter buffer"
    parts = [
        (f"parameters ({stored})", est["parameters"]),
        (f"gradients ({where}, {share}, trainable parameters)", est["gradients"]),
        (f"optimizer state ({OPTIMIZER_STATE[args.optimizer]}, {where}, {share})", est["optimizer"]),
        (f"gathered parameters ({args.precision}: {gathered})", est["gathered_parameters"]),
        (f"unsharded gradients ({unsharded})", est["unsharded_gradients"]),
        (f"activations ({layers})", est["activations_kept"]),
        ("activations of the layer recomputed in backward", est["activations_recomputed"]),
        ("activations (final norm, logits, loss)", est["activations_head"]),
        ("backward temporaries (gradients of one layer's activations)", est["backward_temporaries"]),
        (f"optimizer step temporaries ({STEP_TEMPORARIES[args.optimizer, args.cpu_offload]})",
         est["optimizer_step_temporaries"]),
    ]
    moments = [(label, est[key]) for key, label in MOMENT_LABELS.items()]
    needed = needed_bytes(est["peak"])
    margin = f"margin ({MARGIN_FIXED_GIB:g} GiB CUDA context/NCCL + {MARGIN_FRACTION:.0%} fragmentation)"
    layout = f"{args.sharding_strategy} on {args.nodes} node(s) x {args.gpus_per_node} GPU(s)" + (
        f", tensor parallel over {tp} (step 6: mesh {groups} x {tp})" if tp > 1 else "")
    verdict = "fits" if fits(est["peak"], args.gpu_memory_gib) else "does NOT fit"
    lines = [f"model: {source}: {shape.num_params:,} parameters, {est['trainable_parameters']:,} trained",
             f"{layout}; shard degree {est['shard_degree']}", setup_line(args, accumulation), "",
             f"{'per GPU':62s} {'GiB':>7s}"]
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
                 "one tensor in flight (measured: tools/measure_loading.py)")
    return "\n".join(lines)


def table(shape, source, args):
    """Markdown: 1, 2, 4 and 8 GPUs x each strategy. The GPUs fill nodes of --gpus_per_node;
    HYBRID_SHARD shards inside groups of --shard_group_size (default: a node)."""
    group = args.shard_group_size or args.gpus_per_node
    layout = (f"nodes of {args.gpus_per_node} GPUs; HYBRID_SHARD shards over groups of up to {group}; "
              f"fits = needed <= {args.gpu_memory_gib:g} GiB")
    header = ("| GPUs | strategy | params | grads | AdamW | gathered params + unsharded grads | activations "
              "| peak GiB | peak at | needed GiB | fits |")
    lines = [f"model: {source}: {shape.num_params:,} parameters", f"{setup_line(args, None)}; {layout}", "",
             header, "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for gpus in TABLE_GPUS:
        per_node, group_here = min(gpus, args.gpus_per_node), min(gpus, group)
        for strategy in STRATEGIES:
            if gpus % per_node or gpus % group_here:
                continue  # these GPUs do not fill whole nodes or groups
            total = args.total_batch_size or args.batch_size_per_device * gpus
            if total % (args.batch_size_per_device * gpus):
                continue  # the total batch does not split over these GPUs
            job = argparse.Namespace(**{**vars(args), "sharding_strategy": strategy, "shard_group_size": group_here,
                                        "total_batch_size": total})
            est = estimate_job(shape, job, per_node, gpus // per_node, args.lora, args.attention)
            cells = [est["parameters"], est["gradients"], est["optimizer"],
                     est["gathered_parameters"] + est["unsharded_gradients"],
                     est["activations_kept"] + est["activations_recomputed"] + est["activations_head"], est["peak"]]
            peak_at = next(label for key, label in PEAK_MOMENTS.items() if est[key] == est["peak"])
            verdict = "yes" if fits(est["peak"], args.gpu_memory_gib) else "no"
            lines.append(f"| {gpus} | {strategy} | " + " | ".join(f"{c / GiB:.1f}" for c in cells)
                         + f" | {peak_at} | {needed_bytes(est['peak']) / GiB:.1f} | {verdict} |")
    if args.cpu_offload:
        lines += ["", "With --cpu_offload the params, grads and AdamW columns are in host RAM, not on the GPU."]
    return "\n".join(lines)


TP_TABLE_NODES, TP_TABLE_SEQUENCES = (1, 2, 4), (4096, 16384)


def tp_table(shape, source, args):
    """Markdown: where tensor parallelism is what makes a job fit. 1, 2 and 4 nodes of --gpus_per_node
    GPUs, one row per GPU and step, at sequence 4,096 and 16,384: FSDP alone (step 4, FULL_SHARD over
    every GPU) against step 6 (tensor parallel over each node's GPUs, FSDP across nodes), with and
    without activation checkpointing. A cell: GiB needed per GPU (peak + margin), and whether it fits."""
    per_node = args.gpus_per_node
    columns = [("FSDP", None, False), ("FSDP + checkpointing", None, True), (f"TP {per_node} × FSDP", per_node, False),
               (f"TP {per_node} × FSDP + checkpointing", per_node, True)]
    lines = [f"model: {source}: {shape.num_params:,} parameters; {args.precision} compute, batch "
             f"{args.batch_size_per_device} row per GPU (TP: per group), 1 micro-batch per step, full fine-tuning; "
             f"nodes of {per_node} GPUs of {args.gpu_memory_gib:g} GiB. GiB needed per GPU (peak + margin):", "",
             "| nodes × GPUs | sequence | " + " | ".join(name for name, _, _ in columns) + " |",
             "|---|---:|" + "---:|" * len(columns)]
    for nodes, seq_length in itertools.product(TP_TABLE_NODES, TP_TABLE_SEQUENCES):
        cells = []
        for _, tp_size, checkpointing in columns:
            groups = per_node * nodes // (tp_size or 1)
            job = argparse.Namespace(**{**vars(args), "sharding_strategy": "FULL_SHARD", "shard_group_size": None,
                                        "tp_size": tp_size, "max_seq_length": seq_length, "lora": False,
                                        "gradient_checkpointing": checkpointing, "cpu_offload": False,
                                        "total_batch_size": args.batch_size_per_device * groups})
            peak = estimate_job(shape, job, per_node, nodes)["peak"]
            cells.append(f"{needed_bytes(peak) / GiB:.1f} {'fits' if fits(peak, args.gpu_memory_gib) else 'no'}")
        lines.append(f"| {nodes} × {per_node} | {seq_length:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_job_options(parser):
    """The options that describe a job, named as the training scripts name them (shared with check_plan.py)."""
    parser.add("model", default="codellama/CodeLlama-7b-hf",
               help="local directory with config.json, a config.json, or a Hugging Face id in the local cache")
    parser.add("gpus_per_node", type=int, default=4, help="GPUs (ranks) per node")
    parser.add("nodes", type=int, default=1, help="nodes")
    parser.add("sharding_strategy", choices=STRATEGIES, default="FULL_SHARD",
               help="FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2 (no re-shard after forward), "
                    "HYBRID_SHARD = shard in a node, replicate across nodes, NO_SHARD = replicate (DDP)")
    parser.add("shard_group_size", type=int, default=None,
               help="HYBRID_SHARD: GPUs per shard group (default: --gpus_per_node), as in train.py")
    parser.add("precision", choices=list(COMPUTE_BYTES), default="bf16",
               help="compute dtype (MixedPrecisionPolicy param_dtype); weights, grads and AdamW stay fp32")
    parser.add("max_seq_length", type=int, default=4096, help="tokens per row")
    parser.add("batch_size_per_device", type=int, default=1, help="rows per forward pass on each GPU")
    parser.add("total_batch_size", type=int, default=None,
               help="rows per optimiser step over all GPUs (default: one micro-batch per GPU, no accumulation)")
    parser.add("gradient_checkpointing", nargs="?", const="full", default=None, choices=RECOMPUTATION,
               help="activation checkpointing per decoder layer, as train.py's: full (the flag alone) or selective")
    parser.add("loss_chunk_size", type=at_least(0), default=0,
               help="as train.py's: the loss this many tokens at a time (0: the whole micro-batch's logits)")
    parser.add("cpu_offload", action="store_true", help="FSDP2 CPUOffloadPolicy: sharded state in host RAM")
    parser.add("accumulate_unsharded", action="store_true",
               help="keep gathered weights and whole fp32 gradients between micro-batches, as train.py's option")
    parser.add("optimizer", choices=["adamw", "muon"], default="adamw",
               help="as train.py's: adamw, or muon (Muon for the decoder's matrices or LoRA's adapters, AdamW for "
                    "the rest)")
    parser.add("tp_size", type=int, default=None,
               help="step 6: GPUs that split each layer (tensor parallel), FSDP over the rest (default: none, step 4)")
    parser.add("lora", action="store_true", help="step 5: LoRA adapters on a frozen model")
    parser.add("lora_rank", type=int, default=LORA_RANK, help="with --lora: rank r of the adapters")
    parser.add("lora_target_modules", default=LORA_TARGETS, help="with --lora: linear layers that get adapters")
    parser.add("gpu_memory_gib", type=float, default=None,
               help="memory of one GPU (default: this machine's GPU, else 80)")


def check_job_options(args):
    """Refuse what cannot be a job; fill in the defaults that depend on other options."""
    for name in ("gpus_per_node", "nodes", "max_seq_length", "batch_size_per_device", "lora_rank"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    gpus = args.gpus_per_node * args.nodes
    if args.shard_group_size is not None and (args.shard_group_size < 1 or gpus % args.shard_group_size):
        raise UserError(f"--shard_group_size {args.shard_group_size} does not divide the {gpus} GPUs")
    if args.tp_size is not None:
        if args.tp_size < 1 or gpus % args.tp_size:
            raise UserError(f"--tp_size {args.tp_size} does not divide the {gpus} GPUs into tensor-parallel groups")
        if args.lora or args.cpu_offload or args.sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            raise UserError("--tp_size is step 6: FSDP FULL_SHARD or SHARD_GRAD_OP over the tensor-parallel groups, "
                            "without --lora, --cpu_offload, HYBRID_SHARD or NO_SHARD")
        gpus //= args.tp_size  # the groups share out the batch
    if args.total_batch_size is not None:  # default: one micro-batch per GPU
        gradient_accumulation_steps(args.total_batch_size, args.batch_size_per_device, gpus)  # refuses a bad split
    args.lora_target_modules = [name.strip() for name in args.lora_target_modules.split(",") if name.strip()]
    if not args.lora_target_modules:
        raise UserError("--lora_target_modules names no layer")
    if args.gpu_memory_gib is None:
        args.gpu_memory_gib = gpu_memory_default()
    if not (math.isfinite(args.gpu_memory_gib) and args.gpu_memory_gib > 0):
        raise UserError(f"--gpu_memory_gib must be positive (got {args.gpu_memory_gib:g})")


def parse_arguments(argv=None):
    parser = Parser(__doc__.split("\n\n")[0])
    parser.epilog = "The formulas: 04_fsdp/MEMORY.md, or the top of this file."
    add_job_options(parser)
    parser.add("qlora", action="store_true", help="with --lora: the frozen linear layers stored in 4 bits (NF4)")
    parser.add("attention", choices=["sdpa", "eager"], default="sdpa",
               help="sdpa (the default; flash-style kernels keep no s x s scores) or eager")
    parser.add("table", action="store_true", help="markdown table: 1/2/4/8 GPUs x each strategy")
    parser.add("tp_table", action="store_true",
               help="markdown table: 1, 2 and 4 nodes of --gpus_per_node GPUs at sequence 4096 and 16384, FSDP alone "
                    "against tensor parallel over each node's GPUs x FSDP across nodes, with and without checkpointing")
    args = parser.parse_args(argv)
    check_job_options(args)
    if args.qlora and not args.lora:
        raise UserError("--qlora is LoRA over a 4-bit model: add --lora")
    return args


def main(argv=None):
    args = parse_arguments(argv)
    config, source = load_config(args.model)
    shape = model_shape(config, args.model)
    check_max_seq_length(config, args.max_seq_length, args.model)  # no verdict on rows the model cannot take
    if args.tp_size:
        check_tp_size(args.tp_size, args.gpus_per_node * args.nodes, config, args.model)
    if args.tp_table:
        for seq_length in TP_TABLE_SEQUENCES:
            check_max_seq_length(config, seq_length, args.model)
        check_tp_size(args.gpus_per_node, args.gpus_per_node, config, args.model)
        print(tp_table(shape, source, args))
        return
    print(table(shape, source, args) if args.table else report(shape, source, args))


if __name__ == "__main__":
    exit_on_user_error(main)
