"""The GPU checks in one command, at most 10 minutes: does every step run on CUDA, how fast is the
CodeLlama-7b shape, and does the plan check predict its memory?

    .venv/bin/python benchmark/gpu_check.py                     # every visible GPU, the real 7B shape
    .venv/bin/python benchmark/gpu_check.py --layers 2 --hidden 128 --heads 2 --intermediate 256 \\
        --seq_length 64 --steps 2                               # a shrunk shape: what the CPU test runs

Rows of the table (printed, and written to WORK_DIR/gpu_check.md; the figures to gpu_check.json):
  step 2, 3, 4      the demo model: 02_singlegpu on one GPU with bf16 autocast, 03_ddp and
                    04_fsdp with nccl on every visible GPU (a few steps, evaluation and saving)
  7B shape          benchmark/codellama-7b-config.json with random weights (benchmark/random_weights.py:
                    nothing downloaded) and the demo tokenizer, FULL_SHARD on every visible GPU,
                    sequence --seq_length, one row per GPU, activation checkpointing: LoRA (step 5),
                    QLoRA (step 5 --qlora, needs bitsandbytes), full fine-tuning (step 4; with
                    --cpu_offload where the plan check says it does not fit otherwise, if host RAM
                    allows). These runs are stopped after --steps optimiser steps: a 7B checkpoint
                    is 12 bytes per parameter (81 GB), and saving is not what is measured.
Each row gives tokens/s per GPU (the first step not counted), MFU, peak memory per GPU
(torch.cuda.max_memory_allocated, rank 0: loading and the first evaluation included) and the plan
check's predicted peak for the same job (04_fsdp/check_plan.py, step 2 of training only).

Without CUDA (tests/test_gpu_check.py runs a shrunk shape on the CPU) steps 3 and 4 and the
7B-shape rows run with gloo on 2 CPU processes; step 2 on CUDA and QLoRA are skipped, and MFU and
GPU memory stay empty: nothing here measures a GPU that is not there.
"""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from common.arguments import DEMO_DIR, Parser
from common.errors import UserError, exit_on_user_error
from common.model import DEMO_DOWNLOAD
from common.steps import load_script

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "benchmark" / "codellama-7b-config.json"
SHAPE_FLAGS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "intermediate": "intermediate_size"}
GiB = 1024 ** 3
COLUMNS = ["check", "setup", "result", "tokens/s per GPU (rank)", "MFU", "peak allocated GiB/GPU",
           "plan check's peak GiB", "time s"]


def check_plan():
    return load_script("04_fsdp/check_plan.py")


def make_model_dir(args, model_dir):
    """config.json (the 7B shape, or the overrides) and the demo tokenizer, no weights. The demo
    tokenizer's 1,972 tokens fit the 32,016 embeddings; its special tokens go into the config so
    that generation stops where the data's games end."""
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
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


