"""The training interface shared by the three steps: arguments, device, model, optimiser, schedule."""
import argparse
import math
import os
import random
import shutil
from pathlib import Path

import torch

from common.errors import UserError
from common.tracking import parse_report_to

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = REPO / "demo"
DOWNLOAD_HINT = "python 01_download/download.py --demo --out demo"


def add_flag(parser, name, **kwargs):
    """--batch_size_per_device, also spelt --batch-size-per-device."""
    spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*spellings, dest=name, **kwargs)


def training_arguments(description):
    """The arguments every step takes. Defaults run the built-in tiny demo on any laptop."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flag(parser, "model", default=str(DEMO_DIR / "model"),
             help="local model directory or Hugging Face id (already downloaded; see 01_download)")
    add_flag(parser, "data_dir", default=str(DEMO_DIR / "data"), help="directory with train.jsonl and validation.jsonl")
    add_flag(parser, "output_dir", required=True, help="metrics.jsonl and final/ go here")
    add_flag(parser, "batch_size_per_device", type=int, default=4, help="rows per forward pass on each device")
    add_flag(parser, "gradient_accumulation_steps", type=int, default=1,
             help="micro-batches per optimiser step on each device")
    add_flag(parser, "max_steps", type=int, default=100, help="optimiser steps")
    add_flag(parser, "learning_rate", type=float, default=1e-3, help="peak learning rate")
    add_flag(parser, "warmup_steps", type=int, default=None, help="linear warm-up steps (default: 10%% of max_steps)")
    add_flag(parser, "weight_decay", type=float, default=0.0)
    add_flag(parser, "max_grad_norm", type=float, default=1.0, help="gradient clipping")
    add_flag(parser, "seed", type=int, default=0)
    add_flag(parser, "max_seq_length", type=int, default=256, help="tokens per row")
    add_flag(parser, "no_packing", action="store_true",
             help="one game per row with padding, instead of packing games into full rows")
    add_flag(parser, "gradient_checkpointing", action="store_true",
             help="recompute each decoder layer's activations in backward to save memory")
    add_flag(parser, "eval_every", type=int, default=50, help="validation loss every N steps (0: only at the end)")
    add_flag(parser, "eval_rows", type=int, default=64, help="validation rows for the validation loss")
    add_flag(parser, "eval_games", type=int, default=64, help="game prefixes for the legal-move rate")
    add_flag(parser, "device", choices=["auto", "cpu", "cuda"], default="auto",
             help="auto: CUDA when a GPU is usable, else CPU")
    add_flag(parser, "save_every", type=int, default=0,
             help="save a checkpoint every N steps (0: only at the end)")
    add_flag(parser, "keep_checkpoints", type=int, default=2, help="complete checkpoints to keep")
    add_flag(parser, "resume", action="store_true",
             help="continue from the newest complete checkpoint in --output_dir (start afresh if none)")
    add_flag(parser, "overwrite", action="store_true",
             help="replace the run in --output_dir (its metrics and checkpoints are deleted)")
    add_flag(parser, "trust_remote_code", action="store_true",
             help="let the model directory run its own Python code (off: only transformers' own classes load)")
    add_flag(parser, "report_to", default="none",
             help="also track in: none, or a comma-separated list of tensorboard, mlflow, wandb")
    return parser


def check_arguments(args, world_size=1):
    """Refuse settings that cannot work, before any expensive work starts."""
    for name in ("batch_size_per_device", "gradient_accumulation_steps", "max_steps", "eval_rows", "eval_games",
                 "keep_checkpoints"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.max_seq_length < 16:
        raise UserError(f"--max_seq_length must be at least 16 tokens (got {args.max_seq_length})")
    if not args.learning_rate > 0:
        raise UserError(f"--learning_rate must be positive (got {args.learning_rate})")
    if args.eval_every < 0 or args.save_every < 0:
        raise UserError("--eval_every and --save_every must be 0 (only at the end) or positive")
    if args.resume and args.overwrite:
        raise UserError("--resume continues the run in --output_dir, --overwrite replaces it: choose one")
    args.report_to = parse_report_to(args.report_to)
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.max_steps // 10)
    if not 0 <= args.warmup_steps <= args.max_steps:
        raise UserError(f"--warmup_steps must be between 0 and --max_steps ({args.max_steps})")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no usable GPU here: use --device cpu (or auto), "
                        "or run on a GPU node")
    for name in ("train.jsonl", "validation.jsonl"):
        if not (Path(args.data_dir) / name).is_file():
            raise UserError(f"no {name} in {args.data_dir}: run `{DOWNLOAD_HINT}` "
                            "(or the real download) first, or pass --data_dir")
    output_dir = Path(args.output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create --output_dir {output_dir}: {err.strerror}") from None
    probe = output_dir / f".write-test-{os.getpid()}"  # a real write: os.access says yes to root, always
    try:
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise UserError(f"--output_dir {output_dir} is not writable ({err.strerror}): choose another directory") from None
    if (output_dir / "metrics.jsonl").exists() and not (args.overwrite or args.resume):
        raise UserError(f"{output_dir} already holds a run: pass --resume to continue it, --overwrite "
                        "to replace it, or choose another --output_dir")
    if args.overwrite:
        shutil.rmtree(output_dir / "checkpoints", ignore_errors=True)  # else --resume could pick them up later


def pick_device(choice, local_rank=0):
    """The device of this process. Under torchrun it is the node-local rank's GPU, never the
    global rank (global rank 5 on a 4-GPU node has no GPU 5)."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def seed_everything(seed):
    random.seed(seed)
    torch.manual_seed(seed)


def load_tokenizer(name, trust_remote_code=False):
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(model_missing_message(name, err)) from None
    if tokenizer.pad_token_id is None:  # Llama tokenizers have none; padding is masked out anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name, trust_remote_code=False, **kwargs):
    """The same Hugging Face path for CodeLlama-7b and the demo model: AutoModelForCausalLM.
    Weights stay fp32 here: mixed precision is applied per step, never by casting the model.
    Code shipped inside a model directory runs only with --trust_remote_code."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, trust_remote_code=trust_remote_code,
                                                    **kwargs)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:  # missing, or damaged
        raise UserError(model_missing_message(name, err)) from None


def model_missing_message(name, err):
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if Path(name).exists() or os.sep in name or name.startswith("."):
        return (f"cannot load the model at {name} ({first_line}): run `{DOWNLOAD_HINT}` "
                "for the demo model, or re-run the download step if the files are damaged")
    return (f"cannot load {name} ({first_line}): download it on a login node first with "
            f"`python 01_download/download.py --model {name}`, then run with HF_HUB_OFFLINE=1")


def make_optimizer(model, args):
    """AdamW over the trainable parameters only (with LoRA: the adapters, not the frozen model)."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    return torch.optim.AdamW(trainable, lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=args.weight_decay)


def make_scheduler(optimizer, args):
    """Linear warm-up to the peak learning rate, then cosine decay to 10% of it."""
    def factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def enable_gradient_checkpointing(model):
    """Per decoder layer, non-reentrant; HF keeps its hooks outside the recomputed region."""
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
