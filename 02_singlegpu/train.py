"""Step 2: fine-tune a Llama model on chess games with one GPU (or the CPU).

    python 02_singlegpu/train.py --output_dir runs/single            # the built-in tiny demo
    python 02_singlegpu/train.py --model codellama/CodeLlama-7b-hf --data_dir $SCRATCH/chess/data \
        --output_dir runs/single-7b --total_batch_size 64 --batch_size_per_device 2
        # the 7B command's form only: a full fine-tune of 7B needs more than one 80 GB GPU (16 bytes
        # per parameter, about 100 GiB before activations); step 4 shards it, step 5 trains adapters

One global batch = --total_batch_size rows per optimiser step; the device takes them
--batch_size_per_device at a time and accumulates the gradients. The loss is the mean over the
whole batch's tokens, so the next steps (DDP, FSDP) can split the same batch over several GPUs
and still take exactly the same optimiser step.
"""
import time
from contextlib import nullcontext

import torch
from tqdm import tqdm

from common.arguments import check_arguments, training_arguments
from common.batch import describe, gradient_accumulation_steps
from common.checkpoint import (checkpoint_bytes, load_file, load_newest, mark_complete, prepare, restore_rng,
                               stop_if_not_finite, train_state, written_whole)
from common.chess_eval import StopEvaluation, game_prefixes, legal_move_sums, share_of_rank, validation_loss_sums
from common.data import GlobalBatchSampler, count_loss_tokens, loss_sum, make_loader
from common.device import pick_device
from common.errors import exit_on_user_error, say
from common.hang import Watchdog
from common.metrics import (MetricsLog, StepTimer, flops_per_token, model_flops_utilization, peak_memory,
                            print_summary, run_params, write_summary)
from common.model import enable_gradient_checkpointing, load_config, load_model, load_tokenizer
from common.notation import training_notation
from common.optim import make_optimizer, make_scheduler
from common.output_dir import OutputDir, run_settings
from common.profiling import StepProfiler
from common.prepare_data import prepared_rows, read_games
from common.signals import StopFlag


def parse_arguments(argv=None):
    return training_arguments(__doc__.split("\n\n")[0]).parse_args(argv)


def train_step(model, optimizer, micro_batches, args, device, autocast):
    """One optimiser step on this rank's micro-batches; returns the step's tokens, summed loss and
    gradient norm. The plan check (tools/check_plan.py) runs steps 4 and 5's on fake tensors."""
    # Every token of the global batch weighs the same: divide each micro-batch's summed
    # loss by the token count of the whole global batch, not by its own.
    step_tokens = sum(count_loss_tokens(batch) for batch in micro_batches)

    step_loss = torch.zeros((), device=device)
    for batch in micro_batches:
        with autocast:
            loss = loss_sum(model, batch)
        (loss / step_tokens).backward()
        step_loss += loss.detach()

    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_tokens, step_loss, grad_norm


