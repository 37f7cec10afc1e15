"""workshop/check.py, the exercises' checker, on real small runs of every step: it says `right:` (exit 0)
for the result each step's lesson predicts, `wrong:` (exit 1) with the reason for a run that departs from
it, and one `error:` line (exit 2) for folders it cannot compare."""

import pytest

from conftest import REPO, demo_args, run_python, run_step


def check(*args):
    result = run_python([REPO / "workshop/check.py", *args], timeout=60)
    return result.returncode, result.stdout + result.stderr


# Two optimiser steps of 8 rows: step 2's loss is the first to show a different update. Each run takes
# as few micro-batches as it can (the global batch is the same however it is split: the first check).
STEPS = ["--max_steps", 2, "--total_batch_size", 8]


@pytest.fixture(scope="module")
def runs(demo, tmp_path_factory):
    """The exercises' runs, small: step 2 at 4 micro-batches per step and at 1, steps 3, 4 (also NO_SHARD),
    5 and 6 (tp 2) on 2 ranks."""
    folder = tmp_path_factory.mktemp("workshop")
    made = {}
    for name, step, ranks, rows in (("single", "single", 1, ["--batch_size_per_device", 2]),
                                    ("acc1", "single", 1, ["--batch_size_per_device", 8]),
                                    ("ddp", "ddp", 2, ["--batch_size_per_device", 4]),
                                    ("fsdp", "fsdp", 2, ["--batch_size_per_device", 4]),
                                    ("no_shard", "fsdp", 2, ["--batch_size_per_device", 4,
                                                             "--sharding_strategy", "NO_SHARD"]),
                                    ("lora", "lora", 2, ["--batch_size_per_device", 4]),
                                    ("tp", "tp", 2, ["--batch_size_per_device", 8, "--tp_size", 2])):
        made[name] = folder / name
        run_step(step, demo_args(demo, made[name]) + STEPS + rows, nproc=ranks)
    return made


def test_right_results_are_right(runs):
    for args, says in ((("accumulation", runs["acc1"], runs["single"]), "the same steps"),
                       (("same-loss", runs["single"], runs["ddp"]), "03_ddp on 2 ranks"),
                       (("same-loss", runs["single"], runs["fsdp"]), "04_fsdp on 2 ranks"),
                       (("same-loss", runs["single"], runs["tp"]), "06_tp on 2 ranks"),
                       (("fsdp-shards", runs["ddp"], runs["fsdp"]), "per-rank state is 1/2 of DDP's"),
                       (("lora-adapters", runs["fsdp"], runs["lora"]), "LoRA trains and saves a small part")):
        status, output = check(*args)
        assert status == 0 and output.startswith("right: ") and says in output, (args, output)
    status, output = check("accumulation", runs["acc1"], runs["single"])
    assert "1 micro-batch per step" in output and "4 micro-batches per step" in output, output


def test_wrong_results_are_wrong_and_say_why(runs):
    status, output = check("fsdp-shards", runs["ddp"], runs["no_shard"])
    assert status == 1 and output.startswith("wrong: ") and "not 1/2 of DDP's" in output, output
    assert "NO_SHARD" in output, output
    status, output = check("same-loss", runs["single"], runs["lora"])  # LoRA's steps are not a full fine-tune's
    assert status == 1 and output.startswith("wrong: ") and "the losses part" in output, output
    assert "at step 2" in output, output  # step 1's loss is the untrained model's in both


@pytest.mark.quick
def test_folders_it_cannot_compare_get_one_error_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for args, says in ((("same-loss", tmp_path / "absent", tmp_path / "empty"), "no such folder"),
                       (("same-loss", tmp_path / "empty", tmp_path / "empty"), "not a finished run")):
        status, output = check(*args)
        assert status == 2 and output.startswith("error: ") and says in output and output.count("\n") == 1, output


def test_runs_of_the_wrong_kind_are_refused(runs):
    for args, says in ((("fsdp-shards", runs["ddp"], runs["ddp"]), "give an FSDP run"),
                       (("lora-adapters", runs["fsdp"], runs["fsdp"]), "give a LoRA run"),
                       (("accumulation", runs["single"], runs["single"]), "both runs accumulate 4"),
                       (("accumulation", runs["single"], runs["ddp"]), "one process each")):
        status, output = check(*args)
        assert status == 2 and output.startswith("error: ") and says in output, (args, output)


STEP_READMES = ["02_singlegpu", "03_ddp", "04_fsdp", "05_lora", "06_tp"]


@pytest.mark.quick
@pytest.mark.parametrize("step", STEP_READMES)
def test_each_steps_questions_are_exercises_with_the_answers_folded(step):
    """The reader predicts before reading the answer: every measured answer of a step's Questions sits in a
    collapsed <details> block, and at least one exercise is checked by workshop/check.py on the reader's runs."""
    questions = (REPO / step / "README.md").read_text().split("\n## Questions\n", 1)[1]
    folded = False
    for line in questions.splitlines():
        folded = True if line.startswith("<details>") else False if line.startswith("</details>") else folded
        if line.startswith(("*Measured*", "*Estimated*")):
            assert folded, f"{step}/README.md: a measured answer in the reading path: {line[:80]}"
    assert "\npython workshop/check.py " in questions, f"{step}/README.md: no exercise checked by workshop/check.py"


@pytest.mark.quick
def test_the_front_page_reaches_the_workshop_in_one_link_each():
    front_page = (REPO / "README.md").read_text()
    for target in ("workshop/README.md", "workshop/README.md#exercises", "workshop/DRILLS.md", "workshop/slides.md"):
        assert f"]({target})" in front_page, target
    assert "\n## Exercises\n" in (REPO / "workshop/README.md").read_text()
