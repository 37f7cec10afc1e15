"""Batch size and activation checkpointing, measured: the FSDP guide's two performance questions.

    .venv/bin/python benchmark/sweep.py                  # here: 2 CPU ranks, or every GPU of this node
    .venv/bin/python benchmark/sweep.py --slurm --gpus 4 [--nodes 1] [--partition P] [--account A] \\
        [--time T] [--dry-run]                           # one Slurm job array, one task per run
    .venv/bin/python benchmark/sweep.py --collect runs/sweep    # the table, once the array has run

(a) Double the batch per device (1, 2, 4, ...) until memory runs out: how does the time per step
grow? (b) Gradient (activation) checkpointing recomputes each decoder layer's activations in
backward: how much memory does it save, and what does it cost, at each batch size?

Each run is 04_fsdp/train.py on the demo model and data by default, --steps optimiser steps of
batch_size_per_device × ranks rows (no gradient accumulation), with and without
--gradient_checkpointing, in its own folder under --out. Locally the runs go one
after another, and a setting stops doubling when its run fails with CUDA out of memory or
reaches --max_batch_size (the CPU swaps instead of failing). On Slurm every (batch size,
checkpointing) pair up to --max_batch_size is one task of a single job array, launched as
submit.py launches a job; `--collect` then reads the finished runs. Figures come from each run's
metrics.jsonl, step 1 (warm-up) left out. Writes sweep.md, sweep.json and sweep.png into --out.
The sweep keeps figures, not weights: an ended run's checkpoints/ and final/ are deleted. An --out
that holds an earlier sweep (its sweep.json or a run's folder) is refused before anything runs or is
submitted; --overwrite replaces it.
"""
import argparse
import json
import os
import platform
import re
import shlex
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path


from common.arguments import DEMO_DIR, REPO, Parser, at_least
from common.errors import UserError, exit_on_user_error, first_line
from common.run_dir import RunDir
import submit
from benchmark import run as benchmark_run
from launch.steps import check_training_arguments

SCRIPT = "04_fsdp/train.py"
CPU_RANKS = 2
# The CPU swaps rather than failing: 1 to 32 rows per rank, both settings, take about 4 minutes
# on 2 cores at the default sequence length. A GPU stops at out of memory long before 256
# rows of a real model; the demo model never gets there.
MAX_BATCH = {"cpu": 32, "gpu": 256}
RUN_TIMEOUT_S = 3600  # one run of a few steps; longer means it hangs
# What a rank prints when CUDA memory runs out: PyTorch's allocator, and CUDA or cuBLAS inside a kernel.
OUT_OF_MEMORY = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED")
# Options that mean nothing to a local sweep.
SLURM_ONLY = ("gpus", "nodes", "partition", "account", "time", "cpus_per_task", "mem_gb", "dry_run")


def out_of_memory(log_text):
    return OUT_OF_MEMORY.search(log_text) is not None


def batch_sizes(largest):
    sizes = [1]
    while sizes[-1] * 2 <= largest:
        sizes.append(sizes[-1] * 2)
    return sizes


def planned_run(out, batch, checkpointing):
    name = f"batch{batch}" + ("_checkpointing" if checkpointing else "")
    return {"batch_size_per_device": batch, "gradient_checkpointing": checkpointing,
            "output_dir": str(Path(out).resolve() / name), "status": "not run"}


def training_arguments(args, run, ranks):
    """The run's arguments for 04_fsdp/train.py: one global batch of batch × ranks rows, no
    accumulation, and an evaluation of one item per rank (the script evaluates at both ends)."""
    return ["--model", args.model, "--data_dir", args.data_dir, "--output_dir", run["output_dir"],
            "--total_batch_size", str(run["batch_size_per_device"] * ranks),
            "--batch_size_per_device", str(run["batch_size_per_device"]), "--max_steps", str(args.steps),
            "--max_seq_length", str(args.max_seq_length), "--eval_every", "0", "--eval_rows", str(ranks),
            "--eval_games", str(ranks), *(["--gradient_checkpointing"] if run["gradient_checkpointing"] else [])]


def read_records(output_dir):
    """metrics.jsonl's records; a line cut short (a killed task) is left out."""
    path = RunDir(output_dir).metrics
    records = []
    for line in (path.read_text(errors="replace").splitlines() if path.is_file() else []):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in records if isinstance(r, dict) and all(k in r for k in ("step_time_s", "tokens", "world_size"))]


