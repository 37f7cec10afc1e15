"""Loading the model and its tokenizer: the same Hugging Face path for CodeLlama-7b and the demo.

Weights load in fp32: mixed precision is applied per step (autocast in 02/03, FSDP's policy in
04), never by casting the model. Code shipped inside a model folder runs only with
--trust_remote_code. A missing or damaged file is one `error:` line that says what to do.
"""
import contextlib
from pathlib import Path

import torch

from common.errors import UserError, first_line
from common.run_dir import STEP_PREFIX, RunDir, is_complete

DEMO_DOWNLOAD = "python 01_download/download.py --demo --out demo"
DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo" / "model"


def not_a_model(folder):
    """What a folder that is not a model is, and where its model is, if it is one of the kit's: a
    run's folder, a checkpoint, LoRA adapters. None for anything else."""
    folder = Path(folder)
    if (folder / "adapter_config.json").is_file():
        return (f"{folder} holds LoRA adapters (05_lora's final/ or checkpoint), not a whole model: pass the base "
                "model the run trained (run.json's model) as --model; the adapters load over it with "
                "peft.PeftModel.from_pretrained")
    run = RunDir(folder)
    if run.run_file.is_file() or run.metrics.is_file() or run.checkpoints_dir.is_dir():
        if (run.final / "config.json").is_file():
            return f"{folder} is a run's folder: its model is {run.final}"
        return (f"{folder} is a run's folder, without a final model yet: continue the run with --resume to write "
                f"{run.final}, or export one of its checkpoints of step 4 with tools/export.py")
    if is_complete(folder) or folder.name.startswith(STEP_PREFIX):
        return (f"{folder} is a training checkpoint, not a Hugging Face model: use the run's final/ folder, or export "
                f"a checkpoint of step 4 with `python tools/export.py {folder} OUT_DIR`")
    return None


def model_missing_message(name, err):
    """What to do about a model that does not load: download it, or download it again; or, for a
    folder of the kit that is not a model, where its model is."""
    if Path(name).is_dir() and not_a_model(name):
        return not_a_model(name)
    if Path(name).is_dir():  # there, but a file in it is missing or damaged
        return (f"cannot load the model at {name} ({first_line(err)}): re-run the download step "
                f"(`{DEMO_DOWNLOAD}` for the demo model) if its files are damaged")
    if Path(name).resolve() == DEMO_MODEL:
        return f"no demo model in {name}: run `{DEMO_DOWNLOAD}` first"
    return (f"model {name} is neither a directory nor in the Hugging Face cache ({first_line(err)}): download "
            f"it on a login node first with `python 01_download/download.py --model {name} --out DIR` "
            "(compute nodes are offline: HF_HUB_OFFLINE=1 and the same HF_HOME)")


@contextlib.contextmanager
def config_warnings_refused(name):
    """Some config values transformers cannot use it only warns about, and goes on (a RoPE scaling
    factor below 1: `rope_parameters`'s factor field must be ...): here they are refused, in one line,
    instead of training a model that is not the one config.json describes. Its other warnings pass."""
    import logging
    logger = logging.getLogger("transformers.modeling_rope_utils")
    shown_from, level = logger.getEffectiveLevel(), logger.level
    refusals = []

    def sort(record):
        message = record.getMessage()
        if " must " in message or message.startswith("Missing required keys"):  # a value it cannot use
            refusals.append(message)
            return False  # said in the error line, not before it
        return record.levelno >= shown_from

    logger.addFilter(sort)
    logger.setLevel(min(logging.WARNING, shown_from))  # heard even where TRANSFORMERS_VERBOSITY=error
    try:
        yield
    finally:
        logger.removeFilter(sort)
        logger.setLevel(level)
    if refusals:
        raise UserError(f"cannot build the model from its config.json in {name} ({refusals[0].replace('`', '')}): "
                        "check the values in config.json, or re-run the download step")


def check_max_seq_length(config, max_seq_length, name):
    """Rows no longer than the positions the model has (max_position_embeddings in config.json)."""
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and max_seq_length > positions:
        raise UserError(f"--max_seq_length {max_seq_length} is more than the {positions:,} positions of the model "
                        f"{name} (max_position_embeddings in its config.json): use --max_seq_length {positions} or "
                        "less")


def load_config(name, trust_remote_code=False, max_seq_length=None, **kwargs):
    """The model's config; refused if a value in it cannot work, or if rows of `max_seq_length`
    tokens would not fit its positions."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    try:
        with config_warnings_refused(name):
            config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    except StrictDataclassError as err:  # a value of the wrong type: transformers checks them as it reads
        why = first_line(err) + (f": {first_line(err.__cause__)}" if err.__cause__ else "")
        raise UserError(f"cannot build the model from its config.json in {name} ({why}): check the values in "
                        "config.json, or re-run the download step") from None
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise UserError(model_missing_message(name, err)) from None
    if max_seq_length is not None:
        check_max_seq_length(config, max_seq_length, name)
    return config


def load_tokenizer(name, config, trust_remote_code=False):
    """The model's tokenizer; refused if it has more tokens than the model has embeddings."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise UserError(model_missing_message(name, err)) from None
    if tokenizer.pad_token_id is None:  # Llama tokenizers have none; padding is masked out anyway
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"the tokenizer in {name} has {len(tokenizer):,} tokens but the model only "
                        f"{config.vocab_size:,} embeddings (vocab_size in config.json): token ids beyond it "
                        "cannot be trained; use the tokenizer that came with the model")
    return tokenizer


def load_model_files(args):
    """The run's model files: its config (checked against --max_seq_length), its tokenizer, and the
    notation the games are written in for it (common/notation.py), which goes into the config."""
    from common.notation import training_notation
    config = load_config(args.model, args.trust_remote_code, max_seq_length=args.max_seq_length)
    tokenizer = load_tokenizer(args.model, config, args.trust_remote_code)
    return config, tokenizer, training_notation(args, config)


def build_model(config, trust_remote_code=False):
    """Random weights of the given shape (meta device or fake tensors: no memory at all)."""
    from transformers import AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except (ValueError, TypeError, KeyError, AttributeError) as err:  # a config.json value of the wrong type
        raise UserError(f"cannot build the model from its config.json ({first_line(err)}): "
                        "check the values in config.json, or re-run the download step") from None


def load_model(name, trust_remote_code=False, **kwargs):
    """The pretrained model with its weights, in fp32."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, trust_remote_code=trust_remote_code,
                                                    **kwargs)
    except (OSError, ValueError, RuntimeError, TypeError, KeyError, SafetensorError) as err:  # missing, or damaged
        raise UserError(model_missing_message(name, err)) from None
