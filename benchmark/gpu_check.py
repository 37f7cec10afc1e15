"""The GPU checks in one command, 8 minutes by default: does every step run on CUDA, preemption and
QLoRA included; how fast are the CodeLlama-7b shape and the largest full fine-tune a GPU holds; and
does the plan check predict their memory? Run it on a site's GPU node before the workshop: it ends
with a verdict line, and exits 1 unless the node is ready.

    .venv/bin/python benchmark/gpu_check.py                     # every visible GPU, the real 7B shape
    .venv/bin/python benchmark/gpu_check.py --only lora,qlora   # chosen rows (the ids below)
    sbatch slurm/gpu_check.sh                                   # the same as a Slurm job: one node, all its GPUs
    .venv/bin/python benchmark/gpu_check.py --layers 2 --hidden 128 --heads 2 --intermediate 256 \\
        --seq_length 64 --steps 2 --batch_size_per_device 2     # a shrunk shape: what the CPU test runs

Rows, in the order they run (id: check):
  levers            the speed levers (common/speed.py) on 4 of the 7B shape's layers, 4 rows per GPU, in
                    one process on one GPU (benchmark/speed_levers.py): the eager baseline with every layer
                    recomputed, each lever alone and all together, 6 steps (the first 2 not timed);
                    tokens/s against the baseline, MFU, peak memory, and each step's loss. It fails
                    where a lever's losses stray from the baseline's; the fastest setting with the
                    baseline's losses is what the qlora, lora and full rows then run with
  step2, step3, step4, step5   the demo model: 02_singlegpu on one GPU with bf16 autocast, 03_ddp,
                    04_fsdp and 05_lora with nccl on every visible GPU (40 steps, a save)
  step6             06_tp on every visible GPU, each layer split over 2 of them (tensor parallel 2 x
                    FSDP over the pairs), where there are 2 GPUs or more: fails where a step's loss
                    strays from step4's by more than TP_LOSS_TOLERANCE
  preemption        04_fsdp as step4, with its data loader's worker processes (as on a GPU), SIGTERM to
                    every process of the job in the middle of the run (as Slurm sends it), then
                    --resume: a checkpoint and a `preempted:` line, and the resumed run's losses are
                    step4's
  nf4_sharding      QLoRA's 4-bit weights of two 7B-shape layers give the same logits before and after
                    fully_shard (benchmark/nf4_sharding.py; on 2 GPUs where there are 2)
  qlora, lora       the 7B shape (benchmark/codellama-7b-config.json, random weights through
                    benchmark/random_weights.py, the demo tokenizer), FULL_SHARD on every GPU, rows
                    of --seq_length tokens, at the most rows per GPU that
                    fit (by tools/estimate_memory.py, up to 16; activation checkpointing and the
                    other levers as the levers row chose). QLoRA fails where its memory does
                    not show the 4-bit weights against LoRA's, or its loss strays from LoRA's by
                    more than 2 % over the same steps
  full              full fine-tuning without offload of the largest Llama shape that fits: the 7B
                    shape's layers, as many as fit with 4 rows per GPU, then as many rows as fit.
                    Its MFU is the kit's headline GPU figure
  offload4, offload5  the demo model with --cpu_offload: the sharded state in host memory, gloo beside nccl
  full_offload      the whole 7B shape, full fine-tuning offloaded to host memory (--cpu_offload),
                    where it does not fit otherwise: only when --time_limit leaves it 5 minutes
The 7B-shape runs are stopped after --steps optimiser steps (a 7B checkpoint is 81 GB, and saving
is not what is measured). Each row gives tokens/s per GPU (the first step not counted), MFU, peak
memory per GPU (torch.cuda.max_memory_allocated, loading included: the largest over the ranks where
the run finishes, as the demo's rows do, rank 0's for the 7B shape's stopped runs) and the plan check's
predicted peak for the same job (tools/check_plan.py, the training steps only).

Each row is written to WORK_DIR/gpu_check.md and gpu_check.json as soon as it ends, so a run killed
at any moment leaves the rows done so far. WORK_DIR is the check's own (a new or empty folder, which
it marks): it replaces its runs and model there on every start, so a folder with other files in it
(a run, a model) is refused. The time limit is checked before every run and every
plan check; a row that would not fit in the time left is not run, and says so.

Without CUDA (tests/test_gpu_check.py runs a shrunk shape on the CPU) the rows run with gloo on 2
CPU processes, except step2 and the CPU-offload rows, and the levers row leaves --compile out (it
does not speed a CPU's step; tests/test_speed.py proves it equal there); MFU and GPU memory stay empty, and the
verdict is "NOT ready": nothing here measures a GPU that is not there.
"""
import argparse
import json
import multiprocessing
import os
import queue
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from benchmark.speed_levers import SETTINGS, largest_relative_difference
from common.arguments import DEMO_DIR, Parser, at_least
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
# Step 6 against step 4, each step's loss, relative: the same sums in another order, to fp32's rounding on the
# CPU; in bf16 on a GPU each layer's rounding differs where its matmuls are split, by a few tenths of a percent
TP_LOSS_TOLERANCE = {"cpu": 1e-4, "gpu": 1e-2}
DEMO_STEPS = 40  # of the demo model's rows on a GPU
CPU_DEMO_STEPS = 12  # on the CPU, whose rows only show that each path runs
MOST_ROWS = 16  # the 7B-shape runs try up to this many rows per GPU
FULL_ROWS = 4  # the full fine-tune keeps as many layers as fit with this many rows per GPU
# id: (check, seconds it needs at least: a row is not started with less time left). Measured on one
# H100 (2026-11-27): the demo's rows 21-29 s (the preemption row's two runs 46), the 7B shape's
# QLoRA 135 s, LoRA 106, the full fine-tune of 17 layers 61, mostly loading random weights. The levers
# row's 150: an estimate (six settings, two of them compiled), not yet measured on a GPU.
LEVER_LAYERS, LEVER_ROWS, LEVER_STEPS = 4, 4, 6  # the levers row: 4 of the 7B shape's layers, 4 rows per GPU
# The 7B rows' recomputation where the levers row does not run (or finds no setting): every layer's
BASELINE_LEVERS = ["--gradient_checkpointing"]
ROWS = {"levers": ("speed levers", 150),
        "step2": ("step 2", 25), "step3": ("step 3", 25), "step4": ("step 4", 25), "step5": ("step 5", 25),
        "step6": ("step 6, tensor parallel", 25),
        "preemption": ("preemption, step 4", 45), "nf4_sharding": ("QLoRA sharding", 20),
        "qlora": ("7B shape, QLoRA", 120), "lora": ("7B shape, LoRA", 100), "full": ("full fine-tuning", 60),
        "offload4": ("step 4, CPU offload", 25), "offload5": ("step 5, CPU offload", 25),
        "full_offload": ("7B shape, full fine-tuning, CPU offload", 300)}
