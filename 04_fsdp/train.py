"""Step 4: the same fine-tuning with Fully Sharded Data Parallel (FSDP2, `fully_shard`).

    torchrun --nproc-per-node 2 04_fsdp/train.py --output_dir runs/fsdp --gradient_accumulation_steps 2

DDP keeps a full copy of weights, gradients and optimizer state on every GPU: 16 bytes per
parameter, about 100 GiB for a 7B model. FSDP splits all three across the ranks: each rank
keeps 1/world_size of them, gathers a layer's full weights just before the layer runs, frees
them after, and reduce-scatters the gradients so each rank receives only its own shard.
The data, loss and optimiser step are those of steps 2 and 3.
"""
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
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard  # noqa: E402
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common.checkpoint import (checkpoint_dir, complete_checkpoints, load_file, mark_complete,  # noqa: E402
                               prepare, restore_rng, train_state, TRAIN_STATE)
from common.chess_eval import game_prefixes, legal_move_sums, validation_loss_sums  # noqa: E402
from common.data import GlobalBatchSampler, count_loss_tokens, load_rows, loss_sum, make_loader  # noqa: E402
from common.errors import UserError, exit_on_user_error  # noqa: E402
from common.metrics import (MetricsLog, StepTimer, peak_memory, print_summary, run_params,  # noqa: E402
                            write_summary)
from common.train_setup import (add_flag, check_arguments, enable_gradient_checkpointing, load_model,  # noqa: E402
                                load_tokenizer, make_optimizer, make_scheduler, pick_device,
                                seed_everything, training_arguments)


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
    (embeddings, final norm, lm_head). One unit for the whole model would gather it all at once."""
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy,
                   reshard_after_forward=strategy != "SHARD_GRAD_OP")
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)


def parse_arguments():
    parser = training_arguments(__doc__.split("\n\n")[0])
    add_flag(parser, "sharding_strategy", choices=STRATEGIES, default="FULL_SHARD", help="see the table above")
    add_flag(parser, "shard_group_size", type=int, default=None,
             help="HYBRID_SHARD: ranks per shard group (default: the GPUs of one node)")
    add_flag(parser, "precision", choices=list(PRECISIONS), default=None,
             help="compute dtype of the layers (default: bf16 on GPU, fp32 on CPU); weights and AdamW stay fp32")
    add_flag(parser, "cpu_offload", action="store_true",
             help="keep sharded weights, gradients and optimizer state in CPU memory; the optimizer steps there")
    return parser.parse_args()


def main():
    args = parse_arguments()
    check_arguments(args)
    seed_everything(args.seed)
    # torchrun starts one process per GPU and tells each who it is.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # this process's GPU on its node
    device = pick_device(args.device, local_rank)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    is_main = rank == 0  # only rank 0 logs and saves
    output_dir = Path(args.output_dir)

    # Model: fp32 weights, sharded. FSDP itself runs the layers in bf16 or fp16 and reduces the
    # gradients in fp32 (MixedPrecisionPolicy); the sharded weights and AdamW's state stay fp32.
    # Never cast the model to bf16 before sharding: AdamW would then keep bf16 state.
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model).to(device)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)  # before sharding, so FSDP's hooks stay outside it
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    mesh = build_mesh(args.sharding_strategy, device.type, world_size,
                      args.shard_group_size or int(os.environ["LOCAL_WORLD_SIZE"]))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if args.cpu_offload else OffloadPolicy()
    shard_model(model, mesh, args.sharding_strategy,
                MixedPrecisionPolicy(param_dtype=PRECISIONS[precision], reduce_dtype=torch.float32), offload)
    autocast = nullcontext()  # FSDP casts the weights; no autocast on top
    # fp16 overflows where bf16 does not: scale the loss up, and skip steps whose gradients hit
    # inf. The sharded scaler agrees on "inf found" across ranks. bf16 and fp32 need no scaler.
    scaler = ShardedGradScaler(device=device.type, enabled=precision == "fp16")

    optimizer = make_optimizer(model, args)  # after sharding: it must see the sharded parameters
    scheduler = make_scheduler(optimizer, args)

    # Checkpoints: no rank holds the whole model, so every rank writes its own shards
    # (torch.distributed.checkpoint). The files don't depend on the world size: a run saved on
    # 2 ranks resumes on 4, each rank reading the pieces of its new shards.
    def save_checkpoint(step):
        path = checkpoint_dir(output_dir, step)
        if is_main:
            prepare(path)
        dist.barrier()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
        if is_main:  # dcp.save has returned on every rank: all shards are on disk
            torch.save(train_state(step, scheduler, {"untrained": untrained, "scaler": scaler.state_dict()}),
                       path / TRAIN_STATE)
            mark_complete(path, args.keep_checkpoints)
        dist.barrier()

    start_step, untrained = 0, None
    if args.resume and (checkpoints := complete_checkpoints(output_dir)):
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=checkpoints[-1])  # each rank reads what its shards need
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        train = load_file(checkpoints[-1] / TRAIN_STATE)
        scheduler.load_state_dict(train["scheduler"])
        scaler.load_state_dict(train["scaler"])
        restore_rng(train)
        start_step, untrained = train["step"], train["untrained"]
        if is_main:
            tqdm.write(f"resuming from {checkpoints[-1]}")

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
        tokens = step_tokens.item()
        record = {"step": step + 1, "loss": step_loss.item() / tokens, "lr": scheduler.get_last_lr()[0],
                  "grad_norm": grad_norm.item(), "tokens": int(tokens), "tokens_per_s": tokens / elapsed,
                  "tokens_per_s_per_device": tokens / elapsed / world_size, "step_time_s": elapsed,
                  "data_wait_s": data_wait, "world_size": world_size,
                  "gradient_accumulation_steps": args.gradient_accumulation_steps,
                  "batch_size_per_device": args.batch_size_per_device, **peak_memory(device)}
        if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.max_steps:
            record.update(evaluate())
            if is_main:
                    tqdm.write(f"step {step + 1}: eval_loss={record['eval_loss']:.4f} "
                           f"legal_move_rate={record['legal_move_rate']:.3f}")
        if (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.max_steps:
            saving = time.perf_counter()
            save_checkpoint(step + 1)
            record["checkpoint_save_s"] = time.perf_counter() - saving
        metrics.write(record)
        progress.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
    metrics.close()

    # The final model in Hugging Face format. Each rank holds only shards, so gather the full
    # weights (to CPU, on rank 0 only; the other ranks get an empty dict) and let rank 0 write them.
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak_memory(device))
    if is_main:
        model.save_pretrained(output_dir / "final", state_dict=full_state, safe_serialization=True)
        tokenizer.save_pretrained(output_dir / "final")
        summary = write_summary(output_dir, "04_fsdp", metrics.records, untrained, peaks)
        print_summary("04_fsdp", summary)
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_user_error(main)
