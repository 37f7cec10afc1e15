"""tools/export.py: a sharded checkpoint becomes a Hugging Face model, in one plain process;
incomplete checkpoints and occupied output folders are refused."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, demo_args, run_python, run_step

EXPORT = REPO / "tools/export.py"


def export(checkpoint, out_dir):
    return run_python([EXPORT, checkpoint, out_dir], timeout=300)


@pytest.fixture(scope="module")
def fsdp_run(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_export")
    run_step("fsdp", demo_args(demo, out) + ["--max_steps", 4, "--save_every", 2], nproc=2)
    return out


def test_export_equals_the_final_model_and_loads_without_the_kit(fsdp_run, tmp_path):
    from safetensors.torch import load_file
    out = tmp_path / "exported"
    done = export(fsdp_run / "checkpoints/step-000004", out)
    assert done.returncode == 0, done.stderr[-3000:]
    exported, final = load_file(out / "model.safetensors"), load_file(fsdp_run / "final/model.safetensors")
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)  # the same step: bit for bit
    # A fresh interpreter outside the repository (the kit is not importable): transformers alone loads it.
    check = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n"
             f"model = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
             f"ids = AutoTokenizer.from_pretrained({str(out)!r})('1. e4 e5', return_tensors='pt').input_ids\n"
             "assert model(ids).logits.shape[-1] == model.config.vocab_size\n")
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    # An earlier checkpoint exports too, and holds the earlier weights.
    assert export(fsdp_run / "checkpoints/step-000002", tmp_path / "step2").returncode == 0
    earlier = load_file(tmp_path / "step2/model.safetensors")
    assert any(not torch.equal(earlier[k], final[k]) for k in final)


def test_export_refuses_bad_inputs(fsdp_run, tmp_path):
    incomplete = tmp_path / "step-000002"
    shutil.copytree(fsdp_run / "checkpoints/step-000002", incomplete)
    (incomplete / "COMPLETE").unlink()  # as a save killed before its marker leaves it
    done = export(incomplete, tmp_path / "out")
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "not a complete checkpoint" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("keep me")
    done = export(fsdp_run / "checkpoints/step-000004", occupied)
    assert done.returncode == 2 and "already exists and is not empty" in done.stderr
    assert [p.name for p in occupied.iterdir()] == ["notes.txt"]

    done = export(tmp_path / "no-such-checkpoint", tmp_path / "out")
    assert done.returncode == 2 and "error: no checkpoint at" in done.stderr


def test_export_refuses_damaged_shards_and_an_unwritable_destination(fsdp_run, tmp_path):
    damaged = tmp_path / "step-000004"
    shutil.copytree(fsdp_run / "checkpoints/step-000004", damaged)
    shard = sorted(damaged.glob("*.distcp"))[0]
    os.truncate(shard, 64)  # a shard cut short (a full disk, a copy that broke off): its weights are gone
    done = export(damaged, tmp_path / "out")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "a shard file is missing or damaged" in done.stderr and not (tmp_path / "out").exists()

    for shard in damaged.glob("*.distcp"):
        shard.unlink()
    done = export(damaged, tmp_path / "out")
    assert done.returncode == 2 and "a shard file is missing or damaged" in done.stderr, done.stderr

    done = export(fsdp_run / "checkpoints/step-000004", Path("/sys/kit-export"))  # sysfs: read-only for everyone
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: cannot write the model to /sys/kit-export"), done.stderr


def test_export_leaves_no_partial_folder_and_says_what_is_missing_in_one_line(fsdp_run, tmp_path, tmpfs):
    """A checkpoint without its tokenizer files (copied without them): one line that says so, read
    before anything is written. A disk that fills up while the model is written (here 2 MiB, for a
    6.5 MB model): one line, and neither OUT_DIR nor the folder it was written into is left."""
    untokenized = tmp_path / "step-000004"
    shutil.copytree(fsdp_run / "checkpoints/step-000004", untokenized, ignore=shutil.ignore_patterns("tokenizer*"))
    done = export(untokenized, tmp_path / "out")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"error: {untokenized} holds no tokenizer that can be read (no tokenizer files in "
                                  "it): "), done.stderr
    assert "copy the tokenizer files of the run's --model" in done.stderr, done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-000004"]

    disk = tmpfs("2m")
    done = export(fsdp_run / "checkpoints/step-000004", disk / "exported")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]  # after save_pretrained's bar
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    line = errors[0]
    assert line.startswith(f"error: no room for {disk / 'exported'}: the disk filled up while it was written ("), line
    assert line.endswith("nothing of it was kept. Free some space, or choose an OUT_DIR on a disk with room for it")
    assert list(disk.iterdir()) == []