OPTIONAL = ("offload4", "offload5", "full_offload")  # run where --time_limit leaves them the time
WORK_DIR_MARK = ".gpu_check"  # in a --work_dir the check made its own (take_work_dir)


def take_work_dir(work_dir):
    """The check replaces its runs, its model and its table in --work_dir on every start: it works only
    in a folder of its own, one it creates (or finds empty) and marks (WORK_DIR_MARK). A user's
    folder (a run, a model, the demo) is refused before anything is written."""
    if work_dir.exists() and not work_dir.is_dir():
        raise UserError(f"--work_dir {work_dir} is a file: name a folder for the check (it makes a new one)")
    if work_dir.is_dir() and not (work_dir / WORK_DIR_MARK).is_file() and any(work_dir.iterdir()):
        raise UserError(f"--work_dir {work_dir} holds files that the GPU check did not write (it would replace them): "
                        "name a new or empty folder, which the check makes its own")
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
        (work_dir / WORK_DIR_MARK).write_text("the GPU check's folder: it replaces what is here on every start\n")
    except OSError as err:
        raise UserError(f"cannot write in --work_dir {work_dir} ({err.strerror}): name a writable folder") from None


def make_model_dir(args, model_dir, layers=None):
    """config.json (the 7B shape, or the overrides; `layers` of them) and the demo tokenizer, no
    weights. The demo tokenizer's 85 tokens fit the 32,016 embeddings; its special tokens and its
    notation (the piece notation's words) go into the config, so the games are written as it reads
    them and generation stops where they end."""
    config = json.loads(CONFIG.read_text())
    for flag, key in SHAPE_FLAGS.items():
        if getattr(args, flag) is not None:
            config[key] = getattr(args, flag)
    if layers is not None:
        config["num_hidden_layers"] = layers
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
    return config


