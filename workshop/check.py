"""The exercises' checker: it reads your own run folders and says whether your result is the lesson's,
right or wrong, and why, with the figures it measured. One check per step (workshop/README.md):

    python workshop/check.py accumulation runs/acc1 runs/single step 2: more micro-batches, the same steps
    python workshop/check.py same-loss runs/single runs/ddp     step 3 (and 4, 6): the same steps on N ranks
    python workshop/check.py fsdp-shards runs/ddp runs/fsdp     step 4: a rank keeps 1/N of DDP's state
    python workshop/check.py lora-adapters runs/fsdp runs/lora  step 5: LoRA trains and saves a small part
    python workshop/check.py same-loss runs/single runs/tp      step 6: tensor parallel, the same steps too

It prints one line that starts with `right:` (exit status 0) or `wrong:` (1). A folder that is not a
finished run of the kind the check needs gets one `error:` line (2). It reads only what every run writes
(common/run_dir.py): run.json, metrics.jsonl, summary.json, the newest checkpoint and final/; it never
writes. It needs no GPU: it answers in seconds, on a laptop or a login node.
"""
import argparse
import json
import struct
import sys
from pathlib import Path

from common.errors import UserError, exit_on_user_error
from common.run_dir import RunDir

# Two runs take "the same steps" when each step's loss agrees to this: DDP reproduces one process
# exactly; FSDP's and TP's other summation orders drift by float rounding, up to 1.1e-3 over the demo's
# 150 steps at the default learning rate (the front page's demo table); a learning rate 10 times
# larger differs by 3.0e-2 at step 2, LoRA's step by 2.1e-2 (2-step runs like tests/test_workshop_check.py's).
LOSS_TOLERANCE = 5e-3
# A FULL_SHARD rank keeps 1/N of DDP's state, a little more where a tensor's rows do not divide by N
# (and DDP's file holds a few bytes besides the tensors); NO_SHARD's ranks keep all of it.
SHARD_SLACK = 1.15


def parsed(line):
    """One metrics.jsonl line, or None for a line that a killed write cut short (a resumed run has them)."""
    try:
        step = json.loads(line)
    except ValueError:
        return None
    return step if isinstance(step, dict) and "step" in step and "loss" in step else None


