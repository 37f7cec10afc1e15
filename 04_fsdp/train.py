"""Step 4: the same fine-tuning with Fully Sharded Data Parallel (FSDP2, `fully_shard`).

    torchrun --nproc-per-node 2 04_fsdp/train.py --output_dir runs/fsdp --gradient_accumulation_steps 2

DDP keeps a full copy of weights, gradients and optimizer state on every GPU: 16 bytes per
parameter, about 100 GiB for a 7B model. FSDP splits all three across the ranks: each rank
keeps 1/world_size of them, gathers a layer's full weights just before the layer runs, frees
them after, and reduce-scatters the gradients so each rank receives only its own shard.
The data, loss and optimiser step are those of steps 2 and 3.
"""
import gc
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared `common` package

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,  # noqa: E402
                                                     get_state_dict, set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard  # noqa: E402
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common.checkpoint import (checkpoint_dir, load_file, load_newest, load_sharded, mark_complete,  # noqa: E402
                               prepare, restore_rng, stop_if_not_finite, train_state, TRAIN_STATE)
from common.chess_eval import game_prefixes, legal_move_sums, validation_loss_sums  # noqa: E402
from common.data import GlobalBatchSampler, count_loss_tokens, load_rows, loss_sum, make_loader  # noqa: E402
from common.errors import UserError, exit_on_user_error  # noqa: E402
from common.metrics import (MetricsLog, StepTimer, flops_per_token, model_flops_utilization,  # noqa: E402
                            peak_memory, print_summary, run_params, write_summary)
from common.signals import PreemptionFlag, die_with_launcher  # noqa: E402
from common.train_setup import (add_flag, check_arguments, enable_gradient_checkpointing, load_model,  # noqa: E402
                                load_tokenizer, make_optimizer, make_scheduler, model_missing_message,
                                pick_device, seed_everything, training_arguments)


# The sharding strategies users know from FSDP1 (and DeepSpeed), expressed in FSDP2:
#   FULL_SHARD    (ZeRO-3) shard over all ranks; free each layer's gathered weights after its
#                 forward and gather them again in backward. Least memory.
#   SHARD_GRAD_OP (ZeRO-2) shard over all ranks, but keep the gathered weights from forward to
#                 backward (reshard_after_forward=False): one all-gather less, more memory.
#   HYBRID_SHARD  a 2-D mesh: shard within a group of ranks (by default the GPUs of one node, over
#                 fast NVLink) and replicate across groups (all-reduce over the slower network).
#   NO_SHARD      (DDP) the same 2-D mesh with groups of one rank: every rank keeps everything.
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_mesh(strategy, device_type, world_size, shard_group_size):
    """The ranks FSDP shards over: a 1-D mesh, or (replicas × shards) for hybrid/no sharding."""
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return init_device_mesh(device_type, (world_size,))
    shards = 1 if strategy == "NO_SHARD" else shard_group_size
    if world_size % shards:
        raise UserError(f"HYBRID_SHARD: {world_size} ranks do not split into groups of {shards} "
                        "(--shard_group_size)")
    return init_device_mesh(device_type, (world_size // shards, shards), mesh_dim_names=("replicate", "shard"))


def shard_model(model, mesh, strategy, mp_policy, offload_policy):
    """FSDP by hand, bottom-up: every decoder layer becomes one unit whose weights are
    all-gathered just before it runs and freed right after; then the root takes what is left
    (embeddings, final norm, lm_head). One unit for the whole model would gather it all at once.
    With LoRA a unit holds frozen base weights and trainable adapters alike; FSDP2 shards both."""
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy,
                   reshard_after_forward=strategy != "SHARD_GRAD_OP")
    transformer = model.get_base_model() if hasattr(model, "peft_config") else model  # under peft's wrapper
    for layer in transformer.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)


