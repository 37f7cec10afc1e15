"""benchmark/sweep.py: a tiny real sweep on the CPU (table, JSON and plot agree; --collect reads
it back the same), the out-of-memory rule (recognised in a log, stops the doubling of its setting
only), the Slurm job array as --dry-run prints it without Slurm, and one-line refusals."""
import json
import os
import sys
from pathlib import Path

import pytest

from common.errors import UserError
from benchmark import run as benchmark_run
from benchmark import sweep as sweep_module
from conftest import run_python

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# What torchrun's log holds when a rank runs out of GPU memory (PyTorch 2.x, abridged).
OOM_LOG = """\
total batch 256 = 64 per device × 4 devices × 1 gradient accumulation steps
[rank2]: Traceback (most recent call last):
[rank2]:   File "/kit/04_fsdp/train.py", line 241, in main
[rank2]:     (loss * world_size / step_tokens).backward()
[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.83 GiB. GPU 2 has a total capacity of \
79.19 GiB of which 3.11 GiB is free. Of the allocated memory 71.20 GiB is allocated by PyTorch
E1123 16:02:11.512000 4121 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) local_rank: 2
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""
OTHER_FAILURE = """\
[rank0]: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def run_sweep(*args, env=None, timeout=120):
    env = env or {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return run_python(["benchmark/sweep.py", *args], env=env, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_sweep(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    result = run_sweep("--model", demo / "model", "--data_dir", demo / "data", "--max_batch_size", 2, "--steps", 2,
                       "--max_seq_length", 32, "--out", out, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_tiny_cpu_sweep_writes_a_table_the_json_and_a_plot_that_agree(tiny_sweep):
    results = json.loads((tiny_sweep / "sweep.json").read_text())
    table = (tiny_sweep / "sweep.md").read_text()
    runs = results["runs"]
    assert [(r["batch_size_per_device"], r["gradient_checkpointing"]) for r in runs] == \
        [(1, False), (1, True), (2, False), (2, True)]
    assert results["ranks"] == 2 and results["steps"] == 2 and len(results["load_average_after"]) == 3
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4
    for run, row in zip(runs, rows):
        assert run["status"] == "ok"
        assert run["step_time_s"] > 0 and run["tokens_per_s"] > 0 and run["peak_rss_mib"] > 0
        assert run["tokens_per_s_per_device"] == pytest.approx(run["tokens_per_s"] / 2, abs=0.1)
        assert row == (f"| {run['batch_size_per_device']} | {'on' if run['gradient_checkpointing'] else 'off'} "
                       f"| {run['step_time_s']} | {run['tokens_per_s']} | {run['tokens_per_s_per_device']} "
                       f"| {run['peak_rss_mib']} | ok |")
        folder = Path(run["output_dir"])
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [r["batch_size_per_device"] for r in records] == [run["batch_size_per_device"]] * 2
        assert {r["tokens"] for r in records} == {run["batch_size_per_device"] * 2 * 31}  # packed rows, no accumulation
        assert not (folder / "checkpoints").exists() and not (folder / "final").exists()  # figures, not weights
    assert "torch " in table and "load average" in table and "--max_batch_size 2 --steps 2" in table
    png = (tiny_sweep / "sweep.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 5000


def test_collect_reads_the_same_runs_back(tiny_sweep):
    table = (tiny_sweep / "sweep.md").read_text()
    result = run_sweep("--collect", tiny_sweep)
    assert result.returncode == 0, result.stderr
    assert (tiny_sweep / "sweep.md").read_text() == table


@pytest.mark.quick
def test_out_of_memory_is_recognised_in_a_log(tmp_path):
    sweep = sweep_module
    assert sweep.out_of_memory(OOM_LOG)
    assert sweep.out_of_memory("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be ...")
    assert not sweep.out_of_memory(OTHER_FAILURE)
    run = sweep.planned_run(tmp_path, 64, False)
    Path(run["output_dir"]).mkdir()
    run["logs"] = [str(Path(run["output_dir"]) / "log.txt")]
    Path(run["logs"][0]).write_text(OOM_LOG)
    assert sweep.read_run(run)["status"] == "out of memory"
    Path(run["logs"][0]).write_text(OTHER_FAILURE)
    assert sweep.read_run(run)["status"].startswith("no result")


@pytest.mark.quick
def test_out_of_memory_stops_the_doubling_of_its_setting_only(demo, tmp_path, monkeypatch):
    """The local sweep's rule, with the runs replaced by files: without checkpointing the run of
    2 rows per device fails as a GPU does; with it, every size up to --max_batch_size runs."""
    sweep = sweep_module

    def launch(script, ranks, arguments, log_path, timeout):
        value = dict(zip(arguments, arguments[1:]))
        batch, folder = int(value["--batch_size_per_device"]), Path(value["--output_dir"])
        if batch >= 2 and "--gradient_checkpointing" not in arguments:
            Path(log_path).write_text(OOM_LOG)
            raise UserError(f"{script} on {ranks} ranks failed (exit 1): ChildFailedError: (log: {log_path})")
        records = [{"step": s, "tokens": 100 * batch, "step_time_s": 0.5, "world_size": ranks, "peak_rss_mib": 600}
                   for s in (1, 2, 3)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (folder / "summary.json").write_text("{}")
    monkeypatch.setattr(benchmark_run, "launch", launch)
    monkeypatch.setattr(sys, "argv", ["sweep.py", "--model", str(demo / "model"), "--data_dir", str(demo / "data"),
                                      "--max_batch_size", "4", "--steps", "3", "--out", str(tmp_path)])
    runs = sweep.run_locally(sweep.parse_arguments())["runs"]
    assert [(r["batch_size_per_device"], r["gradient_checkpointing"], r["status"]) for r in runs] == [
        (1, False, "ok"), (1, True, "ok"), (2, False, "out of memory"), (2, True, "ok"), (4, True, "ok")]
    assert runs[-1]["tokens_per_s"] == 800 and runs[-1]["tokens_per_s_per_device"] == 400


@pytest.fixture
def no_slurm_env():
    """Only the virtual environment on PATH: no sbatch, so nothing here can submit a job."""
    return {**os.environ, "PATH": str(Path(sys.executable).parent)}


@pytest.mark.quick
def test_slurm_dry_run_prints_one_array_script_without_slurm(demo, tmp_path, no_slurm_env):
    result = run_sweep("--slurm", "--gpus", 4, "--max_batch_size", 4, "--partition", "gpu", "--time", "20",
                       "--model", demo / "model", "--data_dir", demo / "data", "--out", tmp_path / "sweep",
                       "--dry-run", env=no_slurm_env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("6 tasks in one job array, each 1 node(s) × 4 GPU(s)")
    assert out.count("  task ") == 6 and "task 5: batch 4 per device, checkpointing on" in out
    script = out.split("---- sbatch script (dry run: nothing submitted) ----\n")[1]
    assert script.count("#!/bin/bash") == 1
    for line in ["#SBATCH --array=0-5%6", "#SBATCH --gpus-per-node=4", "#SBATCH --partition=gpu",
                 "#SBATCH --time=20", "#SBATCH --signal=USR2@300", "#SBATCH --requeue"]:
        assert line in script.splitlines(), line
    assert ("-m launch.torchrun --nnodes=1 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=FIRST_NODE:PORT "
            "--rdzv-id=JOBID-RESTARTS 04_fsdp/train.py") in out  # StepLauncher's line, as submit.py's
    assert "--total_batch_size 16 --batch_size_per_device 4" in out and "--gradient_checkpointing" in out
    assert not (tmp_path / "sweep").exists()  # nothing submitted, nothing written


@pytest.mark.quick
@pytest.mark.parametrize("arguments, message", [
    (["--gpus", "4"], "--gpus go with --slurm (locally, --nproc sets the ranks)"),
    (["--slurm"], "--slurm needs --gpus"),
    (["--slurm", "--gpus", "2", "--nproc", "2"], "--nproc is for a local sweep"),
    (["--steps", "1"], "--steps must be at least 2"),
    (["--collect", "runs/x", "--steps", "3"], "--collect DIR reads a sweep that has run"),
    (["--collect", "/nonexistent/sweep"], "no sweep.json in /nonexistent/sweep"),
    (["--slurm", "--gpus", "2", "--time", "soon", "--dry-run"], "--time 'soon' is not a Slurm time limit"),
    (["--model", "/nonexistent/model"], "model /nonexistent/model is neither a directory nor in the Hugging Face"),
    # issue 23: negative counts, refused as they are read
    (["--steps", "-5"], "--steps must be at least 2 (got -5)"),
    (["--max_batch_size", "-2"], "--max_batch_size must be at least 1 (got -2)"),
    (["--nproc", "-1"], "--nproc must be at least 1 (got -1)"),
    (["--max-seq-length", "-64"], "--max_seq_length must be at least 16 (got -64)"),
    (["--slurm", "--gpus", "-4", "--dry-run"], "--gpus must be at least 1 (got -4)"),
    (["--slurm", "--gpus", "2", "--nodes", "-1", "--dry-run"], "--nodes must be at least 1 (got -1)"),
    (["--slurm", "--gpus", "2", "--cpus_per_task", "-8", "--dry-run"], "--cpus_per_task must be at least 1 (got -8)"),
    (["--slurm", "--gpus", "2", "--mem_gb", "-1", "--dry-run"], "--mem_gb must be at least 1 (got -1)"),
    (["--steps", "four"], "--steps must be a whole number (got 'four')"),
])
def test_bad_options_are_one_error_line(arguments, message, no_slurm_env):
    result = run_sweep(*arguments, env=no_slurm_env)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


# ---- issue 36: case 13, and the sweep's own default-output pattern ---------------------------------------

@pytest.mark.quick
@pytest.mark.parametrize("content", ['{"command": "benchmark/sweep.py", "runs": [{"batch_size_per', "[]",
                                     '{"runs": [{"output_dir": "x"}]}'])
def test_collect_of_a_damaged_sweep_json_is_one_line(tmp_path, content):
    """Case 13: a truncated sweep.json was a traceback."""
    (tmp_path / "sweep.json").write_text(content)
    with pytest.raises(UserError, match=f"^{tmp_path / 'sweep.json'} is damaged \\("):
        sweep_module.collect(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["sweep.json"]


@pytest.mark.quick
def test_collect_leaves_out_a_line_cut_short(tmp_path):
    """A task killed while it wrote metrics.jsonl: its run has no result, and the table is written."""
    run = sweep_module.planned_run(tmp_path, 1, False)
    Path(run["output_dir"]).mkdir()
    run["logs"] = [str(Path(run["output_dir"]) / "log.txt")]
    (Path(run["output_dir"]) / "summary.json").write_text("{}")
    (Path(run["output_dir"]) / "metrics.jsonl").write_text('{"step": 1, "tokens": 10, "step_time_s": 1, "world_si')
    assert sweep_module.read_run(run)["status"].startswith("no result")


@pytest.mark.quick
def test_an_earlier_sweep_in_out_is_refused_before_anything_runs(demo, tmp_path, monkeypatch):
    """Each run's folder under --out was deleted first, and sweep.md/.json/.png written over."""
    (tmp_path / "batch1").mkdir()
    (tmp_path / "batch1/notes.txt").write_text("mine")
    (tmp_path / "sweep.json").write_text("{}")
    launched = []
    monkeypatch.setattr(benchmark_run, "launch", lambda *args: launched.append(args))
    for command in (["--max_batch_size", "1"], ["--slurm", "--gpus", "2", "--max_batch_size", "1"]):
        monkeypatch.setattr(sys, "argv", ["sweep.py", "--model", str(demo / "model"), "--data_dir", str(demo / "data"),
                                          "--out", str(tmp_path), *command])
        with pytest.raises(UserError, match=f"--out {tmp_path} holds an earlier sweep .*: pass --overwrite"):
            sweep_module.main()
    assert not launched and (tmp_path / "batch1/notes.txt").read_text() == "mine"
    assert (tmp_path / "sweep.json").read_text() == "{}"
