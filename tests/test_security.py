"""Security: files from elsewhere (a model folder, a checkpoint, a tokenized cache in a shared data
directory) never run code unless the user says so, and the Hugging Face token never lands in
output, logs, metrics, saved configurations or tracker files.

Every hostile file here writes a marker file when its code runs; the marker must never appear.
The --trust_remote_code case shows that the marker does appear when code runs, so the tests can fail.
"""
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, demo_args, run_step, with_changed

EVIL_MODULE = '''
from pathlib import Path
Path({marker!r}).write_text("code from the model folder ran")
from transformers import LlamaConfig, LlamaForCausalLM


class EvilConfig(LlamaConfig):
    model_type = {model_type!r}


class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
'''


def model_with_custom_code(demo, tmp_path, model_type):
    """The demo model, plus a config.json that points at Python code in the folder (auto_map)."""
    model, marker = tmp_path / "model", tmp_path / "remote-code-ran"
    shutil.copytree(demo / "model", model)
    (model / "evil.py").write_text(EVIL_MODULE.format(marker=str(marker), model_type=model_type))
    config = json.loads((model / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "evil.EvilConfig",
                                                    "AutoModelForCausalLM": "evil.EvilModel"})
    (model / "config.json").write_text(json.dumps(config))
    return model, marker


def train_once(step, demo, model, output_dir, *extra, nproc=1):
    args = demo_args(demo, output_dir) + ["--max_steps", 1, *extra]
    args[1] = model
    return run_step(step, args, nproc=nproc, check=False)


