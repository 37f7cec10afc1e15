"""Step 1, 01_download/download.py, run for real against a local stand-in for the Hugging Face Hub.

The hub cannot be reached from here, so tests/fake_hub.py serves a model repo and a dataset repo
from folders these tests make: a tiny LlamaForCausalLM saved like the real one (sharded safetensors,
tokenizer, plus files the script must not fetch) and laion/strategic_game_chess look-alike parquet
files of legal games. Everything else is real: the script runs as a subprocess with HF_ENDPOINT
pointing at the stand-in, huggingface_hub downloads over HTTP into HF_HOME, and transformers loads
the result offline.
"""
import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import chess
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.notation import game_text
from fake_hub import FakeHub

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "01_download/download.py"
MODEL_ID = "tiny-org/tiny-llama"
DATASET_ID = "chess-org/strategic_game_chess"
NOT_CHESS_ID = "chess-org/not_chess"           # parquet without a Moves column
GAMES_PER_FILE, PARQUET_FILES = 12, 3
DECOYS = {"pytorch_model.bin", "README.md", ".gitattributes"}  # in the model repo, never to be fetched
UCI = re.compile(r"^[a-h][1-8][a-h][1-8][qrbn]?$")


# ---- the repos on the stand-in hub --------------------------------------------------------------

def legal_games(count, seed):
    """Short random games of legal moves, as laion/strategic_game_chess rows."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        board = chess.Board()
        for _ in range(rng.randint(4, 30)):
            moves = list(board.legal_moves)
            if not moves:
                break
            board.push(rng.choice(moves))
        outcome = board.outcome()
        rows.append({"Moves": [move.uci() for move in board.move_stack],
                     "Termination": outcome.termination.name if outcome else "MAX_MOVES",
                     "Result": outcome.result() if outcome else "1/2-1/2"})
    return rows


def make_model_repo(folder):
    """A tiny Llama saved the way the hub holds CodeLlama: sharded safetensors + index, tokenizer,
    and files the download must skip (pickled weights, README, .gitattributes)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "<s>", "</s>", "e2e4", "e7e5", "g1f3"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=64))
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="20KB")
    tokenizer.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    (folder / "README.md").write_text("# tiny-llama\n")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    return sum(p.numel() for p in model.parameters())


def write_parquet(rows, path):
    schema = pa.schema([("Moves", pa.list_(pa.string())), ("Termination", pa.string()), ("Result", pa.string())])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The stand-in hub with three repos; `hub.games` are the dataset's games in file-name order."""
    root = tmp_path_factory.mktemp("repos")
    model_parameters = make_model_repo(root / "model")
    rows = legal_games(GAMES_PER_FILE * PARQUET_FILES, seed=1)
    for i in range(PARQUET_FILES):
        write_parquet(rows[i * GAMES_PER_FILE:(i + 1) * GAMES_PER_FILE], root / f"dataset/data/train-{i:05d}.parquet")
    (root / "dataset/README.md").write_text("# chess games\n")
    (root / "not_chess").mkdir()
    pq.write_table(pa.table({"moves": ["e2e4 e7e5"], "Result": ["*"]}), root / "not_chess/games.parquet")
    with FakeHub() as hub:
        hub.model_sha = hub.add_repo(MODEL_ID, root / "model")
        hub.dataset_sha = hub.add_repo(DATASET_ID, root / "dataset", repo_type="dataset")
        hub.add_repo(NOT_CHESS_ID, root / "not_chess", repo_type="dataset")
        hub.model_source, hub.model_parameters = root / "model", model_parameters
        hub.games = [" ".join(row["Moves"]) for row in rows]
        yield hub


def clean_env(**extra):
    """This process's environment without any Hugging Face or proxy settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_")) and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    return {**env, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def run_download(hub, home, out, *args):
    """The script as a user runs it, with the hub at the stand-in's address and the cache in `home`."""
    hub.clear()
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--model", MODEL_ID, "--dataset", DATASET_ID,
               *[str(a) for a in args]]
    return subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env=clean_env(HF_HOME=str(home), HF_ENDPOINT=hub.endpoint))