class Runner:
    """Runs the checks one after the other within the time limit, and collects the table's rows."""

    def __init__(self, args, on_gpu, ranks):
        self.args, self.on_gpu, self.ranks = args, on_gpu, ranks
        self.work_dir = Path(args.work_dir)
        self.deadline = time.monotonic() + args.time_limit
        self.rows = []

    def skip(self, check, setup, why):
        self.rows.append({"check": check, "setup": setup, "result": f"skipped: {why}"})

    def run(self, check, setup, script, nproc, arguments, stop_after=None, random_weights=False, plan=None):
        """One step script run: its own process(es), its log next to its output folder."""
        started = time.monotonic()
        name = check.replace(" ", "_").replace(",", "").replace("/", "")
        output_dir = self.work_dir / name
        shutil.rmtree(output_dir, ignore_errors=True)
        output_dir.mkdir(parents=True)
        log = self.work_dir / f"{name}.log"
        command = ([sys.executable] if nproc is None else
                   [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"])
        if random_weights:
            command.append(str(REPO / "benchmark" / "random_weights.py"))
        command += [str(REPO / script), "--output_dir", str(output_dir), "--overwrite",
                    "--data_dir", self.args.data_dir, *map(str, arguments)]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        if not self.on_gpu:
            env["OMP_NUM_THREADS"] = "1"  # ranks share the CPU's cores
        row = {"check": check, "setup": setup}
        if plan is not None:
            row["planned_peak_gib"] = plan["peak"] / GiB
        remaining = self.deadline - time.monotonic()
        if remaining < 30:
            self.rows.append({**row, "result": "skipped: the time limit (--time_limit) is used up"})
            return
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                       start_new_session=True)  # its own process group: stopped as a whole
            status = None
            while process.poll() is None:
                time.sleep(2)
                if stop_after and len(read_records(output_dir)) >= stop_after:
                    status = f"ok (stopped after {stop_after} steps)"
                elif time.monotonic() > self.deadline:
                    status = "stopped: out of time (--time_limit)"
                if status:
                    os.killpg(process.pid, signal.SIGKILL)  # not SIGTERM: the step would save a checkpoint
                    process.wait()
        if status is None:
            text = log.read_text(errors="replace")
            status = ("ok" if process.returncode == 0 else "out of memory" if "out of memory" in text.lower()
                      else f"failed (exit {process.returncode}, see {log})")
        records = read_records(output_dir)[1:]  # the first step warms up: not counted
        row.update(result=status, seconds=round(time.monotonic() - started))
        if records:
            row["tokens_per_s_per_gpu"] = sum(r["tokens_per_s_per_device"] for r in records) / len(records)
            if all("mfu" in r for r in records):
                row["mfu"] = sum(r["mfu"] for r in records) / len(records)
            if "peak_gpu_allocated_mib" in records[-1]:
                row["peak_allocated_gib"] = records[-1]["peak_gpu_allocated_mib"] / 1024
        self.rows.append(row)
        print(f"{check}: {status} in {row['seconds']} s", flush=True)


def read_records(output_dir):
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is left out


def planned(plan_module, step, argv, ranks):
    """The plan check's figures for the job that `argv` describes, or None where it cannot run."""
    args = plan_module.load_step(step).parse_arguments(["--output_dir", "(plan check)", *map(str, argv)])
    try:
        return plan_module.plan(args, ranks, 1, step)
    except plan_module.PlanUnavailable as err:
        print(f"plan check unavailable: {err}", flush=True)
        return None


def table(rows):
    def cell(row, key, form):
        return "—" if row.get(key) is None else format(row[key], form)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * 3 + "---:|" * (len(COLUMNS) - 3)]
    for row in rows:
        lines.append(f"| {row['check']} | {row['setup']} | {row['result']} "
                     f"| {cell(row, 'tokens_per_s_per_gpu', '.0f')} | {cell(row, 'mfu', '.1%')} "
                     f"| {cell(row, 'peak_allocated_gib', '.2f')} "
                     f"| {cell(row, 'planned_peak_gib', '.2f')} | {cell(row, 'seconds', 'd')} |")
    return "\n".join(lines)


def parse_arguments():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("steps", type=int, default=4, help="optimiser steps per 7B-shape run (the first is not counted)")
    parser.add("seq_length", type=int, default=2048, help="tokens per row of the 7B-shape runs")
    for flag, key in SHAPE_FLAGS.items():
        parser.add(flag, type=int, default=None, help=f"override {key} (a shrunk shape for the CPU)")
    parser.add("data_dir", default=str(DEMO_DIR / "data"), help="the games (the demo's)")
    parser.add("tokenizer", default=str(DEMO_DIR / "model"), help="a directory with tokenizer.json (the demo's)")
    parser.add("work_dir", default=str(REPO / "runs" / "gpu_check"), help="the runs, their logs and the table")
    parser.add("time_limit", type=int, default=600, help="seconds for everything; checks that do not fit are skipped")
    args = parser.parse_args()
    if args.steps < 2:
        raise UserError(f"--steps must be at least 2: the first is not counted (got {args.steps})")
    if not (Path(args.tokenizer) / "tokenizer.json").is_file() or not (Path(args.data_dir) / "train.jsonl").is_file():
        raise UserError(f"no tokenizer in {args.tokenizer} or no train.jsonl in {args.data_dir}: run `{DEMO_DOWNLOAD}`")
    return args


