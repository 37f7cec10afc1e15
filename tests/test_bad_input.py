"""Bad input: one clear `error:` line that says what to do, a non-zero exit, and nothing on disk
lost. Each refused case runs against an output directory that already holds a finished run,
with --resume (so a run that went ahead would write there): afterwards every file of that run
must be unchanged, byte for byte. Damaged checkpoints are not refused but survived: --resume
falls back to the previous complete one, says so, and still ends where the uninterrupted run ends.
"""
import contextlib
import errno
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import checkpoint
from common.errors import UserError
from common.run_dir import is_complete
from launch.steps import load_step
from conftest import (RANKS, REPO, RESUMABLE, STEP_SCRIPTS, assert_same_run, demo_args, read_metrics, run_python,
                      run_ranks, run_step, with_changed)


SPLIT = ["--total_batch_size", 8, "--batch_size_per_device", 2]  # 1 × 2 × 4 or 2 ranks × 2 × 2
SPLITS = {"single": (1, SPLIT), "ddp": (2, SPLIT), "fsdp": (2, SPLIT)}


def one_error_line(result):
    assert result.returncode != 0, result.stdout[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def launcher_error_line(result):
    """Under torchrun every rank reports the same error, and torchrun adds its own summary
    (a traceback of torchrun itself); none of our code may end in a traceback."""
    assert result.returncode != 0, result.stdout[-2000:]
    errors = {line for line in result.stderr.splitlines() if line.startswith("error: ")}
    assert len(errors) == 1, result.stderr[-3000:]
    assert 'train.py", line' not in result.stderr and "[rank0]: Traceback" not in result.stderr, result.stderr[-3000:]
    return errors.pop()


def snapshot(folder):
    """Every file of a run (the lock file, which only says who holds it, is not the run's)."""
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(Path(folder).rglob("*"))
            if path.is_file() and path.name != ".lock"}


@pytest.fixture(scope="module")
def existing_run(demo, tmp_path_factory):
    """A finished run (metrics, checkpoints, final model, summary) that no mistake may touch."""
    output_dir = tmp_path_factory.mktemp("existing") / "run"
    run_step("single", demo_args(demo, output_dir) + ["--max_steps", 2, "--save_every", 1])
    return output_dir


def refused(demo, existing_run, *extra, model=None, data_dir=None, resume=True):
    """Run step 2 on top of the existing run; return its one error line after checking that the
    run's files are exactly as before."""
    before = snapshot(existing_run)
    args = demo_args(demo, existing_run) + ["--max_steps", 4, *(["--resume"] if resume else []), *extra]
    if model is not None:
        args[1] = model
    if data_dir is not None:
        args[3] = data_dir
    line = one_error_line(run_step("single", args, check=False))
    after = snapshot(existing_run)
    assert after.keys() == before.keys(), set(after) ^ set(before)
    assert [name for name in before if after[name] != before[name]] == [], "files of the existing run changed"
    return line


# ---- data ------------------------------------------------------------------------------------

