"""The GPU checks in one command, at most 30 minutes: does every step run on CUDA, how fast is the
CodeLlama-7b shape, and does the plan check predict its memory? Run it on a site's GPU node before
the workshop: it ends with a verdict line, and exits 1 unless the node is ready.

    .venv/bin/python benchmark/gpu_check.py                     # every visible GPU, the real 7B shape
    sbatch slurm/gpu_check.sh                                   # the same as a Slurm job: one node, all its GPUs
    .venv/bin/python benchmark/gpu_check.py --layers 2 --hidden 128 --heads 2 --intermediate 256 \\
        --seq_length 64 --steps 2                               # a shrunk shape: what the CPU test runs

Rows of the table (printed, and written to WORK_DIR/gpu_check.md; the figures to gpu_check.json):
  step 2, 3, 4      the demo model: 02_singlegpu on one GPU with bf16 autocast, 03_ddp and
                    04_fsdp with nccl on every visible GPU (a few steps, evaluation and saving)
  step 4, 5 offload the demo model with --cpu_offload (04_fsdp, 05_lora), every visible GPU: the
                    sharded state in host memory, its collectives over gloo beside nccl
  7B shape          benchmark/codellama-7b-config.json with random weights (benchmark/random_weights.py:
                    nothing downloaded) and the demo tokenizer, FULL_SHARD on every visible GPU,
                    sequence --seq_length, one row per GPU, activation checkpointing: LoRA (step 5),
                    QLoRA (step 5 --qlora, needs bitsandbytes), full fine-tuning (step 4; with
                    --cpu_offload where the plan check says it does not fit otherwise, if host RAM
                    allows). These runs are stopped after --steps optimiser steps: a 7B checkpoint
                    is 12 bytes per parameter (81 GB), and saving is not what is measured.
                    QLoRA fails where its peak memory does not show the 4-bit weights (it must save at
                    least half of what they should against LoRA's fp32 ones: FSDP2 with bitsandbytes'
                    Params4bit is reported to lose the quantisation silently, axolotl PR #2992), or
                    where its loss strays from LoRA's by more than 2 % over the same steps.
Each row gives tokens/s per GPU (the first step not counted), MFU, peak memory per GPU
(torch.cuda.max_memory_allocated, rank 0: loading and the first evaluation included) and the plan
check's predicted peak for the same job (tools/check_plan.py, step 2 of training only).

The time limit covers the three 7B loads: rank 0 initialises 6.7B random weights on one thread
(torchrun's OMP_NUM_THREADS=1) while the other ranks wait, minutes each.

Without CUDA (tests/test_gpu_check.py runs a shrunk shape on the CPU) steps 3 and 4 and the
7B-shape rows run with gloo on 2 CPU processes; step 2 on CUDA, the CPU-offload rows and QLoRA are
skipped, MFU and GPU memory stay empty, and the verdict is "NOT ready": nothing here measures a GPU
that is not there.
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
from common.metrics import peak_flops
from common.model import DEMO_DOWNLOAD, load_config
from common.notation import CONFIG_KEY as NOTATION_KEY
from common.notation import model_notation
from common.run_dir import RunDir


REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "benchmark" / "codellama-7b-config.json"
SHAPE_FLAGS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "intermediate": "intermediate_size"}
GiB = 1024 ** 3
COLUMNS = ["check", "setup", "result", "tokens/s per GPU (rank)", "MFU", "peak allocated GiB/GPU",
           "plan check's peak GiB", "mean loss", "time s"]
QLORA_LOSS_TOLERANCE = 0.02  # QLoRA's mean loss within 2 % of LoRA's over the same steps


def make_model_dir(args, model_dir):
    """config.json (the 7B shape, or the overrides) and the demo tokenizer, no weights. The demo
    tokenizer's 85 tokens fit the 32,016 embeddings; its special tokens and its notation (the piece
    notation's words) go into the config, so the games are written as it reads them and generation
    stops where they end."""
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
    config[NOTATION_KEY] = model_notation(load_config(args.tokenizer))
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
            self.rows.append({**row, "result": "not run: the time limit (--time_limit) is used up"})
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
        row["losses"] = [record["loss"] for record in read_records(output_dir)]
        row["mean_loss"] = mean(row["losses"])
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
    path = RunDir(output_dir).metrics
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


def mean(values):
    return sum(values) / len(values) if values else None


def quantized_weights(config):
    """The weights bitsandbytes stores in 4 bits: every linear layer of the decoder (not lm_head)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = hidden * config.get("num_key_value_heads", config["num_attention_heads"]) // config["num_attention_heads"]
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * config["intermediate_size"])


