"""The run's output directory: one run writes it at a time, --resume continues the same run, and
--overwrite deletes the old run only once every input has been checked. What the directory holds
is common/run_dir.py's.

A requeued Slurm job (same job id, SLURM_RESTART_COUNT > 0) continues its run: --resume, and an
--overwrite meant for its first start is ignored (it would delete the checkpoint to continue from).
"""
import hashlib
import json
import os
import shutil
from pathlib import Path

from common import errors, lock
from common.errors import UserError
from common.notation import CONFIG_KEY
from common.run_dir import RunDir, new_run_id
from common.shared_folder import check_shared, refuse_if_any_rank

# The inputs a run reads from disk: --overwrite must not delete them with the old run.
INPUTS = ("model", "data_dir", "prepared_dir")


def requeued():
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0


class OutputDir:
    """Check the output directory and take it for this run. Rank 0 holds its lock; every node must
    see the same folder (common/shared_folder.py), and every rank reaches the same verdicts, since
    they read the same files. `resume` and `overwrite` say what
    the run does: what was asked, except in a requeued job (see above)."""

    def __init__(self, args, is_main):
        self.run_dir = RunDir(args.output_dir)
        self.path = self.run_dir.path
        self.is_main = is_main
        self.resume, self.overwrite = args.resume, args.overwrite
        if requeued() and not self.resume:
            if is_main:
                print(f"requeued job (restart {os.environ['SLURM_RESTART_COUNT']}): continuing the run in "
                      f"{self.path} from its newest checkpoint", flush=True)
            self.resume, self.overwrite = True, False
        self._make_writable()
        self.lock = None
        refuse_if_any_rank(self._take_lock() if is_main else None)  # rank 0's verdict, which the others wait for
        check_shared(self.path, "--output_dir")  # the same folder on every node: they all write shards there
        if getattr(args, "prepared_dir", None):  # where the job reads, or makes, the tokenized games
            check_shared(args.prepared_dir, "--prepared_dir")
        holds_run = self.run_dir.metrics.exists() or self.run_dir.run_file.exists()
        if holds_run and not (self.resume or self.overwrite):
            raise UserError(f"{self.path} already holds a run: pass --resume to continue it, --overwrite "
                            "to replace it, or choose another --output_dir")
        if self.overwrite:
            self._refuse_to_delete_inputs(args)
            self._refuse_to_delete_through_links()
        else:
            self._refuse_damaged_run_file()
            self._refuse_foreign_checkpoints()
        errors.explain_interrupts_with(self.where_to_continue)

    def _take_lock(self):
        """None once the lock is held, else why not."""
        try:
            self.lock = lock.try_lock(self.run_dir.lock_file)
        except UserError as err:  # not writable, a full disk
            return str(err)
        if self.lock is None:
            return (f"another run is writing to {self.path} ({lock.holder(self.run_dir.lock_file)}): wait for it "
                    "to end, or choose another --output_dir")
        return None

    def _make_writable(self):
        """Every rank must be able to write the folder (a node may see it read-only): one verdict for all."""
        refuse_if_any_rank(self._why_not_writable())

    def _why_not_writable(self):
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return f"cannot create --output_dir {self.path}: {err.strerror}"
        probe = self.path / f".write-test-{os.uname().nodename}-{os.getpid()}"  # a real write: root passes os.access
        try:
            probe.touch()
            probe.unlink()
        except OSError as err:
            return f"--output_dir {self.path} is not writable ({err.strerror}): choose another directory"
        return None

    def _refuse_to_delete_inputs(self, args):
        """--overwrite deletes the old run's outputs: not when an input is among them (e.g. --model
        OUTPUT_DIR/final, to train the finished model further)."""
        for name in INPUTS:
            given = getattr(args, name, None)
            if given is None or not Path(given).exists():  # a hub id, or nothing on disk to lose
                continue
            where = Path(given).resolve()
            for output in self.run_dir.outputs:
                if output.resolve() in (where, *where.parents):
                    raise UserError(f"--{name} {given} is inside {output}, which --overwrite deletes: copy it "
                                    f"out of {self.path} first, or choose another --output_dir")

    def _refuse_to_delete_through_links(self):
        """An output that is a symbolic link (checkpoints/ on a scratch disk) is another disk's folder:
        --overwrite keeps a link to an empty folder (the new run writes there) and deletes nothing
        through a link. It refuses here, before anything is deleted."""
        for output in self.run_dir.outputs:
            if output.is_symlink() and not (output.is_dir() and not any(output.iterdir())):
                raise UserError(f"{output} is a symbolic link (to {os.readlink(output)}): --overwrite does not delete "
                                "through a link. Empty the folder it points to yourself (the link is kept and the new "
                                "run writes there), or remove the link, then run again")

    def _refuse_damaged_run_file(self):
        """run.json names the run (its checkpoints' markers hold its id) and its settings: --resume
        needs it whole. One cut short (a full disk, a copy that stopped) is named as what it is,
        before its checkpoints would look like another run's."""
        run_file = self.run_dir.run_file
        if not run_file.exists():
            return
        try:
            recorded = json.loads(run_file.read_text())
            damage = None if isinstance(recorded, dict) else "not a JSON object"
        except (OSError, ValueError) as err:
            damage = errors.first_line(err)
        if damage:
            raise UserError(f"{run_file} is damaged ({damage}): it records the run's id and settings, which --resume "
                            "needs. Restore it from a backup, or start a new run with --overwrite (it deletes this "
                            "run) or in another --output_dir")

    def _refuse_foreign_checkpoints(self):
        """A checkpoint whose marker names another run (copied in) is never resumed from nor
        deleted: the run refuses to start beside it, rather than to work around it."""
        foreign = self.run_dir.foreign_checkpoints()
        if foreign:
            raise UserError(f"{foreign[-1]} is a checkpoint of another run (its marker does not name the run "
                            f"recorded in {self.run_dir.run_file.name}): move it out of {self.run_dir.checkpoints_dir}"
                            " (a run continues from its own checkpoints only), then start again")

    def where_to_continue(self):
        """What there is to continue from, read when the note is printed: a Ctrl-C that stops the run
        at once may come long after the start, in the middle of a save."""
        latest = self.run_dir.latest_checkpoint()
        if latest is None:
            return f"no complete checkpoint in {self.path} yet"
        return f"the last complete checkpoint is {latest}; continue with --resume"

    def start(self, settings):
        """Called once every input has been checked, just before the run writes: on --resume the
        recorded settings must match; on --overwrite the old run's files go; then the settings
        are recorded, with the run's id (kept on --resume: its checkpoints' markers name it).
        Returns a note for the user, or None."""
        run_file = self.run_dir.run_file
        recorded = json.loads(run_file.read_text()) if self.resume and run_file.is_file() else None
        note = check_same_run(recorded, settings, self.path) if recorded else None
        if self.is_main:
            run_id = self.run_dir.run_id() if recorded else new_run_id()
            if self.overwrite:
                for target in self.run_dir.outputs:
                    if target.is_symlink():  # to an empty folder (_refuse_to_delete_through_links): kept
                        continue
                    shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
            partial = run_file.with_suffix(".partial")
            partial.write_text(json.dumps({"run_id": run_id, **settings}, indent=1) + "\n")
            os.replace(partial, run_file)
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
            # recorded only for Muon, so that the runs of before --optimizer still continue
            **({"optimizer": args.optimizer} if args.optimizer != "adamw" else {}),
            "notation": getattr(config, CONFIG_KEY, None),  # a run's --notation (also in model_config)
            **extra}


