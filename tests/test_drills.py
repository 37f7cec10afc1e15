"""The failure drills (workshop/drills.py, issue 40 point 3): each injects its fault from outside
the training code, and the kit's own output names the right rank, node, phase or step, and cause;
`answer` accepts the right diagnosis and rejects a wrong one with why.

The drills run on 2 CPU ranks here, from fixed seeds (each drawing a rank other than 0, so that a
kit that always blamed rank 0 would fail). The frozen rank's job ends after TIMEOUT_S; the others
are not hangs, and get a watchdog that a busy machine's slow start never trips.
"""
import json
import re

import pytest

from conftest import REPO, run_python

TIMEOUT_S = 20
NO_HANG_S = 300


def drill(name, folder, demo, seed, timeout_s=NO_HANG_S):
    """Start the drill `name` (seeded) in `folder`; its record and its log."""
    run_python(["workshop/drills.py", "start", name, "--folder", folder, "--seed", seed, "--demo", demo, "--ranks",
                "2", "--collective_timeout", timeout_s], check=True, timeout=600)
    return json.loads((folder / "drill.json").read_text()), (folder / "log.txt").read_text()


def answer(name, folder, **given):
    """`drills.py answer` with `given` as its options; (exit status, what it said)."""
    options = [word for question, value in given.items() for word in (f"--{question}", str(value))]
    said = run_python(["workshop/drills.py", "answer", name, "--folder", folder, *options], timeout=60)
    return said.returncode, said.stdout + said.stderr


def assert_graded(name, folder, right, wrong):
    """The right answers are accepted; with one of them wrong, that one is refused, with why."""
    status, said = answer(name, folder, **right)
    assert status == 0 and "all right" in said, said
    question = next(iter(wrong))
    status, said = answer(name, folder, **{**right, **wrong})
    assert status == 1 and re.search(rf"^{question} {re.escape(str(wrong[question]))}: wrong: \S", said, re.M), said
    assert all(f"{other} {value}: right" in said for other, value in right.items() if other != question), said


def errors(log):
    return [line for line in log.splitlines() if line.startswith("error:")]


