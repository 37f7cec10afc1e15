"""The step scripts as modules, for the tools that reuse their code (submit.py, the plan check,
the benchmarks): `02_singlegpu` is not a valid module name, so they are imported by path.
Importing one runs nothing but its definitions (main() runs only as a script)."""
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP_SCRIPTS = {"singlegpu": "02_singlegpu/train.py", "ddp": "03_ddp/train.py", "fsdp": "04_fsdp/train.py",
                "lora": "05_lora/train.py"}


def load_script(path):
    """A script of the kit (a path relative to the repository) as a module, imported once."""
    name = "kit_" + path.removesuffix(".py").replace("/", "_")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_step(step):
    """The module of a step's train.py ("singlegpu", "ddp", "fsdp" or "lora")."""
    return load_script(STEP_SCRIPTS[step])


def check_training_arguments(step, training_args):
    """A job's training arguments, parsed and checked as its training script checks them when it
    starts, but before it is queued or launched (submit.py, the plan check): a typo does not wait in
    the queue to fail. Compute nodes are offline, so the model and the games must be on disk already."""
    from common.arguments import check_arguments
    from common.model import load_config
    from common.prepare_data import source_files
    args = load_step(step).parse_arguments(training_args)
    check_arguments(args)
    load_config(args.model, args.trust_remote_code, local_files_only=True)
    for split in ("train", "validation"):
        source_files(args.data_dir, split)
    return args
