"""Side-by-side benchmark: one process, DDP, every FSDP strategy, packing on and off, step 6's
tensor parallel x FSDP (2 x 2 and 1 x 4), and the Hugging Face Trainer with FSDP, each at gradient
accumulation 1 and 2 on the same global batch, on the built-in tiny default (rows of 128 tokens)
and on the same shape with a 20,480-token vocabulary (rows of 256).

    .venv/bin/python benchmark/run.py            # everything, about 40 minutes on 2 idle CPU cores
    .venv/bin/python benchmark/run.py --quick    # a few steps of some runs the targets compare (the test)
    .venv/bin/python benchmark/run.py --only "fsdp FULL_SHARD x4,tp 2x2,tp 1x4"   # those configurations

Each configuration runs the real script (02/03/04 train.py, benchmark/hf_trainer_fsdp.py) with
python or torchrun, one thread per rank, into its own folder under --runs_dir, and is read back
from its summary.json and metrics.jsonl. Then, for each model and rank count, this script itself
runs under torchrun and measures the bytes a rank holds (tensors only: parameters, gradients,
AdamW state) for DDP, every FSDP strategy, LoRA, FULL_SHARD --accumulate_unsharded and step 6 at
every tensor-parallel size that divides the ranks, set up with the step scripts' own functions:
after the optimiser step, and between micro-batches.

    torchrun --nproc-per-node 2 benchmark/run.py --model demo/model --out bytes.json   # that alone

Writes results.md, results.json, tokens_per_s.png and memory.png into --out (by default beside
the runs, in runs/benchmark/), and checks the targets. The results and runs of an earlier benchmark
there are refused before anything runs; --overwrite replaces them (`--out benchmark --overwrite`:
the figures the README shows).
"""
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from common.arguments import DEMO_DIR, REPO, Parser
from common.errors import UserError, exit_on_user_error
from common.model import DEMO_DOWNLOAD
from common.run_dir import RunDir

SCRIPTS = {"single": "02_singlegpu/train.py", "ddp": "03_ddp/train.py", "fsdp": "04_fsdp/train.py",
           "tp": "06_tp/train.py", "hf_trainer": "benchmark/hf_trainer_fsdp.py"}
MODELS = ["built-in", "wide vocab"]  # the demo model; its shape with WIDE_VOCAB tokens
WIDE_VOCAB = 20_480
ACCUMULATIONS = [1, 2]
GLOBAL_BATCH_ROWS = 16  # rows per optimiser step, whatever the ranks and the accumulation (as demo.sh)
# Tokens per row: the wide vocabulary in rows of 256, as a model with a real tokenizer writes a game
# (about 190 tokens): a second shape of step, beside the built-in model's short rows.
SEQ_LENGTHS = {"built-in": 128, "wide vocab": 256}
LEARNING_RATE = 3e-3
FULL_STEPS, QUICK_STEPS = 20, 3
ROUNDS = 2  # of the runs the targets compare (the full benchmark)
QUICK_BLOCKS = [("wide vocab", 2)]  # --quick: the block with every compared run, and its model's bytes
UNSHARDED = "--accumulate_unsharded"
MUON = ["--optimizer", "muon"]
MICRO_BATCHES = 2  # of the bytes measurement's optimiser steps
SHARD_GROUP_SIZE = 2  # HYBRID_SHARD's ranks per shard group in the bytes measurement (4 ranks: 2 x 2, as the runs)


class Run(NamedTuple):
    model: str  # one of MODELS
    accumulation: int
    name: str
    script: str  # a key of SCRIPTS
    ranks: int
    extra: list  # arguments of this configuration


