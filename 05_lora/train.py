"""Step 5: fine-tune LoRA adapters instead of all weights, sharded with FSDP as in step 4.

    torchrun --nproc-per-node 2 05_lora/train.py --output_dir runs/lora
    torchrun --nproc-per-node 2 05_lora/train.py --qlora ...      # a 4-bit base model (NF4)

LoRA freezes every weight of the model and trains a low-rank update B·A beside each target
linear layer: for CodeLlama-7b at rank 16 about 40M trainable parameters instead of 6.7B, so
gradients and AdamW state shrink 170-fold; the frozen weights are still sharded by FSDP.
QLoRA also stores the frozen linear weights in 4 bits. Checkpoints and the final model hold the
adapters only (peft's format), to be loaded over --model.
"""
import gc
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from tqdm import tqdm

from common import checkpoint
from common.arguments import check_arguments, training_arguments
from common.batch import describe, gradient_accumulation_steps
from common.chess_eval import Evaluation
from common.data import count_loss_tokens, loss_sum, training_data
from common.device import pick_device
from common.errors import UserError, exit_on_user_error
from common.hang import Watchdog
from common.metrics import MetricsLog
from common.model import load_model_files
from common.nf4 import kept_whole
from common.optim import make_optimizer, make_scheduler
from common.output_dir import OutputDir, run_settings
from common.profiling import StepProfiler
from common.process_group import init_process_group
from common.sharded_loading import load_quantized_sharded_model, load_sharded_model
from common.signals import StopFlag
from common.speed import prepare_layers

