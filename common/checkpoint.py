"""When a checkpoint counts, and how it is saved and read: the same rules for all the steps.

Each step saves in its natural form (02: one file; 03: rank 0 writes one file; 04: every rank
writes its shards with torch.distributed.checkpoint), into its folder of the run directory
(common/run_dir.py). A checkpoint counts only once its marker exists, and the marker is written
last: a job killed in the middle of a save leaves a folder without a marker, which resume ignores.
A save is refused before it writes anything if the disk cannot hold it, and a disk that fills up
anyway is one line on every rank, never a hang (sharded_save). The final model is written beside
its folder and moved in whole (written_whole).
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

from common.errors import UserError, first_line, say

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
            say(f"warning: checkpoint {path} is unreadable ({reason}): falling back to the previous one",
                file=sys.stderr)
    if checkpoints:
        raise UserError(f"none of the {len(checkpoints)} complete checkpoints in {run_dir.checkpoints_dir} can "
                        "be read by this run (see the warnings above): if the files are damaged, restore them from "
                        "a backup; they are left as they are. A new run can start in another --output_dir")
    return None


def stop_if_not_finite(loss, step, run_dir, model):
    """A NaN or infinite loss, or weights that the step's update made non-finite, poison the run from
    this step on: stop before anything is saved, so that no checkpoint and no final model ever holds
    a non-finite tensor. A collective where the job has several ranks (each holds its own shards):
    call it at the same point on all ranks; they reach the same verdict."""
    if not math.isfinite(loss):
        problem = f"loss is {loss} at step {step}"
    elif not weights_finite(model):
        problem = f"the weights are not finite after the update of step {step}"
    else:
        return
    latest = run_dir.latest_checkpoint()
    last_good = f"the last good checkpoint is {latest}" if latest else "no checkpoint was saved yet"
    # --resume would repeat this very step: the run's settings, its learning rate too, are fixed (run.json).
    raise UserError(f"{problem}: stopped without saving this step ({last_good}). Start the run again with a lower "
                    "--learning_rate, with --overwrite or in another --output_dir (or check the data and model "
                    "files): --resume keeps the run's learning rate and would repeat this step")


def weights_finite(model):
    """Whether every trainable weight is finite, on every rank (this rank's pieces of sharded ones)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    weights = [param.to_local() if isinstance(param, DTensor) else param
               for param in model.parameters() if param.requires_grad]
    # A sum is NaN or infinite where any element is: one pass, without isfinite's mask of every element
    # (ten times cheaper; a run's weights never sum past fp32's 3e38). It runs after every step.
    finite = torch.stack([weight.sum(dtype=torch.float32) for weight in weights]).isfinite().all().float()
    if dist.is_initialized():
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


def tensor_bytes(state):
    """Bytes of the tensors of a (nested) state dict: a DTensor counts with its full size, whatever
    its sharding. torch.distributed.checkpoint writes each piece of a tensor once, however many
    ranks hold a copy (HYBRID_SHARD's replicas, NO_SHARD's full copies, the plain tensors every rank
    has), so the ranks' files together hold each tensor exactly once."""
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()  # a DTensor's numel() is its global one
    return 0


def pieces(state):
    """The items a save writes: a piece per shard of a DTensor (its replicas are written once), one
    per plain tensor, one per other value (a list of plain values, such as a param group's
    parameter names, is one)."""
    if isinstance(state, dict):
        return sum(pieces(value) for value in state.values())
    if isinstance(state, (list, tuple)) and any(isinstance(item, (dict, list, tuple, torch.Tensor)) for item in state):
        return sum(pieces(value) for value in state)
    placements = getattr(state, "placements", None)  # a DTensor
    if placements is not None:
        return math.prod(state.device_mesh.size(dim) for dim, place in enumerate(placements) if place.is_shard())
    return 1