def read_run(run):
    """The run's status and figures, from its folder and logs: finished (summary.json), out of
    memory (its logs say so), or no result yet."""
    output_dir = Path(run["output_dir"])
    logs = "".join(Path(log).read_text(errors="replace") for log in run["logs"] if Path(log).is_file())
    records = read_records(output_dir)
    if not RunDir(output_dir).summary.is_file() or len(records) < 2:
        run["status"] = "out of memory" if out_of_memory(logs) else f"no result (see {run['logs'][0]})"
        return run
    timed = records[1:]  # step 1 warms up (allocator, first collectives)
    seconds, last = sum(r["step_time_s"] for r in timed), records[-1]
    tokens_per_s = sum(r["tokens"] for r in timed) / seconds
    run.update(status="ok", step_time_s=round(seconds / len(timed), 3), tokens_per_s=round(tokens_per_s, 1),
               tokens_per_s_per_device=round(tokens_per_s / last["world_size"], 1),
               # rank 0's peak up to the last step (loading and the first evaluation included)
               **{key: last[key] for key in ("peak_rss_mib", "peak_gpu_allocated_mib", "peak_gpu_reserved_mib")
                  if key in last})
    return run


def drop_weights(run):
    """The sweep keeps figures, not weights: a few steps' checkpoint and final model of a 7B model
    take 135 GB. Only of a run that has ended (a Slurm task may still be writing)."""
    if run["status"] in ("ok", "out of memory"):
        run_dir = RunDir(run["output_dir"])
        for folder in (run_dir.checkpoints_dir, run_dir.final):
            shutil.rmtree(folder, ignore_errors=True)


def run_locally(args):
    import torch
    on_gpu = torch.cuda.is_available()
    nproc = args.nproc or (torch.cuda.device_count() if on_gpu else CPU_RANKS)
    if on_gpu and nproc > torch.cuda.device_count():
        raise UserError(f"--nproc {nproc}: this node has {torch.cuda.device_count()} GPUs")
    largest = args.max_batch_size or MAX_BATCH["gpu" if on_gpu else "cpu"]
    machine = f"{os.cpu_count()} CPU cores, {platform.machine()}" + (
        f", {torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}" if on_gpu else "")
    check_training_arguments("fsdp", training_arguments(args, planned_run(args.out, 1, False), nproc))
    check_out(args)
    results = {**describe(args, nproc, machine), "load_average_before": load_average()}
    launch = benchmark_run.launch
    out_of_memory_at = {}  # checkpointing setting -> the batch size that ran out
    for batch in batch_sizes(largest):
        for checkpointing in (False, True):
            if checkpointing in out_of_memory_at:
                continue
            run = planned_run(args.out, batch, checkpointing)
            arguments = training_arguments(args, run, nproc)
            output_dir = Path(run["output_dir"])
            shutil.rmtree(output_dir, ignore_errors=True)  # stale figures must not pass for this run's
            output_dir.mkdir(parents=True)
            run["logs"] = [str(output_dir / "log.txt")]
            print(f"== batch {batch} per device, checkpointing {'on' if checkpointing else 'off'}: {SCRIPT} on "
                  f"{nproc} rank(s)", flush=True)
            try:
                launch(SCRIPT, nproc, arguments, run["logs"][0], RUN_TIMEOUT_S)
            except UserError:
                if not out_of_memory(Path(run["logs"][0]).read_text(errors="replace")):
                    raise
                out_of_memory_at[checkpointing] = batch
            results["runs"].append(read_run(run))
            drop_weights(run)
            print(f"   {one_line(run)}", flush=True)
    results["load_average_after"] = load_average()
    return results


