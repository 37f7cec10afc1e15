"""The layout of a run's output directory, defined here once: the training scripts, tools/export.py,
the submitit launcher and the Slurm templates (through the commands below) all ask here.

    OUTPUT_DIR/run.json                     the settings that define the run, and the run's id
    OUTPUT_DIR/.lock                        held by rank 0 while the run is alive
    OUTPUT_DIR/metrics.jsonl                one JSON line per optimiser step
    OUTPUT_DIR/summary.json                 written once the run has finished
    OUTPUT_DIR/checkpoints/step-NNNNNN/     a checkpoint; it counts once its COMPLETE marker exists
    OUTPUT_DIR/final/                       the final model, in Hugging Face format (written beside, as
                                            final.partial-PID, and moved in whole: common/checkpoint.py)
    OUTPUT_DIR/profile/                     --profile_steps: a trace and a summary per rank
    OUTPUT_DIR/hang/                        after a hang: every rank's stacks (common/hang.py)
    OUTPUT_DIR/tensorboard/, mlflow.db, wandb/   the trackers' files (--report_to)

A checkpoint's marker names the run that wrote it (the id in run.json): a checkpoint copied in
from another run is never resumed from, and never deleted to keep --keep_checkpoints.

The Slurm templates' batch shell asks (this module imports nothing heavy, for that):

    python -m common.run_dir finished-at OUTPUT_DIR        when summary.json was written (ns), or "none"
    python -m common.run_dir latest-checkpoint OUTPUT_DIR  the run's newest complete checkpoint, or nothing
"""
import argparse
import json
import os
import uuid
from pathlib import Path

MARKER = "COMPLETE"
STEP_PREFIX = "step-"
CHECKPOINTS = "checkpoints"
CHECKPOINT_FOLDER = f"OUTPUT_DIR/{CHECKPOINTS}/{STEP_PREFIX}NNNNNN"  # how messages name one
# An older kit wrote "ok" in its markers and no id in run.json: such a run keeps "ok" as its id.
OLDER_KIT_ID = "ok"


def new_run_id():
    return uuid.uuid4().hex


def is_complete(checkpoint):
    """Whether a checkpoint folder's save finished, whichever run wrote it."""
    return (Path(checkpoint) / MARKER).is_file()


def step_of(checkpoint):
    """The step of a checkpoint folder (step-000100: 100), None for a folder of another name."""
    name = Path(checkpoint).name
    digits = name.removeprefix(STEP_PREFIX)
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isascii() and digits.isdigit() else None


class RunDir:
    """The paths of one output directory, and the checkpoints of the run recorded there."""

    def __init__(self, path):
        self.path = Path(path)
        self.run_file = self.path / "run.json"
        self.lock_file = self.path / ".lock"
        self.metrics = self.path / "metrics.jsonl"
        self.summary = self.path / "summary.json"
        self.checkpoints_dir = self.path / CHECKPOINTS
        self.final = self.path / "final"
        self.profile = self.path / "profile"
        self.hang = self.path / "hang"
        # What a run writes, and so what --overwrite may delete; nothing else in the folder is touched.
        self.outputs = [self.metrics, self.summary, self.run_file, self.checkpoints_dir, self.final, self.profile,
                        self.hang, self.path / "tensorboard", self.path / "mlflow.db", self.path / "wandb"]

    def __str__(self):
        return str(self.path)

    def checkpoint(self, step):
        return self.checkpoints_dir / f"{STEP_PREFIX}{step:06d}"

    def run_id(self):
        """The id of the run recorded in run.json; None where no run has started."""
        try:
            return json.loads(self.run_file.read_text()).get("run_id", OLDER_KIT_ID)
        except (OSError, ValueError):
            return None

    def write_marker(self, checkpoint):
        """Mark a checkpoint of this run complete, atomically: from now on it counts."""
        partial = checkpoint / f"{MARKER}.partial"
        partial.write_text(f"{self.run_id()}\n")
        os.replace(partial, checkpoint / MARKER)

    def marked_checkpoints(self):
        """(checkpoint, the run id its marker names) for each complete checkpoint, oldest first."""
        folders = self.checkpoints_dir.glob(f"{STEP_PREFIX}*") if self.checkpoints_dir.is_dir() else []
        marked = []
        for folder in sorted((f for f in folders if step_of(f) is not None), key=step_of):
            try:
                marked.append((folder, (folder / MARKER).read_text().strip()))
            except OSError:  # no marker: its save did not finish
                pass
        return marked

    def complete_checkpoints(self):
        """This run's complete checkpoints, oldest first."""
        run_id = self.run_id()
        return [folder for folder, owner in self.marked_checkpoints() if owner == run_id]

    def foreign_checkpoints(self):
        """Complete checkpoints whose marker names another run (copied in from elsewhere)."""
        run_id = self.run_id()
        return [folder for folder, owner in self.marked_checkpoints() if owner != run_id]

    def latest_checkpoint(self):
        """This run's newest complete checkpoint, or None."""
        checkpoints = self.complete_checkpoints()
        return checkpoints[-1] if checkpoints else None

    def finished_at(self):
        """When summary.json was written (ns since the epoch), or None: the run has not finished."""
        try:
            return self.summary.stat().st_mtime_ns
        except OSError:
            return None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m common.run_dir",
                                     description="What a run's output directory holds, for shell scripts.")
    parser.add_argument("command", choices=["finished-at", "latest-checkpoint"])
    parser.add_argument("output_dir", type=Path)
    args = parser.parse_args(argv)
    run_dir = RunDir(args.output_dir)
    if args.command == "finished-at":
        finished = run_dir.finished_at()
        print("none" if finished is None else finished)
    elif (latest := run_dir.latest_checkpoint()) is not None:
        print(latest)


if __name__ == "__main__":
    main()
