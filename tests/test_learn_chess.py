"""benchmark/learn_chess.py --quick: the learning run's whole path (the built-in model and data built
from the shipped games, the real DDP step script on 2 ranks, the plot and the table) in a few steps.
Nothing is asserted about how much it learns: a few steps learn nothing; the full run's figures are
in the README."""
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from conftest import REPO

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("learn_chess")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "benchmark/learn_chess.py"), "--quick", "--out", str(out)],
                            capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout


def test_quick_mode_writes_the_plot_the_table_and_a_rate(quick_run):
    out, stdout = quick_run
    assert (out / "legal_moves.png").read_bytes().startswith(PNG_SIGNATURE)
    results = json.loads((out / "legal_moves.json").read_text())
    assert 0 <= results["legal_move_rate"] <= 1 and 0 <= results["legal_move_rate_untrained"] <= 1
    assert results["wall_s"] > 0
    points = results["points"]
    assert [p["step"] for p in points] == [0, 3, 6]  # untrained, then every --eval_every steps
    assert points[0]["tokens"] == 0 and points[1]["tokens"] < points[2]["tokens"]
    table = (out / "legal_moves.md").read_text()
    # the curve: a header and one row per point; the final model: a header and a row per phase and overall
    # (the separators start "|-")
    assert table.count("\n| ") == 1 + len(points) + 1 + 4
    assert f"{100 * results['legal_move_rate']:.1f}%" in table
    assert "legal moves on 24 held-out positions: " in stdout and "wall time:" in stdout


def test_no_evaluated_game_opens_like_a_trained_one(quick_run):
    """The held-out games share no 10-ply opening with any training game: the evaluation's positions
    are not ones the model was shown. The quick run's 24 held-out openings are the shipped games' last."""
    out, _ = quick_run
    train = [json.loads(line)["text"] for line in (out / "data/train.jsonl").read_text().splitlines()]
    validation = [json.loads(line)["text"] for line in (out / "data/validation.jsonl").read_text().splitlines()]
    openings = {tuple(game.split()[:10]) for game in validation}
    assert len(openings) == 24 and not any(tuple(game.split()[:10]) in openings for game in train)
    learn = [" ".join(m) for m in pq.read_table(REPO / "01_download/chess_learn.parquet").column("Moves").to_pylist()]
    assert validation[-1] == learn[-1]
    results = json.loads((out / "legal_moves.json").read_text())
    assert sum(row["positions"] for phase, row in results["by_phase"].items() if phase != "all") == len(validation)
    assert results["by_phase"]["all"]["positions"] == len(validation) and 0 <= results["baseline"] <= 1


def test_the_shipped_learning_games_leave_out_the_sample():
    """make_chess_sample.py --exclude: no game of chess_learn.parquet is in chess_sample.parquet, none repeats."""
    learn = [tuple(m) for m in pq.read_table(REPO / "01_download/chess_learn.parquet").column("Moves").to_pylist()]
    sample = {tuple(m) for m in pq.read_table(REPO / "01_download/chess_sample.parquet").column("Moves").to_pylist()}
    assert len(set(learn)) == len(learn) and not sample & set(learn)


def test_it_trains_the_built_in_model(quick_run, demo):
    """The same tokenizer, shape and initial weights as `download.py --demo`: what the demo trains."""
    out, _ = quick_run
    assert (out / "model/config.json").read_text() == (demo / "model/config.json").read_text()
    assert (out / "model/model.safetensors").read_bytes() == (demo / "model/model.safetensors").read_bytes()
    assert (out / "model/tokenizer.json").read_text() == (demo / "model/tokenizer.json").read_text()


@pytest.mark.quick
def test_the_generator_leaves_out_the_games_of_another_file(tmp_path):
    """Game i of a seed is the same game in every run, so a longer run that excludes a shorter
    one's file keeps exactly the games after it (the heuristic player: no Stockfish needed)."""
    def generate(games, out, *extra):
        subprocess.run([sys.executable, str(REPO / "01_download/make_chess_sample.py"), "--engine", "none",
                        "--games", str(games), "--workers", "1", "--out", str(out), *extra],
                       check=True, capture_output=True, text=True, timeout=120)
        return [tuple(m) for m in pq.read_table(out).column("Moves").to_pylist()]

    first = generate(12, tmp_path / "first.parquet")
    rest = generate(20, tmp_path / "rest.parquet", "--unique", "--exclude", str(tmp_path / "first.parquet"))
    everything = generate(20, tmp_path / "all.parquet")
    assert everything[:12] == first and rest == everything[12:]


@pytest.mark.quick
@pytest.mark.parametrize("option, value, least", [
    ("--max_steps", -1, 1), ("--held_out", -5, 1), ("--train_games", -3, 0), ("--eval_every", -200, 0),
    ("--eval_games", 0, 1), ("--seed", -1, 0), ("--layers", 0, 1), ("--hidden", 4, 8), ("--total_batch_size", -16, 1),
    ("--batch_size_per_device", 0, 1), ("--max_seq_length", -1024, 16),
])
def test_counts_out_of_range_are_one_error_line(tmp_path, option, value, least):
    """Issue 23: a negative count (or a zero where none can work) is refused as it is read: one
    line, before anything is built; no model or data folder appears."""
    result = subprocess.run([sys.executable, str(REPO / "benchmark/learn_chess.py"), "--out", str(tmp_path / "out"),
                             option, str(value)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"error: {option} must be at least {least} (got {value}) (see --help)\n", result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.quick
def test_step_picks_the_training_script():
    """--step 4 trains with 04_fsdp/train.py on 2 ranks (the learning run on FSDP's shards, Muon
    orthogonalising each matrix on its owner); step 2 is one process; the two options must agree."""
    from benchmark import learn_chess
    from common.errors import UserError

    def script(*argv):
        args = learn_chess.parse_arguments(["--learn_games", "", *argv])
        return args.step, learn_chess.train_command(args, "m", "d", "r")
    assert script()[0] == 3 and "03_ddp/train.py" in " ".join(script()[1])
    step, command = script("--step", "4")
    assert step == 4 and str(REPO / "04_fsdp/train.py") in command and "--nproc-per-node=2" in command
    step, command = script("--nproc", "1")
    assert step == 2 and command[1] == str(REPO / "02_singlegpu/train.py")
    for mismatch in (["--step", "2"], ["--step", "4", "--nproc", "1"]):
        with pytest.raises(UserError, match="^--step"):
            learn_chess.parse_arguments(["--learn_games", "", *mismatch])
