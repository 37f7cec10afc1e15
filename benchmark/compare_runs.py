"""Finished runs side by side: `python benchmark/compare_runs.py RUN_DIR [RUN_DIR ...]`.

Prints a table of their summaries, then, for each run after the first, the largest difference of
its per-step training loss from the first run's, and draws their loss curves into one PNG next to
the runs (the first run's parent folder, loss_curves.png). Runs on the same global batch should
coincide: that is the equivalence the steps promise.
"""
import json
import sys
from pathlib import Path

from common.errors import UserError, exit_on_user_error
from common.run_dir import RunDir

COLUMNS = [("run", "run"), ("world_size", "ranks"), ("final_loss", "final loss"), ("eval_loss", "eval loss"),
           ("tokens_per_s", "tokens/s"), ("peak_rss_mib_per_rank", "peak MiB/rank"),
           ("legal_move_rate_untrained", "legal moves before"), ("legal_move_rate", "legal moves after")]


def markdown_table(summaries):
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "|".join("---" if key == "run" else "---:" for key, _ in COLUMNS) + "|"]
    for summary in summaries:
        lines.append("| " + " | ".join(str(summary[key]) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def step_losses(run_dir):
    """{step: training loss} from metrics.jsonl; a resumed run's repeated steps keep the last."""
    losses = {}
    for line in RunDir(run_dir).metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed run
            continue
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses


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


def main(argv=None):
    run_dirs = [Path(run) for run in (sys.argv[1:] if argv is None else argv)]
    if not run_dirs:
        raise UserError("give one or more run directories (each with summary.json and metrics.jsonl)")
    summaries = []
    for run_dir in run_dirs:
        path = RunDir(run_dir).summary
        if not path.is_file():
            raise UserError(f"{path} is missing: did that run finish?")
        summaries.append(json.loads(path.read_text()))
    print(markdown_table(summaries))
    curves = {run_dir.name: step_losses(run_dir) for run_dir in run_dirs}
    first = run_dirs[0].name
    for run_dir in run_dirs[1:]:
        difference, step = largest_difference(curves[first], curves[run_dir.name])
        if difference is not None:
            print(f"largest per-step loss difference, {run_dir.name} vs {first}: {difference:.2e} (step {step})")
    path = run_dirs[0].resolve().parent / "loss_curves.png"
    plot_losses(curves, path)
    print(f"loss curves: {path}")


if __name__ == "__main__":
    exit_on_user_error(main)
