"""The output directory belongs to one run: a second run on it is refused (and a dead run's lock
does not count), --resume continues the same run only (settings that would make it another run
are refused, a longer run is allowed and says what that does to the schedule), --overwrite
deletes nothing before every input is checked (nor the run's own inputs), a checkpoint of another
run is never resumed from nor deleted, a requeued Slurm job continues its run, and the files a run
writes follow the user's umask."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO, STEP_SCRIPTS, demo_args, read_metrics, run_python, run_step, with_changed

RUN = ["--max_steps", 2, "--save_every", 1, "--total_batch_size", 8, "--batch_size_per_device", 4]


def one_error_line(result):
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def finished_run(demo, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("finished") / "run"
    run_step("single", demo_args(demo, output_dir) + RUN)
    return output_dir


def copy_of(run, tmp_path):
    import shutil
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def test_a_second_run_on_the_same_output_dir_is_refused_and_a_dead_ones_lock_is_not(demo, tmp_path):
    output_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, str(STEP_SCRIPTS["single"]), *map(str, demo_args(demo, output_dir)),
                              "--max_steps", "500", "--total_batch_size", "4"], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while not (output_dir / "metrics.jsonl").exists():
            assert first.poll() is None and time.time() < deadline, "the first run did not start"
            time.sleep(0.1)
        line = one_error_line(run_step("single", demo_args(demo, output_dir) + ["--resume", "--max_steps", 500,
                                                                                 "--total_batch_size", 4],
                                       check=False))
        assert "another run is writing to" in line and f"pid {first.pid}" in line, line
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The dead run's lock file is still there, but nobody holds it.
    assert (output_dir / ".lock").exists()
    run_step("single", demo_args(demo, output_dir) + ["--overwrite", "--max_steps", 1, "--total_batch_size", 4])
    assert [r["step"] for r in read_metrics(output_dir)] == [1]


@pytest.mark.parametrize("change, words", [
    (["--learning_rate", "5e-4"], "learning_rate: 0.001 then, 0.0005 now"),
    (["--total_batch_size", 4], "total_batch_size: 8 then, 4 now"),
    (["--seed", 3], "seed: 0 then, 3 now"),
    (["--no_packing"], "packing: True then, False now"),
    (["--max_steps", 1], "less than the run's 2"),
])
def test_resume_with_other_settings_is_refused(demo, finished_run, tmp_path, change, words):
    run = copy_of(finished_run, tmp_path)
    args = demo_args(demo, run) + with_changed(RUN, change) + ["--resume"]
    line = one_error_line(run_step("single", args, check=False))
    assert words in line, line
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


def test_resume_may_change_the_split_and_grow_the_run(demo, finished_run, tmp_path):
    """Another split of the same global batch (4 rows × 2 instead of 4 × 2 on one process, here
    as 2 ranks) and a larger --max_steps are the same run, made longer; the note says what the
    longer schedule does."""
    run = copy_of(finished_run, tmp_path)
    result = run_step("ddp", demo_args(demo, run) + ["--max_steps", 3, "--save_every", 1, "--total_batch_size", 8,
                                                      "--batch_size_per_device", 2, "--resume"], nproc=2)
    assert "cosine decay is stretched to end at step 3" in result.stdout + result.stderr
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert read_metrics(run)[-1]["world_size"] == 2


def test_resume_with_another_model_says_the_model_changed(demo, finished_run, tmp_path):
    import shutil
    run = copy_of(finished_run, tmp_path)
    other = tmp_path / "other-model"
    shutil.copytree(demo / "model", other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (other / "config.json").write_text(json.dumps(config))
    args = demo_args(demo, run) + RUN + ["--resume"]
    args[1] = other
    line = one_error_line(run_step("single", args, check=False))
    assert "is not the model the run" in line and "started from" in line, line
    assert "--overwrite" not in line  # the advice never leads to deleting good checkpoints
    assert len(list((run / "checkpoints").iterdir())) == 2


def test_overwrite_with_a_mistyped_model_deletes_nothing(demo, finished_run, tmp_path):
    run = copy_of(finished_run, tmp_path)
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    args = demo_args(demo, run) + RUN + ["--overwrite"]
    args[1] = tmp_path / "no-such-model"
    one_error_line(run_step("single", args, check=False))
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before


def snapshot(folder):
    """Every file and its bytes, but the lock's (the refused run took the lock to look)."""
    return {path.relative_to(folder).as_posix(): path.read_bytes() if path.is_file() else None
            for path in sorted(folder.rglob("*")) if path.name != ".lock"}