def succeeded(result):
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def read_games(path):
    """The games of a jsonl file, or of a folder of parquet files (in name order), as move strings."""
    path = Path(path)
    if path.is_dir():
        return [" ".join(moves) for file in sorted(path.glob("*.parquet"))
                for moves in pq.read_table(file, columns=["Moves"]).column("Moves").to_pylist()]
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def printed_exports(stdout):
    """The `export A=B C=D` lines of the end message, as an environment."""
    env = {}
    for line in stdout.splitlines():
        if line.strip().startswith("export "):
            words = shlex.split(line.split("#")[0])[1:]
            env.update(word.split("=", 1) for word in words)
    return {k: os.path.expanduser(v) for k, v in env.items()}


# ---- the real path -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def first_run(hub, tmp_path_factory):
    """20 games, 5 held out: needs the first two parquet files (12 games each), not the third."""
    home, out = tmp_path_factory.mktemp("hf_home"), tmp_path_factory.mktemp("out")
    result = succeeded(run_download(hub, home, out, "--games", 20, "--validation_games", 5))
    return {"home": home, "out": out, "result": result, "requests": list(hub.requests),
            "downloads": hub.downloads()}


def test_model_lands_in_the_hf_cache_without_the_files_it_does_not_need(hub, first_run):
    storage = first_run["home"] / "hub" / "models--tiny-org--tiny-llama"
    snapshot = storage / "snapshots" / hub.model_sha
    assert (storage / "refs/main").read_text() == hub.model_sha
    wanted = {p.name for p in hub.model_source.iterdir()} - DECOYS
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= wanted
    assert len([name for name in wanted if name.endswith(".safetensors")]) >= 2  # sharded, like CodeLlama
    assert {p.name for p in snapshot.iterdir()} == wanted
    for name in wanted:
        assert (snapshot / name).read_bytes() == (hub.model_source / name).read_bytes(), name
    model_downloads = sorted(name for repo, name in first_run["downloads"] if repo == MODEL_ID)
    assert model_downloads == sorted(wanted)  # each file once
    assert not [r for r in first_run["requests"] if any(decoy in r.path for decoy in DECOYS)]


def test_games_are_used_from_the_cache_in_order_with_the_last_ones_held_out(hub, first_run):
    """The training games are the cached parquet files themselves (linked, not rewritten); only the
    last file, cut to the number of games asked for, is written anew."""
    data = first_run["out"] / "data"
    assert read_games(data / "train") == hub.games[:15]
    assert read_games(data / "validation.jsonl") == hub.games[15:20]
    linked = sorted(p for p in (data / "train").iterdir() if p.is_symlink())
    assert [p.name for p in linked] == ["train-00000.parquet"] and str(first_run["home"]) in str(linked[0].resolve())
    assert sorted(p.name for p in (data / "train").iterdir()) == ["train-00000.parquet",
                                                                  "train-00001.first-3.parquet"]
    assert all(UCI.match(move) for game in hub.games[:20] for move in game.split())
    manifest = json.loads((data / "download.json").read_text())
    assert manifest["train_games"] == 15 and manifest["validation_games"] == 5
    # Two parquet files hold 24 >= 20 games: the third is never even asked about, nor the README.
    dataset_downloads = [name for repo, name in first_run["downloads"] if repo == DATASET_ID]
    assert dataset_downloads == ["data/train-00000.parquet", "data/train-00001.parquet"]
    assert not [r for r in first_run["requests"] if "train-00002" in r.path or r.path.endswith("README.md")]
    snapshot = first_run["home"] / "hub" / "datasets--chess-org--strategic_game_chess" / "snapshots" / hub.dataset_sha
    assert sorted(p.name for p in (snapshot / "data").iterdir()) == ["train-00000.parquet", "train-00001.parquet"]