class Runner:
    """Runs the checks one after the other within the time limit; writes the table after each."""

    def __init__(self, args, on_gpu, ranks, hardware):
        self.args, self.on_gpu, self.ranks, self.hardware = args, on_gpu, ranks, hardware
        self.demo_steps = DEMO_STEPS if on_gpu else CPU_DEMO_STEPS
        self.work_dir = Path(args.work_dir)
        self.deadline = time.monotonic() + args.time_limit
        self.rows = []

    def time_left(self):
        return self.deadline - time.monotonic()

    def add(self, row):
        self.rows.append(row)
        write_report(self, final=False)
        return row

    def skip(self, check, setup, why):
        return self.add({"check": check, "setup": setup, "result": f"skipped: {why}"})

    def enough_time(self, row_id, setup):
        """False (and the row says so) when less time is left than the row needs: a check not made,
        or, for the rows that run only where time is left (OPTIONAL), one skipped."""
        check, needs = ROWS[row_id]
        if self.time_left() >= needs:
            return True
        why = f"it needs about {needs} s, {max(0, self.time_left()):.0f} s of --time_limit were left"
        self.add({"check": check, "setup": setup,
                  "result": f"skipped: {why} (raise it)" if row_id in OPTIONAL else f"not run: {why}"})
        return False

    def start(self, script, nproc, arguments, log, random_weights=False, launcher="torch.distributed.run"):
        """A script in a session of its own (stopped as a whole), its output added to `log`."""
        command = ([sys.executable] if nproc is None else
                   [sys.executable, "-m", launcher, "--standalone", f"--nproc-per-node={nproc}"])
        if random_weights:
            command.append(str(REPO / "benchmark" / "random_weights.py"))
        command += [str(REPO / script), *map(str, arguments)]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        if not self.on_gpu:
            env["OMP_NUM_THREADS"] = "1"  # ranks share the CPU's cores
        with log.open("a") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                    start_new_session=True)

    def wait(self, process, output_dir, stop_after=None, signal_after=None):
        """Until the process ends, `stop_after` steps are on record (then killed: no checkpoint) or the
        time is up. `signal_after` steps on record: SIGTERM to every process of the job, once.
        Returns a result for the row, or None if the process ended by itself."""
        signalled = False
        while process.poll() is None:
            time.sleep(0.05 if signal_after else 0.5)  # a demo step on a GPU takes a few hundredths of a second
            done = len(read_records(output_dir))
            if signal_after and not signalled and done >= signal_after:
                signal_job(process.pid, signal.SIGTERM)
                signalled = True
            status = (f"ok (stopped after {stop_after} steps)" if stop_after and done >= stop_after else
                      "stopped: out of time (--time_limit)" if self.time_left() <= 0 else None)
            if status:
                os.killpg(process.pid, signal.SIGKILL)  # not SIGTERM: the step would save a checkpoint
                process.wait()
                return status
        return None

    def run(self, row_id, setup, script, nproc, arguments, stop_after=None, random_weights=False, plans=None):
        """One step script run: its own process(es), its log next to its output folder; beside it the
        plan check's peak for the same job, if `plans` has it by the time the row must start."""
        check = ROWS[row_id][0]
        if not self.enough_time(row_id, setup):
            return None
        plan = plans.get(row_id, self.time_left() - ROWS[row_id][1]) if plans else None
        started = time.monotonic()
        output_dir, log = self.fresh(row_id)
        row = {"check": check, "setup": setup}
        if plan is not None:
            row["planned_peak_gib"] = plan["peak"] / GiB
        process = self.start(script, nproc, self.step_arguments(output_dir, "--overwrite", *arguments), log,
                             random_weights)
        status = self.wait(process, output_dir, stop_after) or exit_result(process.returncode, log)
        row.update(result=status, seconds=round(time.monotonic() - started), **figures(output_dir))
        print(f"{check}: {status} in {row['seconds']} s", flush=True)
        return self.add(row)

    def step_arguments(self, output_dir, *arguments):
        return ["--output_dir", output_dir, "--data_dir", self.args.data_dir, *arguments]

    def fresh(self, row_id):
        output_dir, log = self.work_dir / row_id, self.work_dir / f"{row_id}.log"
        shutil.rmtree(output_dir, ignore_errors=True)
        log.unlink(missing_ok=True)
        return output_dir, log


class Plans:
    """The plan checks of the runs (tools/check_plan.py: up to half a minute of CPU each for the 7B
    shape), made one after the other in a process of their own while the runs go on."""

    def __init__(self, jobs, ranks, deadline):
        """`jobs`: (row id, step, training arguments); their results come back on a queue."""
        context = multiprocessing.get_context("spawn")  # not fork: this process has CUDA started
        self.results, self.found = context.Queue(), {}
        self.process = context.Process(target=plan_each, args=(jobs, ranks, deadline, self.results), daemon=True)
        self.process.start()

    def get(self, row_id, wait_s):
        """The plan of that row's job, waiting at most `wait_s`; None where it did not come."""
        until = time.monotonic() + max(0, wait_s)
        while row_id not in self.found:
            try:
                self.take(self.results.get(timeout=max(0.01, min(1.0, until - time.monotonic()))))
            except queue.Empty:
                if time.monotonic() >= until or not self.process.is_alive():
                    break
        return self.found.get(row_id)

    def take(self, result):
        row_id, plan, why = result
        self.found[row_id] = plan
        if why:
            print(f"plan check for {row_id}: {why}", flush=True)

    def stop(self):
        """Say what the plans not asked for came to, and end their process."""
        while True:
            try:
                self.take(self.results.get_nowait())
            except queue.Empty:
                break
        self.process.kill()