def model_location(model):
    """A local model folder by where it is, however its path was written (relative or absolute);
    a hub id as it is."""
    return str(Path(model).resolve()) if Path(model).is_dir() else model


def as_compared(settings):
    """Settings as --resume compares them: without the run's id (it names the run, it sets nothing),
    with a local model by where it is (a run started by a Slurm template with a relative --model
    continues from submit.py, which passes absolute paths)."""
    return {**{key: value for key, value in settings.items() if key != "run_id"},
            "model": model_location(settings["model"])}


def check_same_run(recorded, settings, path):
    """Refuse --resume with settings that would make it another run; allow a longer run."""
    then, now = as_compared(recorded), as_compared(settings)
    if "notation" not in then:  # a run of before the notation was recorded: model_config covers it
        now.pop("notation", None)
    different = [key for key in sorted(set(then) | set(now)) if key not in MAY_GROW and then.get(key) != now.get(key)]
    if "notation" in different:
        raise UserError(f"the run in {path} trains in the {then['notation']} notation, not {now['notation']}: pass "
                        f"--notation {then['notation']} to continue it, or start a new run in another --output_dir")
    if "model_config" in different:
        raise UserError(f"--model {now['model']} is not the model the run in {path} started from (its "
                        f"config.json differs from {then['model']}'s then): its checkpoints belong to that "
                        "model. Pass that --model, or start a new run in another --output_dir")
    if different:
        changes = "; ".join(f"{key}: {then.get(key)!r} then, {now.get(key)!r} now" for key in different)
        raise UserError(f"--resume would continue the run in {path} with other settings ({changes}): pass the "
                        "run's own settings (see run.json there), or start a new run in another --output_dir")
    if now["max_steps"] < then["max_steps"]:
        raise UserError(f"--max_steps {now['max_steps']} is less than the run's {then['max_steps']}: "
                        "a run can be made longer on --resume, not shorter")
    if now["max_steps"] > then["max_steps"]:
        return (f"note: --max_steps {then['max_steps']} → {now['max_steps']}: the learning rate's cosine "
                f"decay is stretched to end at step {now['max_steps']}, so from the resumed step on it is "
                "higher than the shorter run's")
    return None
