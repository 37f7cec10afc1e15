"""The run's output directory: one run writes it at a time, --resume continues the same run, and
--overwrite deletes the old run only once every input has been checked.

    OUTPUT_DIR/run.json       the settings that define the optimisation, recorded when the run starts
    OUTPUT_DIR/.lock          held by rank 0 while the run is alive (names its host, pid, Slurm job)
    OUTPUT_DIR/metrics.jsonl, summary.json, checkpoints/, final/, tracker folders

A requeued Slurm job (same job id, SLURM_RESTART_COUNT > 0) continues its run: --resume, and an
--overwrite meant for its first start is ignored (it would delete the checkpoint to continue from).
"""
import hashlib
import json
import os
import shutil
from pathlib import Path

from common import errors, lock
from common.checkpoint import complete_checkpoints
from common.errors import UserError

RUN_FILE = "run.json"
# What a run writes, and so what --overwrite may delete; nothing else in the folder is touched.
RUN_OUTPUTS = ["metrics.jsonl", "summary.json", RUN_FILE, "checkpoints", "final", "tensorboard", "mlflow.db",
               "wandb"]


def requeued():
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0


class OutputDir:
    """Check the output directory and take it for this run. Rank 0 holds its lock; every rank
    reaches the same verdicts, since they read the same files."""

    def __init__(self, args, is_main):
        self.path = Path(args.output_dir)
        self.is_main = is_main
        if requeued() and not args.resume:
            if is_main:
                print(f"requeued job (restart {os.environ['SLURM_RESTART_COUNT']}): continuing the run in "
                      f"{self.path} from its newest checkpoint", flush=True)
            args.resume, args.overwrite = True, False
        self.resume, self.overwrite = args.resume, args.overwrite
        self._make_writable()
        self.lock = None
        if is_main:
            self.lock = lock.try_lock(self.path / ".lock")
            if self.lock is None:
                raise UserError(f"another run is writing to {self.path} ({lock.holder(self.path / '.lock')}): "
                                "wait for it to end, or choose another --output_dir")
        holds_run = (self.path / "metrics.jsonl").exists() or (self.path / RUN_FILE).exists()
        if holds_run and not (self.resume or self.overwrite):
            raise UserError(f"{self.path} already holds a run: pass --resume to continue it, --overwrite "
                            "to replace it, or choose another --output_dir")
        errors.interrupted_note[0] = self.where_to_continue()

    def _make_writable(self):
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create --output_dir {self.path}: {err.strerror}") from None
        probe = self.path / f".write-test-{os.uname().nodename}-{os.getpid()}"  # a real write: root passes os.access
        try:
            probe.touch()
            probe.unlink()
        except OSError as err:
            raise UserError(f"--output_dir {self.path} is not writable ({err.strerror}): choose another "
                            "directory") from None

    def where_to_continue(self):
        checkpoints = complete_checkpoints(self.path)
        if not checkpoints:
            return f"no complete checkpoint in {self.path} yet"
        return f"the last complete checkpoint is {checkpoints[-1]}; continue with --resume"

    def start(self, settings):
        """Called once every input has been checked, just before the run writes: on --resume the
        recorded settings must match; on --overwrite the old run's files go; then the settings
        are recorded. Returns a note for the user, or None."""
        recorded_path = self.path / RUN_FILE
        recorded = json.loads(recorded_path.read_text()) if self.resume and recorded_path.is_file() else None
        note = check_same_run(recorded, settings, self.path) if recorded else None
        if self.is_main:
            if self.overwrite:
                for name in RUN_OUTPUTS:
                    target = self.path / name
                    shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
            partial = recorded_path.with_suffix(".partial")
            partial.write_text(json.dumps(settings, indent=1) + "\n")
            os.replace(partial, recorded_path)
        return note

    def release(self):
        if self.lock is not None:
            self.lock.release()
            self.lock = None


# Settings that may differ on --resume; everything else recorded in run.json must match. The world
# size and the split of the global batch (per device × accumulation) are not recorded: they may change.
MAY_GROW = ("max_steps",)
IRRELEVANT_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"}


def run_settings(args, checkpoints, config, train_rows, **extra):
    """What defines the optimisation of a run: the same model and data, the same global batches,
    the same schedule; and the checkpoints' format (a run of step 2 may continue with step 3: same
    file). `extra`: the step's own settings (FSDP's precision, LoRA's adapter)."""
    model_config = {k: v for k, v in config.to_dict().items() if k not in IRRELEVANT_CONFIG_KEYS}
    return {"checkpoints": checkpoints, "model": args.model,
            "model_config": hashlib.sha256(json.dumps(model_config, sort_keys=True).encode()).hexdigest()[:16],
            "data": train_rows.folder.name,  # the content key of the prepared games
            "total_batch_size": args.total_batch_size, "max_seq_length": args.max_seq_length,
            "packing": not args.no_packing, "seed": args.seed, "learning_rate": args.learning_rate,
            "warmup_steps": "10% of max_steps" if args.warmup_is_default else args.warmup_steps,
            "weight_decay": args.weight_decay, "max_grad_norm": args.max_grad_norm, "max_steps": args.max_steps,
            **extra}


def check_same_run(recorded, settings, path):
    """Refuse --resume with settings that would make it another run; allow a longer run."""
    different = [key for key in sorted(set(recorded) | set(settings))
                 if key not in MAY_GROW and recorded.get(key) != settings.get(key)]
    if "model_config" in different:
        raise UserError(f"--model {settings['model']} is not the model the run in {path} started from (its "
                        f"config.json differs from {recorded['model']}'s then): its checkpoints belong to that "
                        "model. Pass that --model, or start a new run in another --output_dir")
    if different:
        changes = "; ".join(f"{key}: {recorded.get(key)!r} then, {settings.get(key)!r} now" for key in different)
        raise UserError(f"--resume would continue the run in {path} with other settings ({changes}): pass the "
                        "run's own settings (see run.json there), or start a new run in another --output_dir")
    if settings["max_steps"] < recorded["max_steps"]:
        raise UserError(f"--max_steps {settings['max_steps']} is less than the run's {recorded['max_steps']}: "
                        "a run can be made longer on --resume, not shorter")
    if settings["max_steps"] > recorded["max_steps"]:
        return (f"note: --max_steps {recorded['max_steps']} → {settings['max_steps']}: the learning rate's cosine "
                f"decay is stretched to end at step {settings['max_steps']}, so from the resumed step on it is "
                "higher than the shorter run's")
    return None
