"""Mistakes a user makes get one clear `error:` line and a non-zero exit, not a traceback."""
import json
import shutil

import pytest
import torch

from conftest import demo_args, run_step


def one_error_line(result):
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return errors[0]


def run_single(demo, tmp_path, *extra, model=None, data_dir=None):
    args = demo_args(demo, tmp_path / "out") + ["--max_steps", 2, *extra]
    if model is not None:
        args[1] = model
    if data_dir is not None:
        args[3] = data_dir
    return run_step("single", args, check=False)


def test_missing_model_names_the_download_command(demo, tmp_path):
    line = one_error_line(run_single(demo, tmp_path, model=tmp_path / "no-such-model"))
    assert "no-such-model" in line and "01_download/download.py" in line


def test_missing_data_names_the_download_command(demo, tmp_path):
    line = one_error_line(run_single(demo, tmp_path, data_dir=tmp_path / "nowhere"))
    assert "train.jsonl" in line and "01_download/download.py" in line


def data_copy(demo, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(demo / "data", data, ignore=shutil.ignore_patterns("tokenized"))
    return data


def test_malformed_jsonl_line_is_named_with_file_and_line(demo, tmp_path):
    data = data_copy(demo, tmp_path)
    lines = (data / "train.jsonl").read_text().splitlines()
    lines[6] = '{"text": "e2e4 e7e5'  # cut short
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    line = one_error_line(run_single(demo, tmp_path, data_dir=data))
    assert "train.jsonl:7" in line


def test_text_that_is_not_uci_moves_is_refused(demo, tmp_path):
    data = data_copy(demo, tmp_path)
    with (data / "train.jsonl").open("a") as out:
        out.write(json.dumps({"text": "1. e4 e5 2. Nf3"}) + "\n")
    assert "not a UCI move" in one_error_line(run_single(demo, tmp_path, data_dir=data))


def test_empty_dataset_is_refused(demo, tmp_path):
    data = data_copy(demo, tmp_path)
    (data / "train.jsonl").write_text("")
    assert "no games" in one_error_line(run_single(demo, tmp_path, data_dir=data))


@pytest.mark.parametrize("flags, words", [
    (["--batch_size_per_device", 0], "--batch_size_per_device"),
    (["--gradient_accumulation_steps", 0], "--gradient_accumulation_steps"),
    (["--batch_size_per_device", 100_000], "one global batch needs"),
    (["--warmup_steps", 10], "--warmup_steps"),
])
def test_batch_settings_that_do_not_fit(demo, tmp_path, flags, words):
    assert words in one_error_line(run_single(demo, tmp_path, *flags))


def test_more_ranks_than_data_is_refused_by_every_launcher(demo, tmp_path):
    result = run_step("ddp", demo_args(demo, tmp_path) + ["--max_steps", 1, "--batch_size_per_device", 100_000],
                      nproc=2, check=False)
    assert result.returncode != 0
    assert "error: the data has" in result.stderr
    assert 'train.py", line' not in result.stderr  # torchrun's own report, but no traceback of ours


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu(demo, tmp_path):
    assert "--device cuda" in one_error_line(run_single(demo, tmp_path, "--device", "cuda"))


@pytest.mark.parametrize("script", ["01_download/download.py", "02_singlegpu/train.py", "03_ddp/train.py",
                                    "04_fsdp/train.py"])
def test_every_script_answers_help(script):
    import subprocess
    import sys
    from conftest import REPO
    result = subprocess.run([sys.executable, str(REPO / script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "usage:" in result.stdout
