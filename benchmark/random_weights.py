"""Run a step script on random weights: only the model's config.json and tokenizer are read.

    torchrun --nproc-per-node 8 benchmark/random_weights.py 04_fsdp/train.py --model DIR ARGS...
    python benchmark/random_weights.py 02_singlegpu/train.py --model DIR ARGS...

For measuring a model's shape (speed, memory) without its weights: CodeLlama-7b's are 27 GB to
download and nothing about them changes tokens/s. The functions that read weights,
common.model.load_model (steps 2 and 3) and the one common.sharded_loading calls on rank 0 (steps
4 and 5, QLoRA's too), are replaced by one that builds the model from its config with random
weights (common.model.build_model); then the script runs as if started itself, with its own
arguments, checks and outputs. Losses are those of an untrained model.
"""
import runpy
import sys

import common.model
import common.sharded_loading
from common.errors import UserError, exit_on_user_error


def random_model(name, trust_remote_code=False, config=None):
    """load_model's stand-in: the same model (its config, or the one given), random weights, fp32."""
    return common.model.build_model(config or common.model.load_config(name, trust_remote_code), trust_remote_code)


def main():
    if len(sys.argv) < 2 or not sys.argv[1].endswith(".py"):
        raise UserError("usage: benchmark/random_weights.py STEP/train.py [its arguments]")
    script = sys.argv[1]
    common.model.load_model = random_model
    common.sharded_loading.load_model = random_model  # imported there by name
    sys.argv = sys.argv[1:]  # the script sees its own command line
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    exit_on_user_error(main)