def test_end_message_names_the_paths_and_offline_mode(hub, first_run):
    stdout = first_run["result"].stdout
    snapshot = first_run["home"] / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / hub.model_sha
    assert str(snapshot) in stdout and str(first_run["out"] / "data") in stdout
    assert "HF_HUB_OFFLINE=1" in stdout and f"--model {MODEL_ID}" in stdout
    assert printed_exports(stdout)["HF_HOME"] == str(first_run["home"])


def test_second_run_downloads_nothing(hub, first_run):
    data = first_run["out"] / "data"
    before = {p.name: p.stat().st_mtime_ns for p in data.iterdir()}
    result = succeeded(run_download(hub, first_run["home"], first_run["out"], "--games", 20, "--validation_games", 5))
    assert hub.requests == []  # not a download, not a HEAD, not an API call
    assert "games already in" in result.stdout
    assert {p.name: p.stat().st_mtime_ns for p in data.iterdir()} == before


def test_model_loads_offline_following_the_end_message(hub, first_run):
    """What a compute node does: the printed exports, no network, the model by its hub id."""
    env = clean_env(HF_ENDPOINT=hub.endpoint, **printed_exports(first_run["result"].stdout))
    assert env["HF_HUB_OFFLINE"] == "1"
    code = ("import json, sys\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "print(json.dumps({'class': type(model).__name__, 'parameters': model.num_parameters(),\n"
            "                  'ids': tokenizer('e2e4 e7e5 g1f3')['input_ids']}))\n")
    hub.clear()
    result = succeeded(subprocess.run([sys.executable, "-c", code, MODEL_ID], capture_output=True, text=True,
                                      timeout=300, env=env))
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["class"] == "LlamaForCausalLM" and loaded["parameters"] == hub.model_parameters
    assert loaded["ids"][-3:] == [4, 5, 6]
    assert hub.requests == []


def test_cache_dir_option_and_its_end_message(hub, tmp_path):
    """--cache_dir is a hub cache (models--*/ directly inside), so the message must say HF_HUB_CACHE."""
    cache = tmp_path / "my cache"
    result = succeeded(run_download(hub, tmp_path / "home", tmp_path / "out", "--games", 12, "--validation_games", 2,
                                    "--cache_dir", cache))
    assert (cache / "models--tiny-org--tiny-llama" / "snapshots" / hub.model_sha / "config.json").is_file()
    assert not (tmp_path / "home" / "hub").exists()
    env = clean_env(HF_ENDPOINT=hub.endpoint, **printed_exports(result.stdout))
    # How transformers finds each file of a model by id (without importing it: that takes long).
    code = "import sys; from huggingface_hub import hf_hub_download; print(hf_hub_download(sys.argv[1], 'config.json'))"
    hub.clear()
    found = succeeded(subprocess.run([sys.executable, "-c", code, MODEL_ID], capture_output=True, text=True,
                                     timeout=60, env=env))
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / hub.model_sha
    assert found.stdout.strip() == str(snapshot / "config.json")
    assert hub.requests == []


# ---- bad input: one error line, exit status 2, earlier results kept ----------------------------

def one_error_line(result):
    assert result.returncode == 2, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def earlier_results(hub, home, out):
    """An earlier, complete download in `out`: every file and link of its data folder."""
    succeeded(run_download(hub, home, out, "--games", 12, "--validation_games", 2))
    return data_files(out)


def data_files(out):
    return {p: (os.readlink(p) if p.is_symlink() else p.read_bytes()) for p in sorted((out / "data").rglob("*"))
            if p.is_file() or p.is_symlink()}


@pytest.mark.parametrize("args, words", [
    (["--dataset", NOT_CHESS_ID], "Moves"),
    (["--games", 100, "--validation_games", 40], f"only {GAMES_PER_FILE * PARQUET_FILES} games"),
], ids=["no-moves-column", "fewer-games-than-held-out"])
def test_bad_dataset_gives_one_error_line_and_keeps_earlier_data(hub, tmp_path, args, words):
    out = tmp_path / "out"
    before = earlier_results(hub, tmp_path / "home", out)
    line = one_error_line(run_download(hub, tmp_path / "home", out, *args))
    assert words in line
    assert data_files(out) == before


def test_games_this_step_did_not_download_are_never_replaced(hub, tmp_path):
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "data/train.jsonl").write_text(json.dumps({"text": "e2e4 e7e5"}) + "\n")
    line = one_error_line(run_download(hub, tmp_path / "home", out, "--games", 12, "--validation_games", 2))
    assert "holds games this step did not download" in line
    assert read_games(out / "data/train.jsonl") == ["e2e4 e7e5"] and hub.requests == []


def test_the_demo_never_replaces_a_real_download(hub, tmp_path):
    """Written over a real download, the demo would replace its games and leave its download.json
    vouching for them: refused, before anything is built."""
    out = tmp_path / "out"
    before = earlier_results(hub, tmp_path / "home", out)
    result = subprocess.run([sys.executable, str(SCRIPT), "--demo", "--out", str(out)], capture_output=True,
                            text=True, timeout=300)
    assert "holds a real download" in one_error_line(result)
    assert data_files(out) == before and not (out / "model").exists()


def test_the_base_install_is_enough_for_the_real_download(hub, tmp_path):
    """requirements.txt alone, without the trackers' extras (which bring httpx, among others)."""
    extras = ["httpx", "tensorboard", "mlflow", "wandb", "sqlalchemy", "alembic"]
    code = (f"import runpy, sys\nfor name in {extras!r}:\n    sys.modules[name] = None  # import fails\n"
            f"sys.argv = [{str(SCRIPT)!r}] + sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    hub.clear()
    result = subprocess.run([sys.executable, "-c", code, "--out", str(tmp_path / "out"), "--model", MODEL_ID,
                             "--dataset", DATASET_ID, "--games", "12", "--validation_games", "2"],
                            capture_output=True, text=True, timeout=120,
                            env=clean_env(HF_HOME=str(tmp_path / "home"), HF_ENDPOINT=hub.endpoint))
    succeeded(result)
    assert read_games(tmp_path / "out/data/train") == hub.games[:10]


def test_counts_that_leave_no_training_games_are_refused_before_downloading(hub, tmp_path):
    line = one_error_line(run_download(hub, tmp_path / "home", tmp_path / "out", "--games", 10,
                                       "--validation_games", 10))
    assert "--validation_games" in line and "--games" in line
    assert hub.requests == [] and not (tmp_path / "home" / "hub").exists()


@pytest.mark.parametrize("args, words", [
    (["--model", "tiny-org/tiny-lama"], "no model tiny-org/tiny-lama on http"),
    (["--dataset", "chess-org/strategic_game_chez"], "no dataset chess-org/strategic_game_chez on http"),
], ids=["model", "dataset"])
def test_mistyped_hub_id_gives_one_error_line(hub, tmp_path, args, words):
    line = one_error_line(run_download(hub, tmp_path / "home", tmp_path / "out", "--games", 12,
                                       "--validation_games", 2, *args))
    assert words in line and "check the spelling" in line
    assert not (tmp_path / "out" / "data").exists()


def test_unreachable_hub_gives_one_error_line(tmp_path):
    """No hub at the address (a compute node without internet): one line, not a traceback."""
    import socket
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), "--model", MODEL_ID],
                            capture_output=True, text=True, timeout=120,
                            env=clean_env(HF_HOME=str(tmp_path / "home"), HF_ENDPOINT=f"http://127.0.0.1:{port}"))
    line = one_error_line(result)
    assert f"cannot download the model {MODEL_ID}" in line and "login node" in line


