"""Will a step-4/5/6 job fit in GPU memory? The plan check runs the job's own code on fake tensors.

    python tools/check_plan.py --gpus_per_node 8 --nodes 8 --max_seq_length 4096 --gradient_checkpointing
    python tools/check_plan.py --gpus_per_node 1 --lora --json       # step 5 on one GPU, as JSON
    python tools/check_plan.py --gpus_per_node 8 --nodes 2 --tp_size 8 --max_seq_length 16384  # step 6
    python tools/check_plan.py --model demo/model --gpus_per_node 2 --max_seq_length 256
    python tools/check_plan.py --compare_table                       # CodeLlama-7b, next to estimate_memory.py

No GPU is needed and no weights are read: only the model's config (`--model` is a local directory,
a config.json, or a Hugging Face id in the local cache; for codellama/CodeLlama-7b-hf the kit's
copy of its config serves when the cache lacks it). CodeLlama-7b on 64 ranks takes about 20 s of
CPU and 0.4 GiB of RAM. Exit status 1 when the job does not fit; 04_fsdp/MEMORY.md has more.

How. PyTorch's FakeTensorMode gives tensors shapes and dtypes but no memory, and a fake process
group lets this process be rank 0 of a job of 1 to 512 ranks. The model is made as every rank of
a real run makes it (common/sharded_loading.py): built from its config on the meta device,
prepared and sharded by the training scripts' own functions (04_fsdp/train.py's build_mesh,
shard_model and precision policy; 05_lora/train.py's, with its add_lora, for --lora; 06_tp/train.py's
2-D mesh and parallelize_and_shard for --tp_size, the fake group split into its dp x tp groups;
activation checkpointing, CPU offload), then given storage: fake storage here. Two optimiser steps of the
job's micro-batches then run as train.py runs them, with its AdamW, under PyTorch's
FSDPMemTracker, which files every live tensor under a category: sharded and gathered parameters,
gradients, AdamW state, activations, backward temporaries, all-gather and reduce-scatter buffers.

What counts is the second step:
  * step 1 takes one micro-batch, so that AdamW's state exists. It is not measured: fake tensors
    over-count the first call of a few operations (AdamW's lazy state, gradient clipping); with
    real tensors step 1 never holds more than step 2, and step 2's figures are the same with
    fake and real tensors (checked on the demo model).
  * step 2 runs the micro-batches with the step script's own train_step, as the job does (with
    --accumulate_unsharded's switches). Those after the second repeat its memory exactly, so only
    the first, the second and the last run.
  * AdamW on a GPU is fused (common/optim.py): one kernel that updates every tensor in place, with
    no temporary copy. The check runs it fused too (fake tensors run its kernel). With --cpu_offload
    the step runs on the CPU, fused as there.
  * no attention mask: rows are packed, and Hugging Face, given a mask of ones, uses none.
The peak is rank 0's (it holds the largest shards when a dimension does not divide evenly).

What it cannot see, and the margin for it. The tracker counts tensors. The CUDA context and
cuBLAS workspaces (about 1 GiB) and NCCL's buffers (more with more ranks) are not tensors, and
PyTorch's caching allocator holds more than is allocated (fragmentation, typically 5 to 15 %);
attention runs the CPU's kernel, which like FlashAttention keeps no s x s matrix but has its own
temporaries. The verdict therefore adds estimate_memory.py's margin, 3 GiB + 10 % of the peak,
before comparing with --gpu_memory_gib (default: this machine's GPU, else 80).

With --cpu_offload the fake run has a single device, the CPU: the sharded parameters, gradients
and AdamW state (and the optimizer step) that the real job keeps in host RAM are left out of the
GPU figure and reported as host RAM.

It also predicts the job's time, and the `--time` to ask for (tools/job_time.py, its `time:` line);
with --time_limit (the templates give the job's time left), a job that limit would end before its
first checkpoint is refused.
"""
import argparse
import gc
import itertools
import json
import math
import sys
import time
import warnings
from contextlib import nullcontext
from datetime import date

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from common.arguments import Parser, at_least, check_arguments
from common.batch import gradient_accumulation_steps
from common.errors import UserError, exit_on_user_error, first_line
from common.metrics import PEAK_BF16_FLOPS, flops_per_token, forward_flops_per_token
from common.model import build_model, check_max_seq_length
from common.nf4 import quantize_frozen_linears, stored_bytes
from common.optim import make_optimizer
from common.sharded_loading import give_storage
from common.speed import prepare_layers
from common.tensor_parallel import check_step_arguments, tp_size_for
from launch.steps import check_training_arguments, load_step
from tools import estimate_memory, job_time

GiB = 1024 ** 3
MAX_RANKS = 512

# torchao's NF4 (QLoRA) checks after each all-gather that it got FSDP's buffer, by data pointers: on fake
# tensors each check warns, harmlessly.
warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")

# FSDPMemTracker's categories, in the order they are reported, with the names used here.
CATEGORIES = {"Sharded Param": "parameters", "Sharded Grad": "gradients", "OptState": "optimizer_state",
              "Unsharded Param": "gathered_parameters", "Unsharded Grad": "unsharded_gradients",
              "All Gather": "all_gather_buffers", "Reduce Scatter": "reduce_scatter_buffers",
              "Activation": "activations", "Temp": "backward_temporaries", "Buffer": "buffers", "Inputs": "inputs"}