@pytest.mark.parametrize("step", ["single", "fsdp"])
def test_code_in_a_model_folder_is_ignored_without_trust_remote_code(demo, tmp_path, step):
    """A known architecture (llama) with an auto_map: transformers' own class is used."""
    model, marker = model_with_custom_code(demo, tmp_path, "llama")
    result = train_once(step, demo, model, tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not marker.exists()


def test_a_model_that_needs_its_own_code_is_refused_without_trust_remote_code(demo, tmp_path):
    model, marker = model_with_custom_code(demo, tmp_path, "evil_llama")
    result = train_once("single", demo, model, tmp_path / "run")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert str(model) in errors[0]
    assert not marker.exists()


def test_trust_remote_code_runs_the_folders_code(demo, tmp_path):
    model, marker = model_with_custom_code(demo, tmp_path, "evil_llama")
    train_once("single", demo, model, tmp_path / "run", "--trust_remote_code")
    assert marker.exists()


@pytest.mark.parametrize("tool", ["estimate_memory", "check_plan"])
@pytest.mark.parametrize("model_type", ["llama", "evil_llama"])
def test_the_memory_tools_never_run_nor_offer_to_run_a_model_folders_code(demo, tmp_path, tool, model_type):
    """Issue 23: tools/estimate_memory.py and tools/check_plan.py read the config only. Not told
    whether to trust a model's code, transformers asks on the terminal (and waits); here stdin is a
    terminal that already holds the answer "y": a question would be answered yes and the marker
    would appear. A known architecture is read without the code; an unknown one is refused."""
    model, marker = model_with_custom_code(demo, tmp_path, model_type)
    terminal, tool_side = os.openpty()
    os.write(terminal, b"y\n")
    try:
        result = subprocess.run([sys.executable, f"tools/{tool}.py", "--model", str(model), "--gpus_per_node", "1",
                                 "--max_seq_length", "64"], stdin=tool_side, capture_output=True, text=True,
                                timeout=300, cwd=REPO)
    finally:
        os.close(terminal)
        os.close(tool_side)
    assert not marker.exists()
    assert "custom code" not in result.stdout + result.stderr  # transformers' question was never asked
    if model_type == "llama":
        assert result.returncode == 0 and "fits" in result.stdout, result.stderr[-3000:]
    else:
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and errors == [
            f"error: --model {model}: its config.json is for a model type transformers does not know, built by the "
            "model's own Python code (auto_map), which is not run here: the figures are for Llama-style models "
            "(tools/check_plan.py --trust_remote_code runs such code, if you trust it)"], result.stderr[-3000:]


# ---- pickles that would run code --------------------------------------------------------------

class RunsCode:
    """Unpickling this calls pathlib.Path.write_text on the marker: code execution."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return Path.write_text, (Path(self.marker), "a pickle ran code")


def hostile_pickle(path, marker):
    torch.save({"model": RunsCode(marker), "optimizer": {}, "train": {}}, path)


def test_checkpoint_with_code_is_refused_and_the_previous_one_used(demo, tmp_path):
    output_dir, marker = tmp_path / "run", tmp_path / "checkpoint-code-ran"
    run = demo_args(demo, output_dir) + ["--max_steps", 2, "--save_every", 1]
    run_step("single", run)
    hostile_pickle(output_dir / "checkpoints/step-000002/state.pt", marker)
    result = run_step("single", with_changed(run, ["--max_steps", 3]) + ["--resume"])
    assert not marker.exists()
    assert "warning: checkpoint" in result.stderr and "step-000002 is unreadable" in result.stderr
    assert "resuming from" in result.stdout + result.stderr and "step-000001" in result.stdout + result.stderr


def test_fsdp_checkpoint_with_code_is_refused(demo, tmp_path):
    """torch.distributed.checkpoint keeps its .metadata as a plain pickle: resuming must not
    unpickle it without restriction (nor the train state)."""
    output_dir, marker = tmp_path / "run", tmp_path / "dcp-code-ran"
    run = demo_args(demo, output_dir) + ["--max_steps", 1]
    run_step("fsdp", run, nproc=1)
    newest = output_dir / "checkpoints/step-000001"
    with open(newest / ".metadata", "wb") as out:
        import pickle
        pickle.dump(RunsCode(marker), out)
    result = run_step("fsdp", with_changed(run, ["--max_steps", 2]) + ["--resume"], nproc=1, check=False)
    assert not marker.exists(), "resuming unpickled the checkpoint's .metadata without restriction"
    assert "is given twice" not in result.stderr  # refused for its checkpoint, not for its arguments
    assert result.returncode != 0 or "warning: checkpoint" in result.stderr


def test_prepared_data_with_code_is_refused(demo, tmp_path):
    """The prepared (tokenized) games are raw arrays read with np.memmap and np.load without
    pickles: a folder planted in a shared cache can at most be refused, never run code."""
    import numpy as np
    prepared, marker = tmp_path / "prepared", tmp_path / "cache-code-ran"
    args = demo_args(demo, tmp_path / "first") + ["--max_steps", 1, "--no_packing", "--prepared_dir", prepared]
    run_step("single", args)
    offsets = sorted(prepared.glob("*/offsets.npy"))
    assert offsets
    for path in offsets:
        np.save(path, np.array([RunsCode(marker)], dtype=object), allow_pickle=True)
    args[5] = tmp_path / "second"
    result = run_step("single", args, check=False)
    assert not marker.exists()
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]


# ---- the Hugging Face token --------------------------------------------------------------------

def test_hf_token_is_never_written_or_printed(demo, tmp_path):
    """A run with every tracker and the download, with HF_TOKEN set: the token appears in no
    output and in no file the kit writes."""
    import importlib.util
    token = "hf_" + secrets.token_hex(17)
    trackers = [name for name in ("tensorboard", "mlflow", "wandb") if importlib.util.find_spec(name)]
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
           "HF_TOKEN": token, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    outputs = []
    # The download, for real against the local stand-in of the hub (which receives the token).
    from fake_hub import FakeHub
    from test_download import DATASET_ID, MODEL_ID, SCRIPT, clean_env, legal_games, make_model_repo, write_parquet
    make_model_repo(tmp_path / "repos/model")
    write_parquet(legal_games(12, seed=2), tmp_path / "repos/dataset/data/train-00000.parquet")
    with FakeHub() as hub:
        hub.add_repo(MODEL_ID, tmp_path / "repos/model")
        hub.add_repo(DATASET_ID, tmp_path / "repos/dataset", repo_type="dataset")
        download = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "download"), "--model",
                                   MODEL_ID, "--dataset", DATASET_ID, "--games", "12", "--validation_games", "2"],
                                  capture_output=True, text=True, timeout=300,
                                  env=clean_env(HF_TOKEN=token, HF_HOME=str(tmp_path / "hf_home"),
                                                HF_ENDPOINT=hub.endpoint))
    assert download.returncode == 0, download.stderr[-2000:]
    outputs.append(download.stdout + download.stderr)
    for step, nproc in (("single", 1), ("ddp", 2)):
        args = demo_args(demo, tmp_path / step) + ["--max_steps", 2, "--save_every", 1,
                                                   "--report_to", ",".join(trackers or ["none"])]
        command = ([sys.executable, str(REPO / "02_singlegpu/train.py")] if step == "single" else
                   [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    str(REPO / "03_ddp/train.py")])
        result = subprocess.run(command + [str(a) for a in args], capture_output=True, text=True, cwd=tmp_path,
                                env={**env, "OMP_NUM_THREADS": "1"}, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(result.stdout + result.stderr)
    assert not [text for text in outputs if token in text], "the token was printed"
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert any(path.name == "metrics.jsonl" for path in written)
    assert any(path.name == "summary.json" for path in written)
    leaked = [str(path) for path in written if token.encode() in path.read_bytes()]
    assert leaked == [], f"the token is in {leaked}"