def data_copy(demo, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(demo / "data", data, ignore=shutil.ignore_patterns("tokenized"))
    return data


def replace_line(path, number, text):
    lines = path.read_bytes().splitlines()
    lines[number - 1] = text if isinstance(text, bytes) else text.encode()
    path.write_bytes(b"\n".join(lines) + b"\n")


BAD_DATA = {
    "malformed-json": ("train.jsonl", 7, '{"text": "e2e4 e7e5', "train.jsonl:7: not valid JSON"),
    "not-an-object": ("train.jsonl", 3, '["e2e4", "e7e5"]', "train.jsonl:3: expected"),
    "wrong-key": ("train.jsonl", 3, '{"moves": "e2e4 e7e5"}', "train.jsonl:3: expected"),
    "not-uci": ("train.jsonl", 5, json.dumps({"text": "1. e4 e5 2. Nf3"}), "'1.' is not a UCI move"),
    "san-moves": ("validation.jsonl", 2, json.dumps({"text": "e4 e5 Nf3 Nc6"}), "'e4' is not a UCI move"),
    "not-utf8": ("train.jsonl", 4, b'{"text": "e2e4 \xff\xfe"}', "train.jsonl:4: not UTF-8"),
    # newlines lost: many games on one line, longer than any legal chess game
    "games-run-together": ("train.jsonl", 2, json.dumps({"text": " ".join(["g1f3 g8f6 f3g1 f6g8"] * 5000)}),
                           "train.jsonl:2: 20,000 moves, more than any chess game"),
    # UCI-shaped, but the king cannot go there: the legal-move evaluation replays validation games
    "illegal-validation-move": ("validation.jsonl", 3, json.dumps({"text": "e2e4 e7e5 e1e8"}),
                                "move 3, 'e1e8', is not legal in that position"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_line_is_named_with_file_and_line(demo, tmp_path, existing_run, case):
    name, number, text, words = BAD_DATA[case]
    data = data_copy(demo, tmp_path)
    replace_line(data / name, number, text)
    assert words in refused(demo, existing_run, data_dir=data)


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty", "blank-lines"])
def test_empty_dataset_is_refused(demo, tmp_path, existing_run, content):
    data = data_copy(demo, tmp_path)
    (data / "train.jsonl").write_text(content)
    assert "holds no games" in refused(demo, existing_run, data_dir=data)


def test_validation_games_too_short_to_evaluate(demo, tmp_path, existing_run):
    """One-move games leave no prefix with a next move to check: refused, not a traceback."""
    data = data_copy(demo, tmp_path)
    (data / "validation.jsonl").write_text(json.dumps({"text": "e2e4"}) + "\n")
    line = refused(demo, existing_run, data_dir=data)
    assert "the validation data gives 0 " in line and "use more validation games" in line, line


def test_missing_data_names_the_download_command(demo, tmp_path, existing_run):
    line = refused(demo, existing_run, data_dir=tmp_path / "nowhere")
    assert "train.jsonl" in line and "01_download/download.py" in line


def test_data_dir_that_is_a_symbolic_link_loop(demo, tmp_path, existing_run):
    """Issue 23: `ln -s loop loop`, given as --data_dir: one line, not pathlib's RuntimeError."""
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    line = refused(demo, existing_run, data_dir=loop)
    assert line == f"error: {loop} is a symbolic link that leads back to itself: pass --data_dir as the folder " \
                   "that holds the games", line


# ---- model files -----------------------------------------------------------------------------

def model_copy(demo, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(demo / "model", model)
    return model


def truncate(path, keep=0.5):
    os.truncate(path, int(path.stat().st_size * keep))


BAD_MODEL = {
    "missing-folder": lambda model: shutil.rmtree(model),
    "no-weights": lambda model: (model / "model.safetensors").unlink(),
    "truncated-weights": lambda model: truncate(model / "model.safetensors"),
    "weights-not-safetensors": lambda model: (model / "model.safetensors").write_bytes(b"\x00" * 4096),
    "config-not-json": lambda model: (model / "config.json").write_text('{"model_type": "llama", '),
    "no-tokenizer": lambda model: [(model / name).unlink() for name in ("tokenizer.json", "tokenizer_config.json")],
}


@pytest.mark.parametrize("case", BAD_MODEL)
def test_missing_or_damaged_model_files(demo, tmp_path, existing_run, case):
    model = model_copy(demo, tmp_path)
    BAD_MODEL[case](model)
    line = refused(demo, existing_run, model=model)
    assert str(model) in line and ("download" in line), line


def edit_config(model, **changes):
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("changes, words", [
    ({"num_hidden_layers": "two"}, "cannot build the model from its config.json"),
    ({"vocab_size": 50}, "has 85 tokens but the model only"),  # a tokenizer larger than the embedding
    # issue 23: a value transformers only warns about, and would train with
    ({"rope_scaling": {"type": "linear", "factor": -2.0}},
     "(rope_parameters's factor field must be a float or int >= 1, got -2.0): check the values in config.json"),
], ids=["wrongly-typed-value", "tokenizer-larger-than-embedding", "negative-rope-scaling-factor"])
def test_model_config_that_cannot_work(demo, tmp_path, existing_run, changes, words):
    model = model_copy(demo, tmp_path)
    edit_config(model, **changes)
    assert words in refused(demo, existing_run, model=model)


# ---- the output directory --------------------------------------------------------------------

def test_output_dir_with_a_run_is_not_overwritten_without_resume_or_overwrite(demo, existing_run):
    line = refused(demo, existing_run, resume=False)
    assert "already holds a run" in line and "--resume" in line and "--overwrite" in line


@pytest.mark.parametrize("where", ["under-a-file", "is-a-file", "read-only-place", "read-only-existing"])
def test_unwritable_output_dir(demo, tmp_path, where):
    """Root may write anywhere os.access is asked about, so the cases are ones root cannot write
    either: a path through a regular file, and sysfs (read-only for everyone)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    output_dir = {"under-a-file": a_file / "run", "is-a-file": a_file, "read-only-place": Path("/sys/kit-test-run"),
                  "read-only-existing": Path("/sys/kernel")}[where]
    if where.startswith("read-only") and not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs here")
    line = one_error_line(run_step("single", demo_args(demo, output_dir) + ["--max_steps", 1], check=False))
    assert str(output_dir) in line and ("cannot create" in line or "not writable" in line), line
    assert a_file.read_text() == "not a directory\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode 555 directory anyway")
def test_output_dir_without_write_permission(demo, tmp_path):
    output_dir = tmp_path / "locked"
    output_dir.mkdir(mode=0o555)
    line = one_error_line(run_step("single", demo_args(demo, output_dir) + ["--max_steps", 1], check=False))
    assert "not writable" in line


# ---- batch arithmetic ------------------------------------------------------------------------

@pytest.mark.parametrize("flags, words", [
    (["--batch_size_per_device", 0], "--batch_size_per_device"),
    (["--total_batch_size", 0], "--total_batch_size"),
    (["--total_batch_size", 6, "--batch_size_per_device", 4], "--total_batch_size 6 is not a multiple of"),
    (["--total_batch_size", 100_000, "--batch_size_per_device", 100_000], "one global batch needs"),
    (["--warmup_steps", 10], "--warmup_steps"),
    (["--max_seq_length", 4], "--max_seq_length"),
    (["--learning_rate", 0], "--learning_rate"),
])
def test_batch_settings_that_do_not_fit(demo, existing_run, flags, words):
    assert words in refused(demo, existing_run, *flags)


def test_a_fresh_python_refuses_with_the_same_one_line(demo, existing_run):
    """The suite runs step 2 in a child of a Python that has imported its libraries already
    (tests/warm_python.py); a user's `python` starts cold and imports them itself: what it prints
    (no warning of an import, say) and its exit status must be the same."""
    args = [STEP_SCRIPTS["single"], *demo_args(demo, existing_run), "--max_steps", 4, "--resume", "--warmup_steps", 10]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cold = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    warm = run_python(args, env)
    assert (cold.returncode, cold.stdout, cold.stderr) == (warm.returncode, warm.stdout, warm.stderr)
    assert cold.returncode == 2 and cold.stderr.startswith("error: --warmup_steps") and cold.stderr.count("\n") == 1


def test_more_ranks_than_data(demo, tmp_path):
    """4 ranks, 2 short games: not even one row per rank."""
    data = data_copy(demo, tmp_path)
    (data / "train.jsonl").write_text('{"text": "e2e4 e7e5 g1f3"}\n{"text": "d2d4 d7d5"}\n')
    args = demo_args(demo, tmp_path / "run") + ["--max_steps", 1, "--no_packing", "--total_batch_size", 4,
                                                "--batch_size_per_device", 1]
    args[3] = data
    line = launcher_error_line(run_step("ddp", args, nproc=4, check=False))
    assert "the data has 2 rows but one global batch needs 4 (--total_batch_size)" in line


def test_rows_longer_than_the_models_positions(demo, existing_run):
    """Issue 23: --max_seq_length beyond max_position_embeddings (the demo model has 1,024)."""
    before = snapshot(existing_run)
    args = with_changed(demo_args(demo, existing_run) + ["--max_steps", 4, "--resume"], ["--max_seq_length", 2048])
    line = one_error_line(run_step("single", args, check=False))
    assert line == (f"error: --max_seq_length 2048 is more than the 1,024 positions of the model {demo / 'model'} "
                    "(max_position_embeddings in its config.json): use --max_seq_length 1024 or less"), line
    assert snapshot(existing_run) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu(demo, existing_run):
    assert "--device cuda" in refused(demo, existing_run, "--device", "cuda")


# ---- a loss that is not a number -------------------------------------------------------------

def test_diverging_loss_stops_and_keeps_the_last_good_checkpoint(demo, tmp_path):
    """A learning rate of 1e30: step 1 is fine, its update blows the weights up, step 2's loss is
    not finite. The run stops there, names the last good checkpoint, and saves nothing after it."""
    output_dir = tmp_path / "run"
    args = demo_args(demo, output_dir) + ["--max_steps", 6, "--save_every", 1, "--learning_rate", 1e30,
                                          "--warmup_steps", 0]
    line = one_error_line(run_step("single", args, check=False))
    assert "loss is" in line and "at step 2" in line and "step-000001" in line and "--learning_rate" in line, line
    assert [r["step"] for r in read_metrics(output_dir)] == [1]
    assert sorted(p.name for p in (output_dir / "checkpoints").iterdir()) == ["step-000001"]
    assert not (output_dir / "final").exists()
    assert math.isfinite(read_metrics(output_dir)[0]["loss"])


@pytest.mark.parametrize("step", ["single", "ddp"])
def test_nan_in_the_model_weights_stops_at_the_first_step(demo, tmp_path, step):
    from safetensors.torch import load_file, save_file
    model = model_copy(demo, tmp_path)
    weights = load_file(model / "model.safetensors")
    name = next(k for k in weights if "layers.1.mlp.down_proj" in k)
    weights[name][0, 0] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    nproc, split = SPLITS[step]
    args = demo_args(demo, tmp_path / "run") + ["--max_steps", 2, "--save_every", 1, *split]
    args[1] = model
    result = run_step(step, args, nproc=nproc, check=False)
    line = one_error_line(result) if step == "single" else launcher_error_line(result)
    assert "loss is nan at step 1" in line and "no checkpoint was saved yet" in line, line
    assert not (tmp_path / "run/checkpoints").exists() or not any((tmp_path / "run/checkpoints").iterdir())
    assert not (tmp_path / "run/final").exists()


@pytest.mark.parametrize("step, optimizer", [("single", "adamw"), ("single", "muon"), ("fsdp", "muon")])
def test_weights_that_the_last_update_makes_non_finite_are_never_saved(demo, tmp_path, step, optimizer):
    """--learning_rate 1e39 --max_steps 1: step 1's loss is finite, its update makes the weights
    infinite. The run used to exit 0 with a non-finite final/ and checkpoint (Muon: an overflow
    traceback); now one line, nothing saved, and its advice (a lower rate, --overwrite) works."""
    nproc, split = SPLITS[step]
    output_dir = tmp_path / "run"
    args = demo_args(demo, output_dir) + ["--max_steps", 1, "--save_every", 1, "--warmup_steps", 0,
                                          "--learning_rate", 1e39, "--optimizer", optimizer, *split]
    result = run_step(step, args, nproc=nproc, check=False)
    line = one_error_line(result) if step == "single" else launcher_error_line(result)
    assert "the weights are not finite after the update of step 1" in line and "no checkpoint was saved" in line, line
    assert "lower --learning_rate, with --overwrite" in line, line
    assert not (output_dir / "checkpoints").exists() or not any((output_dir / "checkpoints").iterdir())
    assert not (output_dir / "final").exists() and not (output_dir / "summary.json").exists()
    if step == "single" and optimizer == "adamw":  # the advice, followed
        run_step(step, with_changed(args, ["--learning_rate", 1e-4]) + ["--overwrite"])
        assert (output_dir / "final").is_dir() and read_metrics(output_dir)[-1]["step"] == 1


@pytest.mark.parametrize("script", ["03_ddp/train.py", "04_fsdp/train.py", "05_lora/train.py", "06_tp/train.py"])
def test_a_step_of_one_process_per_gpu_started_with_python_gives_the_torchrun_command(demo, tmp_path, script):
    """Steps 3 to 6 read their rank from torchrun: started with plain python they used to end in KeyError: 'RANK'."""
    args = [str(arg) for arg in demo_args(demo, tmp_path / "run")]
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    result = run_python([script, *args], env=env)
    line = one_error_line(result)
    assert result.returncode == 2 and f"run `torchrun --nproc-per-node N {script} {' '.join(args)}`" in line, line
    assert not (tmp_path / "run").exists()


# ---- damaged checkpoints: fall back, say so, end up where the uninterrupted run does ------------

def damage_newest(output_dir, step):
    """The newest checkpoint, complete but with a file truncated on disk afterwards (a full disk,
    a copy cut short); and a newer one that was never completed (a save killed halfway)."""
    newest = sorted((output_dir / "checkpoints").iterdir())[-1]
    victim = newest / ("state.pt" if step != "fsdp" else "__1_0.distcp")
    assert victim.is_file(), sorted(p.name for p in newest.iterdir())
    truncate(victim, keep=0.3)
    incomplete = output_dir / "checkpoints" / "step-000099"
    incomplete.mkdir()
    (incomplete / victim.name).write_bytes(b"half a checkpoint")
    return newest


@pytest.mark.parametrize("step", SPLITS)
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(demo, tmp_path, uninterrupted, step):
    reference = uninterrupted(step)
    # The same run as if it had been killed after its last checkpoint: no final model yet.
    damaged = tmp_path / "run"
    shutil.copytree(reference, damaged, ignore=shutil.ignore_patterns("final", "summary.json"))
    newest = damage_newest(damaged, step)
    result = run_step(step, demo_args(demo, damaged) + RESUMABLE + ["--resume"], nproc=RANKS[step])
    said = result.stdout + result.stderr
    warnings = {line for line in result.stderr.splitlines() if line.startswith("warning: ")}
    assert len(warnings) == 1, result.stderr[-3000:]
    warning = warnings.pop()
    assert f"checkpoint {newest} is unreadable" in warning and "falling back" in warning, warning
    assert f"resuming from {damaged / 'checkpoints' / 'step-000004'}" in said, said[-3000:]
    assert_same_run(reference, damaged, tolerance=1e-6)


# ---- every script -----------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["01_download/download.py", "02_singlegpu/train.py", "03_ddp/train.py",
                                    "04_fsdp/train.py"])
def test_every_script_answers_help(script):
    result = run_python([REPO / script, "--help"])
    assert result.returncode == 0 and "usage:" in result.stdout


# ---- a full disk ------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmpfs):
    """A 12 MiB file system: room for the run's metrics, not for a checkpoint of the demo model (19 MB)."""
    return tmpfs("12m")


@pytest.mark.parametrize("step", ["single", "fsdp"])
def test_a_full_disk_is_one_line_that_says_so(demo, small_disk, step):
    nproc, split = SPLITS[step]
    output_dir = small_disk / "run"
    result = run_step(step, demo_args(demo, output_dir) + ["--max_steps", 2, "--save_every", 1, *split],
                      nproc=nproc, check=False)
    line = one_error_line(result) if step == "single" else launcher_error_line(result)
    assert "no room for a checkpoint" in line and "MiB free" in line and "one needs about" in line, line
    assert not any((output_dir / "checkpoints").glob("*/COMPLETE"))


@pytest.mark.parametrize("step", ["single", "tp"])
def test_a_disk_full_from_the_start_is_one_line_that_names_the_folder(demo, tmpfs, step):
    """Not a byte free when the run starts: the output folder's lock file cannot be written (steps 2 and 6)."""
    disk = tmpfs("64k")
    with contextlib.suppress(OSError):
        (disk / "filler").write_bytes(bytes(1 << 20))
    output_dir = disk / "run"
    args = demo_args(demo, output_dir) + ["--max_steps", 1]
    result = run_step("single", args, check=False) if step == "single" else launched([STEP_SCRIPTS["tp"], *args])
    line = one_error_line(result) if step == "single" else launched_error_line(result)
    assert line.startswith(f"error: cannot write the lock file {output_dir}/.lock (No space left on device): the "
                           "disk is full"), line


# Step 4's script, with a disk that another job fills up right after the space check of the second
# checkpoint has passed: all but LEAVE bytes are taken ("index" leaves room for DCP's own files, the
# shards and the index, as large as the first checkpoint's, and not for rank 0's files after them).
FILL_AFTER_CHECK = """
import os, runpy, shutil, sys
import common.checkpoint as checkpoint

script, disk, leave = sys.argv.pop(1), sys.argv.pop(1), sys.argv.pop(1)
checks = []


def pages(path):
    return -(-path.stat().st_size // 4096) * 4096


def prepare_then_fill(path, needed_bytes):
    done = checks_passed(path, needed_bytes)
    checks.append(path)
    if len(checks) == 2:
        first = checks[0]
        room = int(leave) if leave != "index" else sum(
            pages(file) for file in first.iterdir() if file.suffix == ".distcp" or file.name == ".metadata") + 4096
        with open(os.path.join(disk, "filler"), "wb") as filler:
            os.posix_fallocate(filler.fileno(), 0, shutil.disk_usage(disk).free - room)
        print(f"filled the disk after the space check of {path.name}", flush=True)
    return done


checks_passed, checkpoint.prepare = checkpoint.prepare, prepare_then_fill
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
"""


def launched(command, timeout=300):
    """2 ranks under python -m launch.torchrun, as the Slurm templates start them."""
    return run_python(["-m", "launch.torchrun", "--standalone", "--nproc-per-node=2", *command], timeout=timeout)


def launched_error_line(result):
    """The job's one line: the launcher adds nothing, and no rank a traceback or a line of its own."""
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "stopped: " not in result.stderr, result.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("leave", [4 * 2**20, "index"], ids=["in-the-shards", "after-the-shards-on-rank-0"])
def test_a_disk_that_fills_during_a_sharded_save_stops_every_rank_with_one_line(demo, tmp_path, tmpfs, leave):
    """Step 4 on 2 ranks; the space check of the second checkpoint passes, then the disk fills up.
    Either DCP's writes fail on the ranks (`unexpected pos 704 vs 598` from torch.save's zip writer,
    wrapped in a CheckpointException), or DCP's files fit and rank 0's own files after them fail on
    rank 0 alone. Every rank learns it, and the job ends at once (within the timeout: no rank waits
    in a collective for one that has stopped) with one line, exit status 2 and no traceback. The
    failed save's folder is removed; the first checkpoint is intact: --resume continues from it,
    and its next save, the disk still full, is refused by the space check before it writes."""
    disk = tmpfs("64m")  # 3 checkpoints of the demo (20.4 MB each)
    output_dir = disk / "run"
    args = demo_args(demo, output_dir) + ["--max_steps", 3, "--save_every", 1, "--keep_checkpoints", 3, *SPLIT]
    wrapper = tmp_path / "fill_after_check.py"
    wrapper.write_text(FILL_AFTER_CHECK)
    result = launched([wrapper, STEP_SCRIPTS["fsdp"], disk, leave, *args])
    assert "filled the disk after the space check of step-000002" in result.stdout, result.stdout[-3000:]
    line = launched_error_line(result)
    assert line.startswith(f"error: no room for a checkpoint in {output_dir / 'checkpoints'}: one needs about "), line
    assert "MiB free" in line and "the last complete checkpoint is untouched" in line, line
    checkpoints = output_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-000001"]
    assert is_complete(checkpoints / "step-000001")

    resumed = launched([STEP_SCRIPTS["fsdp"], *args, "--resume"])
    assert f"resuming from {checkpoints / 'step-000001'}" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    refused_line = launched_error_line(resumed)
    assert refused_line.startswith(f"error: no room for a checkpoint in {checkpoints}: one needs about "), refused_line
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-000001"]


def test_a_disk_that_fills_while_the_final_model_is_written_leaves_no_half_of_it(demo, tmpfs):
    """Step 2: the checkpoint (19.5 MB) fits, the final model after it (6.5 MB) does not. One line;
    final/ is written beside its place and moved in only when whole, so neither a final/ with a few
    of its files nor the partial folder is left. With room made, --resume writes it from the checkpoint."""
    disk = tmpfs("22m")
    output_dir = disk / "run"
    args = demo_args(demo, output_dir) + ["--max_steps", 1, "--save_every", 1]
    line = one_error_line(run_step("single", args, check=False))
    assert line.startswith(f"error: no room for {output_dir / 'final'}: the disk filled up while it was "), line
    assert "nothing of it was kept" in line and "run the same command with --resume" in line, line
    assert not list(output_dir.glob("final*")), sorted(path.name for path in output_dir.iterdir())
    assert is_complete(output_dir / "checkpoints" / "step-000001")

    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    done = run_step("single", args + ["--resume"])
    assert f"resuming from {output_dir / 'checkpoints' / 'step-000001'}" in done.stdout + done.stderr
    assert sorted(path.name for path in output_dir.glob("final*")) == ["final"]
    assert {"model.safetensors", "tokenizer.json"} <= {path.name for path in (output_dir / "final").iterdir()}


@pytest.mark.quick
def test_a_folder_written_whole_replaces_the_old_one_only_once_it_is_complete(tmp_path):
    """written_whole (common/checkpoint.py), as the steps write final/ and tools/export.py OUT_DIR."""
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_text("the old model")
    for failure in (OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt(), ValueError("a bug")):
        with pytest.raises(UserError if isinstance(failure, OSError) else type(failure)) as raised:
            with checkpoint.written_whole(final) as folder:
                (folder / "config.json").write_text("{}")
                raise failure
        if isinstance(failure, OSError):
            assert str(raised.value).startswith(f"no room for {final}: the disk filled up while it was written (")
            assert "what it held before is untouched" in str(raised.value), raised.value
        assert sorted(path.name for path in tmp_path.iterdir()) == ["final"]  # no partial folder, nothing else
        assert [path.name for path in final.iterdir()] == ["model.safetensors"]
    with checkpoint.written_whole(final) as folder:
        (folder / "model.safetensors").write_text("the new model")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["final"]
    assert (final / "model.safetensors").read_text() == "the new model"
    occupied = tmp_path / "occupied"  # replace=False (an export's OUT_DIR): files someone else put there stay
    occupied.mkdir()
    (occupied / "notes.txt").write_text("keep me")
    with pytest.raises(OSError):
        with checkpoint.written_whole(occupied, replace=False) as folder:
            (folder / "model.safetensors").write_text("a model")
    assert [path.name for path in occupied.iterdir()] == ["notes.txt"] and not list(tmp_path.glob("*.partial-*"))


@pytest.mark.quick
def test_a_full_disk_is_recognised_however_the_save_reports_it(tmp_path):
    """ENOSPC in the chain of causes, in a CheckpointException's failures of each rank, in the text of
    safetensors' errors; torch.save's zip writer gives no reason at all, so its failure counts as a
    full disk only where the disk now has less room than the checkpoint needs."""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException
    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = full
    assert checkpoint.is_disk_full(full) and checkpoint.is_disk_full(wrapped)
    assert checkpoint.is_disk_full(CheckpointException("write", {1: (full, None)}))
    safetensors_full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert checkpoint.is_disk_full(safetensors_full)  # its text only: no errno, no cause
    zip_writer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    in_dcp = CheckpointException("write", {0: (zip_writer, None)})
    free = shutil.disk_usage(tmp_path).free
    assert checkpoint.is_disk_full(in_dcp, tmp_path / "step-000002", free + 1)  # not that much room left
    assert not checkpoint.is_disk_full(in_dcp, tmp_path / "step-000002", 1)  # room enough: another failure
    assert not checkpoint.is_disk_full(OSError(errno.EACCES, "Permission denied"), tmp_path, free + 1)


# ---- step 4 and 5 options and models ---------------------------------------------------------

@pytest.mark.quick
@pytest.mark.parametrize("step, argv, words", [
    ("fsdp", ["--shard_group_size", "0"], "--shard_group_size must be at least 1"),
    ("lora", ["--lora_target_modules", " , "], "at least one --lora_target_modules"),
    ("lora", ["--lora_rank", "0"], "LoRA needs --lora_rank >= 1"),
    ("lora", ["--qlora", "--cpu_offload"], "--qlora keeps its 4-bit weights on the GPUs"),
])
def test_out_of_range_step_options_are_refused(step, argv, words):
    with pytest.raises(UserError, match=words):
        load_step(step).parse_arguments(["--output_dir", "unused", *argv])


@pytest.mark.quick
def test_step_4_names_the_architectures_it_shards():
    """A model without Llama's model.model.layers (GPT-2 here) is refused with the supported ones."""
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))
    with pytest.raises(UserError, match=r"GPT2LMHeadModel keeps no decoder layers at model.model.layers: .*Llama"):
        load_step("fsdp").decoder_layers(model)


def test_lora_target_module_the_model_lacks(demo, tmp_path):
    args = demo_args(demo, tmp_path / "run") + ["--lora_target_modules", "qkv_proj", "--max_steps", 1]
    result = run_step("lora", args, check=False)  # under plain torchrun: its report follows the rank's one line
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: --lora_target_modules qkv_proj: ") and "linear layers are down_proj" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_failed_sharded_save_is_learnt_by_every_rank(tmp_path):
    """sharded_save on 2 gloo ranks, where only rank 0 fails: a full disk is the same UserError on
    both; another error (a bug) is its own error on rank 0 and a lost rank (DistError) on rank 1,
    which common/errors.py turns into `stopped: rank 1 lost another rank`. Neither waits for the other."""
    out = run_ranks(tmp_path, f"""
import errno
from pathlib import Path
import torch, torch.distributed as dist
from common.checkpoint import sharded_save

dist.init_process_group("gloo")
rank = dist.get_rank()
for case, failure in [("disk", OSError(errno.ENOSPC, "No space left on device")), ("bug", ValueError("a bug")),
                      ("none", None)]:
    path = Path({str(tmp_path)!r}) / case
    try:
        with sharded_save(path, {{"w": torch.zeros(4)}}, rank == 0):
            if rank == 0 and failure is not None:
                raise failure
        said = f"saved, {{sorted(p.name for p in path.iterdir())}}"
    except Exception as err:
        said = f"{{type(err).__name__}}: {{err}}"
    print(f"{{case}} rank {{rank}}: {{said}}")
dist.destroy_process_group()
""", timeout=120)
    said = dict(line.split(": ", 1) for line in out.splitlines())
    assert said["disk rank 0"] == said["disk rank 1"], out
    assert said["disk rank 0"].startswith(f"UserError: no room for a checkpoint in {tmp_path}: one needs about "), out
    assert not (tmp_path / "disk").exists()  # removed: it held what the next try needs
    assert said["bug rank 0"] == "ValueError: a bug", out
    assert said["bug rank 1"] == f"DistError: rank 0 failed to save {tmp_path / 'bug'}: a bug", out
    assert said["none rank 0"] == said["none rank 1"] == "saved, []", out