LABELS = {"parameters": "parameters (fp32 shards)", "gradients": "gradients (fp32 shards)",
          "optimizer_state": "AdamW exp_avg + exp_avg_sq (fp32 shards)",
          "optimizer_temporaries": "optimizer step temporaries",
          "gathered_parameters": "gathered parameters (compute dtype)",
          "unsharded_gradients": "unsharded gradients", "all_gather_buffers": "all-gather buffers",
          "reduce_scatter_buffers": "reduce-scatter buffers (fp32)", "activations": "activations",
          "backward_temporaries": "backward temporaries (activations' gradients, recomputed layer)",
          "buffers": "buffers (RoPE tables)", "inputs": "inputs (token ids and labels)"}
# Where the real job keeps them with --cpu_offload: host RAM, not the GPU.
OFFLOADED = ("Sharded Param", "Sharded Grad", "OptState")


class PlanUnavailable(UserError):
    """The plan check cannot run this job (an architecture it cannot shard or build on fake
    tensors): say so, and let the job go ahead unchecked."""


LORA_DEFAULTS = {"lora_rank": estimate_memory.LORA_RANK, "lora_target_modules": estimate_memory.LORA_TARGETS}


# ---- the measurement ------------------------------------------------------------------------------

class PhaseTracker(FSDPMemTracker):
    """FSDPMemTracker that also keeps, for each phase of the loop ("step 2, forward of micro-batch
    1 of 1", ...), the most memory the GPU held during it and the categories at that moment."""

    def __init__(self, model, optimizer, on_host):
        super().__init__(model, optimizer)
        self.on_host = [_FSDPRefType(name) for name in on_host]  # kept in host RAM by the real job
        self.phase = None  # None: not measured
        self.phase_peaks = {}  # phase -> (GPU bytes, {category name: bytes})

    def _update_peak_stats(self, peak_state):
        # Called after every operation. In place of the tracker's own per-module peaks (a walk over
        # all modules each time: a fifth of the run time), one peak per phase of the loop.
        if self.phase is None:
            return
        for snapshot in self._curr_mem_snap.values():  # one device: the CPU stands in for the GPU
            on_gpu = snapshot["Total"] - sum(snapshot.get(key, 0) for key in self.on_host)
            if on_gpu > self.phase_peaks.get(self.phase, (-1, None))[0]:
                self.phase_peaks[self.phase] = (on_gpu, {getattr(key, "value", key): value
                                                         for key, value in snapshot.items()})