class Run:
    """One finished run folder, as the checks read it."""

    def __init__(self, path):
        self.dir = RunDir(path)
        if not self.dir.path.is_dir():
            raise UserError(f"{path}: no such folder; give the --output_dir of a run you trained")
        if not self.dir.summary.is_file() or not self.dir.metrics.is_file():
            raise UserError(f"{path}: not a finished run (no summary.json); let its training end, or run it again")
        self.summary = json.loads(self.dir.summary.read_text())
        self.settings = json.loads(self.dir.run_file.read_text()) if self.dir.run_file.is_file() else {}
        self.steps = [step for step in map(parsed, self.dir.metrics.read_text().splitlines()) if step]
        self.step = self.summary.get("run", "?")  # 02_singlegpu, 03_ddp, ...
        self.ranks = self.summary.get("world_size", 1)
        self.name = str(path)

    def checkpoint(self):
        """The newest complete checkpoint's folder (every run saves one at its end)."""
        latest = self.dir.latest_checkpoint()
        if latest is None:
            raise UserError(f"{self.name}: no complete checkpoint; a run saves one at its end: let it finish")
        return Path(latest)

    def saved_bytes(self):
        """The bytes of the newest checkpoint's files: a whole one's state.pt, or a sharded one's
        .distcp files, all ranks together."""
        folder = self.checkpoint()
        files = [folder / "state.pt"] if (folder / "state.pt").is_file() else list(folder.glob("*.distcp"))
        if not files:
            raise UserError(f"{self.name}: its checkpoint {folder.name} holds neither state.pt nor .distcp files")
        return sum(f.stat().st_size for f in files)

    def kept_per_rank(self):
        """The bytes of tensors one rank keeps, at most, from a sharded checkpoint's index (.metadata):
        each tensor is saved as the parts the ranks hold, and its largest part is what one rank keeps.
        File sizes would not tell: DCP writes a tensor that several ranks hold whole (NO_SHARD) once,
        from whichever rank has written least so far."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from common.safe_dcp import SafeReader  # reads the index without letting it run code
        folder = self.checkpoint()
        if not (folder / ".metadata").is_file():
            raise UserError(f"{self.name}: a whole checkpoint, not one shard per rank; give an FSDP run (04_fsdp) "
                            f"on 2 or more ranks second")
        kept = 0
        for tensor in SafeReader(str(folder)).read_metadata().state_dict_metadata.values():
            if isinstance(tensor, TensorStorageMetadata) and tensor.chunks:
                kept += max(chunk.sizes.numel() for chunk in tensor.chunks) * tensor.properties.dtype.itemsize
        return kept


def same_data(a, b):
    """Refuse two runs that cannot be compared: another model, other games, another global batch."""
    for key, what in (("model_config", "model"), ("data", "games"), ("total_batch_size", "--total_batch_size"),
                      ("max_seq_length", "--max_seq_length"), ("seed", "--seed")):
        if key in a.settings and key in b.settings and a.settings[key] != b.settings[key]:
            raise UserError(f"{a.name} and {b.name} differ in their {what} ({a.settings[key]} against "
                            f"{b.settings[key]}): train both with the same settings, as the exercise says")


def loss_difference(a, b):
    """(the largest per-step loss difference, its step), or a `wrong:` reason when the steps differ."""
    steps_a, steps_b = {r["step"]: r for r in a.steps}, {r["step"]: r for r in b.steps}
    common_steps = sorted(set(steps_a) & set(steps_b))
    if not common_steps:
        raise UserError(f"{a.name} and {b.name} share no step: train both for the same --max_steps")
    for step in common_steps:
        if steps_a[step]["tokens"] != steps_b[step]["tokens"]:
            return None, (f"step {step} trained on {steps_a[step]['tokens']} tokens in {a.name} and "
                          f"{steps_b[step]['tokens']} in {b.name}: not the same global batch (packing? rows?)")
    worst = max(common_steps, key=lambda s: abs(steps_a[s]["loss"] - steps_b[s]["loss"]))
    return (abs(steps_a[worst]["loss"] - steps_b[worst]["loss"]), worst), None


def processes(count):
    return f"{count} rank{'s' if count > 1 else ''}"


def verdict(right, line):
    print(("right: " if right else "wrong: ") + line)
    return 0 if right else 1


def check_same_loss(reference, other, tolerance):
    """Step 3 (and 4, 6): N ranks take the same optimiser steps as one process."""
    a, b = Run(reference), Run(other)
    same_data(a, b)
    found, different_batch = loss_difference(a, b)
    if different_batch:
        return verdict(False, different_batch)
    difference, step = found
    what = f"{b.step} on {processes(b.ranks)} against {a.step} on {processes(a.ranks)}"
    if difference <= tolerance:
        return verdict(True, f"{what}: the same steps, largest per-step loss difference {difference:.2e} "
                             f"(step {step}) within {tolerance:g}; final loss {a.summary['final_loss']} and "
                             f"{b.summary['final_loss']}")
    return verdict(False, f"{what}: the losses part, by {difference:.2e} at step {step} (more than {tolerance:g}): "
                          f"another learning rate, optimiser or data order? Train both with only the ranks changed")


def check_accumulation(few, many, tolerance):
    """Step 2: splitting the global batch into more micro-batches changes speed and memory, not the steps."""
    a, b = Run(few), Run(many)
    same_data(a, b)
    if a.ranks != b.ranks:
        raise UserError(f"{a.name} ran on {a.ranks} process(es), {b.name} on {b.ranks}: this exercise compares two "
                        f"runs of step 2, one process each")
    acc_a, acc_b = (r.steps[-1]["gradient_accumulation_steps"] for r in (a, b))
    if acc_a == acc_b:
        raise UserError(f"both runs accumulate {acc_a} micro-batches per step: train one with "
                        f"--batch_size_per_device 16 (1 micro-batch) and one with the default (4)")
    found, different_batch = loss_difference(a, b)
    if different_batch:
        return verdict(False, different_batch)
    difference, step = found
    trade = "; ".join(f"{acc} micro-batch{'es' if acc > 1 else ''} per step: {run.summary['tokens_per_s']} tokens/s, "
                      f"peak {run.summary['peak_rss_mib_per_rank']} MiB" for acc, run in ((acc_a, a), (acc_b, b)))
    if difference <= tolerance:
        return verdict(True, f"the same steps (largest per-step loss difference {difference:.2e}, step {step}); "
                             f"only speed and memory change: {trade}")
    return verdict(False, f"the losses part, by {difference:.2e} at step {step}: the batch should be the same "
                          f"rows however it is split; {trade}")


def check_fsdp_shards(ddp, fsdp):
    """Step 4: each FULL_SHARD rank keeps 1/N of what a DDP rank holds (weights and AdamW state)."""
    a, b = Run(ddp), Run(fsdp)
    same_data(a, b)
    if (a.checkpoint() / ".metadata").is_file():
        raise UserError(f"{a.name}: a sharded checkpoint; give a DDP run (03_ddp) first")
    ddp_bytes = a.saved_bytes()
    kept = b.kept_per_rank()
    ranks = b.ranks
    if ranks < 2:
        raise UserError(f"{b.name} ran on 1 process: give an FSDP run on 2 or more ranks second")
    share = kept / ddp_bytes
    figures = (f"a rank keeps {kept / 2**20:.2f} MiB of the {ddp_bytes / 2**20:.2f} MiB that DDP saves (weights "
               f"and AdamW state): {share:.3f}, and 1/N = {1 / ranks:.3f} on {ranks} ranks")
    if share <= SHARD_SLACK / ranks:
        return verdict(True, f"your FSDP run's per-rank state is 1/{ranks} of DDP's: {figures}")
    return verdict(False, f"your FSDP run's per-rank state is not 1/{ranks} of DDP's: {figures}; each rank "
                          f"keeps it all (--sharding_strategy NO_SHARD is DDP inside FSDP): use FULL_SHARD")


def tensor_elements(safetensors_file):
    """How many numbers a .safetensors file holds, read from its JSON header alone."""
    with open(safetensors_file, "rb") as file:
        header = json.loads(file.read(struct.unpack("<Q", file.read(8))[0]))
    total = 0
    for name, tensor in header.items():
        if name != "__metadata__":
            count = 1
            for size in tensor["shape"]:
                count *= size
            total += count
    return total


def check_lora_adapters(full, lora):
    """Step 5: LoRA trains, and saves, a small part of the model: the adapters and their AdamW state."""
    a, b = Run(full), Run(lora)
    adapters = b.dir.final / "adapter_model.safetensors"
    if not adapters.is_file():
        raise UserError(f"{b.name}: no final/adapter_model.safetensors; give a LoRA run (05_lora) second")
    model = a.dir.final / "model.safetensors"
    if not model.is_file():
        raise UserError(f"{a.name}: no final/model.safetensors; give a full fine-tune (step 2, 3 or 4) first")
    trained, whole = tensor_elements(adapters), tensor_elements(model)
    saved_full, saved_lora = a.saved_bytes(), b.saved_bytes()
    figures = (f"{trained:,} adapter numbers against the model's {whole:,} ({trained / whole:.1%}); its checkpoint "
               f"{saved_lora / 2**20:.2f} MiB against the full fine-tune's {saved_full / 2**20:.2f} MiB "
               f"({saved_lora / saved_full:.1%})")
    if trained < whole / 2 and saved_lora < saved_full / 2:
        return verdict(True, f"LoRA trains and saves a small part: {figures}")
    return verdict(False, f"LoRA should train and save a small part of the model: {figures}; is {a.name} the full "
                          f"fine-tune and {b.name} the LoRA run, with a small --lora_rank?")


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    checks = parser.add_subparsers(dest="check", required=True, metavar="CHECK")
    for name, first, second, help_text in (
            ("accumulation", "few", "many", "step 2: two single-process runs, 1 and 4 micro-batches per step"),
            ("same-loss", "reference", "other", "steps 3, 4, 6: one process against N ranks (DDP, FSDP, TP)"),
            ("fsdp-shards", "ddp", "fsdp", "step 4: a DDP run and an FSDP run on N ranks"),
            ("lora-adapters", "full", "lora", "step 5: a full fine-tune (step 2, 3 or 4) and a LoRA run")):
        check = checks.add_parser(name, help=help_text, description=help_text)
        check.add_argument(first, help="a run's --output_dir")
        check.add_argument(second, help="a run's --output_dir")
        if name in ("accumulation", "same-loss"):
            check.add_argument("--tolerance", type=float, default=LOSS_TOLERANCE,
                               help="the largest per-step loss difference that counts as the same")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_arguments(argv)
    if args.check == "accumulation":
        return check_accumulation(args.few, args.many, args.tolerance)
    if args.check == "same-loss":
        return check_same_loss(args.reference, args.other, args.tolerance)
    if args.check == "fsdp-shards":
        return check_fsdp_shards(args.ddp, args.fsdp)
    return check_lora_adapters(args.full, args.lora)


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
