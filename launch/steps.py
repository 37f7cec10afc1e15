"""The script lookup: the step scripts as modules, for the launchers and tools that reuse their
code (submit.py, the plan check, the benchmarks). A step folder's name (`02_singlegpu`) is not a
valid module name, so this is the one place that imports a script by its path; everything else is
an ordinary import. Importing a step runs nothing but its definitions (main() runs only as a
script)."""
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP_SCRIPTS = {"download": "01_download/download.py", "singlegpu": "02_singlegpu/train.py",
                "ddp": "03_ddp/train.py", "fsdp": "04_fsdp/train.py", "lora": "05_lora/train.py",
                "tp": "06_tp/train.py"}
TRAINING_STEPS = ("singlegpu", "ddp", "fsdp", "lora", "tp")


def load_step(step):
    """The module of a step's script ("download", "singlegpu", "ddp", "fsdp", "lora" or "tp"), imported once."""
    name = "kit_step_" + step
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / STEP_SCRIPTS[step])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def check_training_arguments(step, training_args):
    """A job's training arguments, parsed and checked as its training script checks them when it
    starts, but before it is queued or launched (submit.py, the plan check): a typo does not wait in
    the queue to fail. Compute nodes are offline, so the model and the games must be on disk already."""
    from common.arguments import check_arguments
    from common.model import load_config
    from common.prepare_data import source_files
    args = load_step(step).parse_arguments(training_args)
    check_arguments(args)
    load_config(args.model, args.trust_remote_code, max_seq_length=args.max_seq_length, local_files_only=True)
    for split in ("train", "validation"):
        source_files(args.data_dir, split)
    return args
