"""Which of the speed levers (common/speed.py) make a training step faster here, at what memory,
with the same losses? The GPU check's `levers` row runs this on a cut-down 7B shape; it runs alone too:

    .venv/bin/python benchmark/speed_levers.py --model runs/gpu_check/levers_model --rows 4 --seq_length 2048

One process, one device, full fine-tuning with fused AdamW (bf16 autocast on a GPU, fp32 on the CPU).
The model is built from its config.json with seeded random weights, the same for every setting, and
trained on the same seeded rows for --steps optimiser steps; the first two (compile's warm-up, the
allocator's) are not timed. The settings (SETTINGS): the baseline, eager with every layer recomputed
(what the 7B rows of the GPU check ran before), each lever changed on its own, and all together.

One JSON line per setting: tokens/s, MFU, peak memory, each step's loss and its largest relative
difference from the baseline's; then one `chosen:` line (JSON): the fastest setting that ran and
whose losses are the baseline's within LOSS_TOLERANCE, and its step options. A setting that runs out
of memory says so and is not chosen.
"""
import argparse
import gc
import json
import math
import sys
import time

import torch

from common.arguments import Parser, at_least
from common.data import loss_sum
from common.errors import UserError, exit_on_user_error, first_line
from common.metrics import flops_per_token, model_flops_utilization
from common.model import load_config
from common.speed import prepare_layers

# name: the step options it runs with (the baseline's recomputation is the 7B rows' earlier default)
SETTINGS = {
    "baseline": {"gradient_checkpointing": "full", "compile": False, "loss_chunk_size": 0},
    "selective recomputation": {"gradient_checkpointing": "selective", "compile": False, "loss_chunk_size": 0},
    "no recomputation": {"gradient_checkpointing": None, "compile": False, "loss_chunk_size": 0},
    "compile": {"gradient_checkpointing": "full", "compile": True, "loss_chunk_size": 0},
    "chunked loss": {"gradient_checkpointing": "full", "compile": False, "loss_chunk_size": 4096},
    "all": {"gradient_checkpointing": "selective", "compile": True, "loss_chunk_size": 4096},
}
# Each step's loss against the baseline's, relative: the same sums in another order (fp32's rounding on
# the CPU; in bf16 a compiled layer fuses and rounds differently, by a few tenths of a percent)
LOSS_TOLERANCE = {"cpu": 1e-4, "cuda": 1e-2}
UNTIMED_STEPS = 2


def step_options(setting):
    """The setting as a step script's command-line options."""
    options = SETTINGS[setting]
    return ([f"--gradient_checkpointing={options['gradient_checkpointing']}"] if options["gradient_checkpointing"]
            else []) + (["--compile"] if options["compile"] else []) + \
        ([f"--loss_chunk_size={options['loss_chunk_size']}"] if options["loss_chunk_size"] else [])


def measure(setting, config, batches, device):
    """Train a fresh model (seeded: the same weights for every setting) on `batches`; its figures."""
    from transformers import AutoModelForCausalLM
    options = SETTINGS[setting]
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    prepare_layers(model, argparse.Namespace(**options, no_packing=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    losses, seconds = [], []
    for batch in batches:
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_sum(model, batch, options["loss_chunk_size"]) / batch["input_ids"].numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the device: the step's time is all of it
        seconds.append(time.perf_counter() - started)
    tokens = batches[0]["input_ids"].numel()
    tokens_per_s = tokens * len(seconds[UNTIMED_STEPS:]) / sum(seconds[UNTIMED_STEPS:])
    figures = {"setting": setting, "options": step_options(setting), "losses": losses,
               "tokens_per_s": tokens_per_s,
               **model_flops_utilization(tokens_per_s, flops_per_token(model, batches[0]["input_ids"].shape[1]),
                                         device)}
    if device.type == "cuda":
        figures["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 1024 ** 3
    return figures


def release(device):
    """Nothing of one setting left for the next to run beside: its tensors, compiled graphs, peak."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def largest_relative_difference(losses, reference):
    """The largest |loss - reference| / |reference| over the steps; NaN where any step's is NaN
    (max() would pass over it)."""
    differences = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    return math.nan if any(map(math.isnan, differences)) else max(differences)


def compare(results, device):
    """Each setting's losses against the baseline's; the fastest one within LOSS_TOLERANCE."""
    tolerance = LOSS_TOLERANCE[device.type]
    baseline = results[0]
    for result in results:
        if "losses" not in result:
            continue
        result["loss_difference"] = largest_relative_difference(result["losses"], baseline["losses"])
        result["speedup"] = result["tokens_per_s"] / baseline["tokens_per_s"]
        result["same_losses"] = result["loss_difference"] <= tolerance
    candidates = [result for result in results if result.get("same_losses")]
    return max(candidates, key=lambda result: result["tokens_per_s"])


def main(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add("model", required=True, help="a folder with config.json (its weights are not read)")
    parser.add("rows", type=at_least(1), default=4, help="rows per step")
    parser.add("seq_length", type=at_least(8), default=2048, help="tokens per row")
    parser.add("steps", type=at_least(UNTIMED_STEPS + 1), default=6,
               help=f"optimiser steps per setting (the first {UNTIMED_STEPS} not timed)")
    parser.add("settings", default=",".join(SETTINGS),
               help="the settings to run, by name, comma-separated (the baseline always runs first)")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.settings.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SETTINGS]
    if unknown:
        raise UserError(f"--settings {','.join(unknown)}: the settings are {', '.join(SETTINGS)}")
    settings = ["baseline", *[name for name in chosen if name != "baseline"]]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = load_config(args.model)
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": ids.to(device), "labels": ids.to(device)}
               for ids in (torch.randint(config.vocab_size, (args.rows, args.seq_length), generator=generator)
                           for _ in range(args.steps))]
    results = []
    for setting in settings:
        try:
            result = measure(setting, config, batches, device)
        except torch.OutOfMemoryError:
            result = {"setting": setting, "options": step_options(setting), "out_of_memory": True}
        except Exception as err:  # a lever that fails here (a compiler missing, a graph break): said, not chosen
            result = {"setting": setting, "options": step_options(setting), "error": first_line(err)}
        release(device)
        if setting == "baseline" and "losses" not in result:
            raise UserError(f"the baseline did not run at {args.rows} rows of {args.seq_length} tokens "
                            f"({result.get('error', 'out of memory')}): lower --rows or --seq_length")
        results.append(result)
        print(json.dumps(result), flush=True)
    best = compare(results, device)
    print("chosen: " + json.dumps({"setting": best["setting"], "options": best["options"],
                                   "speedup": best["speedup"],
                                   "settings": [{key: result.get(key) for key in ("setting", "speedup",
                                                "loss_difference", "same_losses", "out_of_memory", "error")}
                                                for result in results]}), flush=True)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
