"""The training arguments every step takes, and the checks that refuse settings that cannot work.

Parsing is strict, because a launcher passes some of these itself and the user adds the rest:
an abbreviation (`--batch_size 3`) is not accepted, and an option given twice is refused instead
of letting the last one silently win. Checking has no side effects: nothing is created or
deleted here (see common/output_dir.py for the output directory).
"""
import argparse
import math
import re
import sys
from pathlib import Path

from common.errors import UserError
from common.notation import NOTATIONS
from common.speed import RECOMPUTATION
from common.tracking import parse_report_to

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = REPO / "demo"
# Rank 0 reads CodeLlama-7b's 27 GB (or writes step 3's 81 GB checkpoint) while the others wait:
# an hour covers that at 25 MB/s, the speed of a busy shared file system.
COLLECTIVE_TIMEOUT_S = 3600
MAX_COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, no abbreviations and no repeated options."""

    def __init__(self, description):
        super().__init__(description=description, allow_abbrev=False,
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def add(self, name, **kwargs):
        """--batch_size_per_device, also spelt --batch-size-per-device."""
        spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        self.add_argument(*spellings, dest=name, **kwargs)

    def error(self, message):
        # A type's refusal (at_least): "argument --steps/--steps-x: must be ..." -> "--steps must be ..."
        option, _, rest = message.removeprefix("argument ").partition(": ")
        if message.startswith("argument --") and rest.startswith("must be"):
            message = f"{option.split('/')[0]} {rest}"
        raise UserError(f"{message} (see --help)")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self.refuse_repeats(args)
        return super().parse_args(args, namespace)

    def refuse_repeats(self, args):
        seen = {}
        for arg in args:
            if arg == "--":
                break
            action = self._option_string_actions.get(arg.split("=", 1)[0])
            if action is None or not action.option_strings[0].startswith("--"):
                continue
            name = arg.split("=", 1)[0]
            if action.dest in seen:
                raise UserError(f"{action.option_strings[0]} is given twice ({seen[action.dest]} and {name}): "
                                "pass it once. The Slurm templates and submit.py set --total_batch_size, "
                                "--batch_size_per_device, --model, --data_dir and --output_dir themselves; "
                                "change them there")
            seen[action.dest] = name


def at_least(least):
    """An argparse type: a whole number, at least `least` (a count of steps, games, GPUs, ...).
    A negative count is refused as the option is read, in one line: `--steps must be at least 2 (got -5)`."""
    def whole_number(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number (got {text!r})") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least} (got {value})")
        return value
    whole_number.__name__ = f"whole number of at least {least}"
    return whole_number


def step_range(text):
    """An argparse type: `A-B` (or `A`), the optimiser steps to profile, counted from 1."""
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"must be a step or a range of steps such as 5-7 (got {text!r})")
    first, last = int(match[1]), int(match[2] or match[1])
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"must be steps from 1 on, the first not after the last (got {text!r})")
    return first, last


def training_arguments(description):
    """The arguments every step takes. Defaults run the built-in tiny demo on any laptop."""
    parser = Parser(description)
    parser.add("model", default=str(DEMO_DIR / "model"),
               help="local model directory or Hugging Face id (already downloaded; see 01_download)")
    parser.add("data_dir", default=str(DEMO_DIR / "data"),
               help="directory with the games: train.jsonl or train/*.parquet, and validation.jsonl or validation/")
    parser.add("prepared_dir", default=None,
               help="where the tokenized games are kept (default: $HF_DATASETS_CACHE/chess-kit); "
                    "see 01_download/prepare.py")
    parser.add("output_dir", required=True, help="metrics.jsonl, checkpoints/ and final/ go here")
    parser.add("total_batch_size", type=int, default=16,
               help="rows per optimiser step, over all devices: the same at any GPU count")
    parser.add("batch_size_per_device", type=int, default=4,
               help="rows per forward pass on each device; the gradient accumulation makes up the rest")
    parser.add("max_steps", type=int, default=100, help="optimiser steps")
    parser.add("learning_rate", type=float, default=1e-3, help="peak learning rate")
    parser.add("warmup_steps", type=int, default=None, help="linear warm-up steps (default: 10%% of max_steps)")
    parser.add("weight_decay", type=float, default=0.0, help="the optimiser's decoupled weight decay, 0 to 1")
    parser.add("optimizer", choices=["adamw", "muon"], default="adamw",
               help="adamw; or muon: Muon for the decoder's weight matrices, AdamW for the rest (embeddings, "
                    "output head, norms), at the same --learning_rate: for training from scratch "
                    "(benchmark/learn_chess.py)")
    parser.add("max_grad_norm", type=float, default=1.0, help="gradient clipping")
    parser.add("seed", type=int, default=0)
    parser.add("max_seq_length", type=int, default=256, help="tokens per row")
    parser.add("notation", choices=NOTATIONS, default=None,
               help="how the games are written for the model: uci (e2e4) or piece (P e2 e4, common/notation.py); "
                    "default: the one the model's config.json names (chess_notation), else uci")
    parser.add("data_workers", type=at_least(0), default=None,
               help="processes per rank that make the next batches while it trains (default: 2 on a GPU, 0 on the CPU)")
    parser.add("no_packing", action="store_true",
               help="one game per row with padding, instead of packing games into full rows")
    parser.add("gradient_checkpointing", nargs="?", const="full", default=None, choices=RECOMPUTATION,
               help="recompute each decoder layer's activations in backward to save memory: all of them (full, "
                    "what the flag alone means), or all but the matmuls' and attention's outputs (selective: "
                    "more memory, almost no recomputed FLOPs); common/speed.py")
    parser.add("compile", action="store_true",
               help="torch.compile each decoder layer for the training steps (a GPU lever; evaluation stays eager)")
    parser.add("loss_chunk_size", type=at_least(0), default=0,
               help="compute the loss this many tokens at a time, never the whole batch's fp32 logits at once "
                    "(0: all at once)")
    parser.add("eval_every", type=int, default=50, help="validation loss every N steps (0: only at the end)")
    parser.add("eval_rows", type=int, default=64, help="validation rows for the validation loss")
    parser.add("eval_games", type=int, default=64, help="game prefixes for the legal-move rate")
    parser.add("device", choices=["auto", "cpu", "cuda"], default="auto",
               help="auto: CUDA when a GPU is usable, else CPU")
    parser.add("collective_timeout", type=int, default=COLLECTIVE_TIMEOUT_S,
               help="seconds a rank waits in a collective for the others before the job fails (steps 3-5): "
                    "the default covers rank 0 reading or writing 7B on a slow shared disk meanwhile")
    parser.add("profile_steps", type=step_range, default=None,
               help="A-B: a torch.profiler trace of optimiser steps A to B and a summary, in OUTPUT_DIR/profile/")
    parser.add("save_every", type=int, default=0, help="save a checkpoint every N steps (0: only at the end)")
    parser.add("keep_checkpoints", type=int, default=2, help="complete checkpoints to keep")
    parser.add("resume", action="store_true",
               help="continue the run in --output_dir from its newest complete checkpoint (start afresh if none)")
    parser.add("overwrite", action="store_true",
               help="replace the run in --output_dir (its metrics, checkpoints and final model are deleted "
                    "once every input has been checked)")
    parser.add("trust_remote_code", action="store_true",
               help="let the model directory run its own Python code (off: only transformers' own classes load)")
    parser.add("report_to", default="none",
               help="also track in: none, or a comma-separated list of tensorboard, mlflow, wandb")
    return parser


def check_arguments(args):
    """Refuse settings that cannot work or make training meaningless, before any work starts."""
    if not args.output_dir:  # '' would be the current directory
        raise UserError("--output_dir is empty: name a directory for the run, e.g. --output_dir runs/my-run")
    for name in ("total_batch_size", "batch_size_per_device", "max_steps", "eval_rows", "eval_games",
                 "keep_checkpoints"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.max_seq_length < 16:
        raise UserError(f"--max_seq_length must be at least 16 tokens (got {args.max_seq_length})")
    if not (args.learning_rate > 0 and math.isfinite(args.learning_rate)):
        raise UserError(f"--learning_rate must be a positive number (got {args.learning_rate})")
    if not 0 <= args.weight_decay <= 1:
        raise UserError(f"--weight_decay must be between 0 and 1 (got {args.weight_decay})")
    if not (args.max_grad_norm > 0 and math.isfinite(args.max_grad_norm)):
        raise UserError(f"--max_grad_norm must be a positive number (got {args.max_grad_norm}): it is the "
                        "largest gradient norm kept; 1.0 is usual")
    if not 0 <= args.seed < 2**32:
        raise UserError(f"--seed must be between 0 and 2**32 - 1 (got {args.seed})")
    if args.eval_every < 0 or args.save_every < 0:
        raise UserError("--eval_every and --save_every must be 0 (only at the end) or positive")
    if not 1 <= args.collective_timeout <= MAX_COLLECTIVE_TIMEOUT_S:  # beyond, timers overflow (watchdog, c10d)
        raise UserError(f"--collective_timeout must be from 1 second to a week, {MAX_COLLECTIVE_TIMEOUT_S} (got "
                        f"{args.collective_timeout})")
    if args.profile_steps and args.profile_steps[1] > args.max_steps:
        raise UserError(f"--profile_steps {args.profile_steps[0]}-{args.profile_steps[1]} reaches past --max_steps "
                        f"{args.max_steps}: profile steps of the run, from 1 to {args.max_steps}")
    if args.resume and args.overwrite:
        raise UserError("--resume continues the run in --output_dir, --overwrite replaces it: choose one")
    args.report_to = parse_report_to(args.report_to)
    args.warmup_is_default = args.warmup_steps is None
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.max_steps // 10)
    if not 0 <= args.warmup_steps <= args.max_steps:
        raise UserError(f"--warmup_steps must be between 0 and --max_steps ({args.max_steps})")