# What a save writes besides the tensors' bytes (tests/test_gpu_paths.py checks these against real
# saves). Measured with torch 2.13 on the demo model and on Llamas of other shapes, 1 and 2 ranks:
#   torch.distributed.checkpoint writes every piece as a torch.save of its own, 1,520-1,580 bytes
#   besides the data (the zip records, 64-byte aligned), and indexes it in .metadata with another
#   280-360 bytes (the name, offsets, sizes): 1,800-1,940 bytes in all; 2,560 are counted;
#   torch.save of a whole state dict (steps 2 and 3) adds about 310 bytes per tensor; 512 are counted.
# Each rank's file ends in a partly empty block (FILE_BLOCK), and beside the tensors a checkpoint
# holds small files (train_state.pt with the RNG states, config.json, the tokenizer: 14 KB for the
# demo, 2.3 MB for CodeLlama's): SMALL_FILES covers them. The demo's sharded checkpoint on 2 ranks
# (537 pieces): 19.39 MB of tensors, 20.41 MB written, 24.97 MB counted; in one file: 19.49 MB
# written, 19.63 MB counted.
SHARDED_PIECE_BYTES = 2560
ONE_FILE_PIECE_BYTES = 512
FILE_BLOCK = 4096
SMALL_FILES = 4 * 2**20
ONE_FILE_SMALL = 64 * 2**10


def checkpoint_bytes(state, sharded=False):
    """Bytes that saving `state` writes on disk: with torch.distributed.checkpoint (`sharded`,
    every rank's files and the index, and rank 0's small files) or with torch.save, in one file."""
    if not sharded:
        return tensor_bytes(state) + pieces(state) * ONE_FILE_PIECE_BYTES + ONE_FILE_SMALL
    import torch.distributed as dist
    files = dist.get_world_size() if dist.is_initialized() else 1  # one per rank
    return tensor_bytes(state) + pieces(state) * SHARDED_PIECE_BYTES + files * FILE_BLOCK + SMALL_FILES


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
        path.rmdir()
        raise UserError(disk_full_message(path, needed_bytes, free))
    return disk_full_is_one_line(path, needed_bytes)


@contextlib.contextmanager
def disk_full_is_one_line(path, needed_bytes):
    """A checkpoint write that fills the disk stops the run with one line that says so; the folder,
    which never got its marker, is removed (it would only hold the space that the next try needs)."""
    try:
        yield
    except (Exception, *dcp_errors()) as err:
        if is_disk_full(err, path, needed_bytes):
            shutil.rmtree(path, ignore_errors=True)
            raise UserError(disk_full_message(path, needed_bytes)) from None
        raise


@contextlib.contextmanager
def sharded_save(path, state, is_main):
    """A checkpoint that every rank writes a part of (torch.distributed.checkpoint), in the body of
    this context. First rank 0 makes the folder, refused before anything is written if the disk
    cannot hold what the save writes (checkpoint_bytes). Whatever fails then on whichever rank (the
    DCP write on any rank, rank 0's own files after it), every rank learns it in one collective
    after the body, so that no rank waits for one that has stopped: a full disk is the same one
    line on every rank (and the folder, never marked complete, is removed); another failure is its
    traceback where it happened and a lost rank elsewhere. The collectives keep the ranks in step,
    as barriers would: no rank goes on while another is still writing."""
    needed = checkpoint_bytes(state, sharded=True)
    refused = None
    if is_main:
        try:
            prepare(path, needed)
        except Exception as err:
            refused = err
    fail_together(refused, path, needed, is_main)
    try:
        yield
    except (Exception, *dcp_errors()) as err:
        fail_together(err, path, needed, is_main)
    fail_together(None, path, needed, is_main)