def plan_each(jobs, ranks, deadline, results):
    """In the plans' process: each job's plan check in turn, while at least a minute is left."""
    from common.errors import first_line
    from tools import check_plan  # torch and transformers on fake tensors
    for row_id, step, argv in jobs:
        if time.monotonic() > deadline - 60:
            results.put((row_id, None, "plan check not run: less than a minute of --time_limit left"))
            continue
        try:
            args = check_plan.load_step(step).parse_arguments(["--output_dir", "(plan check)", *map(str, argv)])
            results.put((row_id, check_plan.plan(args, ranks, 1, step), None))
        except Exception as err:  # PlanUnavailable, or the check's own failure: the row runs without a plan
            results.put((row_id, None, f"plan check unavailable: {first_line(err)}"))


def signal_job(pid, signum):
    """`signum` to a process and all of its descendants at once, as slurmstepd signals a job's processes."""
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            process.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def exit_result(returncode, log):
    text = log.read_text(errors="replace")
    return ("ok" if returncode == 0 else "out of memory" if "out of memory" in text.lower()
            else f"failed (exit {returncode}, see {log})")


def read_records(output_dir):
    path = RunDir(output_dir).metrics
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is left out


def figures(output_dir):
    """Losses, and tokens/s, MFU and peak memory without the first step (it warms up)."""
    records = read_records(output_dir)
    found = {"losses": [record["loss"] for record in records]}
    found["mean_loss"] = mean(found["losses"])
    timed = records[1:]
    if timed:
        found["tokens_per_s_per_gpu"] = mean([r["tokens_per_s_per_device"] for r in timed])
        if all("mfu" in r for r in timed):
            found["mfu"] = mean([r["mfu"] for r in timed])
        if "peak_gpu_allocated_mib" in timed[-1]:
            found["peak_allocated_gib"] = timed[-1]["peak_gpu_allocated_mib"] / 1024
    summary = RunDir(output_dir).summary  # a run that finished: the largest peak over its ranks
    if summary.exists() and "peak_gpu_allocated_mib_per_rank" in (finished := json.loads(summary.read_text())):
        found["peak_allocated_gib"] = finished["peak_gpu_allocated_mib_per_rank"] / 1024
    return found


def mean(values):
    return sum(values) / len(values) if values else None


def quantized_weights(config):
    """The weights stored in 4 bits: every linear layer of the decoder (not lm_head)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = hidden * config.get("num_key_value_heads", config["num_attention_heads"]) // config["num_attention_heads"]
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * config["intermediate_size"])


def compare_qlora(qlora, lora, config, ranks, on_gpu=True):
    """QLoRA's row fails unless its 4-bit weights show in its GPU memory against LoRA's (fp32 frozen
    weights: at least half of the 3.5 bytes per weight that 4 bits save, per GPU) and its loss
    stays within QLORA_LOSS_TOLERANCE of LoRA's over the same steps."""
    if not (qlora["result"].startswith("ok") and lora["result"].startswith("ok")):
        return
    problems = []
    expected = quantized_weights(config) * 3.5 / ranks / GiB
    if on_gpu and (qlora.get("peak_allocated_gib") is None or lora.get("peak_allocated_gib") is None):
        problems.append("no peak memory recorded to compare with LoRA's")
    elif on_gpu and lora["peak_allocated_gib"] - qlora["peak_allocated_gib"] < expected / 2:
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


def write_report(runner, final):
    """gpu_check.md and gpu_check.json as they stand: every row done so far, and the verdict at the
    end (each file replaced whole, so that a run killed while writing leaves the last complete one)."""
    if final:
        last_line, _ = verdict(runner.rows, runner.on_gpu, runner.hardware)
    else:
        last_line = f"in progress: {len(runner.rows)} check(s) done so far"
    lines = [f"`benchmark/gpu_check.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d')}, {runner.hardware}, "
             f"torch {torch.__version__}.", "", table(runner.rows), "",
             "Peak allocated: torch.cuda.max_memory_allocated over the whole run (loading and the first evaluation "
             "too), the largest over the ranks for the runs that finish, rank 0's for those stopped early; the plan "
             "check predicts the training steps' peak, of tensors only. "
             + mfu_note(runner.on_gpu), "", last_line]
    report = {"hardware": runner.hardware, "rows": runner.rows, "verdict": last_line}
    for name, text in (("gpu_check.md", "\n".join(lines) + "\n"), ("gpu_check.json", json.dumps(report, indent=1))):
        partial = runner.work_dir / f".{name}.partial"
        partial.write_text(text)
        partial.replace(runner.work_dir / name)
    return "\n".join(lines) + "\n"


def most_rows(estimate_memory, config, job, ranks, step, most=MOST_ROWS):
    """The most rows per GPU (a power of two, at most `most`) at which `step`'s job (its training
    arguments `job`, on a model of `config`) fits this GPU by the estimate; 0 if not even one fits."""
    from launch.steps import load_step
    from transformers import AutoConfig
    shape = estimate_memory.model_shape(AutoConfig.for_model(**config), "the check's model")
    args = load_step(step).parse_arguments(["--output_dir", "unused", *map(str, job)])
    gpu = estimate_memory.gpu_memory_default()
    for rows in (2 ** k for k in range(most.bit_length() - 1, -1, -1)):
        trial = argparse.Namespace(**{**vars(args), "batch_size_per_device": rows, "total_batch_size": rows * ranks})
        if estimate_memory.fits(estimate_memory.estimate_job(shape, trial, ranks, 1, lora=step == "lora")["peak"], gpu):
            return rows
    return 0


