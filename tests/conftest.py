"""Shared fixtures: the demo assets, built once per test session, and a way to run a step."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEP_SCRIPTS = {"single": REPO / "02_singlegpu/train.py", "ddp": REPO / "03_ddp/train.py",
                "fsdp": REPO / "04_fsdp/train.py"}
# Small and quick: short rows, little evaluation.
QUICK = ["--max_seq_length", "64", "--eval_every", "0", "--eval_rows", "8", "--eval_games", "8"]


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The built-in tiny default (model + data), made by the real download script."""
    out = tmp_path_factory.mktemp("demo")
    subprocess.run([sys.executable, str(REPO / "01_download/download.py"), "--demo", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    return out


def run_step(step, args, nproc=1, timeout=600, check=True):
    """Run a training step the way a user does: plain python for step 2, torchrun for 3 and 4."""
    if step == "single":
        command = [sys.executable, str(STEP_SCRIPTS[step])]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", str(STEP_SCRIPTS[step])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command + [str(a) for a in args], capture_output=True, text=True,
                            timeout=timeout, env=env, cwd=REPO)
    if check and result.returncode != 0:
        raise AssertionError(f"{step} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def read_metrics(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def demo_args(demo, output_dir):
    return ["--model", demo / "model", "--data_dir", demo / "data", "--output_dir", output_dir, *QUICK]