def test_interrupted_rewrite_never_leaves_a_manifest_that_vouches_for_other_data(hub, tmp_path):
    """download.json says which request the games in data/ answer. A run for another request that
    fails while rewriting them (here: validation.jsonl cannot be written) must not leave the old
    manifest behind, or the next run of the old request could take other games as its own."""
    home, out = tmp_path / "home", tmp_path / "out"
    succeeded(run_download(hub, home, out, "--games", 20, "--validation_games", 5))
    blocker = out / "data" / "validation.partial"  # where validation.jsonl is written first
    blocker.mkdir()
    line = one_error_line(run_download(hub, home, out, "--games", 12, "--validation_games", 2))
    assert "cannot write" in line and "validation.jsonl" in line
    assert json.loads((out / "data/download.json").read_text())["request"] is None  # vouches for nothing
    assert not list((out / "data").glob("train.partial-*"))  # nothing half-built left behind
    blocker.rmdir()
    again = succeeded(run_download(hub, home, out, "--games", 20, "--validation_games", 5))
    assert "games already in" not in again.stdout
    assert read_games(out / "data/train") == hub.games[:15]
    assert read_games(out / "data/validation.jsonl") == hub.games[15:20]
    assert "games already in" in succeeded(run_download(hub, home, out, "--games", 20, "--validation_games", 5)).stdout