def block(model, accumulation):
    """The runs of one model at one accumulation: (those the targets compare, the others). The
    rows per device follow from the global batch, the ranks and the accumulation."""
    def on(ranks, script, name, *extra, groups=None):
        per_device = GLOBAL_BATCH_ROWS // ((groups or ranks) * accumulation)  # a tensor-parallel group shares its rows
        return Run(model, accumulation, name, script, ranks,
                   ["--total_batch_size", GLOBAL_BATCH_ROWS, "--batch_size_per_device", per_device, *extra])

    def tp(ranks, tp_size):  # step 6: mesh (ranks / tp_size) x tp_size
        return on(ranks, "tp", f"tp {ranks // tp_size}x{tp_size}", "--tp_size", tp_size, groups=ranks // tp_size)

    def fsdp(ranks, strategy, *extra):
        name = f"fsdp {strategy} x{ranks}" + (" no packing" if "--no_packing" in extra else "")
        name += (f" {UNSHARDED}" if UNSHARDED in extra else "") + (" muon" if MUON[1] in extra else "")
        return on(ranks, "fsdp", name, "--sharding_strategy", strategy, *extra)

    compared = [on(2, "ddp", "ddp x2"), fsdp(2, "FULL_SHARD"),
                # Both sides of the trade-off: communicate once per optimiser step, at a memory cost.
                *([fsdp(2, "FULL_SHARD", UNSHARDED)] if accumulation > 1 else []),
                # The peer baseline as the SageMaker examples prepare data (one padded game per row), and
                # the Trainer fed our packed rows: the first is the target's yardstick, the second isolates
                # the training loops.
                on(2, "hf_trainer", "hf_trainer fsdp x2"),
                on(2, "hf_trainer", "hf_trainer fsdp x2 packed", "--packing"),
                # Muon on FSDP's shards (each matrix orthogonalised once, by one rank) against DDP's whole matrices
                *([on(2, "ddp", "ddp x2 muon", *MUON), fsdp(2, "FULL_SHARD", *MUON)] if model == "built-in" else [])]
    others = [on(1, "single", "single"), fsdp(2, "SHARD_GRAD_OP"), fsdp(2, "NO_SHARD"),
              fsdp(2, "FULL_SHARD", "--no_packing"),
              # HYBRID_SHARD on 2 ranks of one node is one shard group of 2: FULL_SHARD. On 4: 2 x 2.
              on(4, "ddp", "ddp x4"), fsdp(4, "FULL_SHARD"), fsdp(4, "SHARD_GRAD_OP"),
              fsdp(4, "HYBRID_SHARD", "--shard_group_size", 2), fsdp(4, "NO_SHARD"),
              # Step 6 beside FSDP on 4 ranks: each layer split over 2 ranks (FSDP over 2 groups) or all 4.
              tp(4, 2), tp(4, 4)]
    return compared, others


def configurations(quick, only=None):
    """(the runs the targets compare, the others), over every model and accumulation; with
    `quick`, only the runs the targets compare, of QUICK_BLOCKS; with `only`, the configurations of
    those names."""
    compared, others = [], []
    for model in MODELS:
        for accumulation in ACCUMULATIONS:
            if quick and (model, accumulation) not in QUICK_BLOCKS:
                continue
            runs = block(model, accumulation)
            compared += runs[0]
            others += runs[1]
    if only:
        return [run for run in compared if run.name in only], [run for run in others if run.name in only]
    return compared, [] if quick else others


def build_wide_vocab_model(demo_model, folder):
    """The demo model's shape with a WIDE_VOCAB-token vocabulary: the demo's tokens keep their ids
    (the games tokenize exactly as before) and unused ones fill the rest; random weights, seed 0.
    Offline and the same every time. Embeddings and output layer then hold three quarters of the
    parameters (in the demo model a quarter), as in small models with a real tokenizer: the root
    unit that FSDP gathers around them carries most of the communication."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    tokenizer = json.loads((Path(demo_model) / "tokenizer.json").read_text())
    vocab = tokenizer["model"].get("vocab")
    if not isinstance(vocab, dict):
        raise UserError(f"{demo_model}/tokenizer.json has no word-to-id vocabulary to widen: the wide-vocab model "
                        "is built from the demo tokenizer")
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), WIDE_VOCAB)})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copy(Path(demo_model) / "tokenizer_config.json", folder)
    config = AutoConfig.from_pretrained(demo_model)
    config.vocab_size = len(vocab)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def parameter_count(model_dir):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(p.numel() for p in model.parameters()), model.config.vocab_size


def run_compared(compared, models, args, steps, rounds):
    """The runs the targets compare, one after another, `rounds` times over; each keeps its fastest
    round. On a shared machine other work only ever slows a run down, and interleaving gives every
    configuration the same chances."""
    tries = [[run_configuration(run, models, args, steps) for run in compared] for _ in range(rounds)]
    return [{**max(runs, key=lambda row: row["tokens_per_s"]), "tokens_per_s_rounds": [r["tokens_per_s"] for r in runs]}
            for runs in zip(*tries)]


def launch(script, ranks, arguments, log_path, timeout):
    """Run a script as a user would: python for step 2, the kit's torchrun for the rest (even on
    one rank: they need its rendezvous), as launch/step_launcher.py does."""
    if script == SCRIPTS["single"]:
        command = [sys.executable, str(REPO / script)]
    else:
        command = [sys.executable, "-m", "launch.torchrun", "--standalone", f"--nproc-per-node={ranks}",
                   str(REPO / script)]
    # One thread per rank: ranks never fight over cores, and the comparison is about the parallelism.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            result = subprocess.run(command + [str(a) for a in arguments], stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=REPO, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise UserError(f"{script} on {ranks} ranks ran past {timeout} s: see {log_path}") from None
    if result.returncode != 0:
        tail = Path(log_path).read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"{script} on {ranks} ranks failed (exit {result.returncode}): {tail[0]} (log: {log_path})")
    return time.perf_counter() - started


def run_configuration(run, models, args, steps):
    folder = f"{run.model} acc{run.accumulation} {run.name}".replace(" --", " ").replace(" ", "_")
    output_dir = Path(args.runs_dir) / folder
    output_dir.mkdir(parents=True, exist_ok=True)
    arguments = ["--model", models[run.model], "--data_dir", args.data_dir, "--output_dir", output_dir,
                 "--max_steps", steps, "--max_seq_length", SEQ_LENGTHS[run.model], "--learning_rate", LEARNING_RATE,
                 *run.extra]
    if run.script != "hf_trainer":  # the step scripts evaluate; keep that small, it is not timed
        arguments += ["--eval_every", 0, "--eval_rows", 16, "--eval_games", 16]
    arguments.append("--overwrite")  # this benchmark's own run (main checked the folder), or its earlier round
    print(f"== {run.model}, accumulation {run.accumulation}, {run.name}: {SCRIPTS[run.script]} on {run.ranks} "
          "rank(s)", flush=True)
    wall = launch(SCRIPTS[run.script], run.ranks, arguments, output_dir / "log.txt", args.timeout)
    summary = json.loads(RunDir(output_dir).summary.read_text())
    records = [json.loads(line) for line in RunDir(output_dir).metrics.read_text().splitlines()]
    row = {"model": run.model, "accumulation": run.accumulation, "name": run.name, "script": SCRIPTS[run.script],
           "ranks": run.ranks, "arguments": [str(a) for a in run.extra], "output_dir": str(output_dir),
           "steps": len(records), "tokens_per_step": round(sum(r["tokens"] for r in records) / len(records)),
           "tokens_per_s": summary["tokens_per_s"], "tokens_per_s_per_rank": summary["tokens_per_s_per_device"],
           "step_time_s": summary["step_time_s"], "peak_rss_mib_per_rank": summary["peak_rss_mib_per_rank"],
           "final_loss": summary["final_loss"], "wall_s": round(wall, 1)}
    print(f"   {row['tokens_per_s']} tokens/s, {row['peak_rss_mib_per_rank']} MiB/rank, loss {row['final_loss']}, "
          f"{row['wall_s']} s", flush=True)
    return row


def measure_bytes(model, model_dir, ranks, args):
    """This script under torchrun on `ranks` ranks (measure_process): {"after_step": {configuration:
    {part: max over ranks}}, "between_micro_batches": {...}}."""
    stem = f"bytes_{model.replace(' ', '_')}_x{ranks}"
    out = Path(args.runs_dir) / f"{stem}.json"
    print(f"== {model}: the bytes a rank holds, on {ranks} ranks", flush=True)
    replace = ["--overwrite"] if args.overwrite else []
    launch("benchmark/run.py", ranks, ["--model", model_dir, "--out", out, *replace],
           Path(args.runs_dir) / f"{stem}.log", args.timeout)
    measured = json.loads(out.read_text())
    return {moment: {name: {part: max(values) for part, values in parts.items()}
                     for name, parts in measured[moment].items()} for moment in ("after_step", "between_micro_batches")}


def state_key(row):
    """Which bytes measurement belongs to a run: DDP or its strategy, with Muon "FULL_SHARD muon"
    (None: not measured)."""
    muon = MUON[1] in row["arguments"]
    if "ddp" in row["script"]:
        return None if muon else "DDP"
    if "fsdp/train" in row["script"]:
        return row["arguments"][row["arguments"].index("--sharding_strategy") + 1] + (" muon" if muon else "")
    if "tp/train" in row["script"]:
        return f"TP {row['arguments'][row['arguments'].index('--tp_size') + 1]}"
    return None


def ratio_target(text, needed, numerator, denominator):
    """(text, ratio, needed, met) of numerator ÷ denominator tokens/s; None if a run is missing."""
    if not (numerator and denominator):
        return None
    ratio = numerator["tokens_per_s"] / denominator["tokens_per_s"]
    return text, ratio, f">= {needed}" if needed else "—", ratio >= needed if needed else None


def check_targets(rows, state_bytes):
    """The issue's targets for each model and accumulation, from this run's figures:
    [{"target", "model", "accumulation", "ratio", "needed", "met"}]."""
    by_key = {(row["model"], row["accumulation"], row["name"]): row for row in rows}
    targets = []
    for model in MODELS:
        for accumulation in ACCUMULATIONS:
            def get(name):
                return by_key.get((model, accumulation, name))
            ddp, hf, packed = get("ddp x2"), get("hf_trainer fsdp x2"), get("hf_trainer fsdp x2 packed")
            for fsdp_name in ("fsdp FULL_SHARD x2", f"fsdp FULL_SHARD x2 {UNSHARDED}"):
                full = get(fsdp_name)
                label = "FSDP FULL_SHARD" + (f" {UNSHARDED}" if UNSHARDED in fsdp_name else "")
                found = [
                    ratio_target(f"{label} tokens/s ≥ 0.9 × DDP's, 2 ranks", 0.9, full, ddp),
                    ratio_target(f"{label} useful tokens/s ≥ 1.3 × the HF Trainer FSDP baseline's (SageMaker data "
                                 "preparation: one padded game per row), 2 ranks", 1.3, full, hf),
                    # the training loops alone (issue 24): the rows, the optimiser and the schedule are the same
                    ratio_target(f"{label} tokens/s ≥ 1.0 × the HF Trainer's on the same packed rows, 2 ranks", 1.0,
                                 full, packed)]
                targets += [(model, accumulation, *found) for found in found if found]
            # With one micro-batch per step the optimiser's share of a step is the largest; with more, FSDP's
            # gathers per micro-batch dominate whatever the optimiser (the AdamW row above)
            muon = ratio_target("FSDP FULL_SHARD tokens/s ≥ 0.8 × DDP's, both with --optimizer muon, 2 ranks",
                                0.8 if accumulation == 1 else None, get("fsdp FULL_SHARD x2 muon"), get("ddp x2 muon"))
            targets += [(model, accumulation, *muon)] if muon else []
    for model in MODELS:
        for ranks, measured in sorted(state_bytes.get(model, {}).items()):
            ratio = measured["FULL_SHARD"]["total"] / (measured["DDP"]["total"] / ranks)
            targets.append((model, None, f"FULL_SHARD parameter+gradient+optimizer bytes per rank = 1/{ranks} of "
                            f"DDP's (±2%), {ranks} ranks", ratio, "0.98 to 1.02", abs(ratio - 1) <= 0.02))
    return [{"target": text, "model": model, "accumulation": accumulation, "ratio": round(ratio, 3),
             "needed": needed, "met": met} for model, accumulation, text, ratio, needed, met in targets]


def verdict(target):
    return "—" if target["met"] is None else "met" if target["met"] else "not met"


def configuration_names(rows):
    """(name, ranks) of the configurations that ran, in the order block() lists them."""
    compared, others = block(MODELS[0], max(ACCUMULATIONS))
    order = [run.name for run in compared + others]
    return sorted(dict.fromkeys((row["name"], row["ranks"]) for row in rows), key=lambda key: order.index(key[0]))


def columns():
    """The (model, accumulation) pairs the summary tables have a column for."""
    return [(model, accumulation) for model in MODELS for accumulation in ACCUMULATIONS]


def markdown(results):
    models = "; ".join(f"{name}: {m['parameters'] / 1e6:.1f}M parameters, {m['vocab_size']:,} tokens"
                       for name, m in results["models"].items())
    heading = " | ".join(f"{model}, acc. {accumulation}" for model, accumulation in columns())
    lines = [f"Command: `{results['command']}` ({results['date']}, {results['machine']}; load average "
             f"{results['load_average_before']} before, {results['load_average_after']} after). "
             f"Models: {models}. Every run: {results['global_batch']}, {results['steps']} optimiser steps, one "
             "thread per rank; tokens/s counts loss-bearing tokens only and leaves out step 1. The "
             f"{len(results['compared'])} runs the targets compare ran {results['rounds']} time(s), one after "
             "another, and show their fastest round (every round is in results.json).",
             "", "Tokens/s over all ranks (acc.: gradient accumulation steps):", "",
             f"| configuration | ranks | {heading} |", "|---|---:|" + "---:|" * len(columns())]
    by_key = {(row["model"], row["accumulation"], row["name"]): row for row in results["runs"]}
    for name, ranks in configuration_names(results["runs"]):
        cells = [by_key.get((model, accumulation, name)) for model, accumulation in columns()]
        lines.append(f"| {name} | {ranks} | " + " | ".join("—" if row is None else str(row["tokens_per_s"])
                                                          for row in cells) + " |")

    lines += ["", "Targets (ratios from this run; state bytes do not depend on the accumulation):", "",
              f"| target | needed | {heading} |", "|---|---:|" + "---:|" * len(columns())]
    by_target = {}
    for target in results["targets"]:
        for accumulation in ([target["accumulation"]] if target["accumulation"] else ACCUMULATIONS):
            by_target.setdefault((target["target"], target["needed"]), {})[(target["model"], accumulation)] = target
    for (text, needed), cells in by_target.items():
        lines.append(f"| {text} | {needed} | " + " | ".join(
            "—" if key not in cells else f"{cells[key]['ratio']}" + ("" if cells[key]["met"] is None
                                                                    else f" {verdict(cells[key])}")
            for key in columns()) + " |")

    lines += ["", f"With gradient accumulation {max(ACCUMULATIONS)}, 2 ranks: both sides of `{UNSHARDED}` "
              "(bytes a rank holds between micro-batches, measured by benchmark/run.py: parameters, "
              "including gathered copies kept, + gradients + AdamW state; DDP with no_sync for comparison):", "",
              "| model | configuration | tokens/s | ÷ DDP | peak RSS MiB/rank | held between micro-batches MiB/rank "
              "| of which parameters / gradients / AdamW |", "|---|---|---:|---:|---:|---:|---|"]
    accumulation = max(ACCUMULATIONS)
    for model in MODELS:
        held = results["accumulation_bytes_per_rank"].get(model, {})
        ddp = by_key.get((model, accumulation, "ddp x2"))
        for name, measured in (("fsdp FULL_SHARD x2", "FULL_SHARD"),
                               (f"fsdp FULL_SHARD x2 {UNSHARDED}", f"FULL_SHARD {UNSHARDED}"),
                               ("ddp x2", "DDP")):
            row, parts = by_key.get((model, accumulation, name)), held.get(measured)
            if row is None:
                continue
            ratio = round(row["tokens_per_s"] / ddp["tokens_per_s"], 3) if ddp else "—"
            split = " / ".join(f"{parts[p] / 2**20:.2f}" for p in ("parameters", "gradients", "optimizer")) \
                if parts else "—"
            lines.append(f"| {model} | {name} | {row['tokens_per_s']} | {ratio} | {row['peak_rss_mib_per_rank']} "
                         f"| {'—' if parts is None else round(parts['total'] / 2**20, 2)} | {split} |")

    lines += step6_table(results, by_key)
    lines += ["", "Every run:", "",
              "| model | acc. | configuration | script | ranks | tokens/s | tokens/s per rank | useful tokens/step "
              "| s/step | peak RSS MiB/rank | params+grads+AdamW MiB/rank | final loss |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results["runs"]:
        state = row.get("state_mib_per_rank")
        lines.append(f"| {row['model']} | {row['accumulation']} | {row['name']} | `{row['script']}` | {row['ranks']} "
                     f"| {row['tokens_per_s']} | {row['tokens_per_s_per_rank']} | {row['tokens_per_step']} "
                     f"| {row['step_time_s']} | {row['peak_rss_mib_per_rank']} "
                     f"| {'—' if state is None else state} | {row['final_loss']} |")
    return "\n".join(lines) + "\n"


def step6_table(results, by_key):
    """Step 6 beside FSDP on 4 ranks: tokens/s and the bytes a rank holds."""
    names = [name for name in ("fsdp FULL_SHARD x4", "tp 2x2", "tp 1x4")
             if any(key[2] == name for key in by_key)]
    if not any(name.startswith("tp") for name in names):
        return []
    lines = ["", "Step 6 (tensor parallel x FSDP, `06_tp/train.py`) beside FSDP FULL_SHARD on 4 ranks; the bytes a "
             "rank holds after the optimiser step (parameters + gradients + AdamW state):", "",
             "| model | acc. | configuration | mesh dp x tp | tokens/s | ÷ FSDP x4 | params+grads+AdamW MiB/rank "
             "| peak RSS MiB/rank |", "|---|---:|---|---|---:|---:|---:|---:|"]
    for model, accumulation in columns():
        fsdp = by_key.get((model, accumulation, "fsdp FULL_SHARD x4"))
        for name in names:
            row = by_key.get((model, accumulation, name))
            if row is None:
                continue
            mesh = "4 x 1 (FSDP only)" if name.startswith("fsdp") else name.removeprefix("tp ").replace("x", " x ")
            ratio = round(row["tokens_per_s"] / fsdp["tokens_per_s"], 3) if fsdp else "—"
            lines.append(f"| {model} | {accumulation} | {name} | {mesh} | {row['tokens_per_s']} | {ratio} "
                         f"| {row.get('state_mib_per_rank', '—')} | {row['peak_rss_mib_per_rank']} |")
    return lines


def plot(rows, out):
    """tokens_per_s.png and memory.png: one panel per model, a bar per accumulation."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    names = [name for name, _ in configuration_names(rows)][::-1]  # first configuration on top
    by_key = {(row["model"], row["accumulation"], row["name"]): row for row in rows}
    height = 0.8 / len(ACCUMULATIONS)

    def bars(axis, model, value, label):
        for i, accumulation in enumerate(ACCUMULATIONS):
            values = [value(by_key[(model, accumulation, name)]) if (model, accumulation, name) in by_key else 0
                      for name in names]
            axis.barh([n + (i - (len(ACCUMULATIONS) - 1) / 2) * height for n in range(len(names))], values,
                      height=height, label=f"accumulation {accumulation}")
        axis.set_yticks(range(len(names)), names)
        axis.set_title(model)
        axis.set_xlabel(label)

    def finish(figure, title, name):
        figure.suptitle(title)
        figure.legend(*figure.axes[0].get_legend_handles_labels(), loc="upper center", ncol=len(ACCUMULATIONS),
                      bbox_to_anchor=(0.5, 0.96))
        figure.tight_layout(rect=(0, 0, 1, 0.93))
        figure.savefig(out / name, dpi=100)
        plt.close(figure)

    size = (6 * len(MODELS), 0.5 * len(names) + 1.5)
    figure, axes = plt.subplots(1, len(MODELS), figsize=size, sharey=True, squeeze=False)
    for axis, model in zip(axes[0], MODELS):
        bars(axis, model, lambda row: row["tokens_per_s"], "tokens/s, all ranks (loss-bearing tokens)")
    finish(figure, "Throughput, same global batch", "tokens_per_s.png")

    figure, axes = plt.subplots(2, len(MODELS), figsize=(size[0], 2 * size[1]), sharey=True, squeeze=False)
    for column, model in enumerate(MODELS):
        bars(axes[0][column], model, lambda row: row["peak_rss_mib_per_rank"], "peak RSS per rank, MiB (whole process)")
        bars(axes[1][column], model, lambda row: row.get("state_mib_per_rank") or 0,
             "params + grads + AdamW per rank, MiB (0: not measured)")
    finish(figure, "Memory per rank", "memory.png")


