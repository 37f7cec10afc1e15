"""Where checkpoints live and when one counts: the same rules for all three steps.

Each step saves in its natural form (02: one file; 03: rank 0 writes one file; 04: every rank
writes its shards with torch.distributed.checkpoint), into OUTPUT_DIR/checkpoints/step-NNNNNN/.
A checkpoint counts only once its COMPLETE marker exists, and the marker is written last: a job
killed in the middle of a save leaves a folder without a marker, which resume ignores.
"""
import os
import random
import shutil
from pathlib import Path

import torch

MARKER = "COMPLETE"
TRAIN_STATE = "train_state.pt"  # step, LR schedule, RNG: small, written by one rank


def checkpoint_dir(output_dir, step):
    return Path(output_dir) / "checkpoints" / f"step-{step:06d}"


def complete_checkpoints(output_dir):
    """Complete checkpoints, oldest first."""
    root = Path(output_dir) / "checkpoints"
    found = [path for path in root.glob("step-*") if (path / MARKER).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda path: int(path.name.removeprefix("step-")))


def prepare(path):
    """An empty folder for a new save (a leftover from a killed save at this step is removed)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def mark_complete(path, keep):
    """Write the marker (atomically), then drop all but the newest `keep` complete checkpoints."""
    partial = path / f"{MARKER}.partial"
    partial.write_text("ok\n")
    os.replace(partial, path / MARKER)
    for old in complete_checkpoints(path.parent.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def train_state(step, scheduler, extra):
    """Everything besides weights and optimizer: where the run is and the random state."""
    return {"step": step, "scheduler": scheduler.state_dict(), "python_rng": random.getstate(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [], **extra}


def restore_rng(state):
    random.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"]:
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def load_file(path):
    """torch.load restricted to tensors and plain containers: a checkpoint cannot run code."""
    return torch.load(path, map_location="cpu", weights_only=True)