@pytest.mark.parametrize("input_name", ["model", "data_dir"])
def test_overwrite_never_deletes_the_runs_own_input(demo, finished_run, tmp_path, input_name):
    """--model R/final --output_dir R --overwrite would train on the run's final model, and delete it."""
    import shutil
    run = copy_of(finished_run, tmp_path)
    inside = {"model": run / "final", "data_dir": run / "final" / "games"}[input_name]
    if input_name == "data_dir":
        shutil.copytree(demo / "data", inside)
    before = snapshot(run)
    args = with_changed(demo_args(demo, run), [f"--{input_name}", inside]) + RUN + ["--overwrite"]
    line = one_error_line(run_step("single", args, check=False))
    assert f"--{input_name} {inside} is inside {run / 'final'}, which --overwrite deletes" in line, line
    assert snapshot(run) == before


def test_overwrite_deletes_nothing_through_a_symbolic_link(demo, finished_run, tmp_path):
    """OUTPUT_DIR/checkpoints a link to another disk: --overwrite used to delete run.json, the metrics
    and the summary, then fail on the link, the old run half-deleted. Now it refuses first, naming the
    link; with the folder it points to emptied, the link is kept and the new run saves through it."""
    run = copy_of(finished_run, tmp_path)
    elsewhere = tmp_path / "scratch" / "checkpoints"
    elsewhere.parent.mkdir()
    shutil.move(run / "checkpoints", elsewhere)
    (run / "checkpoints").symlink_to(elsewhere)
    before = snapshot(run), snapshot(elsewhere)
    args = demo_args(demo, run) + RUN + ["--overwrite"]
    line = one_error_line(run_step("single", args, check=False))
    assert f"{run / 'checkpoints'} is a symbolic link (to {elsewhere})" in line and "Empty the folder" in line, line
    assert (snapshot(run), snapshot(elsewhere)) == before
    for checkpoint in elsewhere.iterdir():  # as the line says
        shutil.rmtree(checkpoint)
    run_step("single", args)
    assert (run / "checkpoints").is_symlink() and (elsewhere / "step-000002/COMPLETE").is_file()
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


