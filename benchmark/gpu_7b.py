"""The CodeLlama-7b shape on GPUs: tokens/s/GPU, MFU and peak memory of 04_fsdp, with and
without activation checkpointing. Random weights from the shipped config (no download).

    .venv/bin/python benchmark/gpu_7b.py                     # every visible GPU, the real 7B shape
    .venv/bin/python benchmark/gpu_7b.py --layers 2 --hidden 256 --heads 4 --intermediate 688 --steps 3
                                                             # a shrunk shape: runs on 2 CPU ranks

It writes WORK_DIR/model (benchmark/codellama-7b-config.json, with any shape overrides, plus the
demo tokenizer: chess moves need no other), then runs `04_fsdp/train.py --random_init` twice
(without and with --gradient_checkpointing), each for --steps optimiser steps on the demo data,
and writes the table to WORK_DIR/results.md. A run that does not fit says "out of memory".
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the shared `common` package

import torch  # noqa: E402

from common.errors import UserError, exit_on_user_error  # noqa: E402
from common.metrics import flops_per_token, model_flops_utilization  # noqa: E402
from common.train_setup import DEMO_DIR, DOWNLOAD_HINT, add_flag  # noqa: E402

CONFIG = Path(__file__).resolve().parent / "codellama-7b-config.json"
SHAPE_FLAGS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "intermediate": "intermediate_size"}


def make_model_dir(args, model_dir):
    """config.json (the 7B shape, or the overrides) and the demo tokenizer; no weights."""
    config = json.loads(CONFIG.read_text())
    for flag, key in SHAPE_FLAGS.items():
        if getattr(args, flag) is not None:
            config[key] = getattr(args, flag)
    config["num_key_value_heads"] = config["num_attention_heads"]  # CodeLlama-7b: no grouped-query attention
    if config["hidden_size"] % config["num_attention_heads"]:
        raise UserError(f"--hidden {config['hidden_size']} must be a multiple of "
                        f"--heads {config['num_attention_heads']}")
    model_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(args.tokenizer) / name, model_dir / name)
    # The demo tokenizer's special tokens, so generation stops where the data's games end.
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(model_dir)
    config.update(bos_token_id=ids.bos_token_id, eos_token_id=ids.eos_token_id, pad_token_id=ids.pad_token_id)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def model_flops_per_token(model_dir, seq_length):
    """Training FLOPs per token of this shape (common.metrics' formula), from a meta-device model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return flops_per_token(model, seq_length), sum(p.numel() for p in model.parameters())


def run(args, ranks, model_dir, output_dir, checkpointing):
    """One 04_fsdp run; its summary, or why it stopped."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(REPO / "04_fsdp/train.py"), "--model", model_dir, "--random_init", "--data_dir", args.data_dir,
               "--output_dir", output_dir, "--overwrite", "--max_steps", args.steps,
               "--max_seq_length", args.seq_length, "--batch_size_per_device", args.batch_size_per_device,
               "--gradient_accumulation_steps", args.gradient_accumulation_steps,
               # evaluation is not what is measured: one row and one game per rank
               "--eval_every", 0, "--eval_rows", ranks, "--eval_games", ranks]
    if checkpointing:
        command.append("--gradient_checkpointing")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    output_dir.mkdir(parents=True, exist_ok=True)
    log = output_dir.parent / f"{output_dir.name}.log"  # outside output_dir: --overwrite keeps it
    with log.open("w") as out:
        result = subprocess.run([str(c) for c in command], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                timeout=args.timeout)
    # 04_fsdp saves a checkpoint and final/ at the end (16 bytes per parameter): not needed here
    shutil.rmtree(output_dir / "checkpoints", ignore_errors=True)
    shutil.rmtree(output_dir / "final", ignore_errors=True)
    if result.returncode == 0:
        return json.loads((output_dir / "summary.json").read_text()), "ok"
    text = log.read_text()
    return None, "out of memory" if "OutOfMemoryError" in text or "CUDA out of memory" in text else \
        f"failed (exit {result.returncode}, see {log})"


def parse_arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flag(parser, "steps", type=int, default=10, help="optimiser steps per run (the first is not timed)")
    add_flag(parser, "seq_length", type=int, default=2048, help="tokens per row")
    add_flag(parser, "batch_size_per_device", type=int, default=1)
    add_flag(parser, "gradient_accumulation_steps", type=int, default=8, help="micro-batches per optimiser step")
    add_flag(parser, "ranks", type=int, default=None, help="processes (default: every visible GPU; 2 on the CPU)")
    for flag, key in SHAPE_FLAGS.items():
        add_flag(parser, flag, type=int, default=None, help=f"override {key} (a shrunk shape for the CPU)")
    add_flag(parser, "data_dir", default=str(DEMO_DIR / "data"))
    add_flag(parser, "tokenizer", default=str(DEMO_DIR / "model"), help="a directory with tokenizer.json")
    add_flag(parser, "work_dir", default=str(REPO / "runs" / "gpu_7b"), help="model/, one folder per run, results.md")
    add_flag(parser, "timeout", type=int, default=1800, help="seconds one run may take")
    return parser.parse_args()


def main():
    args = parse_arguments()
    if not (Path(args.tokenizer) / "tokenizer.json").is_file() or not (Path(args.data_dir) / "train.jsonl").is_file():
        raise UserError(f"no tokenizer in {args.tokenizer} or no train.jsonl in {args.data_dir}: run `{DOWNLOAD_HINT}`")
    on_gpu = torch.cuda.is_available()
    ranks = args.ranks or (torch.cuda.device_count() if on_gpu else 2)
    work_dir = Path(args.work_dir)
    config = make_model_dir(args, work_dir / "model")
    flops, params = model_flops_per_token(work_dir / "model", args.seq_length)
    # What 04_fsdp writes at the end of a run: a DCP checkpoint (fp32 weights + AdamW, 12 bytes per
    # parameter) and final/ (fp32, 4 bytes). Refuse now rather than fail after the run.
    needed, free = 16 * params, shutil.disk_usage(work_dir).free
    if free < needed * 1.05:
        raise UserError(f"{work_dir} has {free / 1e9:.0f} GB free, but each run writes a checkpoint and final/ of "
                        f"{needed / 1e9:.0f} GB at its end: pass --work_dir on a bigger disk")
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    hardware = f"{ranks} x {torch.cuda.get_device_name(0)}" if on_gpu else f"{ranks} CPU ranks"
    print(f"model: {params / 1e9:.3f} B parameters ({config['num_hidden_layers']} layers, hidden "
          f"{config['hidden_size']}), {flops / 1e9:.1f} GFLOP per token at {args.seq_length} tokens; {hardware}",
          flush=True)

    precision = "bf16 compute, fp32 weights and AdamW" if on_gpu else "fp32"
    lines = [f"`benchmark/gpu_7b.py {' '.join(sys.argv[1:])}`: {params / 1e9:.3f} B parameters (random), {hardware}, "
             f"{args.batch_size_per_device} x {args.seq_length} tokens x {args.gradient_accumulation_steps} "
             f"micro-batches per GPU per step, {args.steps} steps (step 1 not timed), {precision}.", "",
             "| activation checkpointing | tokens/s/GPU | MFU | peak allocated GiB/GPU | peak reserved GiB/GPU "
             "| peak host RSS GiB/rank | s/step | result |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    results = []
    for checkpointing in (False, True):
        name = "with_checkpointing" if checkpointing else "without_checkpointing"
        started = time.perf_counter()
        summary, status = run(args, ranks, work_dir / "model", work_dir / name, checkpointing)
        print(f"{name}: {status} in {time.perf_counter() - started:.0f} s", flush=True)
        row = {"activation_checkpointing": checkpointing, "status": status}
        if summary:
            per_gpu = summary["tokens_per_s_per_device"]
            row.update(tokens_per_s_per_device=per_gpu, step_time_s=summary["step_time_s"],
                       mfu=model_flops_utilization(per_gpu, flops, device).get("mfu"),
                       peak_allocated_gib=summary.get("peak_gpu_allocated_mib_per_rank", 0) / 1024 or None,
                       peak_reserved_gib=summary.get("peak_gpu_reserved_mib_per_rank", 0) / 1024 or None,
                       peak_rss_gib=summary["peak_rss_mib_per_rank"] / 1024)
        results.append(row)

        def cell(key, form):
            return "—" if row.get(key) is None else format(row[key], form)
        lines.append(f"| {'yes' if checkpointing else 'no'} | {cell('tokens_per_s_per_device', '.1f')} "
                     f"| {cell('mfu', '.1%')} | {cell('peak_allocated_gib', '.1f')} "
                     f"| {cell('peak_reserved_gib', '.1f')} | {cell('peak_rss_gib', '.2f')} "
                     f"| {cell('step_time_s', '.3f')} | {status} |")
    table = "\n".join(lines) + "\n"
    (work_dir / "results.md").write_text(table)
    (work_dir / "results.json").write_text(json.dumps({"parameters": params, "flops_per_token": flops,
                                                       "hardware": hardware, "runs": results}, indent=1) + "\n")
    print("\n" + table + f"\nwrote {work_dir / 'results.md'} and results.json")


if __name__ == "__main__":
    exit_on_user_error(main)