def parse_arguments():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("only", default=",".join(ROWS), help=f"the rows to run, comma-separated ids: {', '.join(ROWS)}")
    parser.add("steps", type=at_least(2), default=3, help="optimiser steps per 7B-shape run (the first is not counted)")
    parser.add("seq_length", type=at_least(16), default=2048, help="tokens per row of the 7B-shape runs")
    parser.add("batch_size_per_device", type=at_least(1), default=None,
               help=f"rows per GPU of the 7B-shape runs (default: the most that fit, up to {MOST_ROWS})")
    for flag, key in SHAPE_FLAGS.items():
        parser.add(flag, type=at_least(1), default=None, help=f"override {key} (a shrunk shape for the CPU)")
    parser.add("data_dir", default=str(DEMO_DIR / "data"), help="the games (the demo's)")
    parser.add("tokenizer", default=str(DEMO_DIR / "model"), help="a directory with tokenizer.json (the demo's)")
    parser.add("work_dir", default=str(REPO / "runs" / "gpu_check"), help="the runs, their logs and the table")
    parser.add("time_limit", type=at_least(60), default=480,
               help="seconds for everything, loads included; a row that does not fit in the time left is not run")
    args = parser.parse_args()
    args.only = [row.strip() for row in args.only.split(",") if row.strip()]
    unknown = [row for row in args.only if row not in ROWS]
    if unknown or not args.only:
        raise UserError(f"--only {','.join(unknown) or '(none)'}: the rows are {', '.join(ROWS)}")
    if not (Path(args.tokenizer) / "tokenizer.json").is_file() or not (Path(args.data_dir) / "train.jsonl").is_file():
        raise UserError(f"no tokenizer in {args.tokenizer} or no train.jsonl in {args.data_dir}: run `{DEMO_DOWNLOAD}`")
    return args


