"""A room shares one model: the trainer downloads and prepares once into a shared cache that the
participants can only read; each participant's run reads it and writes only under its own output
folder (issue 41, point 4)."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import QUICK, REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1"}


def snapshot(folder):
    return {path: (path.stat().st_size, path.stat().st_mtime_ns) for path in folder.rglob("*")}


def read_only(folder, command):
    """`command` with `folder` read-only. Root writes through permission bits, so there it is a
    read-only bind mount of the folder over itself, in a mount namespace of the command's own."""
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(folder)], check=True)
        return command
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a mount namespace here (unshare -m)")
    mount = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && exec \"$@\""
    return ["unshare", "-m", "bash", "-c", mount, "read-only", *command]


def test_a_run_reads_the_rooms_read_only_cache_and_writes_only_its_own_folder(demo, tmp_path):
    shared = tmp_path / "shared"  # the trainer's: model, games, HF_HOME with the prepared games
    shutil.copytree(demo, shared)
    env = {**ENV, "HF_HOME": str(shared / "hf")}
    env.pop("HF_DATASETS_CACHE", None)
    max_seq_length = QUICK[QUICK.index("--max_seq_length") + 1]
    subprocess.run([sys.executable, "01_download/prepare.py", "--model", str(shared / "model"), "--data_dir",
                    str(shared / "data"), "--max_seq_length", max_seq_length], cwd=REPO, env=env, check=True,
                   capture_output=True, timeout=300)
    before = snapshot(shared)
    try:
        run = subprocess.run(read_only(shared, [
            sys.executable, str(REPO / "02_singlegpu/train.py"), "--model", str(shared / "model"), "--data_dir",
            str(shared / "data"), "--output_dir", str(tmp_path / "participant" / "run"), *QUICK, "--max_steps", "1",
            "--total_batch_size", "2", "--batch_size_per_device", "2"]), cwd=REPO, env=env, capture_output=True,
            text=True, timeout=300)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(shared)], check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "participant" / "run" / "summary.json").is_file()
    assert snapshot(shared) == before  # nothing written, nothing prepared again
