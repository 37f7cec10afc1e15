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
    assert table.count("\n| ") == 1 + len(points)  # header and one row per point (the separator starts "|-")
    assert f"{100 * results['legal_move_rate']:.1f}%" in table
    assert "legal moves:" in stdout and "wall time:" in stdout


def test_no_evaluation_game_is_trained_on(quick_run):
    out, _ = quick_run
    train = {json.loads(line)["text"] for line in (out / "data/train.jsonl").read_text().splitlines()}
    validation = [json.loads(line)["text"] for line in (out / "data/validation.jsonl").read_text().splitlines()]
    assert validation and not train & set(validation)
    sample = [" ".join(m) for m in pq.read_table(REPO / "01_download/chess_sample.parquet").column("Moves").to_pylist()]
    assert validation == sample[-len(validation):]  # the demo's own held-out games


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