def submit_array(args):
    """Every (batch size, checkpointing) pair as one task of a single job array, each task
    launched as submit.py launches a job (its executor, launch/step_launcher.py's StepLauncher)."""
    from launch.step_launcher import StepLauncher
    out = Path(args.out).resolve()
    if "%" in str(out) or not str(out).isprintable():
        raise UserError(f"--out {args.out!r}: its logs folder goes into the job script, where Slurm would expand "
                        "a % and a line break would end the #SBATCH line: choose another folder")
    ranks = args.gpus * args.nodes
    # submit.py's options of the same meaning, for its checks and its executor
    job = argparse.Namespace(step="fsdp", job_name="fsdp-sweep", gpus=args.gpus, nodes=args.nodes,
                             partition=args.partition, account=args.account, cpus_per_task=args.cpus_per_task,
                             mem_gb=args.mem_gb, log_dir=str(out / "logs"), dry_run=args.dry_run,
                             total_batch_size=ranks, batch_size_per_device=1, training_args=[])
    submit.check_sbatch_values(job)
    submit.check_request(job)
    timeout_min = submit.time_limit_minutes(args.time)
    warning_s = submit.preemption_warning_s(timeout_min)
    args.model = submit.model_path(args.model)
    args.data_dir = submit.absolute(args.data_dir)
    runs = [planned_run(out, batch, checkpointing) for batch in batch_sizes(args.max_batch_size or MAX_BATCH["gpu"])
            for checkpointing in (False, True)]
    for run in runs:
        check_training_arguments("fsdp", training_arguments(args, run, ranks))  # before anything is queued
    if not args.dry_run:  # a dry run writes and deletes nothing
        check_out(args)
    if not args.dry_run and shutil.which("sbatch") is None:
        raise UserError("no Slurm here (sbatch not found): run this on the cluster's login node, or add --dry-run")

    executor, cpus_per_task = submit.make_executor(job, timeout_min, warning_s)
    launchers = [StepLauncher("fsdp", args.gpus, cpus_per_task, training_arguments(args, run, ranks), warning_s)
                 for run in runs]
    print(f"{len(runs)} tasks in one job array, each {args.nodes} node(s) × {args.gpus} GPU(s), "
          f"time limit {args.time}:")
    for index, run in enumerate(runs):
        print(f"  task {index}: batch {run['batch_size_per_device']} per device, checkpointing "
              f"{'on' if run['gradient_checkpointing'] else 'off'} -> {run['output_dir']}")
    example = launchers[-1].command(args.nodes, first_node="FIRST_NODE", port="PORT", job_id="JOBID",
                                    restarts="RESTARTS")
    print(f"task {len(runs) - 1}, on each node: {shlex.join(example)}")
    print("  (FIRST_NODE: first node of the task's allocation, PORT: 20000 + job id % 20000)")
    if args.dry_run:
        # What submitit does when it submits a batch as one array, then the call submit.py's --dry-run makes.
        executor.parameters["map_count"] = len(runs)
        script = executor._make_submission_file_text(executor._submitit_command_str, uid="dry-run")
        print("\n---- sbatch script (dry run: nothing submitted) ----")
        print(script.rstrip())
        return None

    results = describe(args, ranks, machine=None)  # before submitting: what --collect needs is then sure to be there
    for run in runs:  # stale figures of an earlier sweep must not pass for this one's
        shutil.rmtree(run["output_dir"], ignore_errors=True)
    with submit.slurm_refusal_is_one_line(), executor.batch():
        jobs = [executor.submit(launcher) for launcher in launchers]
    for run, task in zip(runs, jobs):
        run.update(job_id=task.job_id, status="submitted",
                   logs=[str(task.paths.folder / f"{task.job_id}_{node}_log.out") for node in range(args.nodes)])
    array_id = jobs[0].job_id.split("_")[0]
    results.update(runs=runs, machine=f"Slurm job array {array_id}: {args.nodes} node(s) × {args.gpus} GPU(s) per "
                                      f"task, partition {args.partition or '(default)'}")
    print(f"\nsubmitted job array {array_id}\n  status:  squeue -j {array_id}    after it ended: sacct -j {array_id}"
          f"\n  table:   {sys.executable} benchmark/sweep.py --collect {shlex.quote(str(out))}    (once it has ended)")
    return results


def describe(args, ranks, machine):
    import torch
    parameters, _ = benchmark_run.parameter_count(args.model)
    return {"command": shlex.join(["benchmark/sweep.py", *sys.argv[1:]]),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine,
            "torch": torch.__version__, "model": str(args.model),
            "parameters": parameters, "ranks": ranks, "steps": args.steps, "max_seq_length": args.max_seq_length,
            "runs": []}


def load_average():
    return [round(x, 2) for x in os.getloadavg()]


def one_line(run):
    if run["status"] != "ok":
        return run["status"]
    return f"{run['step_time_s']} s/step, {run['tokens_per_s']} tokens/s, {memory(run)} MiB/rank"