@pytest.mark.parametrize("checkpoints", [True, False], ids=["with-checkpoints", "without"])
def test_a_run_file_cut_short_is_named_as_damaged(demo, finished_run, tmp_path, checkpoints):
    """run.json truncated, then --resume: its checkpoints used to be called another run's ("move it
    out"), and without them a JSONDecodeError traceback."""
    run = copy_of(finished_run, tmp_path)
    if not checkpoints:
        shutil.rmtree(run / "checkpoints")
    text = (run / "run.json").read_text()
    (run / "run.json").write_text(text[:len(text) // 2])
    before = snapshot(run)
    line = one_error_line(run_step("single", demo_args(demo, run) + RUN + ["--resume"], check=False))
    assert f"{run / 'run.json'} is damaged" in line and "Restore it from a backup" in line, line
    assert "another run" not in line and "move it out" not in line, line
    assert snapshot(run) == before


def test_a_checkpoint_of_another_run_is_neither_resumed_from_nor_pruned(demo, finished_run, tmp_path):
    """A checkpoint copied in from another run, newer than the run's own: --keep_checkpoints 1 used
    to keep it and delete the run's real ones, and --resume to load it."""
    import shutil
    run = copy_of(finished_run, tmp_path)
    foreign = run / "checkpoints/step-000500"
    shutil.copytree(run / "checkpoints/step-000002", foreign)
    (foreign / "COMPLETE").write_text("0123456789abcdef0123456789abcdef\n")  # another run's id
    before = snapshot(run)
    args = demo_args(demo, run) + with_changed(RUN, ["--max_steps", 3]) + ["--keep_checkpoints", 1, "--resume"]
    line = one_error_line(run_step("single", args, check=False))
    assert f"{foreign} is a checkpoint of another run" in line and "move it out" in line, line
    assert snapshot(run) == before
    # Moved out, the run continues from its own newest checkpoint.
    foreign.rename(tmp_path / "step-000500-of-another-run")
    result = run_step("single", args)
    assert f"resuming from {run / 'checkpoints/step-000002'}" in result.stdout + result.stderr
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000003"]


def test_only_the_runs_own_checkpoints_count_and_are_pruned(tmp_path):
    """A foreign marker that appears while the run goes on: never the newest, never deleted."""
    from common.checkpoint import mark_complete
    from common.run_dir import RunDir
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    run_dir.run_file.write_text(json.dumps({"run_id": "this-run"}))
    for step in (2, 4, 500):
        run_dir.checkpoint(step).mkdir(parents=True)
    (run_dir.checkpoint(500) / "COMPLETE").write_text("another-run\n")
    for step in (2, 4):
        mark_complete(run_dir, step, keep=2)
    assert run_dir.complete_checkpoints() == [run_dir.checkpoint(2), run_dir.checkpoint(4)]
    assert run_dir.foreign_checkpoints() == [run_dir.checkpoint(500)]
    run_dir.checkpoint(6).mkdir()
    mark_complete(run_dir, 6, keep=1)
    assert sorted(p.name for p in run_dir.checkpoints_dir.iterdir()) == ["step-000006", "step-000500"]
    assert run_dir.latest_checkpoint() == run_dir.checkpoint(6)


def test_the_shell_asks_the_run_dir_for_progress(finished_run, tmp_path):
    """slurm/preemption.sh's questions: when did the run finish, and what is its newest checkpoint."""
    def ask(command, output_dir):
        return subprocess.run([sys.executable, "-m", "common.run_dir", command, str(output_dir)], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
    assert ask("latest-checkpoint", finished_run) == str(finished_run / "checkpoints/step-000002")
    assert ask("finished-at", finished_run) == str((finished_run / "summary.json").stat().st_mtime_ns)
    assert ask("latest-checkpoint", tmp_path / "nothing-yet") == ""
    assert ask("finished-at", tmp_path / "nothing-yet") == "none"


@pytest.mark.quick
def test_an_empty_output_dir_is_refused(demo, tmp_path):
    """--output_dir '' used to write the run into the current directory."""
    result = run_python([STEP_SCRIPTS["single"], *with_changed(demo_args(demo, tmp_path), ["--output_dir", ""])],
                        timeout=300, cwd=tmp_path)
    assert "--output_dir is empty" in one_error_line(result)
    assert list(tmp_path.iterdir()) == []


def test_resume_takes_the_model_by_relative_or_absolute_path(demo, finished_run, tmp_path):
    """A run started by a Slurm template (--model demo/model, relative to the kit) continues from
    submit.py, which passes absolute paths."""
    run = copy_of(finished_run, tmp_path)
    settings = json.loads((run / "run.json").read_text())
    settings["model"] = os.path.relpath(demo / "model", REPO)  # the steps run in the kit's folder
    (run / "run.json").write_text(json.dumps(settings))
    run_step("single", demo_args(demo, run) + with_changed(RUN, ["--max_steps", 3]) + ["--resume"])
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def test_a_second_ctrl_c_names_the_checkpoints_saved_by_then(demo, tmp_path):
    """The note of a Ctrl-C that stops the run at once is what is on disk when it comes: a second
    Ctrl-C in the middle of a save names the checkpoint saved before, not the start's "none yet"."""
    output_dir = tmp_path / "run"
    script = tmp_path / "interrupted_run.py"
    script.write_text(f"""
import argparse
from common.checkpoint import mark_complete
from common.errors import exit_on_user_error
from common.output_dir import OutputDir

def main():
    args = argparse.Namespace(output_dir={str(output_dir)!r}, resume=False, overwrite=False,
                              model={str(demo / "model")!r}, data_dir={str(demo / "data")!r}, prepared_dir=None)
    output = OutputDir(args, is_main=True)
    output.start({{"model": args.model, "max_steps": 4}})
    output.run_dir.checkpoint(2).mkdir(parents=True)
    mark_complete(output.run_dir, 2, keep=2)  # a save of the run finished
    output.run_dir.checkpoint(4).mkdir()  # the next one is under way...
    raise KeyboardInterrupt  # ...when the second Ctrl-C comes

exit_on_user_error(main)
""")
    result = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (f"interrupted: the last complete checkpoint is "
                                              f"{output_dir / 'checkpoints/step-000002'}; continue with --resume")


def test_requeued_job_continues_its_run_and_ignores_overwrite(demo, finished_run, tmp_path):
    """A job requeued by Slurm (same job id, SLURM_RESTART_COUNT > 0) runs the same command again:
    the --overwrite meant for its first start must not delete the checkpoint to continue from."""
    run = copy_of(finished_run, tmp_path)
    (run / "final").rename(tmp_path / "final-of-step-2")
    env = {**os.environ, "SLURM_RESTART_COUNT": "1", "OMP_NUM_THREADS": "1"}
    args = [*map(str, demo_args(demo, run) + ["--max_steps", 3, "--save_every", 1, "--total_batch_size", 8,
                                              "--batch_size_per_device", 4, "--overwrite"])]
    result = subprocess.run([sys.executable, str(STEP_SCRIPTS["single"]), *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "requeued job (restart 1): continuing the run" in result.stdout
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


@pytest.mark.quick
@pytest.mark.parametrize("flags, words", [
    (["--batch_size", 3], "unrecognized arguments: --batch_size"),  # no prefix matching
    (["--learn", "1e-3"], "unrecognized arguments: --learn"),
    (["--batch_size_per_device", 2, "--batch-size-per-device", 4], "--batch_size_per_device is given twice"),
    (["--max_grad_norm", 0], "--max_grad_norm must be a positive number"),
    (["--weight_decay", -0.1], "--weight_decay must be between 0 and 1"),
    (["--seed", -1], "--seed must be between 0"),
    (["--learning_rate", "nan"], "--learning_rate must be a positive number"),
])
def test_no_silently_wrong_settings(demo, tmp_path, flags, words):
    line = one_error_line(run_step("single", demo_args(demo, tmp_path / "run") + flags, check=False))
    assert words in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_saved_files_follow_the_umask(demo, finished_run):
    for path in [*(finished_run / "final").iterdir(), *(finished_run / "checkpoints").rglob("*")]:
        if path.is_file():
            assert path.stat().st_mode & 0o044 == 0o044, (path, oct(path.stat().st_mode))


def test_ctrl_c_ends_with_one_line_naming_the_checkpoint(demo, tmp_path):
    output_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, str(STEP_SCRIPTS["single"]), *map(str, demo_args(demo, output_dir)),
                                "--max_steps", "500", "--save_every", "1", "--total_batch_size", "4"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not (output_dir / "metrics.jsonl").exists() or not read_metrics(output_dir):
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and "Traceback" not in err, err[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith("preempted: saved a checkpoint at step")]
    assert len(stopped) == 1 and "stopped by Ctrl-C" in stopped[0], out[-2000:]
    assert not psutil.pid_exists(process.pid) or psutil.Process(process.pid).status() == psutil.STATUS_ZOMBIE


def two_nodes(demo, out, shared, node_1_mount):
    """A 2-step FSDP run as two torchrun "nodes" of one rank on this machine (--nnodes 2); node 1 runs in
    a mount namespace of its own where `node_1_mount` (a shell command, $0 the shared folder) changes
    what it sees of `shared`. Returns both processes and their standard errors."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def node(rank):
        return [sys.executable, "-m", "launch.torchrun", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={rank}",
                "--master-addr=127.0.0.1", f"--master-port={port}", str(STEP_SCRIPTS["fsdp"]),
                *map(str, demo_args(demo, out) + ["--max_steps", 2])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(node(0), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    in_own_mounts = ["unshare", "--mount", "--propagation", "private", "sh", "-c", node_1_mount + ' && exec "$@"',
                     str(shared), *node(1)]
    second = subprocess.Popen(in_own_mounts, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    (_, first_err), (_, second_err) = first.communicate(timeout=300), second.communicate(timeout=300)
    return first, second, first_err, second_err


def test_an_output_folder_that_a_node_sees_read_only_is_refused_on_that_node(demo, tmp_path):
    """Two torchrun "nodes", the second in a mount namespace where the shared folder is read-only: that node
    says so in one line that names the folder and the node, the first ends with a `stopped:` line, both exit
    2 without a traceback, and no probe file is left in the folder."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give one node a private mount")
    shared = tmp_path / "shared"
    shared.mkdir()
    out = shared / "run"
    out.mkdir()  # made by the job's first attempt, say
    first, second, first_err, second_err = two_nodes(
        demo, out, shared, 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0"')  # node 1 sees it read-only
    assert (first.returncode, second.returncode) == (2, 2), first_err[-2000:] + second_err[-2000:]
    line = f"node 1 ({socket.gethostname()}): --output_dir {out} is not writable (Read-only file system)"
    said = [line for line in second_err.splitlines() if line.startswith(("error:", "stopped:"))]
    assert said == [f"error: {line}: choose another directory"], second_err[-3000:]
    said = [line for line in first_err.splitlines() if line.startswith(("error:", "stopped:"))]
    assert said == [f"stopped: {line}: choose another directory"], first_err[-3000:]
    assert "Traceback" not in first_err + second_err
    assert not list(shared.rglob(".shared-check-*")) and not list(shared.rglob(".write-test-*"))


def test_an_output_folder_that_a_node_does_not_share_is_refused_with_its_name(demo, tmp_path):
    """Two torchrun "nodes" on this machine (--nnodes 2, --node-rank 0 and 1), the second in a mount
    namespace of its own where a tmpfs hides the output folder's parent: what a node-local /tmp or
    scratch is. Before any training, one line names the node that does not see the folder."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give one node a private mount")
    shared = tmp_path / "shared"
    shared.mkdir()
    out = shared / "run"
    first, second, first_err, second_err = two_nodes(demo, out, shared, 'mount -t tmpfs tmpfs "$0"')  # hidden on node 1
    assert (first.returncode, second.returncode) == (2, 2), first_err[-2000:] + second_err[-2000:]
    errors = [line for line in first_err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --output_dir {out} is not shared by the job's nodes: node 1 ({socket.gethostname()}) "
                      "cannot see the file rank 0 wrote there (a folder on each node's own disk, such as /tmp or a "
                      "local scratch?). Each node would keep its part of every checkpoint: use a folder on a file "
                      "system that every node mounts (e.g. /scratch/$USER/...)"], first_err[-3000:]
    assert "Traceback" not in first_err + second_err
    assert not (out / "metrics.jsonl").exists() and not list(out.glob(".shared-check-*"))