def parse_arguments(argv=None):
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("quick", action="store_true",
               help=f"{QUICK_STEPS} steps of the runs the targets compare, once each, for {QUICK_BLOCKS} "
                    "(model, accumulation) only: the test")
    parser.add("model", default=str(DEMO_DIR / "model"), help="the built-in model (the wide-vocab one is made from it)")
    parser.add("data_dir", default=str(DEMO_DIR / "data"))
    parser.add("runs_dir", default=str(REPO / "runs" / "benchmark"), help="one output folder per configuration")
    parser.add("out", default=None, help="where results.md/.json and the plots go (default: --runs_dir; `--out "
               "benchmark --overwrite` updates the figures the README shows)")
    parser.add("overwrite", action="store_true",
               help="replace the results in --out and the runs in --runs_dir of an earlier benchmark")
    parser.add("timeout", type=int, default=600, help="seconds one configuration may take")
    parser.add("only", default=None,
               help="comma-separated configuration names (as in results.md, e.g. 'fsdp FULL_SHARD x4,tp 2x2'): run "
                    "only those, for every model and accumulation")
    args = parser.parse_args(argv)
    if args.only is not None:
        compared, others = block(MODELS[0], max(ACCUMULATIONS))
        known = [run.name for run in compared + others]
        args.only = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in args.only if name not in known]
        if unknown or not args.only:
            raise UserError(f"--only {','.join(unknown) or '(nothing)'}: not a configuration; they are: "
                            f"{', '.join(known)}")
    args.out = args.runs_dir if args.out is None else args.out
    return args