# The sharding strategies users know from FSDP1 (and DeepSpeed), expressed in FSDP2:
#   FULL_SHARD    (ZeRO-3) shard over all ranks; free each layer's gathered weights after its
#                 forward and gather them again in backward. Least memory.
#   SHARD_GRAD_OP (ZeRO-2) shard over all ranks, but keep the gathered weights from forward to
#                 backward (reshard_after_forward=False): one all-gather less, more memory.
#   HYBRID_SHARD  a 2-D mesh: shard within a group of ranks (by default the GPUs of one node, over
#                 fast NVLink) and replicate across groups (all-reduce over the slower network).
#   NO_SHARD      (DDP) the same 2-D mesh with groups of one rank: every rank keeps everything.
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_mesh(strategy, device_type, world_size, shard_group_size):
    """The ranks FSDP shards over: a 1-D mesh, or (replicas × shards) for hybrid/no sharding."""
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return init_device_mesh(device_type, (world_size,))
    shards = 1 if strategy == "NO_SHARD" else shard_group_size
    if world_size % shards:
        raise UserError(f"HYBRID_SHARD: {world_size} ranks do not split into groups of {shards} "
                        "(--shard_group_size)")
    return init_device_mesh(device_type, (world_size // shards, shards), mesh_dim_names=("replicate", "shard"))


def decoder_layers(model):
    """The repeated blocks FSDP shards one by one: `model.model.layers` in Llama and the other
    Hugging Face decoders laid out like it (Mistral, Qwen2, Gemma, Phi-3, ...). Under peft's
    wrapper they are those of the base model: a unit holds frozen weights and adapters alike."""
    model = model.get_base_model()
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(f"{type(model).__name__} keeps no decoder layers at model.model.layers: step 4 shards "
                        "Llama-style models (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, ...)")
    return layers


def shard_model(model, mesh, strategy, mp_policy, offload_policy, load_unit=None):
    """FSDP by hand, bottom-up: every decoder layer becomes one unit whose weights are
    all-gathered just before it runs and freed right after; then the root takes what is left
    (embeddings, final norm, lm_head), which FSDP keeps gathered from forward to backward, as
    they are needed at both ends. One unit for the whole model would gather it all at once.
    QLoRA: `load_unit` gives each unit its weights (4-bit) just before FSDP takes it, and 4-bit
    weights that cannot be split over the ranks stay whole on each (kept_whole: common/nf4.py)."""
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for layer in decoder_layers(model):
        if load_unit:
            load_unit(layer)
        fully_shard(layer, reshard_after_forward=strategy != "SHARD_GRAD_OP",
                    ignored_params=kept_whole(layer, mesh.shape[-1]), **options)
    if load_unit:
        load_unit(model)
    fully_shard(model, **options)


def add_lora(model, args, frozen_dtype=torch.float32):
    """Freeze every weight and add a trainable low-rank update B·A (rank r, scaled by alpha/r)
    beside each target linear layer. B starts at zero, so training starts from the model.
    The frozen weights are stored in `frozen_dtype` (bf16: FSDP casts them to it anyway); adapters fp32."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=args.lora_target_modules)
    try:
        model = get_peft_model(model, config)
    except ValueError as err:  # no module of that name
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        raise UserError(f"--lora_target_modules {','.join(args.lora_target_modules)}: {err}; this model's linear "
                        f"layers are {', '.join(linear)}") from None
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(frozen_dtype)
    return model


def parse_arguments(argv=None):
    parser = training_arguments(__doc__.split("\n\n")[0])
    parser.add("sharding_strategy", choices=STRATEGIES, default="FULL_SHARD", help="see the table above")
    parser.add("shard_group_size", type=int, default=None,
               help="HYBRID_SHARD: ranks per shard group (default: the GPUs of one node)")
    parser.add("precision", choices=list(PRECISIONS), default=None,
               help="compute dtype of the layers and frozen weights (default: bf16 on GPU, fp32 on CPU); adapters fp32")
    parser.add("cpu_offload", action="store_true",
               help="keep sharded weights, gradients and optimizer state in CPU memory; the optimizer steps there")
    parser.add("accumulate_unsharded", action="store_true",
               help="with gradient accumulation: keep the gathered weights and full gradients on every rank between "
                    "micro-batches and communicate once per optimiser step (like DDP's no_sync): faster, more memory")
    parser.add("lora_rank", type=int, default=16, help="rank r of the update B·A")
    parser.add("lora_alpha", type=float, default=32.0, help="the update is scaled by alpha / r")
    parser.add("lora_target_modules", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
               help="comma-separated names of the linear layers that get adapters")
    parser.add("qlora", action="store_true",
               help="LoRA over a 4-bit base model: the decoder's frozen linear weights in NF4 (torchao); bf16 compute")
    args = parser.parse_args(argv)
    if args.shard_group_size is not None and args.shard_group_size < 1:
        raise UserError(f"--shard_group_size must be at least 1 (got {args.shard_group_size})")
    args.lora_target_modules = [name.strip() for name in args.lora_target_modules.split(",") if name.strip()]
    if args.lora_rank < 1 or not args.lora_alpha > 0 or not args.lora_target_modules:
        raise UserError("LoRA needs --lora_rank >= 1, --lora_alpha > 0 and at least one --lora_target_modules")
    if args.qlora and args.cpu_offload:
        raise UserError("--qlora keeps its 4-bit weights on the GPUs, --cpu_offload moves the weights to host memory: "
                        "choose one")
    return args


def train_step(model, optimizer, micro_batches, args, device, autocast):
    """One optimiser step on this rank's micro-batches; returns the step's tokens, summed loss and
    gradient norm. The plan check (tools/check_plan.py) runs steps 4 and 5's on fake tensors."""
    # Every token of the global batch weighs the same: divide each micro-batch's summed
    # loss by the token count of the whole global batch (all ranks), not by its own.
    step_tokens = sum(count_loss_tokens(batch) for batch in micro_batches).to(device)
    dist.all_reduce(step_tokens)

    step_loss = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        # FSDP reduce-scatters after each micro-batch, so gradients stay sharded; like DDP's no_sync,
        # --accumulate_unsharded keeps full gradients (and gathered weights) and communicates once.
        if args.accumulate_unsharded:
            last = i == len(micro_batches) - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
        with autocast:
            loss = loss_sum(model, batch, args.loss_chunk_size)
        # FSDP averages gradients over ranks; × world_size turns that average into the sum.
        (loss * dist.get_world_size() / step_tokens).backward()
        step_loss += loss.detach()
    dist.all_reduce(step_loss)

    # The parameters are DTensor shards; the norm comes back as a DTensor of the full norm (on the CPU, offloaded).
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).full_tensor().to(device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_tokens, step_loss, grad_norm


def main():
    args = parse_arguments()
    check_arguments(args)
    # torchrun starts one process per GPU and tells each who it is.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # this process's GPU on its node
    accumulation = gradient_accumulation_steps(args.total_batch_size, args.batch_size_per_device, world_size)
    device = pick_device(args.device, local_rank)
    init_process_group(device, args.collective_timeout, cpu_tensors=args.cpu_offload)
    is_main = rank == 0  # only rank 0 logs and saves
    output = OutputDir(args, is_main)  # one run at a time per output directory, which every node must see
    output_dir = output.run_dir  # what goes where: common/run_dir.py
    watchdog = Watchdog(output_dir.hang, args.collective_timeout, "loading")  # a hang ends the run, and says where
    torch.manual_seed(args.seed)

    # Model: the frozen weights in the compute dtype, the adapters in fp32, sharded. FSDP itself runs
    # the layers in bf16 and reduces the gradients in fp32 (MixedPrecisionPolicy); the adapters and
    # AdamW's state stay fp32 (add_lora casts only what no optimiser updates).
    config, tokenizer, notation = load_model_files(args)  # and how the games are written: common/notation.py
    precision = args.precision or ("bf16" if device.type == "cuda" or args.qlora else "fp32")
    mesh = build_mesh(args.sharding_strategy, device.type, world_size,
                      args.shard_group_size or int(os.environ["LOCAL_WORLD_SIZE"]))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if args.cpu_offload else OffloadPolicy()
    mp_policy = MixedPrecisionPolicy(param_dtype=PRECISIONS[precision], reduce_dtype=torch.float32)

    def prepare_model(model):  # before sharding, so that FSDP's hooks stay outside the recomputation
        prepare_layers(model, args)  # --gradient_checkpointing, --compile: common/speed.py
        return add_lora(model, args, PRECISIONS[precision])

    def shard(model, load_unit=None):
        shard_model(model, mesh, args.sharding_strategy, mp_policy, offload, load_unit)
    if args.qlora:  # the frozen linear weights in 4 bits, quantized layer by layer as rank 0 sends them
        model = load_quantized_sharded_model(args.model, config, rank, device, shard, prepare=prepare_model,
                                             trust_remote_code=args.trust_remote_code)
    else:
        model = load_sharded_model(args.model, config, rank, device, shard, prepare=prepare_model,
                                   cpu_offload=args.cpu_offload, trust_remote_code=args.trust_remote_code)
    autocast = nullcontext()  # FSDP casts the weights; no autocast on top
    if args.accumulate_unsharded and accumulation > 1:  # gather each layer once per optimiser step,
        model.set_reshard_after_forward(False)  # keep it until the last micro-batch's backward

    optimizer = make_optimizer(model, args)  # after sharding; the trainable parameters: the adapters
    scheduler = make_scheduler(optimizer, args)

    # Data: every optimiser step gets one global batch, of which each rank takes its share. Each rank
    # evaluates its share (the same count on every rank), then the sums are added up.
    with watchdog.unwatched("preparing the data"):  # hours for a big data set, and no collective in it
        train_rows, sampler = training_data(args, tokenizer, notation, rank, world_size)
        evaluation = Evaluation(args, tokenizer, notation, rank, world_size)

    # Every input is checked; only now does the run write (and --overwrite delete the old run).
    note = output.start(run_settings(args, "sharded LoRA adapters", config, train_rows, precision=precision,
                                     lora=[args.lora_rank, args.lora_alpha, args.lora_target_modules, args.qlora]))
    if is_main:
        tqdm.write(describe(args.total_batch_size, args.batch_size_per_device, world_size, accumulation)
                   + f", {args.sharding_strategy}")

    # Checkpoints: no rank holds the whole model, so every rank writes its own shards
    # (torch.distributed.checkpoint). The files don't depend on the world size: a run saved on
    # 2 ranks resumes on 4, each rank reading the pieces of its new shards. Only the adapters are
    # saved: the frozen weights are those of --model (so loading them back leaves the model's other
    # entries alone: strict=False). Rank 0 adds the config, tokenizer and adapter config.
    state_options = StateDictOptions(ignore_frozen_params=True, strict=False)

    def save_checkpoint(step):
        path = output_dir.checkpoint(step)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=state_options)
        state = {"model": model_state, "optimizer": optimizer_state}
        with checkpoint.sharded_save(path, state, is_main):  # refused at once if the disk is too full; all ranks fail
            dcp.save(state, checkpoint_id=path)
            if is_main:  # dcp.save has returned on every rank: all shards are on disk
                train = checkpoint.train_state(step, scheduler, {"untrained": untrained})
                torch.save(train, path / checkpoint.TRAIN_STATE)
                model.config.save_pretrained(path)
                tokenizer.save_pretrained(path)
                model.peft_config["default"].save_pretrained(path)

    def load_checkpoint(path):
        nonlocal start_step, untrained
        model_state, optimizer_state = get_state_dict(model, optimizer, options=state_options)
        state = {"model": model_state, "optimizer": optimizer_state}
        checkpoint.load_sharded(state, path)  # each rank reads what its shards need
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=state_options)
        train = checkpoint.load_file(path / checkpoint.TRAIN_STATE)
        scheduler.load_state_dict(train["scheduler"])
        checkpoint.restore_rng(train)
        start_step, untrained = train["step"], train["untrained"]

    start_step, untrained = 0, None
    if output.resume and (resumed_from := checkpoint.load_newest(output_dir, load_checkpoint)) and is_main:
        tqdm.write(f"resuming from {resumed_from}" + (f"\n{note}" if note else ""))
    # From here on SIGTERM (preemption, time limit), Slurm's USR2 warning and Ctrl-C make the run save
    # a checkpoint at the end of the step and stop (common/signals.py); the loader's workers leave it to the rank.
    stop = StopFlag(device)
    batches = sampler.batches(train_rows, start_step, tokenizer.pad_token_id, device, args.data_workers)

    def evaluate(stop_requested=None):
        """Validation loss and legal-move rate; None if every rank was asked to stop meanwhile."""
        model.eval()
        with autocast:
            sums = evaluation.sums(model, device, stop_requested)
        model.train()
        if sums is None:
            return None
        dist.all_reduce(sums)
        return evaluation.figures(sums)

    if untrained is None:
        watchdog.phase("untrained evaluation")
        untrained = evaluate()
        if is_main:
            tqdm.write(f"untrained model: {untrained}")
    metrics = MetricsLog(output_dir, is_main, args, model, world_size, accumulation, device, resumed_at=start_step)
    profiler = StepProfiler(args.profile_steps, output_dir.profile, start_step, device)
    if metrics.evaluation_missing():  # a stop came between the resumed step and its evaluation
        watchdog.phase("evaluation", start_step)
        metrics.add_evaluation(evaluate())
    progress = tqdm(range(start_step, args.max_steps), desc="train", initial=start_step, total=args.max_steps,
                    mininterval=1.0, disable=not is_main)
    for step in progress:
        watchdog.phase("training", step + 1)
        timer = metrics.timer()
        with timer.waiting_for_data():
            micro_batches = [{k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
                             for _ in range(accumulation)]
        step_tokens, step_loss, grad_norm = train_step(model, optimizer, micro_batches, args, device, autocast)
        scheduler.step()

        # The step's one wait for the GPU: its figures, and whether any rank was asked to stop.
        tokens, loss_total, grad_norm, stopping = torch.stack([step_tokens, step_loss, grad_norm,
                                                               stop.any_rank()]).tolist()
        checkpoint.stop_if_not_finite(loss_total, step + 1, output_dir, model)  # the same verdict on every rank
        record = metrics.step_record(step + 1, tokens, loss_total, grad_norm, scheduler.get_last_lr()[0], timer)
        if not stopping and metrics.evaluates_at(step + 1):
            watchdog.phase("evaluation", step + 1)
            figures = evaluate(stop.requested)
            stopping = figures is None
            if figures:
                record.update(figures)
                if is_main:
                    tqdm.write(f"step {step + 1}: eval_loss={record['eval_loss']:.4f} "
                               f"legal_move_rate={record['legal_move_rate']:.3f}")
        save_now = (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.max_steps or stopping
        if save_now:
            watchdog.phase("checkpoint", step + 1)
            record["checkpoint_save_s"] = timer.seconds(save_checkpoint, step + 1)
        metrics.write(record)
        profiler.step()
        if save_now and is_main:  # only now, with its step on record, does the checkpoint count
            checkpoint.mark_complete(output_dir, step + 1, args.keep_checkpoints)
        progress.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if stopping:
            metrics.close()
            watchdog.done()
            stop.say_saved(step + 1, output_dir)
            model = None  # as at the end of main
            gc.collect()
            dist.destroy_process_group()
            return
    watchdog.phase("final model")

    # The final adapters in peft's format (load them over --model with PeftModel.from_pretrained).
    # Each rank holds only shards: gather them on rank 0 (the other ranks get an empty dict).
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                      ignore_frozen_params=True))
    peaks = [None] * world_size
    dist.all_gather_object(peaks, metrics.peak_memory())
    if is_main:
        with checkpoint.written_whole(output_dir.final) as final:  # beside final/, then moved in: never half-written
            model.save_pretrained(final, state_dict=full_state, safe_serialization=True)
            tokenizer.save_pretrained(final)
    metrics.finish("05_lora", untrained, peaks)
    # Free the sharded model while the process group is alive: freed the other way round, at exit,
    # a gloo group can deadlock or abort in its destructor (pytorch/pytorch#56297). FSDP modules
    # sit in reference cycles, so dropping the name is not enough: the garbage collector frees them.
    model = None
    gc.collect()
    watchdog.done()
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_user_error(main, needs_torchrun=True)
