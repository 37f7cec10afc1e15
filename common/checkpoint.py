"""When a checkpoint counts, and how it is saved and read: the same rules for all the steps.

Each step saves in its natural form (02: one file; 03: rank 0 writes one file; 04: every rank
writes its shards with torch.distributed.checkpoint), into its folder of the run directory
(common/run_dir.py). A checkpoint counts only once its marker exists, and the marker is written
last: a job killed in the middle of a save leaves a folder without a marker, which resume ignores.
"""
import contextlib
import errno
import math
import os
import pickle
import random
import shutil
import sys
from pathlib import Path

import torch

from common.errors import UserError

TRAIN_STATE = "train_state.pt"  # step, LR schedule, RNG: small, written by one rank


def load_newest(run_dir, load):
    """Resume: call `load(path)` on the newest complete checkpoint that can be read, and return
    that path (None when there is none: a fresh start). A damaged one (a file truncated or
    corrupted on disk after it was completed) is reported and the previous one used instead.
    Every rank must reach the same verdict: they all read the same files, and DCP raises on all
    ranks when one of them fails."""
    checkpoints = run_dir.complete_checkpoints()
    for path in reversed(checkpoints):
        try:
            load(path)
            return path
        except (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError,
                *dcp_errors()) as err:
            reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            print(f"warning: checkpoint {path} is unreadable ({reason}): falling back to the previous one",
                  file=sys.stderr, flush=True)
    if checkpoints:
        raise UserError(f"none of the {len(checkpoints)} complete checkpoints in {run_dir.checkpoints_dir} can "
                        "be read by this run (see the warnings above): if the files are damaged, restore them from "
                        "a backup; they are left as they are. A new run can start in another --output_dir")
    return None


def stop_if_not_finite(loss, step, run_dir):
    """A NaN or infinite loss poisons the weights from this step on: stop before anything is saved."""
    if math.isfinite(loss):
        return
    latest = run_dir.latest_checkpoint()
    last_good = f"the last good checkpoint is {latest}" if latest else "no checkpoint was saved yet"
    raise UserError(f"loss is {loss} at step {step}: stopped without saving this step ({last_good}). "
                    "Lower --learning_rate (or check the data and model files), then continue with --resume")


def tensor_bytes(state):
    """Bytes that saving the tensors of a (nested) state dict writes: a DTensor counts with its
    full size, whatever its sharding. torch.distributed.checkpoint writes each piece of a tensor
    once, however many ranks hold a copy (HYBRID_SHARD's replicas, NO_SHARD's full copies, the
    plain tensors every rank has), so the ranks' files together hold each tensor exactly once."""
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()  # a DTensor's numel() is its global one
    return 0


def size(n):
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def prepare(path, needed_bytes):
    """An empty folder for a new save (a leftover from a killed save at this step is removed),
    refused before writing anything if the disk cannot hold the checkpoint. Returns a context for
    the writes: a disk that fills up anyway is one line too."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise UserError(disk_full_message(path, needed_bytes, free))
    return disk_full_is_one_line(path, needed_bytes)


@contextlib.contextmanager
def disk_full_is_one_line(path, needed_bytes):
    """A checkpoint write that fills the disk stops the run with one line that says so (the
    folder stays incomplete, without its marker: --resume never uses it)."""
    try:
        yield
    except (OSError, RuntimeError, *dcp_errors()) as err:
        if is_disk_full(err):
            raise UserError(disk_full_message(path, needed_bytes)) from None
        raise


def disk_full_message(path, needed_bytes, free=None):
    free = shutil.disk_usage(path.parent).free if free is None else free
    return (f"no room for a checkpoint in {path.parent}: one needs about {size(needed_bytes)}, the disk has "
            f"{size(free)} free. Free some space (--keep_checkpoints keeps fewer) or move --output_dir to a "
            "bigger file system; the last complete checkpoint is untouched")


def is_disk_full(err):
    return getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in str(err)


def readable_by_others(folder):
    """Give saved files the permissions of the user's umask: safetensors creates them rw-------,
    which would keep colleagues in a shared project directory from reading the model."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [Path(folder), *Path(folder).rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def mark_complete(run_dir, step, keep):
    """Mark the checkpoint of `step` complete, then drop all but the run's newest `keep` complete
    checkpoints (only its own: common/run_dir.py)."""
    path = run_dir.checkpoint(step)
    run_dir.write_marker(path)
    readable_by_others(path)
    for old in run_dir.complete_checkpoints()[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def train_state(step, scheduler, extra):
    """Everything besides weights and optimizer: where the run is and the random state. On a GPU,
    the state of the saving rank's own GPU only (the current device), not of every GPU of its
    node: a run saved on 8 GPUs per node resumes on 4."""
    return {"step": step, "scheduler": scheduler.state_dict(), "python_rng": random.getstate(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None, **extra}


def restore_rng(state):
    """Every rank takes the saved states, each into its own GPU (all ranks start from one seed).
    A checkpoint of the CPU resumes on a GPU with the GPU's state as seeded, and the other way
    round the GPU's state is left out."""
    random.setstate(state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    cuda_rng = state["cuda_rng"]
    if isinstance(cuda_rng, list):  # written by an older kit: every GPU of rank 0's node; the first is its own
        cuda_rng = cuda_rng[0] if cuda_rng else None
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng)


def load_file(path):
    """torch.load restricted to tensors and plain containers: a checkpoint cannot run code."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_sharded(state, path, **kwargs):
    """dcp.load, reading only tensors and plain values (common/safe_dcp.py)."""
    from common.safe_dcp import safe_load  # imported here: DCP takes a second to import, and only FSDP needs it
    safe_load(state, path, **kwargs)


def dcp_errors():
    """DCP's CheckpointException where DCP is in use (where no module imported it, nothing raises it)."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return (api.CheckpointException,) if api else ()