RESULTS = ("results.md", "results.json", "tokens_per_s.png", "memory.png")


def check_outputs(args):
    """An earlier benchmark's results in --out, or anything in --runs_dir (its runs, the wide-vocab
    model, the bytes measured), are replaced only with --overwrite: refused before anything runs."""
    found = [Path(args.out) / name for name in RESULTS if (Path(args.out) / name).exists()]
    if Path(args.runs_dir).is_dir():
        found += sorted(Path(args.runs_dir).iterdir())
    if found and not args.overwrite:
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise UserError(f"{found[0]}{more} exist already (an earlier benchmark's): pass --overwrite to replace them, "
                        "or choose another --out and --runs_dir")


def main():
    args = parse_arguments()
    if not (Path(args.model) / "config.json").is_file() or not (Path(args.data_dir) / "train.jsonl").is_file():
        raise UserError(f"no model in {args.model} or no train.jsonl in {args.data_dir}: run `{DEMO_DOWNLOAD}` first")
    check_outputs(args)
    steps = QUICK_STEPS if args.quick else FULL_STEPS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, load_before = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    models = {"built-in": args.model,
              "wide vocab": str(build_wide_vocab_model(args.model, Path(args.runs_dir) / "wide_vocab_model"))}

    compared, others = configurations(args.quick, args.only)
    rounds = 1 if args.quick else ROUNDS
    rows = run_compared(compared, models, args, steps, rounds)
    rows += [run_configuration(run, models, args, steps) for run in others]
    rank_counts = sorted({row["ranks"] for row in rows} - {1})
    measured = {model: {ranks: measure_bytes(model, model_dir, ranks, args) for ranks in rank_counts}
                for model, model_dir in models.items() if model in {row["model"] for row in rows}}
    state_bytes = {model: {ranks: held["after_step"] for ranks, held in by_ranks.items()}
                   for model, by_ranks in measured.items()}
    accumulation_bytes = {model: {name: by_ranks[2]["between_micro_batches"][name]
                                  for name in ("FULL_SHARD", f"FULL_SHARD {UNSHARDED}", "DDP")}
                          for model, by_ranks in measured.items() if 2 in by_ranks}
    for row in rows:
        measured = state_bytes[row["model"]].get(row["ranks"], {}).get(state_key(row))
        if measured:
            row["state_mib_per_rank"] = round(measured["total"] / 2**20, 2)

    import torch
    results = {
        "command": " ".join(["benchmark/run.py"] + sys.argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__}",
        "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "models": {name: dict(zip(("parameters", "vocab_size"), parameter_count(path)), path=path)
                   for name, path in models.items()},
        "global_batch": f"{GLOBAL_BATCH_ROWS} rows per step, of " + " and ".join(
            f"{length} tokens ({model})" for model, length in SEQ_LENGTHS.items()), "steps": steps,
        "compared": [f"{run.model}, accumulation {run.accumulation}, {run.name}" for run in compared],
        "rounds": rounds, "runs": rows,
        "state_bytes_per_rank": {model: {str(k): v for k, v in by_ranks.items()}
                                 for model, by_ranks in state_bytes.items()},
        "accumulation_bytes_per_rank": accumulation_bytes,
        "targets": check_targets(rows, state_bytes),
        "total_wall_s": round(time.perf_counter() - started, 1)}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    plot(rows, out)
    print("\n" + markdown(results))
    for target in results["targets"]:
        where = target["model"] + ("" if target["accumulation"] is None else f", accumulation {target['accumulation']}")
        print(f"target {'NOT MET' if target['met'] is False else verdict(target)}: {target['target']} ({where}): "
              f"ratio {target['ratio']}")
    print(f"wrote {out / 'results.md'}, results.json, tokens_per_s.png, memory.png in {results['total_wall_s']} s")


