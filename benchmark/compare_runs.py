"""Side-by-side table of finished runs: `python benchmark/compare_runs.py RUN_DIR [RUN_DIR ...]`."""
import json
import sys
from pathlib import Path

from common.errors import UserError, exit_on_user_error

COLUMNS = [("run", "run"), ("world_size", "ranks"), ("final_loss", "final loss"), ("eval_loss", "eval loss"),
           ("tokens_per_s", "tokens/s"), ("peak_rss_mib_per_rank", "peak MiB/rank"),
           ("legal_move_rate_untrained", "legal moves before"), ("legal_move_rate", "legal moves after")]


def markdown_table(summaries):
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "|".join("---" if key == "run" else "---:" for key, _ in COLUMNS) + "|"]
    for summary in summaries:
        lines.append("| " + " | ".join(str(summary[key]) for key, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main():
    summaries = []
    for run_dir in sys.argv[1:]:
        path = Path(run_dir) / "summary.json"
        if not path.is_file():
            raise UserError(f"{path} is missing: did that run finish?")
        summaries.append(json.loads(path.read_text()))
    print(markdown_table(summaries))


if __name__ == "__main__":
    exit_on_user_error(main)