def seed_drawing(name, rank=1, **fixed):
    """A seed whose draw gives rank `rank` (and the `fixed` draws): the drills draw with random.Random."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("drills", REPO / "workshop/drills.py")
    drills = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drills)
    for seed in range(1000):
        drawn = drills.DRILLS[name](REPO, seed, REPO, TIMEOUT_S, 2).drawn
        if drawn.get("rank", rank) == rank and all(drawn.get(key) == value for key, value in fixed.items()):
            return seed
    raise AssertionError(f"no seed draws rank {rank} and {fixed}")


def test_frozen_rank_is_named_as_the_one_that_did_not_answer(demo, tmp_path):
    seed = seed_drawing("frozen-rank", rank=1, phase="training")
    record, log = drill("frozen-rank", tmp_path, demo, seed, TIMEOUT_S)
    assert record["facts"]["returncode"] == 3, log[-3000:]
    assert len(errors(log)) == 1, log[-3000:]
    assert re.match(rf"error: no progress for {TIMEOUT_S} s in training of step \d+: .*rank 0 (waiting|busy) in ",
                    errors(log)[0]), errors(log)
    assert "rank 1 did not answer (stopped or gone)" in errors(log)[0]
    assert (tmp_path / "run/hang/stacks-rank0.txt").is_file()
    assert_graded("frozen-rank", tmp_path, {"rank": 1, "phase": "training", "cause": "frozen"}, {"rank": 0})
    assert_graded("frozen-rank", tmp_path, {"rank": 1, "phase": "training", "cause": "frozen"}, {"cause": "killed"})


def test_killed_rank_is_named_by_torchrun_with_its_signal(demo, tmp_path):
    seed = seed_drawing("killed-rank", rank=1)
    record, log = drill("killed-rank", tmp_path, demo, seed)
    assert record["facts"]["returncode"] != 0
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: -9 ", log), log[-3000:]
    assert re.search(r"^stopped: rank 0 lost another rank of the job", log, re.M), log[-3000:]
    assert_graded("killed-rank", tmp_path, {"rank": 1, "cause": "killed"}, {"cause": "frozen"})


def test_a_straggler_spends_the_least_of_its_step_waiting_in_communication(demo, tmp_path):
    seed = seed_drawing("straggler", rank=1)
    record, log = drill("straggler", tmp_path, demo, seed)
    assert record["facts"]["returncode"] == 0, log[-3000:]
    shares = {}
    for rank in (0, 1):
        summary = (tmp_path / f"run/profile/summary-rank{rank}.txt").read_text()
        shares[rank] = float(re.search(r"^  communication +([\d.]+)%", summary, re.M).group(1))
    assert shares[1] < shares[0], shares  # rank 0 waits for the straggler in the gradients' all-reduce
    assert_graded("straggler", tmp_path, {"rank": 1, "cause": "straggler"}, {"rank": 0})


def test_a_nonfinite_loss_names_its_step_and_the_last_good_checkpoint(demo, tmp_path):
    record, log = drill("nonfinite-loss", tmp_path, demo, seed=0)
    assert record["facts"]["returncode"] == 2
    [line] = errors(log)
    # the loss of step N, or the weights after its update, whichever the kit sees first
    found = re.match(r"error: (?:loss is (?:nan|inf|-inf) at step|the weights are not finite after the update of step) "
                     r"(\d+): stopped without saving this step \(the last good checkpoint is (\S+)\)", line)
    assert found, line
    step, checkpoint = int(found.group(1)), found.group(2)
    steps = (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    assert step == len(steps) + 1 and json.loads(steps[-1])["step"] == step - 1  # every step before it was logged
    assert checkpoint.endswith(f"step-{step - 1:06d}") and (tmp_path / "run/checkpoints" / checkpoint.split("/")[-1]
                                                             / "COMPLETE").is_file()
    assert_graded("nonfinite-loss", tmp_path, {"step": step, "cause": "learning-rate"}, {"step": step + 1})


def test_a_node_with_its_own_output_folder_is_named_before_any_training(demo, tmp_path):
    seed = seed_drawing("unshared-folder", rank=None, node=2)
    record, log = drill("unshared-folder", tmp_path, demo, seed)
    assert record["facts"]["returncodes"] == [2, 2, 2], log[-3000:]
    [line] = set(errors(log))
    assert re.match(rf"error: --output_dir {tmp_path}/run is not shared by the job's nodes: node 2 \(", line), line
    assert not (tmp_path / "run/metrics.jsonl").exists()
    assert_graded("unshared-folder", tmp_path, {"node": 2, "cause": "unshared-folder"}, {"node": 1})


def test_a_preemption_during_a_save_stops_at_a_complete_checkpoint_that_the_resume_continues(demo, tmp_path):
    seed = seed_drawing("preempted-save", rank=1, signal="SIGUSR2")
    record, log = drill("preempted-save", tmp_path, demo, seed)
    facts = record["facts"]
    assert facts["returncode"] == 0 and facts["resume_returncode"] == 0, log[-3000:]
    [stopped] = re.findall(r"^preempted: saved a checkpoint at step (\d+) .*\(stopped by (.*)\)$", log, re.M)
    step = int(stopped[0])
    assert stopped[1] == "a signal on another rank"  # rank 0 says it; USR2 went to rank 1
    assert step >= facts["signalled_during_save_of_step"] and step == facts["newest_complete"]
    assert re.search(rf"resuming from \S+/step-{step:06d}", log), log[-3000:]
    assert (tmp_path / "run/final/config.json").is_file()
    assert_graded("preempted-save", tmp_path, {"step": step, "cause": "preempted"}, {"cause": "killed"})


@pytest.mark.quick
def test_an_answer_without_a_drill_or_with_a_question_left_out_is_one_error_line(tmp_path):
    status, said = answer("frozen-rank", tmp_path, rank=1, cause="frozen")
    assert status == 2 and said.startswith("error: no drill started in ") and "Traceback" not in said
    (tmp_path / "drill.json").write_text(json.dumps({"drill": "frozen-rank", "seed": 1, "collective_timeout": 10,
                                                     "ranks": 3, "facts": {"returncode": 3}}))
    status, said = answer("frozen-rank", tmp_path, rank=1, cause="frozen")
    assert status == 2 and said == "error: answer every question of the drill frozen-rank: --phase ...\n", said
