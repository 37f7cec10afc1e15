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


# ---- issue 36, case 12 ----------------------------------------------------------------------------------

def test_runs_in_folders_of_the_same_name_are_told_apart(tmp_path, capsys):
    """Two learning runs (each in OUT/run): the second overwrote the first in the table and the
    difference said 0.00e+00 where the losses were 4.8768 and 4.8320."""
    write_run(tmp_path / "a/run", [4.9, 4.8768])
    write_run(tmp_path / "b/run", [4.9, 4.8320])
    compare_runs.main([str(tmp_path / "a/run"), str(tmp_path / "b/run")])
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("| a/run | 1 |") and out[3].startswith("| b/run | 1 |")
    assert "largest per-step loss difference, b/run vs a/run: 4.48e-02 (step 2)" in out
    with pytest.raises(compare_runs.UserError, match="is given twice"):
        compare_runs.main([str(tmp_path / "a/run"), str(tmp_path / "a" / ".." / "a/run")])


def test_different_global_batches_are_said(tmp_path, capsys):
    for name, per_device, ranks in (("small", 2, 1), ("large", 4, 2)):
        write_run(tmp_path / name, [7.0, 6.8])
        records = [{"step": step, "loss": 7.0, "batch_size_per_device": per_device, "world_size": ranks,
                    "gradient_accumulation_steps": 2} for step in (1, 2)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    compare_runs.main([str(tmp_path / "small"), str(tmp_path / "large")])
    assert capsys.readouterr().err == ("warning: large took 16 rows per optimiser step, small 4: different global "
                                       "batches, whose losses are not expected to coincide\n")


@pytest.mark.parametrize("damage, says", [
    (lambda run: (run / "metrics.jsonl").unlink(), "metrics.jsonl is missing"),
    (lambda run: (run / "summary.json").write_text(""), "summary.json cannot be read"),
    (lambda run: (run / "summary.json").write_text("[1, 2]"), "summary.json is not a run's summary"),
])
def test_a_run_without_its_files_is_one_line(tmp_path, damage, says):
    """A run without metrics.jsonl, or with an empty summary.json: a traceback before."""
    write_run(tmp_path / "good", [7.0])
    write_run(tmp_path / "bad", [7.0])
    damage(tmp_path / "bad")
    with pytest.raises(compare_runs.UserError, match=says):
        compare_runs.main([str(tmp_path / "good"), str(tmp_path / "bad")])
    assert not (tmp_path / "loss_curves.png").exists()


def test_an_existing_plot_is_kept(tmp_path, capsys):
    """The kin of the default-output pattern: loss_curves.png was written over."""
    write_run(tmp_path / "runs/one", [7.0, 6.8])
    (tmp_path / "runs/loss_curves.png").write_bytes(b"mine")
    for number in (2, 3):
        compare_runs.main([str(tmp_path / "runs/one")])
        assert capsys.readouterr().out.splitlines()[-1] == f"loss curves: {tmp_path / f'runs/loss_curves-{number}.png'}"
    assert (tmp_path / "runs/loss_curves.png").read_bytes() == b"mine"