def main():
    args = parse_arguments()
    on_gpu = torch.cuda.is_available()
    ranks = torch.cuda.device_count() if on_gpu else 2
    hardware = f"{ranks} x {torch.cuda.get_device_name(0)}" if on_gpu else f"no CUDA: {ranks} CPU processes, gloo"
    runner = Runner(args, on_gpu, ranks)
    runner.work_dir.mkdir(parents=True, exist_ok=True)
    backend = "nccl" if on_gpu else "gloo, CPU"
    precision = "bf16" if on_gpu else "fp32"
    def demo(total_batch_size):  # a few steps, one evaluation, a save
        return ["--model", args.tokenizer, "--max_steps", 5, "--eval_every", 0, "--eval_rows", 2 * ranks,
                "--eval_games", 2 * ranks, "--max_seq_length", 128, "--total_batch_size", total_batch_size,
                "--batch_size_per_device", 4]
    print(f"gpu_check on {hardware}", flush=True)

    # Steps 2, 3 and 4 on the demo model: do they run on this machine's GPUs?
    if on_gpu:
        runner.run("step 2", "demo model, 1 GPU, bf16 autocast", "02_singlegpu/train.py", None,
                   demo(4) + ["--device", "cuda"])
    else:
        runner.skip("step 2", "demo model, 1 GPU, bf16 autocast", "no CUDA GPU here")
    runner.run("step 3", f"demo model, DDP, {ranks} ranks, {backend}", "03_ddp/train.py", ranks, demo(4 * ranks))
    plan_module = check_plan()
    fsdp_demo = demo(4 * ranks) + ["--precision", precision]
    runner.run("step 4", f"demo model, FSDP FULL_SHARD, {ranks} ranks, {backend}", "04_fsdp/train.py", ranks,
               fsdp_demo, plan=planned(plan_module, "fsdp", fsdp_demo, ranks))

    # The 7B shape with random weights.
    model_dir = runner.work_dir / "model"
    make_model_dir(args, model_dir)
    job = ["--model", model_dir, "--max_seq_length", args.seq_length, "--batch_size_per_device", 1,
           "--total_batch_size", ranks, "--gradient_checkpointing", "--precision", precision, "--max_steps", 1000,
           "--eval_every", 0, "--eval_rows", ranks, "--eval_games", ranks]  # stopped long before step 1000
    config = json.loads((model_dir / "config.json").read_text())
    shape = (f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, random weights, "
             f"FULL_SHARD x {ranks}, 1 x {args.seq_length} tokens, checkpointing")
    lora_plan = planned(plan_module, "lora", job, ranks)
    runner.run("7B shape, LoRA", shape, "05_lora/train.py", ranks, job, stop_after=args.steps, random_weights=True,
               plan=lora_plan)
    if not on_gpu:
        runner.skip("7B shape, QLoRA", shape, "needs CUDA and bitsandbytes")
    elif importlib.util.find_spec("bitsandbytes") is None:
        runner.skip("7B shape, QLoRA", shape, "bitsandbytes is not installed (pip install bitsandbytes)")
    else:  # the plan check cannot build a 4-bit model on fake tensors: no prediction
        runner.run("7B shape, QLoRA", shape, "05_lora/train.py", ranks, job + ["--qlora"], stop_after=args.steps,
                   random_weights=True)
    # Full fine-tuning: FULL_SHARD, or where the plan check says that does not fit, with the sharded
    # state in host RAM (FSDP's CPU offload), if this machine has the RAM.
    full, setup = job, shape
    full_plan = planned(plan_module, "fsdp", full, ranks)
    if full_plan is not None and not full_plan["fits"]:
        import psutil
        full, setup = job + ["--cpu_offload"], shape + ", CPU offload"
        full_plan = planned(plan_module, "fsdp", full, ranks)
        host, ram = full_plan["host_per_rank"] * ranks * 1.1, psutil.virtual_memory().total  # 10 % to spare
        if host > ram:
            runner.skip("7B shape, full fine-tuning", setup, f"does not fit on {ranks} GPU(s); offloaded it needs "
                        f"{host / GiB:.0f} GiB of host RAM, this machine has {ram / GiB:.0f}")
            full = None
    if full is not None:
        runner.run("7B shape, full fine-tuning", setup, "04_fsdp/train.py", ranks, full, stop_after=args.steps,
                   random_weights=True, plan=full_plan)

    lines = [f"`benchmark/gpu_check.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}, {hardware}, "
             f"torch {torch.__version__}.", "", table(runner.rows), "",
             "Peak allocated: rank 0's torch.cuda.max_memory_allocated over the whole run (loading and the first "
             "evaluation too); the plan check predicts the training steps' peak, of tensors only."]
    text = "\n".join(lines) + "\n"
    (runner.work_dir / "gpu_check.md").write_text(text)
    (runner.work_dir / "gpu_check.json").write_text(json.dumps({"hardware": hardware, "rows": runner.rows},
                                                               indent=1) + "\n")
    print("\n" + text + f"wrote {runner.work_dir / 'gpu_check.md'} and gpu_check.json")


if __name__ == "__main__":
    exit_on_user_error(main)