def test_deleted_data_file_is_downloaded_again(hub, tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    succeeded(run_download(hub, home, out, "--games", 12, "--validation_games", 2))
    (out / "data/validation.jsonl").unlink()
    again = succeeded(run_download(hub, home, out, "--games", 12, "--validation_games", 2))
    assert "games already in" not in again.stdout
    assert read_games(out / "data/validation.jsonl") == hub.games[10:12]


# ---- the built-in tiny default -----------------------------------------------------------------

def test_demo_builds_a_tiny_model_and_data_without_network(hub, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "demo"
    hub.clear()
    succeeded(subprocess.run([sys.executable, str(SCRIPT), "--demo", "--out", str(out)], capture_output=True,
                             text=True, timeout=300,
                             env=clean_env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "home"),
                                           HF_ENDPOINT=hub.endpoint)))
    assert hub.requests == []
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 1e6 < model.num_parameters() < 20e6
    assert (out / "model/model.safetensors").is_file()

    sample = [" ".join(moves) for moves in pq.read_table(REPO / "01_download/chess_sample.parquet")
              .column("Moves").to_pylist()]
    assert model.config.chess_notation == "piece" and model.config.vocab_size % 64 == 0
    for game in sample[:50]:  # the piece notation's words, one known token each
        text = game_text("piece", game.split())
        game_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(game_ids) == len(text.split()) and tokenizer.unk_token_id not in game_ids
        assert tokenizer.decode(game_ids) == text

    train, validation = read_games(out / "data/train.jsonl"), read_games(out / "data/validation.jsonl")
    assert sorted(train + validation) == sorted(sample) and len(validation) >= 200
    assert {tuple(g.split()[:10]) for g in validation}.isdisjoint(tuple(g.split()[:10]) for g in train)
    for path in (out / "data/train.jsonl", out / "data/validation.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert all(list(row) == ["text"] and all(UCI.match(m) for m in row["text"].split()) for row in rows)


# ---- issue 23: the demo writes only over its own files -------------------------------------------

def run_demo(out, *args):
    return subprocess.run([sys.executable, str(SCRIPT), "--demo", "--out", str(out), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=clean_env(HF_HUB_OFFLINE="1"))


def every_file(out):
    """Every file and link under `out`, with its bytes (or where it points)."""
    return {p.relative_to(out).as_posix(): (os.readlink(p) if p.is_symlink() else p.read_bytes())
            for p in sorted(Path(out).rglob("*")) if p.is_file() or p.is_symlink()}


@pytest.fixture(scope="module")
def earlier_demo(tmp_path_factory):
    """A demo made with --seed 1: download.py's own output, with its record (data/demo.json)."""
    out = tmp_path_factory.mktemp("earlier-demo")
    succeeded(run_demo(out, "--seed", 1))
    return every_file(out)


def users_model(out):
    (out / "model").mkdir(parents=True)
    (out / "model/config.json").write_text('{"model_type": "llama", "note": "my own model"}\n')
    (out / "model/model.safetensors").write_bytes(b"my weights")


def users_games(out):
    (out / "data").mkdir(parents=True)
    (out / "data/train.jsonl").write_text(json.dumps({"text": "e2e4 e7e5"}) + "\n")


def users_model_beside_the_demo_data(out, earlier):
    users_model(out)
    (out / "data").mkdir()
    for name in ("data/train.jsonl", "data/validation.jsonl", "data/demo.json"):  # the demo's own, as it wrote them
        (out / name).write_bytes(earlier[name])


def demo_games_edited(out, earlier):
    for name, content in earlier.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(content)
    with (out / "data/train.jsonl").open("a") as games:
        games.write(json.dumps({"text": "d2d4 d7d5"}) + "\n")  # the user's game, added to the demo's


def link_to_a_model(out, target):
    users_model(target)
    out.mkdir()
    (out / "model").symlink_to(target / "model")


@pytest.mark.parametrize("case", ["users-model", "users-games", "users-model-beside-demo-data",
                                  "demo-games-edited", "link-to-a-model", "users-file-named-like-the-record"])
def test_the_demo_never_replaces_files_it_did_not_write(tmp_path, earlier_demo, case):
    """A folder holding the user's own model/ or data/ (or the demo's, changed since) is refused
    in one line, before anything is written; download.py tells its own files by its record."""
    out = tmp_path / "out"
    if case == "users-model":
        users_model(out)
    elif case == "users-games":
        users_games(out)
    elif case == "users-model-beside-demo-data":
        users_model_beside_the_demo_data(out, earlier_demo)
    elif case == "demo-games-edited":
        demo_games_edited(out, earlier_demo)
    elif case == "link-to-a-model":
        link_to_a_model(out, tmp_path / "elsewhere")
    else:
        users_games(out)
        (out / "data/demo.json").write_text('{"my": "notes"}\n')
    before, outside = every_file(out), every_file(tmp_path / "elsewhere") if case == "link-to-a-model" else None
    line = one_error_line(run_demo(out))
    assert line.startswith(f"error: {out} holds files that download.py --demo did not write (") and "--out" in line
    assert every_file(out) == before  # nothing written, nothing replaced
    if outside is not None:
        assert every_file(tmp_path / "elsewhere") == outside


def test_the_demo_replaces_its_own_earlier_output(tmp_path, earlier_demo):
    """Its own files, by its record (another seed here), or a demo made before the record existed
    (the very bytes this run writes): rewritten, and the record then names every file."""
    out = tmp_path / "out"
    for name, content in earlier_demo.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(content)
    succeeded(run_demo(out))  # seed 0 over seed 1
    fresh = every_file(out)
    assert fresh["model/model.safetensors"] != earlier_demo["model/model.safetensors"]
    record = json.loads(fresh["data/demo.json"])
    assert not record["being_written"] and sorted(record["files"]) == sorted(set(fresh) - {"data/demo.json"})
    (out / "data/demo.json").unlink()  # as a demo made before the record existed
    succeeded(run_demo(out))
    assert every_file(out) == fresh


@pytest.mark.parametrize("where", ["under-a-file", "out-is-a-file", "proc", "sys"])
def test_the_demo_where_nothing_can_be_written(tmp_path, where):
    """Root may write almost anywhere, so these are places root cannot write either: a path through
    a regular file, and /proc and /sys."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    out = {"under-a-file": a_file / "demo", "out-is-a-file": a_file, "proc": Path("/proc/kit-test-demo"),
           "sys": Path("/sys/kit-test-demo")}[where]
    if where in ("proc", "sys") and not Path(f"/{where}/self" if where == "proc" else "/sys/kernel").exists():
        pytest.skip(f"no /{where} here")
    line = one_error_line(run_demo(out))
    assert line.startswith("error: cannot create ") and "choose another --out" in line, line
    assert a_file.read_text() == "not a directory\n" and (out == a_file or not out.exists())