def main():
    args = parse_arguments()
    on_gpu = torch.cuda.is_available()
    ranks = torch.cuda.device_count() if on_gpu else 2
    hardware = f"{ranks} x {torch.cuda.get_device_name(0)}" if on_gpu else f"no CUDA: {ranks} CPU processes, gloo"
    runner = Runner(args, on_gpu, ranks, hardware)
    take_work_dir(runner.work_dir)
    backend = "nccl" if on_gpu else "gloo, CPU"
    precision = "bf16" if on_gpu else "fp32"
    wanted = set(args.only)
    print(f"gpu_check on {hardware}: {', '.join(args.only)} within {args.time_limit} s", flush=True)

    def demo(total_batch_size):  # a few steps, one evaluation, a save
        return ["--model", args.tokenizer, "--max_steps", runner.demo_steps, "--eval_every", 0,
                "--eval_rows", 2 * ranks, "--eval_games", 2 * ranks, "--max_seq_length", 128,
                "--total_batch_size", total_batch_size, "--batch_size_per_device", 4]
    sharded_demo = demo(4 * ranks) + ["--precision", precision]

    # The levers first: the 7B-shape jobs run with the setting it chooses.
    model_dir = runner.work_dir / "model"
    config = make_model_dir(args, model_dir)
    chosen = levers(runner, args, config) if "levers" in wanted else BASELINE_LEVERS

    # The 7B-shape jobs (random weights), decided now, so that their plan checks run beside the demo's rows.
    from tools import estimate_memory

    def job(rows, model=model_dir, levers=chosen):  # stopped long before step 1000
        return ["--model", model, "--max_seq_length", args.seq_length, "--batch_size_per_device", rows,
                "--total_batch_size", rows * ranks, *levers, "--precision", precision,
                "--max_steps", 1000, "--eval_every", 0, "--eval_rows", ranks, "--eval_games", ranks]
    lora_rows = args.batch_size_per_device or max(1, most_rows(estimate_memory, config, job(1), ranks, "lora"))
    lora_job = job(lora_rows)
    # QLoRA eager: its 4-bit layers under torch.compile are not proven equal on the CPU (tests/test_speed.py)
    qlora_levers = [option for option in chosen if option != "--compile"]
    qlora_job = job(lora_rows, levers=qlora_levers) + ["--qlora"]

    def shape(options):
        return (f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, random weights, "
                f"FULL_SHARD x {ranks}, {lora_rows} x {args.seq_length} tokens per GPU, {levers_text(options)}")
    full_layers, full_rows = largest_full_fine_tune(args, config, job, ranks, estimate_memory)
    full_dir = runner.work_dir / "full_model"
    full_job = job(full_rows, full_dir)
    if full_layers:
        make_model_dir(args, full_dir, full_layers)
    tensor_parallel_demo = sharded_demo + ["--tp_size", 2]  # step 6: layers split over pairs of GPUs
    jobs = [("step4", "fsdp", sharded_demo), ("step6", "tp", tensor_parallel_demo),
            ("qlora", "lora", qlora_job), ("lora", "lora", lora_job), ("full", "fsdp", full_job)]
    plans = Plans([(row_id, step, argv) for row_id, step, argv in jobs if row_id in wanted and
                   (row_id != "full" or full_layers) and (row_id != "step6" or ranks >= 2)], ranks, runner.deadline)
    try:
        # The steps on the demo model: do they run on this machine's GPUs?
        if "step2" in wanted:
            if on_gpu:
                runner.run("step2", "demo model, 1 GPU, bf16 autocast", "02_singlegpu/train.py", None,
                           demo(4) + ["--device", "cuda"])
            else:
                runner.skip("step 2", "demo model, 1 GPU, bf16 autocast", "no CUDA GPU here")
        if "step3" in wanted:
            runner.run("step3", f"demo model, DDP, {ranks} ranks, {backend}", "03_ddp/train.py", ranks,
                       demo(4 * ranks))
        if "step4" in wanted:
            runner.run("step4", f"demo model, FSDP FULL_SHARD, {ranks} ranks, {backend}", "04_fsdp/train.py", ranks,
                       sharded_demo, plans=plans)
        if "step5" in wanted:
            runner.run("step5", f"demo model, LoRA, FULL_SHARD, {ranks} ranks, {backend}", "05_lora/train.py",
                       ranks, sharded_demo)
        if "step6" in wanted:
            tensor_parallel(runner, tensor_parallel_demo, backend, plans)
        if "preemption" in wanted:
            preemption(runner, sharded_demo, backend)
        if "nf4_sharding" in wanted:
            nf4_sharding(runner, model_dir, min(2, ranks))

        # The 7B shape: QLoRA, LoRA, and the largest full fine-tune.
        qlora = lora = None
        if "qlora" in wanted:
            qlora = runner.run("qlora", shape(qlora_levers) + ", 4-bit base",
                               "05_lora/train.py", ranks, qlora_job, stop_after=args.steps, random_weights=True,
                               plans=plans)
        if "lora" in wanted:
            lora = runner.run("lora", shape(chosen), "05_lora/train.py", ranks, lora_job, stop_after=args.steps,
                              random_weights=True, plans=plans)
        if qlora and lora:
            compare_qlora(qlora, lora, config, ranks, on_gpu)
            write_report(runner, final=False)
        if "full" in wanted:
            setup = (f"{full_layers} of the 7B shape's {config['num_hidden_layers']} layers, random weights, "
                     f"FULL_SHARD x {ranks}, {full_rows} x {args.seq_length} tokens per GPU, "
                     f"{levers_text(chosen)}, AdamW")
            if full_layers:
                runner.run("full", setup, "04_fsdp/train.py", ranks, full_job, stop_after=args.steps,
                           random_weights=True, plans=plans)
            else:
                runner.skip(ROWS["full"][0], setup, "not even one layer of the 7B shape fits")

        # Where the time allows: FSDP's CPU offload.
        for row_id, script in (("offload4", "04_fsdp/train.py"), ("offload5", "05_lora/train.py")):
            if row_id in wanted:
                setup = f"demo model, --cpu_offload, {ranks} ranks, nccl + gloo"
                if on_gpu:
                    runner.run(row_id, setup, script, ranks, sharded_demo + ["--cpu_offload"])
                else:
                    runner.skip(ROWS[row_id][0], setup,
                                "no CUDA GPU here (tests/test_fsdp_options.py offloads on the CPU)")
        if "full_offload" in wanted:
            full_offload(runner, config, job(1), ranks, estimate_memory, model_dir)
    finally:
        plans.stop()

    text = write_report(runner, final=True)
    print(f"wrote {runner.work_dir / 'gpu_check.md'} and gpu_check.json\n\n" + text, end="", flush=True)
    return verdict(runner.rows, on_gpu, hardware)[1]


