"""The step scripts as modules, for the tools that reuse their code (submit.py, the plan check,
the benchmarks): `02_singlegpu` is not a valid module name, so they are imported by path.
Importing one runs nothing but its definitions (main() runs only as a script)."""
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP_SCRIPTS = {"singlegpu": "02_singlegpu/train.py", "ddp": "03_ddp/train.py", "fsdp": "04_fsdp/train.py",
                "lora": "05_lora/train.py"}


def load_step(step):
    """The module of a step's train.py ("singlegpu", "ddp", "fsdp" or "lora"), imported once."""
    name = f"kit_step_{step}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / STEP_SCRIPTS[step])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
