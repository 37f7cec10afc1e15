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
from contextlib import nullcontext

import torch
from tqdm import tqdm

from common import checkpoint
from common.arguments import check_arguments, training_arguments
from common.batch import describe, gradient_accumulation_steps
from common.chess_eval import Evaluation
from common.data import count_loss_tokens, loss_sum, training_data
from common.device import pick_device
from common.errors import exit_on_user_error
from common.hang import Watchdog
from common.metrics import MetricsLog
from common.model import load_model, load_model_files
from common.optim import make_optimizer, make_scheduler
from common.output_dir import OutputDir, run_settings
from common.profiling import StepProfiler
from common.signals import StopFlag
from common.speed import prepare_layers


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
            loss = loss_sum(model, batch, args.loss_chunk_size)
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
    watchdog = Watchdog(output_dir.hang, args.collective_timeout, "loading")  # a hang ends the run, and says where
    torch.manual_seed(args.seed)

    # Model: fp32 weights; on GPU the forward pass runs in bf16 under autocast
    # (bf16 has fp32's range, so no GradScaler is needed).
    config, tokenizer, notation = load_model_files(args)  # and how the games are written: common/notation.py
    model = load_model(args.model, args.trust_remote_code, config=config).to(device)
    prepare_layers(model, args)  # --gradient_checkpointing, --compile: common/speed.py
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args)

    # Data: every optimiser step gets one global batch.
    with watchdog.unwatched("preparing the data"):  # hours for a big data set
        train_rows, sampler = training_data(args, tokenizer, notation)
        evaluation = Evaluation(args, tokenizer, notation)

    # Every input is checked; only now does the run write (and --overwrite delete the old run).
    note = output.start(run_settings(args, "one file", config, train_rows))
    tqdm.write(describe(args.total_batch_size, args.batch_size_per_device, 1, accumulation))

    # Checkpoints: one file with everything needed to continue exactly where the run stopped.
    def save_checkpoint(step):
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "train": checkpoint.train_state(step, scheduler, {"untrained": untrained})}
        path = output_dir.checkpoint(step)
        with checkpoint.prepare(path, checkpoint.checkpoint_bytes(state)):  # refused at once if the disk is full
            torch.save(state, path / "state.pt")

    def load_checkpoint(path):
        nonlocal start_step, untrained
        state = checkpoint.load_file(path / "state.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["train"]["scheduler"])
        checkpoint.restore_rng(state["train"])
        start_step, untrained = state["train"]["step"], state["train"]["untrained"]

    start_step, untrained = 0, None
    if output.resume and (resumed_from := checkpoint.load_newest(output_dir, load_checkpoint)):
        tqdm.write(f"resuming from {resumed_from}" + (f"\n{note}" if note else ""))
    # From here on SIGTERM (preemption, time limit), Slurm's USR2 warning and Ctrl-C make the run save
    # a checkpoint at the end of the step and stop (common/signals.py); the loader's workers leave it to the rank.
    stop = StopFlag(device)
    batches = sampler.batches(train_rows, start_step, tokenizer.pad_token_id, device, args.data_workers)

    def evaluate(stop_requested=None):
        """Validation loss and legal-move rate; None if the run was asked to stop meanwhile."""
        model.eval()
        with autocast:
            sums = evaluation.sums(model, device, stop_requested)
        model.train()
        if sums is None:
            return None
        return evaluation.figures(sums)

    if untrained is None:
        watchdog.phase("untrained evaluation")
        untrained = evaluate()
        tqdm.write(f"untrained model: {untrained}")
    metrics = MetricsLog(output_dir, True, args, model, 1, accumulation, device, resumed_at=start_step)
    profiler = StepProfiler(args.profile_steps, output_dir.profile, start_step, device)
    if metrics.evaluation_missing():  # a stop came between the resumed step and its evaluation
        watchdog.phase("evaluation", start_step)
        metrics.add_evaluation(evaluate())
    progress = tqdm(range(start_step, args.max_steps), desc="train", initial=start_step, total=args.max_steps,
                    mininterval=1.0)
    for step in progress:
        watchdog.phase("training", step + 1)
        timer = metrics.timer()
        with timer.waiting_for_data():
            micro_batches = [{k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
                             for _ in range(accumulation)]
        step_tokens, step_loss, grad_norm = train_step(model, optimizer, micro_batches, args, device, autocast)
        scheduler.step()

        # The step's one wait for the GPU: its figures, and whether the run was asked to stop.
        tokens, loss_total, grad_norm, stopping = torch.stack([step_tokens, step_loss, grad_norm,
                                                               stop.any_rank()]).tolist()
        checkpoint.stop_if_not_finite(loss_total, step + 1, output_dir, model)
        record = metrics.step_record(step + 1, tokens, loss_total, grad_norm, scheduler.get_last_lr()[0], timer)
        if not stopping and metrics.evaluates_at(step + 1):
            watchdog.phase("evaluation", step + 1)
            figures = evaluate(stop.requested)
            stopping = figures is None
            if figures:
                record.update(figures)
                tqdm.write(f"step {step + 1}: eval_loss={record['eval_loss']:.4f} "
                           f"legal_move_rate={record['legal_move_rate']:.3f}")
        save_now = (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.max_steps or stopping
        if save_now:
            watchdog.phase("checkpoint", step + 1)
            record["checkpoint_save_s"] = timer.seconds(save_checkpoint, step + 1)
        metrics.write(record)
        profiler.step()
        if save_now:  # only now, with its step on record, does the checkpoint count
            checkpoint.mark_complete(output_dir, step + 1, args.keep_checkpoints)
        progress.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if stopping:
            metrics.close()
            watchdog.done()
            stop.say_saved(step + 1, output_dir)
            return
    watchdog.phase("final model")

    # The final model in Hugging Face format, loadable with AutoModelForCausalLM.from_pretrained.
    with checkpoint.written_whole(output_dir.final) as final:  # beside final/, then moved in: never half-written
        model.save_pretrained(final, safe_serialization=True)
        tokenizer.save_pretrained(final)
    metrics.finish("02_singlegpu", untrained, [metrics.peak_memory()])
    watchdog.done()


if __name__ == "__main__":
    exit_on_user_error(main)