def main():
    args = parse_arguments()
    check_arguments(args)
    accumulation = gradient_accumulation_steps(args.total_batch_size, args.batch_size_per_device, 1)
    device = pick_device(args.device)
    output = OutputDir(args, is_main=True)  # one run at a time per output directory
    output_dir = output.run_dir  # what goes where: common/run_dir.py
    torch.manual_seed(args.seed)

    # Model: fp32 weights; on GPU the forward pass runs in bf16 under autocast
    # (bf16 has fp32's range, so no GradScaler is needed).
    config = load_config(args.model, args.trust_remote_code, max_seq_length=args.max_seq_length)
    tokenizer = load_tokenizer(args.model, config, args.trust_remote_code)
    notation = training_notation(args, config)  # how the games are written: common/notation.py
    model = load_model(args.model, args.trust_remote_code, config=config).to(device)
    model_flops = flops_per_token(model, args.max_seq_length)  # for MFU
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)

    # Data: tokenized once per data set, memory-mapped here; every optimiser step gets one global batch.
    pack = not args.no_packing
    train_rows = prepared_rows(args.data_dir, "train", tokenizer, args.max_seq_length, pack, args.prepared_dir,
                               notation=notation)
    validation_rows = prepared_rows(args.data_dir, "validation", tokenizer, args.max_seq_length, pack,
                                    args.prepared_dir, notation=notation)
    eval_rows = [validation_rows[i] for i in range(min(args.eval_rows, len(validation_rows)))]
    prefixes = game_prefixes(read_games(args.data_dir, "validation", args.eval_games), args.eval_games, args.seed)
    eval_rows = share_of_rank(eval_rows, 0, 1, "rows")
    prefixes = share_of_rank(prefixes, 0, 1, "game prefixes")
    sampler = GlobalBatchSampler(train_rows, args.total_batch_size, args.batch_size_per_device,
                                 rank=0, world_size=1, seed=args.seed, max_steps=args.max_steps)

    # Every input is checked; only now does the run write (and --overwrite delete the old run).
    note = output.start(run_settings(args, "one file", config, train_rows))
    tqdm.write(describe(args.total_batch_size, args.batch_size_per_device, 1, accumulation))

    # Checkpoints: one file with everything needed to continue exactly where the run stopped.
    def save_checkpoint(step):
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "train": train_state(step, scheduler, {"untrained": untrained})}
        path = output_dir.checkpoint(step)
        with prepare(path, checkpoint_bytes(state)):  # refused at once if the disk is too full
            torch.save(state, path / "state.pt")

    def load_checkpoint(path):
        nonlocal start_step, untrained
        state = load_file(path / "state.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["train"]["scheduler"])
        restore_rng(state["train"])
        start_step, untrained = state["train"]["step"], state["train"]["untrained"]

    start_step, untrained = 0, None
    if output.resume and (resumed_from := load_newest(output_dir, load_checkpoint)):
        tqdm.write(f"resuming from {resumed_from}" + (f"\n{note}" if note else ""))
    batches = iter(make_loader(train_rows, sampler.starting_at(start_step), tokenizer.pad_token_id, device))

    def evaluate(stop_requested=None):
        """Validation loss and legal-move rate."""
        model.eval()
        with autocast:
            sums = torch.stack([
                *validation_loss_sums(model, eval_rows, args.batch_size_per_device, tokenizer.pad_token_id, device,
                                      stop_requested),
                *legal_move_sums(model, tokenizer, notation, prefixes, args.batch_size_per_device, args.max_seq_length,
                                 device, stop_requested)])
        model.train()
        loss, tokens, legal, tried = sums.tolist()
        return {"eval_loss": loss / tokens, "legal_move_rate": legal / tried}

    if untrained is None:
        untrained = evaluate()
        tqdm.write(f"untrained model: {untrained}")
    # From here on SIGTERM (preemption, time limit), Slurm's USR2 warning and Ctrl-C make the run save
    # a checkpoint at the end of the step and stop (common/signals.py).
    stop = StopFlag(device)
    metrics = MetricsLog(output_dir, enabled=True, report_to=args.report_to,
                         params=run_params(args, 1, device), resumed_at=start_step)
    watchdog = Watchdog(output_dir.hang, args.collective_timeout)  # a hang ends the job, and says where
    profiler = StepProfiler(args.profile_steps, output_dir.profile, start_step, device)
    progress = tqdm(range(start_step, args.max_steps), desc="train", initial=start_step, total=args.max_steps,
                    mininterval=1.0)
    for step in progress:
        watchdog.phase("training", step + 1)
        timer = StepTimer(device)
        waiting = time.perf_counter()
        micro_batches = [{k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
                         for _ in range(accumulation)]
        timer.data_ready(waiting)
        step_tokens, step_loss, grad_norm = train_step(model, optimizer, micro_batches, args, device, autocast)
        scheduler.step()

        elapsed, data_wait = timer.finish()
        tokens, loss_total, grad_norm = torch.stack([step_tokens, step_loss, grad_norm]).tolist()  # one sync
        stop_if_not_finite(loss_total, step + 1, output_dir)
        record = {"step": step + 1, "loss": loss_total / tokens, "lr": scheduler.get_last_lr()[0],
                  "grad_norm": grad_norm, "tokens": int(tokens), "tokens_per_s": tokens / elapsed,
                  "tokens_per_s_per_device": tokens / elapsed, "step_time_s": elapsed,
                  "data_wait_s": data_wait, "world_size": 1, "gradient_accumulation_steps": accumulation,
                  "batch_size_per_device": args.batch_size_per_device, **peak_memory(device),
                  **model_flops_utilization(tokens / elapsed, model_flops, device)}
        stopping = stop.requested()
        if not stopping and ((args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.max_steps):
            watchdog.phase("evaluation", step + 1)
            try:
                record.update(evaluate(stop.requested))
                tqdm.write(f"step {step + 1}: eval_loss={record['eval_loss']:.4f} "
                           f"legal_move_rate={record['legal_move_rate']:.3f}")
            except StopEvaluation:
                stopping = True
        save_now = (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.max_steps or stopping
        if save_now:
            watchdog.phase("checkpoint", step + 1)
            saving = time.perf_counter()
            save_checkpoint(step + 1)
            record["checkpoint_save_s"] = time.perf_counter() - saving
        metrics.write(record)
        profiler.step()
        if save_now:  # only now, with its step on record, does the checkpoint count
            mark_complete(output_dir, step + 1, args.keep_checkpoints)
        progress.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if stopping:
            metrics.close()
            watchdog.done()
            say(f"preempted: saved a checkpoint at step {step + 1} in {output_dir}; continue with --resume "
                       f"(stopped by {stop.reason()})")
            return
    metrics.close()
    watchdog.phase("final model", args.max_steps)

    # The final model in Hugging Face format, loadable with AutoModelForCausalLM.from_pretrained.
    with written_whole(output_dir.final) as final:  # beside final/, then moved in: never half-written
        model.save_pretrained(final, safe_serialization=True)
        tokenizer.save_pretrained(final)
    summary = write_summary(output_dir, "02_singlegpu", metrics.records, untrained, [peak_memory(device)])
    print_summary("02_singlegpu", summary)
    watchdog.done()


if __name__ == "__main__":
    exit_on_user_error(main)
