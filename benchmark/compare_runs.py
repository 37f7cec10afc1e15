"""Finished runs side by side: `python benchmark/compare_runs.py RUN_DIR [RUN_DIR ...]`.

Prints a table of their summaries, then, for each run after the first, the largest difference of
its per-step training loss from the first run's, and draws their loss curves into one PNG next to
the runs (the first run's parent folder, loss_curves.png; if that exists, it is kept and the plot
goes beside it: loss_curves-2.png, ...). Runs on the same global batch should coincide: that is
the equivalence the steps promise; runs on different global batches are compared with a warning.
Each run is named by its folder, with as many parent folders as it takes to tell the runs apart.
"""
import itertools
import json
import sys
from pathlib import Path

from common.errors import UserError, exit_on_user_error, first_line
from common.run_dir import RunDir

COLUMNS = [("run", "run"), ("world_size", "ranks"), ("final_loss", "final loss"), ("eval_loss", "eval loss"),
           ("tokens_per_s", "tokens/s"), ("peak_rss_mib_per_rank", "peak MiB/rank"),
           ("legal_move_rate_untrained", "legal moves before"), ("legal_move_rate", "legal moves after")]


def markdown_table(summaries, labels):
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "|".join("---" if key == "run" else "---:" for key, _ in COLUMNS) + "|"]
    for summary, label in zip(summaries, labels):
        lines.append("| " + " | ".join(label if key == "run" else str(summary.get(key, "—")) for key, _ in COLUMNS)
                     + " |")
    return "\n".join(lines)


def labels_of(run_dirs):
    """Each run's folder name, with as many parents as it takes to tell them apart (a/run, b/run)."""
    paths = [run_dir.resolve() for run_dir in run_dirs]
    twice = next((run_dir for run_dir, path in zip(run_dirs, paths) if paths.count(path) > 1), None)
    if twice is not None:
        raise UserError(f"{twice} is given twice: give each run once")
    for depth in range(1, max(len(path.parts) for path in paths) + 1):
        labels = ["/".join(path.parts[-depth:]) for path in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(path) for path in paths]


def read_summary(run_dir):
    path = RunDir(run_dir).summary
    if not path.is_file():
        raise UserError(f"{path} is missing: did that run finish?")
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} cannot be read ({first_line(err)}): did that run finish? (a run writes it "
                        "last)") from None
    if not isinstance(summary, dict):
        raise UserError(f"{path} is not a run's summary (a JSON object): did that run finish?")
    return summary


def read_records(run_dir):
    """metrics.jsonl's records; a line cut short by a killed run is left out."""
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise UserError(f"{path} is missing: give run folders of the step scripts (each has summary.json and "
                        "metrics.jsonl)")
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def step_losses(records):
    """{step: training loss}; a resumed run's repeated steps keep the last."""
    return {record["step"]: record["loss"] for record in records if isinstance(record.get("loss"), (int, float))}


def global_batch(records):
    """Rows per optimiser step (per device × ranks × accumulation), or None if the records do not say."""
    parts = ("batch_size_per_device", "world_size", "gradient_accumulation_steps")
    first = records[0] if records else {}
    return first[parts[0]] * first[parts[1]] * first[parts[2]] if all(key in first for key in parts) else None


def largest_difference(reference, other):
    """(largest |loss difference|, at which step) over the steps both runs have."""
    common = sorted(reference.keys() & other.keys())
    if not common:
        return None, None
    step = max(common, key=lambda s: abs(reference[s] - other[s]))
    return abs(reference[step] - other[step]), step


def plot_losses(curves, path):
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4))
    for (name, losses), style in zip(curves.items(), ["-", "--", ":", "-."] * len(curves)):
        steps = sorted(losses)
        axes.plot(steps, [losses[s] for s in steps], style, label=name)
    axes.set_xlabel("optimiser step")
    axes.set_ylabel("training loss")
    axes.set_title("same global batch, different parallelism")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def free_path(path):
    """`path`, or the first of path-2, path-3, ... that does not exist: nothing is written over."""
    numbered = (path.with_name(f"{path.stem}-{number}{path.suffix}") for number in itertools.count(2))
    return path if not path.exists() else next(other for other in numbered if not other.exists())


def main(argv=None):
    run_dirs = [Path(run) for run in (sys.argv[1:] if argv is None else argv)]
    if not run_dirs:
        raise UserError("give one or more run directories (each with summary.json and metrics.jsonl)")
    labels = labels_of(run_dirs)
    summaries = [read_summary(run_dir) for run_dir in run_dirs]
    records = [read_records(run_dir) for run_dir in run_dirs]
    print(markdown_table(summaries, labels))
    curves = {label: step_losses(run_records) for label, run_records in zip(labels, records)}
    first, batch = labels[0], global_batch(records[0])
    for label, run_records in zip(labels[1:], records[1:]):
        other = global_batch(run_records)
        if None not in (batch, other) and other != batch:
            print(f"warning: {label} took {other} rows per optimiser step, {first} {batch}: different global "
                  "batches, whose losses are not expected to coincide", file=sys.stderr, flush=True)
        difference, step = largest_difference(curves[first], curves[label])
        if difference is not None:
            print(f"largest per-step loss difference, {label} vs {first}: {difference:.2e} (step {step})")
    path = free_path(run_dirs[0].resolve().parent / "loss_curves.png")
    plot_losses(curves, path)
    print(f"loss curves: {path}")


if __name__ == "__main__":
    exit_on_user_error(main)