def memory(run):
    """Peak memory per rank: on a GPU what PyTorch allocated / what it reserved, else resident memory."""
    if "peak_gpu_allocated_mib" in run:
        return f"{run['peak_gpu_allocated_mib']} / {run['peak_gpu_reserved_mib']}"
    return run.get("peak_rss_mib", "—")


def markdown(results):
    on_gpu = any("peak_gpu_allocated_mib" in run for run in results["runs"])
    peak = "peak GPU MiB per rank, allocated / reserved" if on_gpu else "peak RSS MiB per rank"
    load = (f"load average {results['load_average_before']} before, {results['load_average_after']} after"
            if "load_average_before" in results else "Slurm tasks: load average not measured")
    lines = [f"Command: `{results['command']}` ({results['date']}; {results['machine']}; torch {results['torch']}; "
             f"{load}).", "",
             f"Model {results['model']} ({results['parameters'] / 1e6:.1f}M parameters), 04_fsdp FULL_SHARD on "
             f"{results['ranks']} ranks, {results['max_seq_length']} tokens per row, {results['steps']} optimiser "
             "steps per run, no gradient accumulation (rows per step = batch per device × ranks). s/step and tokens/s "
             "leave out step 1; tokens/s counts loss-bearing tokens; peak memory is rank 0's, up to the last step.",
             "", f"| batch per device | checkpointing | s/step | tokens/s | tokens/s per device | {peak} | status |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for run in results["runs"]:
        ok = run["status"] == "ok"
        cells = [run["step_time_s"], run["tokens_per_s"], run["tokens_per_s_per_device"], memory(run)] if ok \
            else ["—"] * 4
        lines.append(f"| {run['batch_size_per_device']} | {'on' if run['gradient_checkpointing'] else 'off'} | "
                     + " | ".join(str(cell) for cell in cells) + f" | {run['status']} |")
    return "\n".join(lines) + "\n"


def plot(results, path):
    """Time per step, tokens/s and peak memory against the batch per device, one line per setting."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    on_gpu = any("peak_gpu_allocated_mib" in run for run in results["runs"])
    peak = "peak_gpu_allocated_mib" if on_gpu else "peak_rss_mib"
    panels = [("step_time_s", "s per optimiser step"), ("tokens_per_s", "tokens/s, all ranks"),
              (peak, "peak GPU allocated MiB per rank" if on_gpu else "peak RSS MiB per rank")]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for checkpointing in (False, True):
        runs = [run for run in results["runs"] if run["gradient_checkpointing"] == checkpointing]
        ok = [run for run in runs if run["status"] == "ok"]
        failed = [run["batch_size_per_device"] for run in runs if run["status"] == "out of memory"]
        label = f"checkpointing {'on' if checkpointing else 'off'}" + (
            f" (out of memory at {min(failed)})" if failed else "")
        for axis, (key, _) in zip(axes, panels):
            axis.plot([run["batch_size_per_device"] for run in ok], [run[key] for run in ok], marker="o", label=label)
    sizes = sorted({run["batch_size_per_device"] for run in results["runs"]})
    for axis, (_, title) in zip(axes, panels):
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes, [str(size) for size in sizes], minor=False)
        axis.minorticks_off()
        axis.set_xlabel("batch per device (rows)")
        axis.set_title(title)
        axis.set_ylim(bottom=0)
    axes[0].legend()
    figure.suptitle(f"04_fsdp on {results['ranks']} ranks, {results['max_seq_length']} tokens per row")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_results(results, out):
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "sweep.md").write_text(markdown(results))
    plot(results, out / "sweep.png")
    print("\n" + markdown(results))
    print(f"wrote {out / 'sweep.md'}, sweep.json and sweep.png")


# What --collect needs of sweep.json (describe() writes them, and a planned run per task).
DESCRIBED = ("command", "date", "machine", "torch", "model", "parameters", "ranks", "steps", "max_seq_length", "runs")
PLANNED = ("batch_size_per_device", "gradient_checkpointing", "output_dir", "logs")


def collect(folder):
    path = Path(folder) / "sweep.json"
    if not path.is_file():
        raise UserError(f"no sweep.json in {folder}: --collect reads the --out folder of a sweep")
    try:
        results = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        results, why = None, first_line(err)
    else:
        why = "it lacks what a sweep writes into it"
    if not (isinstance(results, dict) and all(key in results for key in DESCRIBED) and isinstance(results["runs"], list)
            and all(isinstance(run, dict) and all(key in run for key in PLANNED) and run["logs"]
                    for run in results["runs"])):
        raise UserError(f"{path} is damaged ({why}): it is written as a sweep is submitted (or, locally, ends); run "
                        "the sweep again with --overwrite") from None
    for run in results["runs"]:
        drop_weights(read_run(run))
    return results


def check_out(args):
    """An earlier sweep in --out (its sweep.json, a run's folder) is replaced only with --overwrite:
    its runs' folders are deleted before the new runs start (stale figures must not pass for theirs)."""
    out = Path(args.out)
    earlier = [out / "sweep.json"] + sorted(out.glob("batch*")) if out.is_dir() else []
    earlier = [path for path in earlier if path.exists()]
    if earlier and not args.overwrite:
        raise UserError(f"--out {out} holds an earlier sweep ({earlier[0].name}): pass --overwrite to replace it, "
                        "or choose another --out")


def parse_arguments():
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("model", default=str(DEMO_DIR / "model"), help="model directory or downloaded Hugging Face id")
    parser.add("data_dir", default=str(DEMO_DIR / "data"), help="directory with the games (see 01_download)")
    parser.add("steps", type=at_least(2), default=4, help="optimiser steps per run; the first is not counted")
    parser.add("max_seq_length", type=at_least(16), default=128, help="tokens per row")
    parser.add("max_batch_size", type=at_least(1),
               help=f"largest batch per device (default: {MAX_BATCH['cpu']} on the CPU, {MAX_BATCH['gpu']} on GPUs)")
    parser.add("out", default=str(REPO / "runs" / "sweep"), help="the runs' folders, sweep.md/.json/.png")
    parser.add("nproc", type=at_least(1),
               help=f"ranks of a local sweep (default: every GPU, or {CPU_RANKS} on the CPU)")
    parser.add("slurm", action="store_true", help="submit the runs as one Slurm job array instead")
    parser.add("gpus", type=at_least(1), help="--slurm, required: GPUs per node")
    parser.add("nodes", type=at_least(1), default=1, help="--slurm: nodes per run")
    parser.add("partition", help="--slurm: partition (default: the cluster's default)")
    parser.add("account", help="--slurm: account to charge (default: yours)")
    parser.add("time", default="00:30:00", help="--slurm: time limit of each task, minutes, HH:MM:SS or D-HH:MM:SS")
    parser.add("cpus_per_task", type=at_least(1), help="--slurm: CPUs per node (default: 8 per GPU)")
    parser.add("mem_gb", type=at_least(1), help="--slurm: memory per node in GB (default: the cluster's default)")
    parser.add("dry_run", action="store_true", help="--slurm: print the array's sbatch script; submit nothing")
    parser.add("overwrite", action="store_true", help="replace the sweep in --out (its runs, table and plot)")
    parser.add("collect", metavar="DIR", help="write the table and plot of the sweep that ran into DIR (its --out)")
    args = parser.parse_args()
    given = [name for name, value in vars(args).items() if value != parser.get_default(name)]
    if args.collect and given != ["collect"]:
        raise UserError("--collect DIR reads a sweep that has run, with the settings it ran with: give it alone")
    if not args.slurm and set(given) & set(SLURM_ONLY):
        raise UserError(" ".join(f"--{name}" for name in SLURM_ONLY if name in given) + " go with --slurm"
                        + (" (locally, --nproc sets the ranks)" if "gpus" in given else ""))
    if args.slurm and args.nproc is not None:
        raise UserError("--nproc is for a local sweep: on Slurm, --gpus and --nodes set the ranks")
    if args.slurm and args.gpus is None:
        raise UserError("--slurm needs --gpus: the GPUs per node of each run")
    return args


def main():
    args = parse_arguments()
    if args.collect:
        results = collect(args.collect)
        write_results(results, Path(args.collect))
    elif args.slurm:
        results = submit_array(args)
        if results is not None:  # the runs' figures come with --collect
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "sweep.json").write_text(json.dumps(results, indent=1) + "\n")
    else:
        started = time.perf_counter()
        write_results(run_locally(args), Path(args.out))
        print(f"{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    exit_on_user_error(main)