def fail_together(err, path, needed_bytes, is_main):
    """Every rank tells how its part of a save went (`err`: None if well), and learns how the
    others' went; if any failed, every rank raises: the same one-line UserError if a rank's failure
    was the user's to fix (a full disk), else its own error on the rank that failed and a lost rank
    (common/errors.py) on the others."""
    import torch.distributed as dist
    said = None
    if isinstance(err, UserError):
        said = ("user", str(err))
    elif err is not None:
        said = ("user", None) if is_disk_full(err, path, needed_bytes) else ("failed", first_line(err))
    told = [None] * dist.get_world_size()
    dist.all_gather_object(told, said)
    failed = {rank: said for rank, said in enumerate(told) if said is not None}
    if not failed:
        return
    users = [text for kind, text in failed.values() if kind == "user"]
    if users:
        if is_main:  # a save that did not finish: its files hold the space that the next try needs
            shutil.rmtree(path, ignore_errors=True)
        raise UserError(next(filter(None, users), None) or disk_full_message(path, needed_bytes)) from None
    if err is not None:
        raise err
    rank, (_, text) = next(iter(failed.items()))
    raise dist.DistError(f"rank {rank} failed to save {path}: {text}")


def written_whole(folder, then="Free some space (or move --output_dir to a bigger file system), then run the same "
                               "command with --resume: it starts from the last checkpoint and writes the final model",
                  replace=True):
    """A context that gives a folder beside `folder` (FOLDER.partial-PID) to write into, and moves it
    into place once it is whole: a run (or an export) that fails or is killed halfway never leaves a
    half-written folder, nor the partial one. An older `folder` (a run's final/) is replaced only
    then, and stays as it was if the new one fails; with replace=False only an empty one is (an
    export's OUT_DIR: what someone else put there is never removed). A full disk is one line, which
    ends with `then`: what to do."""
    return _written_whole(Path(folder), then, replace)


@contextlib.contextmanager
def _written_whole(folder, then, replace):
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    replaced = folder.with_name(f"{folder.name}.replaced-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        yield partial
        readable_by_others(partial)
        if replace and folder.is_dir() and any(folder.iterdir()):
            os.replace(folder, replaced)  # kept until the new folder is in place
        os.replace(partial, folder)  # also onto an empty folder; never onto one with files in it
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)  # ours
        if replaced.exists() and not folder.exists():
            os.replace(replaced, folder)
        if isinstance(err, Exception) and is_disk_full(err):
            kept = "what it held before is untouched" if folder.exists() else "nothing of it was kept"
            raise UserError(f"no room for {folder}: the disk filled up while it was written "
                            f"({size(shutil.disk_usage(folder.parent).free)} free now); {kept}. {then}") from None
        raise
    shutil.rmtree(replaced, ignore_errors=True)


def disk_full_message(path, needed_bytes, free=None):
    free = shutil.disk_usage(path.parent).free if free is None else free
    return (f"no room for a checkpoint in {path.parent}: one needs about {size(needed_bytes)}, the disk has "
            f"{size(free)} free. Free some space (--keep_checkpoints keeps fewer) or move --output_dir to a "
            "bigger file system; the last complete checkpoint is untouched")


FULL_WORDS = ("No space left on device", "Disk quota exceeded")
# torch.save's zip writer reports a failed write without the reason (errno): "unexpected pos 704 vs
# 598", "file write failed". Such a failure counts as a full disk where the disk now is too full.
WRITE_FAILED_WORDS = ("unexpected pos", "file write failed")


def is_disk_full(err, path=None, needed_bytes=None):
    """Whether a failed write is a full disk (or a full quota): ENOSPC anywhere in the chain of
    causes, also inside DCP's CheckpointException (each rank's failure, wrapped) and safetensors'
    errors (their text); or torch.save's reasonless write failure on a disk now with less free
    space than `needed_bytes`."""
    errors = list(error_chain(err))
    if any(getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for error in errors):
        return True
    text = "\n".join(str(error) for error in errors)
    if any(words in text for words in FULL_WORDS):
        return True
    if path is None or needed_bytes is None or not any(words in text for words in WRITE_FAILED_WORDS):
        return False
    try:
        return shutil.disk_usage(next(p for p in (Path(path), *Path(path).parents) if p.exists())).free < needed_bytes
    except OSError:
        return False


def error_chain(err):
    """An error, its causes and contexts, and the failures of every rank that a CheckpointException wraps."""
    seen, todo = set(), [err]
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        todo += [error.__cause__, error.__context__]
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            todo += [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]


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
