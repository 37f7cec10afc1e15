"""Turn a checkpoint of 04_fsdp/train.py into a Hugging Face model (safetensors + tokenizer).

    python tools/export.py runs/fsdp/checkpoints/step-000100 runs/fsdp/step-100-hf

A checkpoint is sharded: each rank wrote its own pieces (torch.distributed.checkpoint). This
reads all the pieces in one process (no torchrun, no GPU), puts the full tensors together and
writes them with save_pretrained, so that AutoModelForCausalLM.from_pretrained(OUT_DIR) loads
them without this kit. The checkpoint folder also holds the run's config.json and tokenizer.
"""
import argparse
import pickle
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torch.distributed.checkpoint.api import CheckpointException

from common.checkpoint import load_sharded, written_whole
from common.run_dir import CHECKPOINT_FOLDER, MARKER, RunDir, is_complete
from common.safe_dcp import SafeReader
from common.errors import UserError, exit_on_user_error, first_line


def check_paths(checkpoint, out_dir):
    if not checkpoint.is_dir():
        raise UserError(f"no checkpoint at {checkpoint}: pass a folder {CHECKPOINT_FOLDER}")
    run = RunDir(checkpoint)
    if run.run_file.is_file() or run.checkpoints_dir.is_dir():
        latest = run.latest_checkpoint()
        raise UserError(f"{checkpoint} is a run's folder: pass one of its checkpoints, a folder "
                        f"{CHECKPOINT_FOLDER}" + (f" (the newest complete one is {latest})" if latest else
                                                  " (it has no complete one)"))
    if not is_complete(checkpoint) and (checkpoint / "config.json").is_file() and any(
            checkpoint.glob("*.safetensors")):
        raise UserError(f"{checkpoint} is a Hugging Face model already (a run's final/ folder, or an export): "
                        "AutoModelForCausalLM.from_pretrained loads it as it is")
    if not is_complete(checkpoint):
        raise UserError(f"{checkpoint} is not a complete checkpoint (no {MARKER} marker: its save was "
                        "interrupted): choose an older one")
    if (checkpoint / "adapter_config.json").is_file():
        raise UserError(f"{checkpoint} holds LoRA adapters only: the run's final/ folder has them in peft's "
                        "format; load them over the base model with peft.PeftModel.from_pretrained")
    if not (checkpoint / ".metadata").is_file() or not (checkpoint / "config.json").is_file():
        raise UserError(f"{checkpoint} is not a checkpoint of 04_fsdp/train.py (no .metadata or config.json)")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} already exists and is not empty: choose a new OUT_DIR")


def load_model_weights(checkpoint):
    """The full model tensors of a DCP checkpoint, named as in the model's state dict."""
    try:
        metadata = SafeReader(checkpoint).read_metadata()
        # The checkpoint holds {"model": ..., "optimizer": ...}; allocate full-size tensors for the
        # model's entries and let DCP fill them from every rank's pieces.
        state = {key.removeprefix("model."): torch.empty(entry.size, dtype=entry.properties.dtype)
                 for key, entry in metadata.state_dict_metadata.items()
                 if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
        with warnings.catch_warnings():  # DCP warns that there is no process group: one process, on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load_sharded({"model": state}, checkpoint, no_dist=True)  # one process reads every rank's pieces
    except (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError, CheckpointException) as err:
        raise UserError(f"{checkpoint} cannot be read ({first_line(err)}): a shard file is missing or damaged; "
                        "export an older complete checkpoint") from None
    return state


def load_tokenizer(checkpoint):
    """The tokenizer that rank 0 saved beside the shards, read before anything is written."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(checkpoint)
    except (OSError, ValueError, TypeError, KeyError) as err:
        files = sorted(path.name for path in checkpoint.glob("tokenizer*"))
        why = f"{', '.join(files)}: {first_line(err).rstrip(' :')}" if files else "no tokenizer files in it"
        raise UserError(f"{checkpoint} holds no tokenizer that can be read ({why}): copy the tokenizer files of the "
                        "run's --model (tokenizer.json, tokenizer_config.json, ...) into it, then export "
                        "again") from None


def export(checkpoint, out_dir):
    from transformers import AutoConfig, AutoModelForCausalLM
    weights = load_model_weights(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):  # only the structure: save_pretrained writes `weights`
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing = set(model.state_dict()) - set(weights)
    if missing:
        raise UserError(f"{checkpoint} lacks {len(missing)} of the model's weights (e.g. {sorted(missing)[0]}): "
                        "it does not match its config.json")
    # Written next to OUT_DIR under a name of this process, then renamed (common/checkpoint.py): an
    # export that fails or is interrupted leaves no half-written model, and no partial folder; nothing
    # this export did not create is ever removed.
    try:
        with written_whole(out_dir, "Free some space, or choose an OUT_DIR on a disk with room for it",
                           replace=False) as partial:  # an empty OUT_DIR is replaced, never one with files
            model.save_pretrained(partial, state_dict=weights, safe_serialization=True)
            tokenizer.save_pretrained(partial)
    except OSError as err:
        raise UserError(f"cannot write the model to {out_dir} ({err.strerror or first_line(err)}): choose a "
                        "writable OUT_DIR on a disk with room for it") from None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help=f"a complete checkpoint: {CHECKPOINT_FOLDER}")
    parser.add_argument("out_dir", type=Path, help="new (or empty) folder for the Hugging Face model")
    args = parser.parse_args()
    check_paths(args.checkpoint, args.out_dir)
    export(args.checkpoint, args.out_dir)
    print(f"exported {args.checkpoint} to {args.out_dir}: "
          f"AutoModelForCausalLM.from_pretrained({str(args.out_dir)!r}) loads it")


if __name__ == "__main__":
    exit_on_user_error(main)
