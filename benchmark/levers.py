"""FSDP speed levers, measured before adopting any: step 4 as it is, with explicit prefetching
(FSDP2's public set_modules_to_forward_prefetch / set_modules_to_backward_prefetch: each layer
asks for the next one's weights before it runs), and with every decoder layer compiled
(`layer.compile()` before sharding, as torchtitan does). FULL_SHARD on 2 ranks, the built-in
model, the benchmark's global batch at accumulation 1 and 2; the rounds interleave and each
configuration keeps its fastest.

    .venv/bin/python benchmark/levers.py      # about 5 minutes on 2 idle CPU cores; after ./demo.sh

Writes levers.md and levers.json into --out (benchmark/), the runs into --runs_dir; each run is
run.py's, with its settings. Under torchrun it is the training process itself: 04_fsdp/train.py with
the lever given by --lever in its shard_model().
"""
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from common.arguments import DEMO_DIR, REPO, Parser
from common.errors import UserError, exit_on_user_error
from launch.steps import load_script

LEVERS = ["as is", "prefetch", "compile"]
RANKS = 2


def with_lever(train, lever):
    """Replace train.shard_model with one that adds `lever`."""
    shard_model = train.shard_model

    def shard_with_lever(model, *args):
        layers = list(train.decoder_layers(model))
        if lever == "compile":
            for layer in layers:
                layer.compile()
        shard_model(model, *args)
        if lever == "prefetch":
            for layer, following in zip(layers, layers[1:]):
                layer.set_modules_to_forward_prefetch([following])
                following.set_modules_to_backward_prefetch([layer])
    train.shard_model = shard_with_lever


def training_process():
    at = sys.argv.index("--lever")  # ours; every other argument is 04_fsdp/train.py's
    lever = sys.argv[at + 1]
    del sys.argv[at: at + 2]
    train = load_script("04_fsdp/train.py")
    with_lever(train, lever)
    exit_on_user_error(train.main)


def main():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("model", default=str(DEMO_DIR / "model"))
    parser.add("data_dir", default=str(DEMO_DIR / "data"))
    parser.add("out", default=str(REPO / "benchmark"), help="levers.md and levers.json go here")
    parser.add("runs_dir", default=str(REPO / "runs" / "levers"), help="one folder per run")
    parser.add("rounds", type=int, default=2)
    parser.add("timeout", type=int, default=900, help="seconds one run may take (compiling included)")
    args = parser.parse_args()
    if not Path(args.model, "config.json").is_file():
        raise UserError(f"{args.model} holds no model: run `python 01_download/download.py --demo --out demo` first")
    bench = load_script("benchmark/run.py")
    out, load_before, began = Path(args.out), os.getloadavg(), time.time()
    runs = [bench.Run("built-in", accumulation, lever, "levers", RANKS,
                      ["--total_batch_size", bench.GLOBAL_BATCH_ROWS,
                       "--batch_size_per_device", bench.GLOBAL_BATCH_ROWS // (RANKS * accumulation), "--lever", lever])
            for accumulation in (1, 2) for lever in LEVERS]
    rows = bench.run_compared(runs, {"built-in": args.model}, args, bench.FULL_STEPS, args.rounds)
    fastest = {(row["accumulation"], row["name"]): row for row in rows}
    lines = [f"Command: `benchmark/levers.py` ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; load average "
             f"{[round(x, 2) for x in load_before]} before, {[round(x, 2) for x in os.getloadavg()]} after; "
             f"{time.time() - began:.0f} s). FSDP FULL_SHARD, {RANKS} ranks, one thread each, "
             f"{bench.GLOBAL_BATCH_ROWS} rows x {bench.SEQ_LENGTH} tokens per step, {bench.FULL_STEPS} steps "
             f"(tokens/s leaves out step 1, where compiling happens; the wall time includes it), fastest of "
             f"{args.rounds} interleaved rounds.", "",
             "| accumulation | lever | tokens/s | ÷ as is | wall s | final loss |", "|---:|---|---:|---:|---:|---:|"]
    for (accumulation, lever), row in fastest.items():
        ratio = row["tokens_per_s"] / fastest[(accumulation, "as is")]["tokens_per_s"]
        lines.append(f"| {accumulation} | {lever} | {row['tokens_per_s']} | {ratio:.3f} | {row['wall_s']} "
                     f"| {row['final_loss']} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "levers.md").write_text("\n".join(lines) + "\n")
    (out / "levers.json").write_text(json.dumps({f"{a} {lever}": row for (a, lever), row in fastest.items()},
                                                indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun: a training process
        training_process()
    else:
        exit_on_user_error(main)
