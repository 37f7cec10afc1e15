"""Step 2: fine-tune a Llama model on chess games with one GPU (or the CPU).

    python 02_singlegpu/train.py --output_dir runs/single            # the built-in tiny demo
    python 02_singlegpu/train.py --model codellama/CodeLlama-7b-hf --data_dir $SCRATCH/chess/data \
        --output_dir runs/single-7b --batch_size_per_device 2 --gradient_accumulation_steps 16

One global batch = batch_size_per_device × gradient_accumulation_steps rows. The loss is the
mean over that whole batch's tokens, so the next steps (DDP, FSDP) can split the same batch
over several GPUs and still take exactly the same optimiser step.
"""
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared `common` package

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common.checkpoint import (checkpoint_dir, load_file, load_newest, mark_complete, prepare,  # noqa: E402
                               restore_rng, stop_if_not_finite, train_state)
from common.chess_eval import game_prefixes, legal_move_sums, validation_loss_sums  # noqa: E402
from common.data import GlobalBatchSampler, count_loss_tokens, load_rows, loss_sum, make_loader  # noqa: E402
from common.errors import exit_on_user_error  # noqa: E402
from common.metrics import (MetricsLog, StepTimer, flops_per_token, model_flops_utilization,  # noqa: E402
                            peak_memory, print_summary, run_params, write_summary)
from common.signals import PreemptionFlag  # noqa: E402
from common.train_setup import (check_arguments, enable_gradient_checkpointing, load_model,  # noqa: E402
                                load_tokenizer, make_optimizer, make_scheduler, pick_device,
                                seed_everything, training_arguments)


def main():
    args = training_arguments(__doc__.split("\n\n")[0]).parse_args()
    check_arguments(args)
    seed_everything(args.seed)
    device = pick_device(args.device)
    output_dir = Path(args.output_dir)
    # Slurm's warning before a time limit or preemption: finish the step, save, exit cleanly.
    preemption = PreemptionFlag(device)  # from here on, USR2 no longer kills us

    # Model: fp32 weights; on GPU the forward pass runs in bf16 under autocast
    # (bf16 has fp32's range, so no GradScaler is needed).
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    model = load_model(args.model, args.trust_remote_code).to(device)
    model_flops = flops_per_token(model, args.max_seq_length)  # for MFU
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)

    # Checkpoints: one file with everything needed to continue exactly where the run stopped.
    def save_checkpoint(step):
        path = checkpoint_dir(output_dir, step)
        prepare(path)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "train": train_state(step, scheduler, {"untrained": untrained})}, path / "state.pt")

    def load_checkpoint(path):
        nonlocal start_step, untrained
        state = load_file(path / "state.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["train"]["scheduler"])
        restore_rng(state["train"])
        start_step, untrained = state["train"]["step"], state["train"]["untrained"]

    start_step, untrained = 0, None
    if args.resume and (resumed_from := load_newest(output_dir, load_checkpoint)):
        tqdm.write(f"resuming from {resumed_from}")

    # Data: tokenized once and cached; every optimiser step gets one global batch.
    cache_dir = Path(args.data_dir) / "tokenized"
    train_rows, _ = load_rows(Path(args.data_dir) / "train.jsonl", tokenizer, args.max_seq_length,
                              not args.no_packing, cache_dir)
    eval_rows, eval_games = load_rows(Path(args.data_dir) / "validation.jsonl", tokenizer,
                                      args.max_seq_length, not args.no_packing, cache_dir)
    eval_rows, prefixes = eval_rows[: args.eval_rows], game_prefixes(eval_games, args.eval_games, args.seed)
    sampler = GlobalBatchSampler(len(train_rows), args.batch_size_per_device, args.gradient_accumulation_steps,
                                 rank=0, world_size=1, seed=args.seed, start_step=start_step,
                                 max_steps=args.max_steps)
    batches = iter(make_loader(train_rows, sampler, tokenizer.pad_token_id, device))


    def evaluate():
        """Validation loss and legal-move rate."""
        model.eval()
        with autocast:
            sums = torch.stack([
                *validation_loss_sums(model, eval_rows, args.batch_size_per_device, tokenizer.pad_token_id, device),
                *legal_move_sums(model, tokenizer, prefixes, args.batch_size_per_device, args.max_seq_length, device)])
        model.train()
        loss, tokens, legal, tried = sums.tolist()
        return {"eval_loss": loss / tokens, "legal_move_rate": legal / tried}

    if untrained is None:
        untrained = evaluate()
        tqdm.write(f"untrained model: {untrained}")
    metrics = MetricsLog(output_dir, enabled=True, report_to=args.report_to,
                         params=run_params(args, 1, device), resumed_at=start_step)
    progress = tqdm(range(start_step, args.max_steps), desc="train", initial=start_step, total=args.max_steps,
                    mininterval=1.0)
    for step in progress:
        timer = StepTimer(device)
        waiting = time.perf_counter()
        micro_batches = [{k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
                         for _ in range(args.gradient_accumulation_steps)]
        timer.data_ready(waiting)
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
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        elapsed, data_wait = timer.finish()
        tokens, loss_total, grad_norm = torch.stack([step_tokens, step_loss, grad_norm]).tolist()  # one sync
        stop_if_not_finite(loss_total, step + 1, output_dir)
        record = {"step": step + 1, "loss": loss_total / tokens, "lr": scheduler.get_last_lr()[0],
                  "grad_norm": grad_norm, "tokens": int(tokens), "tokens_per_s": tokens / elapsed,
                  "tokens_per_s_per_device": tokens / elapsed, "step_time_s": elapsed,
                  "data_wait_s": data_wait, "world_size": 1,
                  "gradient_accumulation_steps": args.gradient_accumulation_steps,
                  "batch_size_per_device": args.batch_size_per_device, **peak_memory(device),
                  **model_flops_utilization(tokens / elapsed, model_flops, device)}
        preempted = preemption.requested()
        if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.max_steps:
            record.update(evaluate())
            tqdm.write(f"step {step + 1}: eval_loss={record['eval_loss']:.4f} "
                       f"legal_move_rate={record['legal_move_rate']:.3f}")
        save_now = (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.max_steps or preempted
        if save_now:
            saving = time.perf_counter()
            save_checkpoint(step + 1)
            record["checkpoint_save_s"] = time.perf_counter() - saving
        metrics.write(record)
        if save_now:  # only now, with its step on record, does the checkpoint count
            mark_complete(checkpoint_dir(output_dir, step + 1), args.keep_checkpoints)
        progress.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if preempted and step + 1 < args.max_steps:
            metrics.close()
            tqdm.write(f"preempted: saved a checkpoint at step {step + 1} in {output_dir}; continue with --resume")
            return
    metrics.close()

    # The final model in Hugging Face format, loadable with AutoModelForCausalLM.from_pretrained.
    model.save_pretrained(output_dir / "final", safe_serialization=True)
    tokenizer.save_pretrained(output_dir / "final")
    summary = write_summary(output_dir, "02_singlegpu", metrics.records, untrained, [peak_memory(device)])
    print_summary("02_singlegpu", summary)


if __name__ == "__main__":
    exit_on_user_error(main)