def levers(runner, args, config):
    """The levers row: benchmark/speed_levers.py on LEVER_LAYERS of the 7B shape, LEVER_ROWS rows per GPU
    (--batch_size_per_device), in one process on one GPU. Returns the step options of the fastest
    setting with the baseline's losses (BASELINE_LEVERS where it did not run or found none). On the
    CPU the compiled settings are left out: compiling does not speed a CPU's step."""
    rows, layers = args.batch_size_per_device or LEVER_ROWS, min(LEVER_LAYERS, config["num_hidden_layers"])
    setup = (f"{layers} layers of the 7B shape, 1 {'GPU' if runner.on_gpu else 'CPU process'}, {rows} x "
             f"{args.seq_length} tokens, {LEVER_STEPS} steps, against eager with every layer recomputed")
    if not runner.enough_time("levers", setup):
        return BASELINE_LEVERS
    settings = [name for name, options in SETTINGS.items() if runner.on_gpu or not options["compile"]]
    started = time.monotonic()
    model_dir, log = runner.fresh("levers")
    make_model_dir(args, model_dir, layers)
    process = runner.start("benchmark/speed_levers.py", None, ["--model", model_dir, "--rows", rows, "--seq_length",
                                                         args.seq_length, "--steps", LEVER_STEPS,
                                                         "--settings", ",".join(settings)], log)
    try:
        process.wait(timeout=max(1, runner.time_left()))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    lines = log.read_text(errors="replace").splitlines()
    measured = {found["setting"]: found for found in map(json.loads, [line for line in lines if line.startswith("{")])}
    choice = next((json.loads(line.removeprefix("chosen: ")) for line in lines if line.startswith("chosen: ")), None)
    row = {"check": ROWS["levers"][0], "setup": setup, "seconds": round(time.monotonic() - started)}
    if choice is None:
        row["result"] = ("stopped: out of time (--time_limit)" if runner.time_left() <= 0 else
                         exit_result(process.returncode, log))
        runner.add(row)
        return BASELINE_LEVERS
    best = measured[choice["setting"]]
    row.update({key: best[found] for key, found in (("tokens_per_s_per_gpu", "tokens_per_s"), ("mfu", "mfu"),
                                                     ("peak_allocated_gib", "peak_allocated_gib")) if found in best},
               mean_loss=mean(best["losses"]), result=lever_result(choice), levers=choice["settings"])
    print(f"levers: {row['result']}", flush=True)
    runner.add(row)
    return choice["options"]


def levers_text(options):
    return " ".join(options) or "no levers"


def lever_result(choice):
    """`ok: chosen ...; each: ...`, or FAILED where a setting's losses stray from the baseline's or it failed."""
    each = "; ".join(f"{found['setting']} " + (
        "out of memory" if found["out_of_memory"] else f"failed: {found['error']}" if found["error"] else
        f"{found['speedup']:.2f}x, losses within {found['loss_difference']:.1e}") for found in choice["settings"][1:])
    strayed = [found["setting"] for found in choice["settings"]
               if found["error"] or (found["speedup"] is not None and not found["same_losses"])]
    chosen = f"{choice['setting']} ({levers_text(choice['options'])}, {choice['speedup']:.2f}x)"
    if strayed:
        return f"FAILED: {', '.join(strayed)} (losses not the baseline's, or failed); chosen {chosen}; each: {each}"
    return f"ok: chosen {chosen}; each: {each}"


def tensor_parallel(runner, arguments, backend, plans):
    """Step 6 at tensor parallel 2 on every GPU (FSDP over the pairs), where there are 2 or more; the
    same global batch as the step4 row, so the losses are step4's (bf16 on a GPU: to its rounding)."""
    setup = f"demo model, tensor parallel 2 x FSDP {runner.ranks // 2}, {runner.ranks} ranks, {backend}"
    if runner.ranks < 2:
        runner.skip(ROWS["step6"][0], setup, "needs 2 GPUs or more (each layer split over 2)")
        return
    row = runner.run("step6", setup, "06_tp/train.py", runner.ranks, arguments, plans=plans)
    reference = next((r for r in runner.rows if r["check"] == ROWS["step4"][0] and r["result"] == "ok"), None)
    if row and row["result"] == "ok" and reference:
        compare_with_step4(row, reference, runner.on_gpu)
        write_report(runner, final=False)


def compare_with_step4(row, reference, on_gpu):
    """Step 6's row fails where its losses stray from step 4's on the same global batches by more than
    TP_LOSS_TOLERANCE (relative; bf16 on a GPU, fp32 on the CPU), or where it has not the same steps."""
    tolerance = TP_LOSS_TOLERANCE["gpu" if on_gpu else "cpu"]
    if len(row["losses"]) != len(reference["losses"]):
        row["result"] = f"FAILED: {len(row['losses'])} steps on record against step4's {len(reference['losses'])}"
        return
    worst = largest_relative_difference(row["losses"], reference["losses"])
    row["result"] = (f"ok: losses within {worst:.1e} of step4's" if worst <= tolerance else
                     f"FAILED: losses differ from step4's by up to {worst:.1e} (relative; at most {tolerance:.0e})")