def add_lora(model, args):
    """LoRA: freeze every weight and add a trainable low-rank update B·A (rank r, scaled by
    alpha/r) beside each target linear layer. B starts at zero, so training starts from the model."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=[name.strip() for name in args.lora_target_modules.split(",") if name.strip()])
    return get_peft_model(model, config)


def load_config(name, trust_remote_code):
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(model_missing_message(name, err)) from None


def load_sharded_model(args, rank, device, shard):
    """Low host-memory loading. Loading the model on every rank would put N full copies in each
    node's host memory (8 × 27 GB for a 7B model in fp32). Instead every rank builds the model on
    the meta device (shapes, no memory) and shards it; only rank 0 reads the weights (or, with
    --random_init, draws them), and sends them to the others one tensor at a time; each rank keeps
    only its own shard of each."""
    from transformers import AutoModelForCausalLM
    config = load_config(args.model, args.trust_remote_code)

    def prepare(model):  # the same structure on every rank, real or meta
        if args.gradient_checkpointing:
            enable_gradient_checkpointing(model)  # before sharding, so FSDP's hooks stay outside it
        return add_lora(model, args) if args.lora else model

    full_model = None
    if rank == 0:
        full_model = prepare(AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                              trust_remote_code=args.trust_remote_code)
                             if args.random_init else load_model(args.model, args.trust_remote_code))
    with torch.device("meta"):
        model = prepare(AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                         trust_remote_code=args.trust_remote_code))
    shard(model)
    model.to_empty(device=device)  # memory for this rank's shards only, uninitialised
    set_model_state_dict(model, full_model.state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers outside the state dict (RoPE's inv_freq) are garbage after to_empty: take rank 0's.
    reference = dict(full_model.named_buffers()) if rank == 0 else {}
    for module_name, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            buffer = getattr(module, name)
            buffer = (reference[f"{module_name}.{name}"] if rank == 0 else torch.empty_like(buffer)).to(device)
            dist.broadcast(buffer, src=0)
            module.register_buffer(name, buffer, persistent=False)
    return model


def load_qlora_model(args, device, shard):
    """QLoRA: the frozen base weights stored in 4 bits (NF4, bitsandbytes), computed in bf16, with
    LoRA adapters on top. Every rank loads the quantized model straight onto its own GPU (4-bit
    weights are a quarter of the bf16 size), so there is nothing to broadcast. The 4-bit weights are
    stored as bf16 elements (bnb_4bit_quant_storage) so that FSDP can shard them like the rest."""
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    model = load_model(args.model, args.trust_remote_code, quantization_config=quantization,
                       device_map={"": device})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model = add_lora(model, args)
    shard(model)
    return model


def check_fsdp_arguments(args):
    if args.qlora:
        if args.random_init:
            raise UserError("--qlora quantizes real weights: drop --random_init")
        if args.device == "cpu" or not torch.cuda.is_available():
            raise UserError("--qlora needs a CUDA GPU (bitsandbytes' 4-bit kernels): use --lora on the CPU")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise UserError("--qlora needs bitsandbytes: `pip install bitsandbytes` on the GPU nodes") from None
        args.lora = True  # QLoRA is LoRA over a quantized base
    if args.lora and (args.lora_rank < 1 or args.lora_alpha <= 0 or not args.lora_target_modules.strip(", ")):
        raise UserError("--lora needs --lora_rank >= 1, --lora_alpha > 0 and at least one --lora_target_modules")


def parse_arguments():
    parser = training_arguments(__doc__.split("\n\n")[0])
    add_flag(parser, "sharding_strategy", choices=STRATEGIES, default="FULL_SHARD", help="see the table above")
    add_flag(parser, "shard_group_size", type=int, default=None,
             help="HYBRID_SHARD: ranks per shard group (default: the GPUs of one node)")
    add_flag(parser, "precision", choices=list(PRECISIONS), default=None,
             help="compute dtype of the layers (default: bf16 on GPU, fp32 on CPU); weights and AdamW stay fp32")
    add_flag(parser, "cpu_offload", action="store_true",
             help="keep sharded weights, gradients and optimizer state in CPU memory; the optimizer steps there")
    add_flag(parser, "random_init", action="store_true",
             help="random weights from --model's config.json (no weight files needed: benchmarks)")
    add_flag(parser, "lora", action="store_true", help="train LoRA adapters (peft) instead of all weights")
    add_flag(parser, "lora_rank", type=int, default=16, help="LoRA: rank r of the update B·A")
    add_flag(parser, "lora_alpha", type=float, default=32.0, help="LoRA: the update is scaled by alpha / r")
    add_flag(parser, "lora_target_modules", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
             help="LoRA: comma-separated names of the linear layers that get adapters")
    add_flag(parser, "qlora", action="store_true",
             help="LoRA over a 4-bit (NF4) base model; needs a GPU and bitsandbytes")
    return parser.parse_args()


def main():
    die_with_launcher()  # no orphaned ranks if torchrun is killed
    args = parse_arguments()
    check_arguments(args)
    check_fsdp_arguments(args)
    seed_everything(args.seed)
    # torchrun starts one process per GPU and tells each who it is.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # this process's GPU on its node
    device = pick_device(args.device, local_rank)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    is_main = rank == 0  # only rank 0 logs and saves
    output_dir = Path(args.output_dir)
    # Slurm's warning before a time limit or preemption: all ranks finish the step, save, exit cleanly.
    preemption = PreemptionFlag(device)  # from here on, USR2 no longer kills us

    # Model: fp32 weights, sharded. FSDP itself runs the layers in bf16 or fp16 and reduces the
    # gradients in fp32 (MixedPrecisionPolicy); the sharded weights and AdamW's state stay fp32.
    # Never cast the model to bf16 before sharding: AdamW would then keep bf16 state.
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    mesh = build_mesh(args.sharding_strategy, device.type, world_size,
                      args.shard_group_size or int(os.environ["LOCAL_WORLD_SIZE"]))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if args.cpu_offload else OffloadPolicy()
    mp_policy = MixedPrecisionPolicy(param_dtype=PRECISIONS[precision], reduce_dtype=torch.float32)

    def shard(model):
        shard_model(model, mesh, args.sharding_strategy, mp_policy, offload)
    model = load_qlora_model(args, device, shard) if args.qlora else load_sharded_model(args, rank, device, shard)
    model_flops = flops_per_token(model, args.max_seq_length)  # for MFU
    autocast = nullcontext()  # FSDP casts the weights; no autocast on top
    # fp16 overflows where bf16 does not: scale the loss up, and skip steps whose gradients hit
    # inf. The sharded scaler agrees on "inf found" across ranks. bf16 and fp32 need no scaler.
    scaler = ShardedGradScaler(device=device.type, enabled=precision == "fp16")

    optimizer = make_optimizer(model, args)  # after sharding: it must see the sharded parameters
    scheduler = make_scheduler(optimizer, args)

    # Checkpoints: no rank holds the whole model, so every rank writes its own shards
    # (torch.distributed.checkpoint). The files don't depend on the world size: a run saved on
    # 2 ranks resumes on 4, each rank reading the pieces of its new shards. With LoRA only the
    # adapters are saved: the frozen weights are those of --model (so loading them back leaves
    # the model's other entries alone: strict=False). Rank 0 adds the config and tokenizer, so
    # that 04_fsdp/export.py can turn a checkpoint into a Hugging Face model.
    state_options = StateDictOptions(ignore_frozen_params=args.lora, strict=not args.lora)

    def save_checkpoint(step):
        path = checkpoint_dir(output_dir, step)
        if is_main:
            prepare(path)
        dist.barrier()
        model_state, optimizer_state = get_state_dict(model, optimizer, options=state_options)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
        if is_main:  # dcp.save has returned on every rank: all shards are on disk
            torch.save(train_state(step, scheduler, {"untrained": untrained, "scaler": scaler.state_dict()}),
                       path / TRAIN_STATE)
            model.config.save_pretrained(path)
            tokenizer.save_pretrained(path)
            if args.lora:
                model.peft_config["default"].save_pretrained(path)
        dist.barrier()

    def load_checkpoint(path):
        nonlocal start_step, untrained
        model_state, optimizer_state = get_state_dict(model, optimizer, options=state_options)
        state = {"model": model_state, "optimizer": optimizer_state}
        load_sharded(state, path)  # each rank reads what its shards need
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=state_options)
        train = load_file(path / TRAIN_STATE)
        scheduler.load_state_dict(train["scheduler"])
        scaler.load_state_dict(train["scaler"])
        restore_rng(train)
        start_step, untrained = train["step"], train["untrained"]

    start_step, untrained = 0, None
    if args.resume and (resumed_from := load_newest(output_dir, load_checkpoint)) and is_main:
        tqdm.write(f"resuming from {resumed_from}")

    # Data: tokenized once and cached; every optimiser step gets one global batch.
    cache_dir = Path(args.data_dir) / "tokenized"
    train_rows, _ = load_rows(Path(args.data_dir) / "train.jsonl", tokenizer, args.max_seq_length,
                              not args.no_packing, cache_dir)
    eval_rows, eval_games = load_rows(Path(args.data_dir) / "validation.jsonl", tokenizer,
                                      args.max_seq_length, not args.no_packing, cache_dir)
    eval_rows, prefixes = eval_rows[: args.eval_rows], game_prefixes(eval_games, args.eval_games, args.seed)
    # Each rank evaluates its share (the same count on every rank), then the sums are added up.
    eval_rows = eval_rows[rank: len(eval_rows) - len(eval_rows) % world_size: world_size]
    prefixes = prefixes[rank: len(prefixes) - len(prefixes) % world_size: world_size]
    sampler = GlobalBatchSampler(len(train_rows), args.batch_size_per_device, args.gradient_accumulation_steps,
                                 rank=rank, world_size=world_size, seed=args.seed, start_step=start_step,
                                 max_steps=args.max_steps)
    batches = iter(make_loader(train_rows, sampler, tokenizer.pad_token_id, device))


    def evaluate():
        """Validation loss and legal-move rate."""
        model.eval()
        with autocast:
            sums = torch.stack([
                *validation_loss_sums(model, eval_rows, args.batch_size_per_device, tokenizer.pad_token_id, device),
                *legal_move_sums(model, tokenizer, prefixes, args.batch_size_per_device, args.max_seq_length, device)])
        dist.all_reduce(sums)
        model.train()
        loss, tokens, legal, tried = sums.tolist()
        return {"eval_loss": loss / tokens, "legal_move_rate": legal / tried}

    if untrained is None:
        untrained = evaluate()
        if is_main:
            tqdm.write(f"untrained model: {untrained}")
    metrics = MetricsLog(output_dir, enabled=is_main, report_to=args.report_to,
                         params=run_params(args, world_size, device), resumed_at=start_step)
    progress = tqdm(range(start_step, args.max_steps), desc="train", initial=start_step, total=args.max_steps,
                    mininterval=1.0, disable=not is_main)
    for step in progress:
        timer = StepTimer(device)
        waiting = time.perf_counter()
        micro_batches = [{k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
                         for _ in range(args.gradient_accumulation_steps)]
        timer.data_ready(waiting)
        # Every token of the global batch weighs the same: divide each micro-batch's summed
        # loss by the token count of the whole global batch (all ranks), not by its own.
        step_tokens = sum(count_loss_tokens(batch) for batch in micro_batches).to(device)
        dist.all_reduce(step_tokens)

        step_loss = torch.zeros((), device=device)
        for batch in micro_batches:
            # Unlike DDP's no_sync, FSDP reduce-scatters after every micro-batch: skipping it
            # would keep full-size unsharded gradients on every GPU (+4 bytes per parameter).
            with autocast:
                loss = loss_sum(model, batch)
            # FSDP averages gradients over ranks; × world_size turns that average into the sum.
            scaler.scale(loss * world_size / step_tokens).backward()
            step_loss += loss.detach()
        dist.all_reduce(step_loss)

        # The parameters are DTensor shards; the norm comes back as a DTensor of the full norm.
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).full_tensor()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        elapsed, data_wait = timer.finish()
        tokens, loss_total, grad_norm = torch.stack([step_tokens, step_loss, grad_norm]).tolist()  # one sync
        stop_if_not_finite(loss_total, step + 1, output_dir)  # the same verdict on every rank
        record = {"step": step + 1, "loss": loss_total / tokens, "lr": scheduler.get_last_lr()[0],
                  "grad_norm": grad_norm, "tokens": int(tokens), "tokens_per_s": tokens / elapsed,
                  "tokens_per_s_per_device": tokens / elapsed / world_size, "step_time_s": elapsed,
                  "data_wait_s": data_wait, "world_size": world_size,
                  "gradient_accumulation_steps": args.gradient_accumulation_steps,
                  "batch_size_per_device": args.batch_size_per_device, **peak_memory(device),
                  **model_flops_utilization(tokens / elapsed / world_size, model_flops, device)}
        preempted = preemption.requested()
        if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.max_steps:
            record.update(evaluate())
            if is_main:
                    tqdm.write(f"step {step + 1}: eval_loss={record['eval_loss']:.4f} "
                           f"legal_move_rate={record['legal_move_rate']:.3f}")
        save_now = (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.max_steps or preempted
        if save_now:
            saving = time.perf_counter()
            save_checkpoint(step + 1)
            record["checkpoint_save_s"] = time.perf_counter() - saving
        metrics.write(record)
        if save_now and is_main:  # only now, with its step on record, does the checkpoint count
            mark_complete(checkpoint_dir(output_dir, step + 1), args.keep_checkpoints)
        progress.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if preempted and step + 1 < args.max_steps:
            metrics.close()
            if is_main:
                tqdm.write(f"preempted: saved a checkpoint at step {step + 1} in {output_dir}; "
                           "continue with --resume")
            model = None  # as at the end of main
            gc.collect()
            dist.destroy_process_group()
            return
    metrics.close()

    # The final model in Hugging Face format. Each rank holds only shards, so gather the full
    # weights (to CPU, on rank 0 only; the other ranks get an empty dict) and let rank 0 write them.
    # With LoRA, final/ holds the adapters in peft's format (load them over --model).
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                      ignore_frozen_params=args.lora))
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak_memory(device))
    if is_main:
        model.save_pretrained(output_dir / "final", state_dict=full_state, safe_serialization=True)
        tokenizer.save_pretrained(output_dir / "final")
        summary = write_summary(output_dir, "04_fsdp", metrics.records, untrained, peaks)
        print_summary("04_fsdp", summary)
    # Free the sharded model while the process group is alive: freed the other way round, at exit,
    # a gloo group can deadlock or abort in its destructor (pytorch/pytorch#56297). FSDP modules
    # sit in reference cycles, so dropping the name is not enough: the garbage collector frees them.
    model = None
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_user_error(main)