def compare_qlora(qlora, lora, config, ranks):
    """QLoRA's row fails unless its 4-bit weights show in its memory against LoRA's (fp32 frozen
    weights: at least half of the 3.5 bytes per weight that 4 bits save, per GPU) and its loss
    stays within QLORA_LOSS_TOLERANCE of LoRA's over the same steps."""
    if not (qlora["result"].startswith("ok") and lora["result"].startswith("ok")):
        return
    problems = []
    expected = quantized_weights(config) * 3.5 / ranks / GiB
    if qlora.get("peak_allocated_gib") is None or lora.get("peak_allocated_gib") is None:
        problems.append("no peak memory recorded to compare with LoRA's")
    elif lora["peak_allocated_gib"] - qlora["peak_allocated_gib"] < expected / 2:
        problems.append(f"peak {qlora['peak_allocated_gib']:.1f} GiB per GPU against LoRA's "
                        f"{lora['peak_allocated_gib']:.1f}: 4-bit weights should save about {expected:.1f} GiB "
                        "(was the quantisation lost in sharding?)")
    steps = min(len(qlora["losses"]), len(lora["losses"]))
    qlora_loss, lora_loss = mean(qlora["losses"][:steps]), mean(lora["losses"][:steps])
    if qlora_loss is None or not abs(qlora_loss - lora_loss) <= QLORA_LOSS_TOLERANCE * abs(lora_loss):  # NaN too
        problems.append(f"mean loss {qlora_loss} against LoRA's {lora_loss} over the same {steps} steps")
    if problems:
        qlora["result"] = "FAILED: " + "; ".join(problems)


def verdict(rows, on_gpu, hardware):
    """The last line, and the exit status: is this node ready for the workshop?"""
    failed = [row["check"] for row in rows if not row["result"].startswith(("ok", "skipped"))]
    passed = sum(row["result"].startswith("ok") for row in rows)
    if not on_gpu:
        return (f"verdict: NOT ready: no usable CUDA GPU here; of the checks that run on the CPU {passed} passed"
                + (f", failed: {', '.join(failed)}" if failed else ""), 1)
    if failed:
        return f"verdict: NOT ready: {', '.join(failed)} failed on {hardware} (see the table and the logs)", 1
    skipped = [f"{row['check']} ({row['result'].removeprefix('skipped: ')})" for row in rows
               if row["result"].startswith("skipped")]
    return (f"verdict: ready: {passed} checks passed on {hardware}"
            + (f"; skipped: {'; '.join(skipped)}" if skipped else ""), 0)


def mfu_note(on_gpu):
    """Which peak the MFU column was measured against."""
    if not on_gpu:
        return "MFU: none without a GPU."
    peak, name = peak_flops(torch.device("cuda", 0))
    if peak is None:
        return f"MFU: none: {name} is not in common/metrics.py's PEAK_BF16_FLOPS (add its dense bf16 peak there)."
    return f"MFU against the {name}'s dense bf16 peak, {peak / 1e12:.0f} TFLOP/s (common/metrics.py)."


def table(rows):
    def cell(row, key, form):
        return "—" if row.get(key) is None else format(row[key], form)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * 3 + "---:|" * (len(COLUMNS) - 3)]
    for row in rows:
        lines.append(f"| {row['check']} | {row['setup']} | {row['result']} "
                     f"| {cell(row, 'tokens_per_s_per_gpu', '.0f')} | {cell(row, 'mfu', '.1%')} "
                     f"| {cell(row, 'peak_allocated_gib', '.2f')} "
                     f"| {cell(row, 'planned_peak_gib', '.2f')} | {cell(row, 'mean_loss', '.3f')} "
                     f"| {cell(row, 'seconds', 'd')} |")
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
    parser.add("time_limit", type=int, default=1800,
               help="seconds for everything (three 7B loads among them); checks that do not fit are not run")
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
    from tools import check_plan as plan_module  # torch and transformers: only when asked
    fsdp_demo = demo(4 * ranks) + ["--precision", precision]
    runner.run("step 4", f"demo model, FSDP FULL_SHARD, {ranks} ranks, {backend}", "04_fsdp/train.py", ranks,
               fsdp_demo, plan=planned(plan_module, "fsdp", fsdp_demo, ranks))
    for check, script in (("step 4, CPU offload", "04_fsdp/train.py"), ("step 5, CPU offload", "05_lora/train.py")):
        setup = f"demo model, --cpu_offload, {ranks} ranks, nccl + gloo"
        if on_gpu:
            runner.run(check, setup, script, ranks, fsdp_demo + ["--cpu_offload"])
        else:
            runner.skip(check, setup, "no CUDA GPU here (tests/test_fsdp_options.py offloads on the CPU)")

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
        runner.rows.append({"check": "7B shape, QLoRA", "setup": shape, "result": "not run: bitsandbytes is not "
                            "installed (environment.yml installs it; or pip install bitsandbytes)"})
    else:  # the plan check cannot build a 4-bit model on fake tensors: no prediction
        runner.run("7B shape, QLoRA", shape, "05_lora/train.py", ranks, job + ["--qlora"], stop_after=args.steps,
                   random_weights=True)
        compare_qlora(runner.rows[-1], next(row for row in runner.rows if row["check"] == "7B shape, LoRA"), config,
                      ranks)
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

    last_line, status = verdict(runner.rows, on_gpu, hardware)
    lines = [f"`benchmark/gpu_check.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}, {hardware}, "
             f"torch {torch.__version__}.", "", table(runner.rows), "",
             "Peak allocated: rank 0's torch.cuda.max_memory_allocated over the whole run (loading and the first "
             "evaluation too); the plan check predicts the training steps' peak, of tensors only. " + mfu_note(on_gpu),
             "", last_line]
    text = "\n".join(lines) + "\n"
    (runner.work_dir / "gpu_check.md").write_text(text)
    (runner.work_dir / "gpu_check.json").write_text(json.dumps({"hardware": hardware, "rows": runner.rows,
                                                                "verdict": last_line}, indent=1) + "\n")
    print(f"wrote {runner.work_dir / 'gpu_check.md'} and gpu_check.json\n\n" + text, end="", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