def preemption(runner, arguments, backend):
    """Step 4 as the step4 row runs it, with the loader's workers, stopped by SIGTERM to every process
    of the job once 3 steps are done, then resumed to the end."""
    setup = f"demo model, FSDP, {runner.ranks} ranks, {backend}, 2 loader workers, SIGTERM to every process"
    if not runner.enough_time("preemption", setup):
        return
    started = time.monotonic()
    output_dir, log = runner.fresh("preemption")
    arguments = [*arguments, "--data_workers", 2]
    launch = dict(script="04_fsdp/train.py", nproc=runner.ranks, log=log, launcher="launch.torchrun")
    process = runner.start(arguments=runner.step_arguments(output_dir, "--overwrite", *arguments), **launch)
    status = runner.wait(process, output_dir, signal_after=3)
    text = log.read_text(errors="replace")
    saved = [line for line in text.splitlines() if line.startswith("preempted: saved a checkpoint at step ")]
    if status is None:
        if process.returncode != 128 + signal.SIGTERM or not saved or "Traceback" in text or "killed by" in text:
            status = f"FAILED: the SIGTERM did not end in a checkpoint and a `preempted:` line (see {log})"
        else:
            resumed = runner.start(arguments=runner.step_arguments(output_dir, "--resume", *arguments), **launch)
            status = runner.wait(resumed, output_dir) or exit_result(resumed.returncode, log)
    row = {"check": ROWS["preemption"][0], "setup": setup, "result": status,
           "seconds": round(time.monotonic() - started), **figures(output_dir)}
    if status == "ok":
        reference = next((r for r in runner.rows if r["check"] == ROWS["step4"][0] and r["result"] == "ok"), None)
        steps = [r["step"] for r in read_records(output_dir)]
        if steps != list(range(1, runner.demo_steps + 1)):
            row["result"] = f"FAILED: the resumed run's steps are not each step once ({steps})"
        elif reference is None:
            row["result"] = f"ok: {saved[0]}, resumed to the end (no step4 row to compare its losses with)"
        else:
            worst = max(abs(a - b) for a, b in zip(row["losses"], reference["losses"]))
            row["result"] = (f"ok: {saved[0].split(' in ')[0].removeprefix('preempted: ')}, resumed; losses within "
                             f"{worst:.1e} of step4's" if worst <= 1e-4 else
                             f"FAILED: the resumed losses differ from step4's by up to {worst:.1e}")
    print(f"preemption: {row['result']}", flush=True)
    runner.add(row)


def nf4_sharding(runner, model_dir, ranks):
    setup = f"2 layers of the 7B shape, NF4 + LoRA, fp32 compute, {ranks} rank(s)"
    if not runner.enough_time("nf4_sharding", setup):
        return
    started = time.monotonic()
    _, log = runner.fresh("nf4_sharding")
    process = runner.start("benchmark/nf4_sharding.py", ranks, ["--model", model_dir, "--layers", 2], log)
    process.wait()
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith('{"ranks"')]
    row = {"check": ROWS["nf4_sharding"][0], "setup": setup, "seconds": round(time.monotonic() - started)}
    if process.returncode == 0 and lines:
        found = json.loads(lines[-1])
        row["result"] = (f"ok: the same logits to {found['max_difference']:.1e} (scale {found['logit_scale']:.2f}); "
                         f"{found['split_4bit_weights']} 4-bit weights split, {found['whole_4bit_weights']} kept whole")
    else:
        row["result"] = f"FAILED (exit {process.returncode}, see {log})"
    runner.add(row)


def largest_full_fine_tune(args, config, job, ranks, estimate_memory):
    """(layers, rows): the most of the 7B shape's layers that a full fine-tune fits with FULL_ROWS
    rows per GPU (or --batch_size_per_device), then the most rows that still fit; (0, 0) where not
    even one layer does. Its MFU is what full fine-tuning reaches on this GPU."""
    least = args.batch_size_per_device or FULL_ROWS
    for layers in range(config["num_hidden_layers"], 0, -1):
        rows = most_rows(estimate_memory, {**config, "num_hidden_layers": layers}, job(1), ranks, "fsdp")
        if rows >= least:
            return layers, args.batch_size_per_device or rows
    return 0, 0


def full_offload(runner, config, job, ranks, estimate_memory, model_dir):
    """The whole 7B shape, full fine-tuning with the sharded state in host memory, where it does not
    fit the GPUs otherwise and the host has the memory available."""
    setup = f"{config['num_hidden_layers']} layers, random weights, FULL_SHARD x {ranks}, CPU offload"
    if most_rows(estimate_memory, config, job, ranks, "fsdp", most=1):
        runner.skip(ROWS["full_offload"][0], setup, "fits the GPUs without offload (see full fine-tuning)")
        return
    from transformers import AutoConfig
    shape = estimate_memory.model_shape(AutoConfig.for_model(**config), str(model_dir))
    host = estimate_memory.loading_bytes(shape) * 4 * 1.1  # fp32 weights, gradients and AdamW's two, 10 % to spare
    available = psutil.virtual_memory().available
    if host > available:
        runner.skip(ROWS["full_offload"][0], setup, f"offloaded it needs {host / GiB:.0f} GiB of host memory, "
                    f"{available / GiB:.0f} GiB are available")
        return
    runner.run("full_offload", setup, "04_fsdp/train.py", ranks, job + ["--cpu_offload"], stop_after=runner.args.steps,
               random_weights=True)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
