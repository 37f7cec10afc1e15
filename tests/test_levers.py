"""benchmark/levers.py: a lever it measures is put into step 4's real training, and prefetching
changes when weights are gathered, not the maths (the same per-step losses as step 4 as it is)."""
from conftest import EQUIVALENCE, REPO, demo_args, read_metrics, run_step


def test_prefetch_runs_step_4_and_keeps_its_losses(demo, tmp_path):
    common = ["--total_batch_size", 8, "--batch_size_per_device", 2]  # 2 ranks x 2 rows x 2 micro-batches
    plain = tmp_path / "plain"
    run_step("fsdp", demo_args(demo, plain) + EQUIVALENCE + common, nproc=2)
    prefetched = tmp_path / "prefetch"
    lever = ["--lever", "prefetch"]  # levers.py under torchrun: step 4 with the lever
    run_step(REPO / "benchmark/levers.py", demo_args(demo, prefetched) + EQUIVALENCE + common + lever, nproc=2)
    assert [r["loss"] for r in read_metrics(prefetched)] == [r["loss"] for r in read_metrics(plain)]