# ---- under torchrun: the bytes a rank holds -------------------------------------------------------

def held_bytes(model, optimizer):
    """This rank's bytes of every distinct parameter tensor (the shards the optimizer holds and,
    while FSDP keeps a unit gathered, the module's gathered copies), of their gradients and of
    AdamW's state: a DTensor's local shard, a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    def size(tensor):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()
    optimized = [p for group in optimizer.param_groups for p in group["params"]]
    params = {id(p): p for p in [*model.parameters(), *optimized]}.values()
    parts = {"parameters": sum(size(p) for p in params),
             "gradients": sum(size(p.grad) for p in params if p.grad is not None),
             "optimizer": sum(size(value) for state in optimizer.state.values()
                              for name, value in state.items() if name != "step")}
    return {"total": sum(parts.values()), **parts}


def two_steps(model, optimizer, configuration, ids):
    """Two optimiser steps of MICRO_BATCHES micro-batches, run as the step scripts run them (DDP:
    no_sync but on the last; --accumulate_unsharded: the gathered weights and whole gradients kept
    until the last; otherwise FSDP's defaults). The bytes held after the first micro-batch's
    backward of step 2 (AdamW's state exists by then), and after its optimiser step."""
    from torch.distributed.tensor.parallel import loss_parallel

    from common.data import loss_sum
    held = {}
    for step in (1, 2):
        for i in range(MICRO_BATCHES):
            last = i == MICRO_BATCHES - 1
            if configuration.endswith(UNSHARDED):  # as 04_fsdp/train.py switches FULL_SHARD
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_forward(last)
                model.set_reshard_after_backward(last)
            if configuration.startswith("TP"):  # as 06_tp/train.py: the loss on the vocabulary's parts
                with loss_parallel():
                    loss_sum(model, {"input_ids": ids, "labels": ids}).to_local().backward()
            else:
                with model.no_sync() if configuration == "DDP" and not last else nullcontext():
                    model(input_ids=ids, labels=ids).loss.backward()
            if (step, i) == (2, 0):
                held["between_micro_batches"] = held_bytes(model, optimizer)
        optimizer.step()
        if step == 2:
            held["after_step"] = held_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
    return held


def measure_process():
    """One rank of the bytes measurement: DDP as 03_ddp wraps the model, each FSDP strategy and
    FULL_SHARD --accumulate_unsharded with 04_fsdp/train.py's build_mesh and shard_model, LoRA with
    05_lora/train.py's add_lora (its default rank and layers) sharded FULL_SHARD, all in fp32 as on
    the CPU; FULL_SHARD and LoRA again with --optimizer muon. Rank 0 writes {moment: {configuration:
    {part: [bytes of rank 0, rank 1, ...]}}}. Tensors only: no allocator slack, no DDP gradient buckets."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    from torch.nn.parallel import DistributedDataParallel

    from common.model import load_model
    from common.optim import make_optimizer
    from launch.steps import load_step

    parser = Parser("One rank of benchmark/run.py's bytes measurement (under torchrun)")
    parser.add("model", default=str(DEMO_DIR / "model"))
    parser.add("out", required=True, help="JSON file to write (rank 0): a new one, unless --overwrite")
    parser.add("overwrite", action="store_true", help="replace --out if it exists")
    args = parser.parse_args()
    if Path(args.out).exists() and not args.overwrite:
        raise UserError(f"--out {args.out} exists already: pass --overwrite to replace it, or choose another --out")
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    fsdp, lora, tp = load_step("fsdp"), load_step("lora"), load_step("tp")
    settings = lora.parse_arguments(["--output_dir", "unused"])  # the steps' default LoRA and AdamW settings
    hybrid = world_size % SHARD_GROUP_SIZE == 0 and world_size > SHARD_GROUP_SIZE  # else no 2-D mesh (or FULL_SHARD)
    strategies = [s for s in fsdp.STRATEGIES if hybrid or s != "HYBRID_SHARD"]
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    results = {"after_step": {}, "between_micro_batches": {}}
    tp_sizes = [f"TP {size}" for size in range(2, world_size + 1) if world_size % size == 0]  # step 6's meshes
    for name in ["DDP", *strategies, f"FULL_SHARD {UNSHARDED}", "LoRA", *tp_sizes, "FULL_SHARD muon", "LoRA muon"]:
        configuration = name.removesuffix(" muon")
        settings.optimizer = "muon" if name.endswith(" muon") else "adamw"
        torch.manual_seed(0)
        model = load_model(args.model)
        tp_size = int(configuration.split()[1]) if configuration.startswith("TP") else 1
        ids = torch.randint(4, model.config.vocab_size, (2, 16),  # a tensor-parallel group's ranks share their rows
                            generator=torch.Generator().manual_seed(dist.get_rank() // tp_size))
        if configuration == "DDP":
            model = DistributedDataParallel(model)
        elif configuration.startswith("TP"):
            tp.parallelize_and_shard(model.train(), tp.build_mesh("cpu", world_size, tp_size), "FULL_SHARD", fp32)
        else:
            step = lora if configuration == "LoRA" else fsdp
            if configuration == "LoRA":
                model = lora.add_lora(model, settings)
            strategy = configuration if configuration in strategies else "FULL_SHARD"
            mesh = step.build_mesh(strategy, "cpu", world_size, SHARD_GROUP_SIZE)
            step.shard_model(model, mesh, strategy, fp32, OffloadPolicy())
        optimizer = make_optimizer(model, settings)  # after sharding, as the step scripts
        for moment, held in two_steps(model, optimizer, configuration, ids).items():
            per_rank = [None] * world_size
            dist.all_gather_object(per_rank, held)
            results[moment][name] = {part: [p[part] for p in per_rank] for part in held}
        del model, optimizer
        gc.collect()  # a sharded model sits in reference cycles: free it before the process group goes
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"world_size": world_size, **results}, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_user_error(measure_process if "RANK" in os.environ else main)  # RANK: started by torchrun
