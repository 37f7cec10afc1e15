"""benchmark/compare_runs.py, the demo's last word: the table, the largest per-step loss difference
of each run from the first, and the PNG of the loss curves."""
import json

import pytest

from benchmark import compare_runs


pytestmark = pytest.mark.quick
SUMMARY = {"world_size": 1, "final_loss": 6.5, "eval_loss": 6.6, "tokens_per_s": 4000.0, "peak_rss_mib_per_rank": 700,
           "legal_move_rate_untrained": 0.02, "legal_move_rate": 0.1}


def write_run(path, losses, **summary):
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({**SUMMARY, "run": path.name, **summary}))
    lines = [json.dumps({"step": step, "loss": loss}) for step, loss in enumerate(losses, start=1)]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 9, "lo')  # a line cut short


def test_table_differences_and_plot(tmp_path, capsys):
    write_run(tmp_path / "runs/single", [7.0, 6.8, 6.6])
    write_run(tmp_path / "runs/ddp", [7.0, 6.8, 6.6], world_size=2)
    write_run(tmp_path / "runs/fsdp", [7.0, 6.8005, 6.6001], world_size=2)
    compare_runs.main([str(tmp_path / "runs" / name) for name in ("single", "ddp", "fsdp")])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| run | ranks | final loss") and out[2].startswith("| single | 1 | 6.5")
    assert "largest per-step loss difference, ddp vs single: 0.00e+00 (step 1)" in out
    assert "largest per-step loss difference, fsdp vs single: 5.00e-04 (step 2)" in out
    assert out[-1] == f"loss curves: {tmp_path / 'runs/loss_curves.png'}"
    assert (tmp_path / "runs/loss_curves.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_an_unfinished_run_is_one_line(tmp_path):
    (tmp_path / "running").mkdir()
    with pytest.raises(compare_runs.UserError, match="summary.json is missing: did that run finish"):
        compare_runs.main([str(tmp_path / "running")])