def state_bytes(model, optimizer):
    """Rank 0's parameters, gradients and AdamW state, after the optimiser step."""
    params = list(model.parameters())
    return {"parameters": sum(stored_bytes(p) for p in params),
            "gradients": sum(stored_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(stored_bytes(value) for state in optimizer.state.values()
                             for name, value in state.items() if name != "step")}


def build(args, step, mesh, config, fake_mode, accumulation):
    """The model as the step script prepares it, sharded, with fake storage; and its AdamW.
    As common/sharded_loading.py does on every rank: build and prepare the model on the meta
    device, shard it, then give it storage (here fake storage: to_empty under FakeTensorMode)."""
    module = load_step(step)
    with torch.device("meta"):
        try:
            model = build_model(config, args.trust_remote_code)
        except Exception as err:  # whatever the architecture's code raises: the check cannot run, the job may
            raise PlanUnavailable(f"cannot build {args.model} from its config ({first_line(err)})") \
                from None
        prepare_layers(model, args, compile_layers=False)  # before sharding, as in train.py
        precision = args.precision or "bf16"  # what train.py uses on a GPU
        if step == "lora":
            model = module.add_lora(model, args, module.PRECISIONS[precision])
    try:
        module.decoder_layers(model)
    except UserError as err:
        raise PlanUnavailable(str(err)) from None
    mp_policy = MixedPrecisionPolicy(param_dtype=module.PRECISIONS[precision], reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=False) if args.cpu_offload else OffloadPolicy()  # no pinning without CUDA
    if step == "tp":  # tensor parallel over mesh["tp"], then FSDP over mesh["dp"]
        module.parallelize_and_shard(model, mesh, args.sharding_strategy, mp_policy)
    elif getattr(args, "qlora", False):  # as the job loads it: unit by unit, each layer's linear weights in 4 bits
        def load_unit(unit):
            with fake_mode:
                give_storage(model, unit, lambda name, tensor: torch.empty_like(tensor, device="cpu"))
                if unit is not model:
                    quantize_frozen_linears(unit)
        module.shard_model(model, mesh, args.sharding_strategy, mp_policy, offload, load_unit)
    else:
        module.shard_model(model, mesh, args.sharding_strategy, mp_policy, offload)
    if args.accumulate_unsharded and accumulation > 1:  # as train.py: gathered once per optimiser step
        model.set_reshard_after_forward(False)
    with fake_mode:
        if not getattr(args, "qlora", False):  # QLoRA's units have their (fake) storage already
            model.to_empty(device="cpu")
        # AdamW fused, Muon's Newton-Schulz in bf16, as on a GPU.
        optimizer = make_optimizer(model, args, newton_schulz_dtype=torch.bfloat16)
    return model, optimizer


def run_steps(module, model, optimizer, tracker, args, world_size, accumulation, vocab_size, last_argument):
    """Two optimiser steps, each by the step script's own train_step (its last argument
    `last_argument`: steps 4 and 5's autocast, step 6's data-parallel mesh); the tracker measures the
    second. Hooks name the phase the memory belongs to: the root module's forward starts a
    micro-batch's forward, the gradient reaching its logits starts that micro-batch's backward."""
    rows, length = args.batch_size_per_device, args.max_seq_length
    measured, micro_batch_count = [False], [0]

    def phase(name):
        tracker.phase = name if measured[0] else None

    def forward_starts(_module, _inputs):
        micro_batch_count[0] += 1
        tracker.reset_mod_stats()  # FSDPMemTracker's module statistics hold one forward at a time
        phase(f"step 2, forward of {micro_batch_name()}")

    def forward_ends(_module, _inputs, output):
        name = micro_batch_name()
        output.logits.register_hook(lambda grad: phase(f"step 2, backward of {name}"))

    def micro_batch_name():
        number = micro_batch_count[0]  # the third run is the job's last
        return f"micro-batch {accumulation if number == 3 else number} of {accumulation}"

    def optimizer_step_starts(*_):
        phase("step 2, optimizer step")

    def optimizer_step_ends(*_):
        if measured[0]:  # before train_step's zero_grad: the gradients are still there
            state.update(state_bytes(model, optimizer))

    def micro_batch():
        # Packed rows have no padding: given a mask of ones, Hugging Face runs causal attention with
        # no mask at all. It cannot tell ones on fake tensors and would keep an s x s mask in every
        # layer, so the check passes no mask, which takes the same path.
        ids = torch.randint(0, vocab_size, (rows, length))
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": None}

    state = {}
    hooks = [model.register_forward_pre_hook(forward_starts, prepend=True),  # before FSDP's own
             model.register_forward_hook(forward_ends),
             optimizer.register_step_pre_hook(optimizer_step_starts),
             optimizer.register_step_post_hook(optimizer_step_ends)]
    # Step 1 takes one micro-batch, so that AdamW's state exists. Step 2 takes the job's micro-batches;
    # those between the second and the last repeat the second's memory exactly, so it runs three at most
    # (train_step tells the last by its position, as in the job).
    for measured[0], count in ((False, 1), (True, min(accumulation, 3))):
        micro_batch_count[0] = 0
        batches = [micro_batch() for _ in range(count)]  # train.py moves a step's micro-batches at once
        tracker.track_inputs((batches,))
        module.train_step(model, optimizer, batches, args, torch.device("cpu"), last_argument)
    tracker.phase = None
    for hook in hooks:
        hook.remove()
    return state


def plan(args, gpus_per_node, nodes=1, step="fsdp", gpu_memory_gib=None):
    """Rank 0's memory for the job that `args` (04_fsdp's, 05_lora's or 06_tp's parsed training
    arguments) describes, on `nodes` x `gpus_per_node` GPUs; a dict of bytes, the peak's moment and
    the verdict. Raises PlanUnavailable where the check cannot run, UserError for a job that cannot start."""
    started = time.perf_counter()
    if step not in ("fsdp", "lora", "tp"):
        raise PlanUnavailable(f"the plan check is for the FSDP steps (fsdp, lora, tp), not {step}")
    world_size = gpus_per_node * nodes
    if not 1 <= world_size <= MAX_RANKS:
        raise UserError(f"the plan check runs 1 to {MAX_RANKS} ranks (got {nodes} x {gpus_per_node} = {world_size})")
    if dist.is_initialized():
        raise PlanUnavailable("a process group is already running in this process")
    config, source = estimate_memory.load_config(args.model, args.trust_remote_code)
    # Step 6 has none of CPU offload, HYBRID_SHARD's groups or QLoRA; a tensor-parallel group shares its rows.
    args = argparse.Namespace(**{"cpu_offload": False, "shard_group_size": None, "tp_size": None, **vars(args)})
    tp_size = tp_size_for(args, config, world_size, gpus_per_node, on_gpu=True) if step == "tp" else 1
    accumulation = gradient_accumulation_steps(args.total_batch_size, args.batch_size_per_device,
                                               world_size // tp_size)
    gpu_memory_gib = estimate_memory.gpu_memory_default() if gpu_memory_gib is None else gpu_memory_gib
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        # The mesh outside fake mode: making it runs real (fake-backend) collectives on real tensors.
        if step == "tp":
            mesh = load_step(step).build_mesh("cpu", world_size, tp_size)
        else:
            mesh = load_step(step).build_mesh(args.sharding_strategy, "cpu", world_size,
                                              args.shard_group_size or gpus_per_node)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # to_empty reads the meta model's tensors
        model, optimizer = build(args, step, mesh, config, fake_mode, accumulation)
        # A model the check can build: rows longer than its positions are a job that cannot start, not a fit.
        check_max_seq_length(config, args.max_seq_length, args.model)
        with fake_mode:
            tracker = PhaseTracker(model, optimizer, OFFLOADED if args.cpu_offload else ())
            try:
                with tracker:
                    state = run_steps(load_step(step), model, optimizer, tracker, args, world_size, accumulation,
                                      config.vocab_size, mesh["dp"] if step == "tp" else nullcontext())
            except Exception as err:  # an operation fake tensors cannot run: unchecked, not refused
                raise PlanUnavailable(f"the model's code failed on fake tensors ({type(err).__name__}: "
                                      f"{first_line(err)})") from None
            parameters = sum(p.numel() for p in model.parameters())
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            flops = flops_per_token(model, args.max_seq_length), forward_flops_per_token(model, args.max_seq_length)
            phase_peaks = tracker.phase_peaks
            del model, optimizer, tracker
    finally:
        gc.collect()  # FSDP modules sit in reference cycles: free them while the group exists
        dist.destroy_process_group()
    result = summarise(phase_peaks, state, offloaded=args.cpu_offload)
    result.update(
        model=source, parameters=parameters, trainable_parameters=trainable, step=step, ranks=world_size,
        gpus_per_node=gpus_per_node, nodes=nodes, sharding_strategy=args.sharding_strategy, tp_size=tp_size,
        shard_group_size=args.shard_group_size or gpus_per_node, precision=args.precision or "bf16",
        max_seq_length=args.max_seq_length, batch_size_per_device=args.batch_size_per_device,
        accumulation=accumulation, gradient_checkpointing=args.gradient_checkpointing, cpu_offload=args.cpu_offload,
        accumulate_unsharded=args.accumulate_unsharded, optimizer=args.optimizer, gpu_memory_gib=gpu_memory_gib,
        needed=estimate_memory.needed_bytes(result["peak"]),
        fits=estimate_memory.fits(result["peak"], gpu_memory_gib))
    # The formulas' figures for the same job, and, where it does not fit, the changes that would fit
    # (none where the formulas do not know the model: they are written for Llama-style decoders).
    result.update(estimate=None, would_fit_with=[])
    try:
        shape = estimate_memory.model_shape(config, args.model, args.trust_remote_code)
    except UserError:
        shape = None
    if shape is not None:
        result["estimate"] = estimate_memory.estimate_job(shape, args, gpus_per_node, nodes, lora=step == "lora",
                                                          tp_size=tp_size)
        if not result["fits"]:
            result["would_fit_with"] = changes_that_fit(shape, args, gpus_per_node, nodes, step, gpu_memory_gib,
                                                        tp_size)
    result["time"] = predict_time(args, step, world_size, *flops, parameters, state)
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def this_gpu():
    """The CUDA name of this machine's GPU (the templates run the check on the job's node), else None."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def predict_time(args, step, ranks, flops, forward_flops, parameters, state, gpu=None, flops_per_s=None):
    """tools/job_time.py's prediction for the job, at `flops_per_s` per GPU, else at the GPU's peak x
    its MFU (the GPU check's measured figure where it has one); with where the speed comes from."""
    gpu = gpu or this_gpu()
    known = gpu if gpu in PEAK_BF16_FLOPS else job_time.DEFAULT_GPU
    kind = "qlora" if getattr(args, "qlora", False) else "lora" if step == "lora" else "full"
    mfu, source = job_time.mfu_for(known, kind)
    recomputed = forward_flops if getattr(args, "gradient_checkpointing", None) in ("full", True) else 0
    rows = args.total_batch_size or args.batch_size_per_device * ranks
    speed = flops_per_s or PEAK_BF16_FLOPS[known] * mfu * job_time.WITH_RECOMPUTATION[kind]
    prediction = job_time.predict(flops, recomputed, rows * args.max_seq_length, ranks, speed,
                                  getattr(args, "max_steps", 100), getattr(args, "save_every", 0), parameters,
                                  state["parameters"] + state["optimizer"])
    assumed = "" if gpu == known else \
        f" (assumed: {'no GPU here' if gpu is None else gpu + ' is not in common/metrics.py'})"
    peak = f"{known}'s {PEAK_BF16_FLOPS[known] / 1e12:g} TFLOP/s{assumed}"
    prediction.update(gpu=known, mfu=mfu, flops_per_token=flops, recomputed_flops_per_token=recomputed,
                      speed=f"{speed / 1e12:.3g} TFLOP/s per GPU" if flops_per_s
                      else f"{mfu:.1%} MFU ({source}; {mfu * job_time.WITH_RECOMPUTATION[kind]:.1%} with the "
                           f"recomputation it ran with) of {peak}")
    return prediction


def time_line(result):
    """One line: how long the job takes, and the --time to ask for."""
    t = result["time"]
    return (f"time: {t['steps']} steps x {t['step_s']:.3g} s + loading {job_time.duration(t['loading_s'])} + "
            f"{t['saves']} checkpoint(s) x {t['save_s']:.0f} s = {job_time.duration(t['total_s'])}, at {t['speed']}; "
            f"ask for --time {t['request']} (+{job_time.MARGIN:.0%}, at least {job_time.MIN_MARGIN_S // 60} minutes)")


def time_limit_verdict(result, limit_s, override):
    """Against the job's time limit: None where the job fits in it, else a warning line; a UserError
    for a job that would be killed before its first checkpoint."""
    t = result["time"]
    if job_time.killed_before_checkpoint(t, limit_s):
        raise UserError(f"the time limit, {job_time.duration(limit_s)}, ends the job before its first checkpoint "
                        f"(at {job_time.duration(t['first_checkpoint_s'])}): ask for --time {t['request']} or "
                        f"save sooner with --save_every ({override} runs it anyway)")
    if limit_s < t["total_s"]:
        return (f"warning: the time limit, {job_time.duration(limit_s)}, is shorter than the job "
                f"({job_time.duration(t['total_s'])}): it will stop at a checkpoint and need a requeue or --resume "
                f"to finish; --time {t['request']} runs it in one go")
    return None


def changes_that_fit(shape, args, gpus_per_node, nodes, step, gpu_memory_gib, tp_size=1):
    """One-change alternatives that fit by estimate_memory.py's formulas (instant, unlike a plan
    check each), cheapest first: what the refusal suggests."""
    def fits_with(gpus=gpus_per_node, nodes_=nodes, lora=step == "lora", tp=tp_size, **changes):
        job = argparse.Namespace(**{**vars(args), **changes})
        if job.total_batch_size % (job.batch_size_per_device * gpus * nodes_ // tp):
            job.total_batch_size = job.batch_size_per_device * gpus * nodes_ // tp  # the count the refusal names
        estimate = estimate_memory.estimate_job(shape, job, gpus, nodes_, lora=lora, tp_size=tp)
        return estimate_memory.fits(estimate["peak"], gpu_memory_gib)

    found = []
    if not args.gradient_checkpointing and fits_with(gradient_checkpointing=True):
        found.append("--gradient_checkpointing")
    smaller = [b for b in range(args.batch_size_per_device - 1, 0, -1) if args.batch_size_per_device % b == 0]
    if fitting := [b for b in smaller if fits_with(batch_size_per_device=b)]:
        found.append(f"--batch_size_per_device {fitting[0]}")
    if args.sharding_strategy != "FULL_SHARD" and fits_with(sharding_strategy="FULL_SHARD"):
        found.append("--sharding_strategy FULL_SHARD")
    if args.sharding_strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):  # more GPUs share the state
        more = [n for n in (nodes * 2 ** k for k in range(1, 10)) if n * gpus_per_node <= MAX_RANKS]
        if fitting := [n for n in more if fits_with(nodes_=n)]:
            found.append(f"{fitting[0] * gpus_per_node} GPUs (--nodes {fitting[0]})")
    if step == "tp":  # more GPUs of a node split each layer (tensor parallelism stays inside a node)
        larger = [t for t in range(tp_size + 1, gpus_per_node + 1) if gpus_per_node % t == 0
                  and all(size % t == 0 for size in shape.tp_divisible)]
        if fitting := [t for t in larger if fits_with(tp=t)]:
            found.append(f"--tp_size {fitting[0]}")
        return found
    if not args.cpu_offload and fits_with(cpu_offload=True):
        found.append("--cpu_offload")
    if step == "fsdp" and fits_with(lora=True, **LORA_DEFAULTS):
        found.append("step 5 (LoRA)")
    if step == "fsdp" and gpus_per_node > 1:  # step 6: each node's GPUs split the layers
        node = [t for t in range(2, gpus_per_node + 1) if gpus_per_node % t == 0
                and all(size % t == 0 for size in shape.tp_divisible)]
        if node and fits_with(tp=node[-1], sharding_strategy="FULL_SHARD", cpu_offload=False):
            found.append(f"step 6 (--tp_size {node[-1]})")
    return found


def gib(n):
    return f"{n / GiB:.1f}"


def verdict_line(result):
    """One line: does the job fit, the figure, and if not what to change."""
    margin = result["needed"] - result["peak"]
    where = f"peak {gib(result['peak'])} GiB at {result['peak_at']} + {gib(margin)} GiB margin"
    if result["fits"]:
        return (f"plan check: fits: {gib(result['needed'])} of {result['gpu_memory_gib']:g} GiB per GPU needed "
                f"({where})")
    changes = result["would_fit_with"]
    advice = (f"by the estimate it would fit with {', or '.join(changes)}" if changes
              else "no single change fits by the estimate: combine them (python tools/estimate_memory.py)")
    return (f"plan check: does NOT fit: {gib(result['needed'])} GiB per GPU needed ({where}), a GPU has "
            f"{result['gpu_memory_gib']:g} GiB; {advice}")


def summarise(phase_peaks, state, offloaded):
    """The peak over step 2's phases, what made it up, and each phase's peak and its parts. The
    optimizer step's temporaries are those the fake run measured: Muon's buckets (fused AdamW has none)."""
    def parts(phase, gpu, snapshot):
        on_gpu = {"total": gpu, **{name: snapshot.get(key, 0) for key, name in CATEGORIES.items()
                                   if not (offloaded and key in OFFLOADED)}}
        if not offloaded:  # during the step AdamW's temporaries are filed with its state: part them
            on_gpu["optimizer_temporaries"] = max(0, on_gpu["optimizer_state"] - state["optimizer"])
            on_gpu["optimizer_state"] -= on_gpu["optimizer_temporaries"]
        return on_gpu
    phases = {phase: parts(phase, gpu, snapshot) for phase, (gpu, snapshot) in phase_peaks.items()}
    peak_at = max(phases, key=lambda phase: phases[phase]["total"])
    return {"peak": phases[peak_at]["total"], "peak_at": peak_at,
            "at_peak": {name: value for name, value in phases[peak_at].items() if name != "total"},
            "phases": phases, "state": state, "host_per_rank": sum(state.values()) if offloaded else 0}


# ---- the command line -----------------------------------------------------------------------------

COMPARE_RANKS = [1, 2, 4, 8, 64]


# The options of a plan check that are the step script's own, with the same names and meaning.
JOB_OPTIONS = ("model", "sharding_strategy", "shard_group_size", "precision", "max_seq_length",
               "batch_size_per_device", "gradient_checkpointing", "loss_chunk_size", "cpu_offload",
               "accumulate_unsharded", "trust_remote_code", "lora_rank", "lora_target_modules", "optimizer", "tp_size",
               "max_steps", "save_every")


def step_of(args):
    """The step a plan check's options describe: 6 with --tp_size, 5 with --lora, else 4."""
    return "tp" if getattr(args, "tp_size", None) else "lora" if args.lora else "fsdp"


def training_arguments(args, gpus_per_node, nodes, **changes):
    """The job as the step script's own arguments: its defaults for everything the memory does not
    depend on (learning rate, LoRA alpha, ...), the job's values for the rest, checked as it checks them."""
    job = {**vars(args), **changes}
    step_name = step_of(argparse.Namespace(**job))
    training = load_step(step_name).parse_arguments(["--output_dir", "(plan check: nothing is written)"])
    for name in JOB_OPTIONS:
        if hasattr(training, name):
            setattr(training, name, job[name])
    groups = gpus_per_node * nodes // (job.get("tp_size") or 1)  # a tensor-parallel group shares its rows
    training.total_batch_size = job["total_batch_size"] or job["batch_size_per_device"] * groups
    check_arguments(training)
    if step_name == "tp":  # the step's own refusal, which its defaults above did not meet
        check_step_arguments(training)
    return training


def size(n):
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def report(result):
    """The plan check's figures for people."""
    step = {"lora": "step 5, LoRA", "tp": "step 6, tensor parallel x FSDP"}.get(result["step"], "step 4")
    tp = result["tp_size"]
    layout = f", mesh {result['ranks'] // tp} x {tp}: tensor parallel over {tp} GPUs" if result["step"] == "tp" else ""
    lines = [f"model: {result['model']}: {result['parameters']:,} parameters, "
             f"{result['trainable_parameters']:,} trained ({step})",
             f"{result['sharding_strategy']} on {result['nodes']} node(s) x {result['gpus_per_node']} GPU(s) = "
             f"{result['ranks']} ranks{layout}, {result['precision']} compute, sequence {result['max_seq_length']}, "
             "batch "
             f"{result['batch_size_per_device']} per GPU x {result['accumulation']} micro-batch(es) per step"
             + (" kept unsharded between them" if result["accumulate_unsharded"] else "")
             + (", activation checkpointing" if result["gradient_checkpointing"] else "")
             + (", CPU offload" if result["cpu_offload"] else "")
             + (", Muon" if result["optimizer"] == "muon" else ""),
             f"measured on fake tensors: two optimiser steps of the training code in {result['seconds']:.0f} s", "",
             f"rank 0's GPU at the peak, {result['peak_at']}:"]
    labels = {**LABELS, "optimizer_state": f"{estimate_memory.OPTIMIZER_STATE[result['optimizer']]} (fp32 shards)"}
    lines += [f"  {labels[name]:60s} {size(value):>10s}" for name, value in result["at_peak"].items() if value]
    lines += [f"  {'peak':60s} {size(result['peak']):>10s}",
              f"  {'margin (3 GiB CUDA context/NCCL + 10 % fragmentation)':60s} "
              f"{size(result['needed'] - result['peak']):>10s}", f"  {'needed':60s} {size(result['needed']):>10s}", "",
              "peak of each phase of step 2: " + ", ".join(f"{phase.removeprefix('step 2, ')} {size(parts['total'])}"
                                                           for phase, parts in result["phases"].items()),
              "state per rank after the optimiser step: " + ", ".join(
                  f"{name} {size(value)}" for name, value in result["state"].items())
              + (" (in host RAM: --cpu_offload)" if result["cpu_offload"] else ""),
              f"estimate_memory.py's formulas for the same job: peak {size(result['estimate']['peak'])}"
              if result["estimate"] else "estimate_memory.py's formulas do not know this model", "",
              loading_line(result["parameters"]), time_line(result), verdict_line(result)]
    return "\n".join(lines)


def compare_table(args):
    """Markdown: the plan check next to estimate_memory.py at 1, 2, 4, 8 and 64 ranks, every
    strategy, with and without activation checkpointing and LoRA (takes a while: 80 plan checks)."""
    import transformers
    command = "python tools/check_plan.py " + " ".join(sys.argv[1:])
    lines = [f"`{command}`, {date.today().isoformat()}, torch {torch.__version__}, transformers "
             f"{transformers.__version__}: {args.model}, {args.precision}, sequence {args.max_seq_length}, batch "
             f"{args.batch_size_per_device} per GPU, nodes of {args.gpus_per_node} GPUs (HYBRID_SHARD shards "
             "inside one). GiB per GPU, plan check / estimate; Δ = estimate vs plan.", "",
             "| ranks | strategy | checkpointing | LoRA | params | grads | AdamW | peak | Δ peak | plan's peak at |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---|"]
    worst = {"state": 0.0, "peak": 0.0}
    for lora, checkpointing, ranks, strategy in itertools.product(
            (False, True), (False, True), COMPARE_RANKS, estimate_memory.STRATEGIES):
        per_node = min(ranks, args.gpus_per_node)
        job = training_arguments(args, per_node, ranks // per_node, lora=lora, gradient_checkpointing=checkpointing,
                                 sharding_strategy=strategy, shard_group_size=None, total_batch_size=None)
        result = plan(job, per_node, ranks // per_node, "lora" if lora else "fsdp", args.gpu_memory_gib)
        estimate = result["estimate"]
        cells = []
        for name in ("parameters", "gradients", "optimizer"):
            measured = result["state"][name]
            worst["state"] = max(worst["state"], abs(estimate[name] - measured) / measured)
            cells.append(f"{measured / GiB:.2f} / {estimate[name] / GiB:.2f}")
        difference = (estimate["peak"] - result["peak"]) / result["peak"]
        worst["peak"] = max(worst["peak"], abs(difference))
        lines.append(f"| {ranks} | {strategy} | {'yes' if checkpointing else 'no'} | {'yes' if lora else 'no'} | "
                     + " | ".join(cells) + f" | {result['peak'] / GiB:.2f} / {estimate['peak'] / GiB:.2f} "
                     f"| {difference:+.1%} "
                     f"| {result['peak_at'].removeprefix('step 2, ')} |")
        print(f"{ranks} {strategy} checkpointing={checkpointing} lora={lora}: {result['seconds']:.0f} s",
              file=sys.stderr, flush=True)
    lines += ["", f"Largest difference: {worst['state']:.1%} on params, grads and AdamW state (allowed 5 %), "
                  f"{worst['peak']:.1%} on the peak (allowed 15 %)."]
    return "\n".join(lines)


def loading_host_bytes(parameters):
    """Host memory of rank 0 while it loads the model for the others (common/sharded_loading.py): the
    whole model in fp32, about 1.5 x that while it reads the checkpoint (04_fsdp/MEMORY.md)."""
    return int(1.5 * 4 * parameters)


def loading_line(parameters):
    return (f"host memory: rank 0 holds {size(loading_host_bytes(parameters))} while it loads the model "
            "(fp32 weights, 1.5 x while reading the checkpoint): a node's memory request needs that much")


def check_job(step, args, gpus_per_node, nodes, gpu_memory_gib, override, choose_sharding=False, out=None,
              time_limit_s=None):
    """The check before a job starts (submit.py, the Slurm templates): one verdict line, or a
    UserError naming the figure and what to change; `override` says how to run it anyway. With
    `choose_sharding` and several nodes, the job's sharding is the check's choice (choose_sharding);
    `args.sharding_strategy` says which it is. With `time_limit_s`, a job that would be killed before its
    first checkpoint is refused too, and one longer than the limit warned of. Returns the plan, or None
    where it cannot run."""
    out = out or sys.stdout  # read at the call: a test (or a caller) may have replaced it
    try:
        if choose_sharding and nodes > 1:
            args.sharding_strategy, result = choose_strategy(args, gpus_per_node, nodes, step, gpu_memory_gib, out)
        else:
            result = plan(args, gpus_per_node, nodes, step, gpu_memory_gib)
    except PlanUnavailable as why:
        print(f"plan check: not run: {why}; the job goes ahead unchecked", file=out, flush=True)
        return None
    if not result["fits"]:
        raise UserError(f"{verdict_line(result)} ({override} runs it anyway)")
    print(f"{verdict_line(result)} ({result['seconds']:.0f} s)", file=out, flush=True)
    print(loading_line(result["parameters"]), file=out, flush=True)
    print(time_line(result), file=out, flush=True)
    if time_limit_s is not None and (warning := time_limit_verdict(result, time_limit_s, override)):
        print(warning, file=out, flush=True)
    return result


def choose_strategy(args, gpus_per_node, nodes, step, gpu_memory_gib, out=None):
    """The sharding of a job on several nodes that names none: HYBRID_SHARD where the plan check says
    it fits (each node keeps a replica, sharded over its own GPUs: every layer's all-gather stays on
    the node's NVLink, and only the gradients' all-reduce crosses the network), else FULL_SHARD
    (sharded over every GPU of every node: less memory, each all-gather across the network). Prints
    the choice and both peaks; returns (the strategy, its plan)."""
    out = out or sys.stdout

    def job(strategy):  # the job's --shard_group_size stays: the job will run HYBRID_SHARD with it
        return argparse.Namespace(**{**vars(args), "sharding_strategy": strategy})
    plans = {strategy: plan(job(strategy), gpus_per_node, nodes, step, gpu_memory_gib)
             for strategy in ("HYBRID_SHARD", "FULL_SHARD")}
    choice = "HYBRID_SHARD" if plans["HYBRID_SHARD"]["fits"] else "FULL_SHARD"
    hybrid, full = (gib(plans[strategy]["needed"]) for strategy in ("HYBRID_SHARD", "FULL_SHARD"))
    group = (f"in groups of {args.shard_group_size} GPUs" if getattr(args, "shard_group_size", None)
             else f"inside each node of {gpus_per_node} GPUs")
    print(f"sharding: {choice} on {nodes} nodes: HYBRID_SHARD (sharded {group}) "
          f"needs {hybrid} GiB per GPU, FULL_SHARD (over all {gpus_per_node * nodes} GPUs) {full} GiB, of "
          f"{plans[choice]['gpu_memory_gib']:g}; --sharding_strategy chooses another", file=out, flush=True)
    return choice, plans[choice]


def names_option(argv, option):
    """Whether a command line gives `option` (--name or --name=value, either spelling)."""
    spellings = (option, option.replace("_", "-"))
    return any(arg.split("=", 1)[0] in spellings for arg in argv)


def chooses_sharding(step, nodes, training_args):
    """Whether the plan check chooses a job's sharding (submit.py, the Slurm templates): steps 4 and 5 on
    several nodes, where the training arguments name no --sharding_strategy. Step 6 has no HYBRID_SHARD:
    its tensor-parallel groups take the node's place."""
    return step != "tp" and nodes > 1 and not names_option(training_args, "--sharding_strategy")


def check_training_job(argv):
    """`check_plan.py --gpus_per_node N --nodes M [--step lora] -- TRAINING ARGUMENTS`: the check of
    a job given as the training script's own arguments (what slurm/fsdp.sh runs before training).
    With --choose_sharding (the templates'), the chosen strategy is the one line on stdout, the
    check's own lines go to stderr."""
    own, training_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = Parser("the plan check of a job given by its training arguments (after --)")
    parser.add("step", choices=["fsdp", "lora", "tp"], default="fsdp", help="04_fsdp, 05_lora or 06_tp")
    parser.add("gpus_per_node", type=at_least(1), required=True, help="GPUs (ranks) per node")
    parser.add("nodes", type=at_least(1), default=1, help="nodes")
    parser.add("gpu_memory_gib", type=float, default=None, help="memory of one GPU (default: this machine's, else 80)")
    parser.add("override", default="--force", help="how the refusal says to run the job anyway")
    parser.add("choose_sharding", action="store_true",
               help="several nodes and no --sharding_strategy: choose HYBRID_SHARD where it fits, else FULL_SHARD, "
                    "and print the choice alone on stdout")
    parser.add("time_limit", default="",
               help="the job's time limit or time left, in Slurm's format (squeue -o %%L): refuse a job it would end "
                    "before its first checkpoint, warn of one longer (empty or UNLIMITED: none)")
    args = parser.parse_args(own)
    limit = args.time_limit.strip()
    time_limit_s = None if limit in ("", "UNLIMITED", "NOT_SET", "INVALID") else \
        job_time.slurm_seconds(limit, "--time_limit")
    if args.gpu_memory_gib is not None and not (math.isfinite(args.gpu_memory_gib) and args.gpu_memory_gib > 0):
        raise UserError(f"--gpu_memory_gib must be positive (got {args.gpu_memory_gib:g})")
    job = check_training_arguments(args.step, training_args)
    choose = args.choose_sharding and chooses_sharding(args.step, args.nodes, training_args)
    out = sys.stderr if args.choose_sharding else sys.stdout
    result = check_job(args.step, job, args.gpus_per_node, args.nodes, args.gpu_memory_gib, args.override, choose, out,
                       time_limit_s)
    if choose and result is not None:
        print(job.sharding_strategy, flush=True)
    return 0


def parse_arguments(argv=None):
    parser = Parser(__doc__.split("\n\n")[0])
    estimate_memory.add_job_options(parser)
    parser.add("trust_remote_code", action="store_true", help="let the model directory's own code build the model")
    parser.add("max_steps", type=at_least(1), default=100, help="optimiser steps, for the time line")
    parser.add("save_every", type=at_least(0), default=0,
               help="a checkpoint every N steps (0: only at the end), for the time line")
    parser.add("json", action="store_true", help="print the figures as JSON (bytes, seconds)")
    parser.add("compare_table", action="store_true",
               help=f"markdown: this check next to estimate_memory.py at {COMPARE_RANKS} ranks x every strategy, "
                    "with and without activation checkpointing and LoRA (about 80 plan checks)")
    args = parser.parse_args(argv)
    estimate_memory.check_job_options(args)
    if not 1 <= args.gpus_per_node * args.nodes <= MAX_RANKS:
        raise UserError(f"the plan check runs 1 to {MAX_RANKS} ranks (got {args.nodes} x {args.gpus_per_node})")
    return args


def main(argv=None):
    """Exit status 0: the job fits; 1: it does not (2, an error line, when checking training arguments)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        return check_training_job(argv)
    args = parse_arguments(argv)
    if args.compare_table:
        print(compare_table(args))
        return 0
    result = plan(training_arguments(args, args.gpus_per_node, args.nodes), args.gpus_per_node, args.nodes,
                  step_of(args), args.gpu_memory_gib)
    print(json.dumps(result, indent=1) if args.json else report(result))
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
