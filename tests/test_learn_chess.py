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

from conftest import REPO, run_python

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
    result = run_python([REPO / "benchmark/learn_chess.py", "--out", tmp_path / "out", option, value], timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"error: {option} must be at least {least} (got {value}) (see --help)\n", result.stderr
    assert not (tmp_path / "out").exists()


# ---- issue 36: nothing a user wrote is lost; options as given ---------------------------------------------

def learn_chess(*args):
    return run_python([REPO / "benchmark/learn_chess.py", *args], timeout=120)


def snapshot(folder):
    return {path.relative_to(folder): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_a_second_run_into_the_same_out_is_refused(quick_run):
    """Case 1: the same command again (any options) replaced the first run: a new run id, final/
    rewritten, a user's file in run/final/ deleted, legal_moves.json replaced. Now one line, and
    nothing changes."""
    out, _ = quick_run
    (out / "run/final/my_notes.txt").write_text("kept")
    before = snapshot(out)
    result = learn_chess("--quick", "--nproc", 1, "--out", out)
    assert result.returncode == 2 and result.stdout == "", result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr == (f"error: --out {out} holds a learning run already: pass --overwrite to replace it (its "
                             "model, data, run and results), or choose another --out\n")
    assert snapshot(out) == before


@pytest.mark.quick
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_an_out_folder_that_is_not_a_learning_run_is_never_written(demo, tmp_path, overwrite):
    """Case 2: --out a copy of demo/: its data/train.jsonl was cut from 2,777 to 300 games, exit 0."""
    import shutil
    out = tmp_path / "copy"
    shutil.copytree(demo, out)
    before = snapshot(out)
    result = learn_chess("--quick", "--out", out, *overwrite)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith(f"error: --out {out} is not empty and holds no learning run (data, model)")
    assert result.stderr.count("\n") == 1 and snapshot(out) == before


@pytest.mark.quick
def test_overwrite_deletes_the_learning_run_s_own_files_only(tmp_path, monkeypatch):
    """--overwrite: the earlier run's model, data, run and results go; a user's file beside them and
    the prepared games (a cache by content) stay; the new run is recorded before anything is built."""
    from benchmark import learn_chess
    out = tmp_path / "out"
    for name in ("model/config.json", "data/train.jsonl", "run/final/model.safetensors", "prepared/x/rows.arrow"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("old")
    for name in ("train.log", "legal_moves.json", "legal_moves.md", "legal_moves.png", "notes.txt"):
        (out / name).write_text("old")
    with pytest.raises(learn_chess.UserError, match="holds a learning run already"):
        learn_chess.take_out_folder(learn_chess.parse_arguments(["--out", str(out)]))
    monkeypatch.setattr(sys, "argv", ["benchmark/learn_chess.py", "--out", str(out), "--overwrite"])
    learn_chess.take_out_folder(learn_chess.parse_arguments(sys.argv[1:]))
    assert sorted(path.name for path in out.iterdir()) == ["learn_chess.json", "notes.txt", "prepared"]
    assert (out / "prepared/x/rows.arrow").read_text() == "old"
    assert "--overwrite" in json.loads((out / "learn_chess.json").read_text())["command"]


@pytest.mark.quick
def test_quick_gives_way_to_the_options_given_with_it():
    """Case 14: --quick silently replaced an explicit --max_steps, --held_out and --eval_games (and
    the report named the command as if they had been used); it has its own default --out."""
    from benchmark import learn_chess
    args = learn_chess.parse_arguments(["--quick", "--max_steps", "9", "--held_out", "30", "--eval_games", "5"])
    assert (args.max_steps, args.held_out, args.eval_games) == (9, 30, 5)
    assert (args.train_games, args.eval_every, args.total_batch_size) == (300, 3, 4)  # the rest: --quick's
    assert args.out == str(REPO / "runs/learn_chess_quick")
    assert learn_chess.parse_arguments([]).out == str(REPO / "runs/learn_chess")


@pytest.mark.quick
@pytest.mark.parametrize("options, says", [
    (["--hidden", "10"], "--hidden 10: the model's 4 heads need a hidden size that is a multiple of 8"),
    (["--hidden", "12"], "--hidden 12: the model's 4 heads need a hidden size that is a multiple of 8"),
    (["--learn_games", "01_download"], "--learn_games 01_download is a folder: it takes a Parquet file of games"),
    (["--out", "README.md"], "--out README.md is a file"),
])
def test_bad_options_are_one_line_before_any_work(tmp_path, options, says):
    result = learn_chess(*([] if "--out" in options else ["--out", tmp_path / "out"]), *options)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith(f"error: {says}") and result.stderr.count("\n") == 1, result.stderr
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
