"""How long will a step-4/5/6 job take? The plan check's time line (tools/check_plan.py).

The job's time is its loading, its optimiser steps and its checkpoint writes:
  * a step: the FLOPs of one step on one GPU (common/metrics.py's count per token, the recomputed
    forward of --gradient_checkpointing added) at the GPU's peak x its MFU;
  * loading: the model's bytes read by rank 0, and the start (imports, rendezvous, the data);
  * a checkpoint: rank 0's parameters and AdamW state written.
The `--time` to ask for is that with a margin. Evaluations (--eval_every) are left out: a forward
pass of --eval_rows rows, a small part of a real job. Every figure the prediction assumes is below.
"""
import math
import re

from common.errors import UserError

# MFU measured by the GPU check (benchmark/gpu_check.py) on one H100 80GB HBM3, 2026-11-27
# (benchmark/README.md, "On a GPU"): a full fine-tune of 17 layers of the 7B shape, LoRA and QLoRA on
# the 7B shape, 16 x 2,048 tokens per GPU, activation checkpointing.
MEASURED_MFU = {"NVIDIA H100 80GB HBM3": {"full": 0.358, "lora": 0.261, "qlora": 0.242}}
# Any other GPU: a round 30 % for a full fine-tune (below the H100's 35.8 %), the H100's figures for
# LoRA and QLoRA (their frozen weights' small matmuls keep the GPU from its peak on any GPU).
DEFAULT_MFU = {"full": 0.30, "lora": 0.261, "qlora": 0.242}
# Those rows recomputed every layer (--gradient_checkpointing) and MFU counts useful FLOPs only: in the same
# time the GPU also ran the recomputed forward, 2 FLOPs per weight on top of 6 (trained) or 4 (frozen). The
# speed a job's FLOPs run at, its recomputation counted with them, is MFU x this.
WITH_RECOMPUTATION = {"full": 8 / 6, "lora": 6 / 4, "qlora": 6 / 4}
# A GPU the plan check cannot see (the login node has none) or whose peak common/metrics.py does not know.
DEFAULT_GPU = "NVIDIA H100 80GB HBM3"
READ_BYTES_PER_S = 0.5e9  # rank 0 reads the checkpoint from a shared file system under load
CHECKPOINT_BYTES = 2  # a Hugging Face checkpoint's bytes per parameter (bf16)
START_S = 60  # Python's imports, torchrun's rendezvous, the prepared data read
WRITE_BYTES_PER_S = 1e9  # each rank writes its shards of a checkpoint (DCP), all at once
MARGIN, MIN_MARGIN_S = 0.20, 600  # the --time asked for: the prediction + 20 %, and at least 10 minutes more
WARNING_S = 300  # Slurm's USR2 warning before the time limit (launch/step_launcher.py, the templates)


def mfu_for(gpu, kind):
    """(MFU, where the figure comes from) for `kind` ("full", "lora", "qlora") on the GPU named `gpu`."""
    if kind in MEASURED_MFU.get(gpu, {}):
        return MEASURED_MFU[gpu][kind], "the GPU check's on that GPU, benchmark/README.md"
    return DEFAULT_MFU[kind], "the kit's default for a GPU the GPU check has not measured, tools/job_time.py"


def predict(flops_per_token, recomputed_flops_per_token, tokens_per_step, ranks, flops_per_s, max_steps, save_every,
            parameters, checkpoint_bytes_per_rank):
    """The job's seconds: loading, each step, each checkpoint; how many of each; the total and the
    `--time` to ask for. `flops_per_s` is one GPU's achieved speed (peak x MFU)."""
    step_s = tokens_per_step * (flops_per_token + recomputed_flops_per_token) / ranks / flops_per_s
    saves = (max_steps // save_every if save_every else 0) + (1 if not save_every or max_steps % save_every else 0)
    loading_s = START_S + parameters * CHECKPOINT_BYTES / READ_BYTES_PER_S
    save_s = checkpoint_bytes_per_rank / WRITE_BYTES_PER_S
    total_s = loading_s + max_steps * step_s + saves * save_s
    first_save_step = min(save_every, max_steps) if save_every else max_steps
    return {"step_s": step_s, "steps": max_steps, "loading_s": loading_s, "save_s": save_s, "saves": saves,
            "first_checkpoint_s": loading_s + first_save_step * step_s + save_s, "total_s": total_s,
            "flops_per_s": flops_per_s, "request": slurm_time(request_seconds(total_s))}


def request_seconds(total_s):
    """The time limit to ask for: the prediction with its margin, in whole minutes."""
    return math.ceil(max(total_s * (1 + MARGIN), total_s + MIN_MARGIN_S) / 60) * 60


def slurm_time(seconds):
    """Seconds as Slurm writes a time limit: HH:MM:SS, or D-HH:MM:SS from a day on."""
    days, rest = divmod(math.ceil(seconds), 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def slurm_seconds(text, option="--time"):
    """Slurm's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; squeue's time left too) → seconds."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise UserError(f"{option} {text!r} is not a Slurm time limit (minutes, HH:MM:SS or D-HH:MM:SS)")
    days, first, second, third = match.groups()
    # Past the first field, each counts up to the next: hours to 23 after a day, minutes and seconds to 59.
    limits = [(24 if days is not None else None, first), (60, second), (60, third)]
    if any(field is not None and limit is not None and int(field) >= limit for limit, field in limits):
        raise UserError(f"{option} {text!r} is not a Slurm time limit: after D- the hours run 0-23, and minutes and "
                        "seconds 0-59 (e.g. 1-12:30:00 for a day and a half)")
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + int(first) * 3600 + int(second or 0) * 60 + int(third or 0)
    if third is not None:  # HH:MM:SS
        return int(first) * 3600 + int(second) * 60 + int(third)
    return int(first) * 60 + int(second or 0)  # MM[:SS]


def killed_before_checkpoint(time, limit_s):
    """Whether a job with `limit_s` seconds ends before any checkpoint: its first save comes after the limit,
    and Slurm's warning (which saves one, and requeues) comes before its first step has ended or leaves
    too little time for a step and a save."""
    at_warning = (time["loading_s"] + time["step_s"] <= limit_s - WARNING_S
                  and time["step_s"] + time["save_s"] <= WARNING_S)
    return limit_s < time["first_checkpoint_s"] and not at_warning


def duration(seconds):
    """A number of seconds for people: minutes under an hour, else Slurm's format."""
    return slurm_time(seconds) if seconds >= 3600 else f"{seconds / 60:.1f} min"
