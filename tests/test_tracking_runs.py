"""--report_to in the training scripts: only rank 0 tracks; the step metrics arrive."""
import pytest

from conftest import demo_args, run_step

pytest.importorskip("tensorboard", reason="the tracking extras are not installed (requirements-tracking.txt)")


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_ddp_run_reports_step_metrics_from_rank_0_only(demo, tmp_path):
    run_step("ddp", demo_args(demo, tmp_path) + ["--max_steps", 3, "--batch_size_per_device", 2,
                                                 "--report_to", "tensorboard"], nproc=2)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1, "one writer: rank 0"
    found = scalars(tmp_path)
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_rss_mib", "eval_loss", "legal_move_rate"):
        assert tag in found, (tag, sorted(found))
    assert [step for step, _ in found["loss"]] == [1, 2, 3]


def test_unknown_tracker_is_refused_before_training(demo, tmp_path):
    result = run_step("single", demo_args(demo, tmp_path) + ["--report_to", "comet"], check=False)
    assert result.returncode == 2 and "error: --report_to: unknown tracker 'comet'" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
