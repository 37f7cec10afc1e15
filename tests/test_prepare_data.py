"""The prepared data (common/prepare_data.py) and the file lock it uses (common/lock.py).

Real files, the real `datasets` package and a one-token-per-move tokenizer: rows as the kit has always
made them, jsonl and laion-schema parquet, one preparer while other processes wait (also when
the preparer is killed mid-way), a cache keyed by content, a read-only data directory, the
data errors of tests/test_bad_input.py, and rows that pickle as a file name, not as data.
"""
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from common.errors import UserError
from common.lock import holder, try_lock, wait_for_lock
from common.prepare_data import default_cache_dir, encoder_of, prepared_rows, read_games
from launch.steps import load_step
from conftest import REPO, run_python
from test_bad_input import BAD_DATA, replace_line


@pytest.fixture(scope="module")
def tokenizer():
    """One token per UCI move: rows of the data's own notation, so the expected rows are plain to
    write (the piece notation's rows: tests/test_notation.py)."""
    return load_step("download").build_word_tokenizer("uci")


def texts(path):
    return [json.loads(line)["text"] for line in Path(path).read_text().splitlines() if line.strip()]


def reference_rows(games, tokenizer, row, pack):
    """The kit's rows, written plainly: each game as BOS, moves, EOS. Packed: all games in one
    stream, cut into full rows. Unpacked: each game in pieces of `row`, a last piece of one token dropped."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    tokens = [[bos, *ids, eos] for ids in tokenizer(games, add_special_tokens=False)["input_ids"]]
    if pack:
        stream = [t for game in tokens for t in game]
        return [stream[start: start + row] for start in range(0, len(stream) - row + 1, row)]
    return [game[start: start + row] for game in tokens for start in range(0, len(game), row)
            if len(game) - start > 1]


def as_lists(rows):
    return [rows[i].tolist() for i in range(len(rows))]


def digest(rows):
    return hashlib.sha256(b"".join(rows[i].numpy().tobytes() for i in range(len(rows)))).hexdigest()


def data_copy(demo, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(demo / "data", data)
    return data


def published(cache):
    """The prepared folders a reader would trust, and the temporary ones."""
    if not Path(cache).exists():
        return [], []
    folders = [p for p in Path(cache).iterdir() if p.is_dir() and p.name != "file-hashes"]
    return ([p for p in folders if ".tmp-" not in p.name], [p for p in folders if ".tmp-" in p.name])


# ---- the rows --------------------------------------------------------------------------------------

@pytest.mark.quick
@pytest.mark.parametrize("pack,row,num_proc", [(True, 64, 1), (False, 64, 2), (False, 16, 1)])
def test_rows_are_the_kits_rows(demo, tokenizer, tmp_path, pack, row, num_proc):
    games = texts(demo / "data/train.jsonl")
    lengths = [len(game.split()) + 2 for game in games]
    assert pack or any(n % row == 1 for n in lengths)  # the dropped lone token really happens
    assert max(lengths) > 2 * row  # games longer than a row are split over rows
    rows = prepared_rows(demo / "data", "train", tokenizer, row, pack, cache_dir=tmp_path, num_proc=num_proc)
    assert as_lists(rows) == reference_rows(games, tokenizer, row, pack)
    assert rows[0].dtype == torch.long and rows[-1].tolist() == rows[len(rows) - 1].tolist()
    assert [r.tolist() for r in rows[2:5]] == [rows[i].tolist() for i in (2, 3, 4)]
    with pytest.raises(IndexError):
        rows[len(rows)]


def square_tokenizer(normalizer):
    """A sub-word tokenizer: a move is two or three tokens (e2 ##e4, e7 ##e8 ##q). With a normalizer
    (one that changes nothing in UCI text) it may not tokenize move by move: the general path."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    squares = [f + r for f in "abcdefgh" for r in "12345678"]
    words = ["<pad>", "<unk>", "<s>", "</s>", *squares, *("##" + s for s in squares), *("##" + p for p in "qrbn")]
    core = Tokenizer(models.WordPiece({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if normalizer:
        core.normalizer = normalizers.Lowercase()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.mark.quick
@pytest.mark.parametrize("normalizer", [False, True], ids=["move-by-move", "whole-games"])
def test_sub_word_tokenizers_make_the_same_rows(demo, tmp_path, normalizer):
    tokenizer = square_tokenizer(normalizer)
    assert encoder_of(tokenizer)[1]["by_move"] is not normalizer
    assert len(tokenizer("e2e4 e7e8q", add_special_tokens=False)["input_ids"]) == 5  # really sub-word
    games = texts(demo / "data/validation.jsonl")
    for row, pack in [(64, True), (16, False)]:
        rows = prepared_rows(demo / "data", "validation", tokenizer, row, pack, cache_dir=tmp_path, num_proc=1)
        assert as_lists(rows) == reference_rows(games, tokenizer, row, pack)


def write_laion(path, games):
    """A parquet file with the columns of laion/strategic_game_chess."""
    pq.write_table(pa.table({"Moves": pa.array(games, pa.list_(pa.string())),
                             "Termination": ["CHECKMATE"] * len(games), "Result": ["1-0"] * len(games)}), path)


def laion_copy(demo, tmp_path):
    """The demo games as laion parquet files in a Hugging Face-like cache (blobs), linked from
    DATA_DIR/{split}/ as the hub's snapshots are. One file has no games, one a game without moves
    (both skipped)."""
    games = {split: [g.split() for g in texts(demo / f"data/{split}.jsonl")] for split in ("train", "validation")}
    blobs, data = tmp_path / "hub/blobs", tmp_path / "laion"
    blobs.mkdir(parents=True)
    for split, moves in games.items():
        (data / split).mkdir(parents=True)
        parts = [moves[:1000], [], moves[1000:2000] + [[]] + moves[2000:]] if split == "train" else [moves]
        for i, part in enumerate(parts):
            blob = blobs / hashlib.sha256(f"{split}{i}".encode()).hexdigest()
            write_laion(blob, part)
            link = data / split / f"{split}-{i:05d}-of-{len(parts):05d}.parquet"
            link.symlink_to(os.path.relpath(blob, link.parent))
    return data


@pytest.mark.quick
def test_laion_parquet_files_through_links(demo, tokenizer, tmp_path):
    data = laion_copy(demo, tmp_path)
    for pack in (True, False):
        rows = prepared_rows(data, "train", tokenizer, 64, pack, cache_dir=tmp_path / "cache", num_proc=2)
        assert as_lists(rows) == reference_rows(texts(demo / "data/train.jsonl"), tokenizer, 64, pack)
    assert read_games(data, "train", 1001) == texts(demo / "data/train.jsonl")[:1001]  # across the files
    assert read_games(data, "validation", 64) == texts(demo / "data/validation.jsonl")[:64]


@pytest.mark.quick
def test_rows_pickle_as_a_name_not_as_data(demo, tokenizer, tmp_path):
    rows = prepared_rows(demo / "data", "train", tokenizer, 64, False, cache_dir=tmp_path)
    first = rows[0]  # opens the maps
    assert all(isinstance(a, np.memmap) for a in (rows._tokens, rows._offsets, rows._lengths))
    blob = pickle.dumps(rows)
    assert len(blob) < 4096 < (rows.folder / "tokens.bin").stat().st_size
    again = pickle.loads(blob)
    assert again._tokens is None and torch.equal(again[0], first) and len(again) == len(rows)
    loader = torch.utils.data.DataLoader(rows, batch_size=None, sampler=range(10), num_workers=2)
    assert [row.tolist() for row in loader] == [rows[i].tolist() for i in range(10)]


@pytest.mark.quick
def test_a_damaged_prepared_folder_is_refused(demo, tokenizer, tmp_path):
    rows = prepared_rows(demo / "data", "validation", tokenizer, 64, True, cache_dir=tmp_path)
    with open(rows.folder / "tokens.bin", "r+b") as tokens:
        tokens.truncate(100)
    with pytest.raises(UserError, match="is damaged .* delete that folder"):
        prepared_rows(demo / "data", "validation", tokenizer, 64, True, cache_dir=tmp_path)


# ---- the cache: keyed by content, found without re-reading -----------------------------------------

@pytest.mark.quick
def test_the_cache_key_follows_content(demo, tokenizer, tmp_path, capsys):
    from transformers import AutoTokenizer
    cache = tmp_path / "cache"

    def rows_of(data=demo / "data", tok=tokenizer, row=64, pack=True, cache=cache):
        rows = prepared_rows(data, "validation", tok, row, pack, cache_dir=cache)
        return rows, "preparing" in capsys.readouterr().out

    first, prepared = rows_of()
    assert prepared
    again, prepared = rows_of()
    assert again.folder == first.folder and not prepared
    assert rows_of(data=data_copy(demo, tmp_path))[0].folder == first.folder  # the same bytes elsewhere
    assert rows_of(row=32)[0].folder != first.folder and rows_of(pack=False)[0].folder != first.folder
    model = tmp_path / "model"
    tokenizer.save_pretrained(model)
    same, prepared = rows_of(tok=AutoTokenizer.from_pretrained(model))
    assert same.folder == first.folder and not prepared
    used = AutoTokenizer.from_pretrained(model)  # padding and truncation left set on it by a call
    used(["e2e4", "e2e4 e7e5 g1f3"], padding=True, truncation=True, max_length=2)
    assert rows_of(tok=used)[0].folder == first.folder
    assert as_lists(rows_of(tok=used, cache=tmp_path / "other")[0]) == as_lists(first)  # not cut to 2 tokens
    # the tokenizer edited in place: two moves trade ids
    spec = json.loads((model / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["e2e4"], vocab["d2d4"] = vocab["d2d4"], vocab["e2e4"]
    (model / "tokenizer.json").write_text(json.dumps(spec))
    edited, prepared = rows_of(tok=AutoTokenizer.from_pretrained(model))
    assert prepared and edited.folder != first.folder and as_lists(edited) != as_lists(first)
    # a data file rewritten in place, same size: prepared again
    data = data_copy(demo, tmp_path / "edited")
    lines = (data / "validation.jsonl").read_text().splitlines(keepends=True)
    (data / "validation.jsonl").write_text("".join([lines[1], lines[0], *lines[2:]]))
    assert rows_of(data=data)[0].folder != first.folder


@pytest.mark.quick
def test_a_warm_start_reads_no_data(demo, tokenizer, tmp_path, capsys):
    """File hashes are remembered by (path, size, mtime, inode): a memo made wrong on purpose is
    believed, so the file was not read again; touching the file makes it read (and found the same)."""
    cache = tmp_path / "cache"
    first = prepared_rows(demo / "data", "validation", tokenizer, 64, True, cache_dir=cache)
    memos = [p for p in (cache / "file-hashes").iterdir() if not p.name.endswith(".lock")]
    assert len(memos) == 1
    memos[0].write_text("0" * 64)
    assert prepared_rows(demo / "data", "validation", tokenizer, 64, True, cache_dir=cache).folder != first.folder
    data = data_copy(demo, tmp_path)
    stat = (data / "validation.jsonl").stat()
    os.utime(data / "validation.jsonl", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    capsys.readouterr()
    assert prepared_rows(data, "validation", tokenizer, 64, True, cache_dir=cache).folder == first.folder
    assert "preparing" not in capsys.readouterr().out


@pytest.mark.quick
def test_the_cache_lives_with_the_hugging_face_caches(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert default_cache_dir() == tmp_path / "hf/datasets/chess-kit"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    assert default_cache_dir() == tmp_path / "datasets/chess-kit"


@pytest.mark.quick
def test_a_read_only_data_directory(demo, tokenizer, tmp_path, monkeypatch):
    """Bind-mounted read-only (chmod would not stop root). The cache goes to HF_DATASETS_CACHE."""
    mount_point = tmp_path / "read-only"
    mount_point.mkdir()
    try:
        mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(demo / "data"), str(mount_point)],
                                 capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here: a read-only bind mount needs it (and root)")
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount read-only here ({mounted.stderr.strip()}): needs root or CAP_SYS_ADMIN")
    try:
        with pytest.raises(OSError):
            (mount_point / "probe").write_text("x")
        monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
        rows = prepared_rows(mount_point, "train", tokenizer, 64, True)
        assert rows.folder.parent == tmp_path / "datasets/chess-kit"
        assert as_lists(rows) == reference_rows(texts(demo / "data/train.jsonl"), tokenizer, 64, True)
        assert len(read_games(mount_point, "validation", 8)) == 8
        with pytest.raises(UserError, match=re.escape(str(mount_point))):  # a read-only cache: one clear line
            prepared_rows(demo / "data", "train", tokenizer, 64, True, cache_dir=mount_point / "cache")
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


# ---- one preparer, the others wait -----------------------------------------------------------------

WORKER = r"""
import hashlib, json, os, sys, time
from pathlib import Path
import common.prepare_data as prepare_data
from launch.steps import load_step

data, cache, marks, mode = sys.argv[1:5]
marks = Path(marks)
tokenizer = load_step("download").build_word_tokenizer("uci")  # the `tokenizer` fixture's
if mode == "slow":  # whoever prepares holds the lock until every other worker has found it at work
    wait_for_lock, prepare = prepare_data.wait_for_lock, prepare_data.prepare

    def waiting_marked(path, on_wait=None, **kwargs):
        def said(holder):
            on_wait(holder)
            (marks / f"waiting-{os.getpid()}").touch()
        return wait_for_lock(path, on_wait=said if on_wait else None, **kwargs)

    def prepare_when_all_wait(*args, **kwargs):
        deadline = time.monotonic() + 120  # then the test's count of waiting lines fails, it does not hang
        while len(list(marks.glob("waiting-*"))) < len(list(marks.glob("ready-*"))) - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        return prepare(*args, **kwargs)
    prepare_data.wait_for_lock, prepare_data.prepare = waiting_marked, prepare_when_all_wait
if mode == "die-midway":  # half a token file, then wait for the SIGKILL
    def write_rows(token_lists, folder, *args):
        (folder / "tokens.bin").write_bytes(bytes(1000))
        (marks / "midway").touch()
        time.sleep(600)
    prepare_data.write_rows = write_rows
(marks / f"ready-{os.getpid()}").touch()
while not (marks / "go").exists():
    time.sleep(0.02)
rows = prepare_data.prepared_rows(data, "train", tokenizer, 32, False, cache_dir=cache)
digest = hashlib.sha256(b"".join(rows[i].numpy().tobytes() for i in range(len(rows)))).hexdigest()
print(json.dumps({"digest": digest, "folder": str(rows.folder)}), flush=True)
"""


def start_worker(demo, cache, marks, mode, log):
    marks.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", WORKER, str(demo / "data"), str(cache), str(marks), mode],
                            cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})


def wait_until(condition, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_one_process_prepares_while_the_others_wait(demo, tokenizer, tmp_path):
    cache, marks, count = tmp_path / "cache", tmp_path / "marks", 3
    logs = [tmp_path / f"worker{i}.log" for i in range(count)]
    workers = [start_worker(demo, cache, marks, "slow", log) for log in logs]
    wait_until(lambda: len(list(marks.glob("ready-*"))) == count or any(w.poll() is not None for w in workers),
               "the workers to start")
    (marks / "go").touch()  # all at once
    for worker in workers:
        worker.wait(timeout=300)
    outputs = [log.read_text() for log in logs]
    assert all(worker.returncode == 0 for worker in workers), outputs
    preparing = [out.count("preparing ") for out in outputs]
    waiting = [len(re.findall(r"^waiting for .*pid \d+", out, re.M)) for out in outputs]
    assert sorted(preparing) == [0] * (count - 1) + [1], outputs
    assert waiting == [1 - p for p in preparing], outputs  # each waiter says so once
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    reference = prepared_rows(demo / "data", "train", tokenizer, 32, False, cache_dir=tmp_path / "reference")
    assert {r["digest"] for r in results} == {digest(reference)}
    assert published(cache) == ([Path(results[0]["folder"])], [])


def test_a_preparer_killed_midway_leaves_nothing_trusted(demo, tokenizer, tmp_path):
    cache = tmp_path / "cache"
    dying = start_worker(demo, cache, tmp_path / "dying", "die-midway", tmp_path / "dying.log")
    (tmp_path / "dying/go").touch()
    wait_until(lambda: (tmp_path / "dying/midway").exists() or dying.poll() is not None, "the preparer to get mid-way")
    assert dying.poll() is None, (tmp_path / "dying.log").read_text()
    trusted, partial = published(cache)
    assert trusted == [] and len(partial) == 1
    waiting_log = tmp_path / "waiting.log"
    waiting = start_worker(demo, cache, tmp_path / "waiting", "normal", waiting_log)
    (tmp_path / "waiting/go").touch()
    wait_until(lambda: "waiting for" in waiting_log.read_text() or waiting.poll() is not None, "the waiter to wait")
    assert f"pid {dying.pid}" in waiting_log.read_text()
    dying.send_signal(signal.SIGKILL)
    dying.wait()
    waiting.wait(timeout=300)
    output = waiting_log.read_text()
    assert waiting.returncode == 0 and "preparing " in output, output
    reference = prepared_rows(demo / "data", "train", tokenizer, 32, False, cache_dir=tmp_path / "reference")
    assert json.loads(output.strip().splitlines()[-1])["digest"] == digest(reference)
    trusted, partial = published(cache)
    assert len(trusted) == 1 and partial == []  # the dead preparer's folder is gone


# ---- the lock itself ---------------------------------------------------------------------------------

HOLDER = r"""
import os, sys, time
from common.lock import try_lock
lock = try_lock(sys.argv[1])
if os.fork() == 0:  # a child (as a DataLoader worker is): it must not keep the lock once we are dead
    print("child", os.getpid(), flush=True)
    time.sleep(120)
    os._exit(0)
time.sleep(0.2)
print("held", lock is not None, flush=True)
time.sleep(120)
"""


@pytest.mark.quick
def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    path = tmp_path / "locks/x.lock"
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "SLURM_JOB_ID": "4242", "RANK": "3"})
    child = None
    try:
        lines = [process.stdout.readline().split() for _ in range(2)]
        child = int(next(line[1] for line in lines if line[0] == "child"))
        assert ["held", "True"] in lines
        assert try_lock(path) is None
        who = holder(path)
        assert all(part in who for part in ["rank 3", f"host {socket.gethostname()}", f"pid {process.pid}",
                                            "Slurm job 4242"]), who
        threading.Timer(1.0, process.kill).start()  # SIGKILL: no chance to clean up
        waits = []
        with wait_for_lock(path, on_wait=waits.append, poll_s=0.05) as lock:
            assert waits == [who]  # said once, however long it polled
            assert try_lock(path) is None  # exclusive within one process too
        assert lock._fd is None
        with try_lock(path):
            assert f"pid {os.getpid()}" in holder(path)
    finally:
        process.kill()
        process.wait()
        if child:
            os.kill(child, signal.SIGKILL)


# ---- data errors: one line that names the file and the line ---------------------------------------------

def refused(data, split, tokenizer, tmp_path, num_proc=2):
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as err:
        prepared_rows(data, split, tokenizer, 64, True, cache_dir=cache, num_proc=num_proc)
    assert published(cache) == ([], [])  # nothing half-made left behind
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.quick
@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_is_named_with_file_and_line(demo, tokenizer, tmp_path, case):
    """The cases of tests/test_bad_input.py; a worker process of `datasets.map` finds them."""
    name, number, text, words = BAD_DATA[case]
    data = data_copy(demo, tmp_path)
    replace_line(data / name, number, text)
    split = name.removesuffix(".jsonl")
    if case != "illegal-validation-move":  # tokenizing does not replay the games; the evaluation does
        message = refused(data, split, tokenizer, tmp_path)
        assert words in message and message.startswith(f"{data / name}:{number}: "), message
    if split == "validation":
        with pytest.raises(UserError, match=re.escape(words)):
            read_games(data, split, 64)


@pytest.mark.quick
def test_a_move_the_tokenizer_does_not_know_is_refused(demo, tokenizer, tmp_path):
    data = data_copy(demo, tmp_path)
    replace_line(data / "train.jsonl", 9, json.dumps({"text": "e2e4 e7e5 a1h5"}))  # UCI-shaped, no piece moves so
    message = refused(data, "train", tokenizer, tmp_path)
    assert message.startswith(f"{data / 'train.jsonl'}:9: 'a1h5' is not in the tokenizer's vocabulary"), message


@pytest.mark.quick
def test_an_illegal_validation_game_is_refused(demo, tmp_path):
    data = data_copy(demo, tmp_path)
    replace_line(data / "validation.jsonl", 3, json.dumps({"text": "e2e4 e7e5 e1e3"}))
    with pytest.raises(UserError, match=re.escape(f"{data / 'validation.jsonl'}:3: move 3, 'e1e3', is not legal")):
        read_games(data, "validation", 64)


@pytest.mark.quick
@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty", "blank-lines"])
def test_no_games_is_refused(demo, tokenizer, tmp_path, content):
    data = data_copy(demo, tmp_path)
    (data / "train.jsonl").write_text(content)
    assert "holds no games" in refused(data, "train", tokenizer, tmp_path, num_proc=None)


@pytest.mark.quick
def test_missing_data_names_the_download_command(tokenizer, tmp_path):
    message = refused(tmp_path / "nowhere", "train", tokenizer, tmp_path)
    assert "train.jsonl" in message and "01_download/download.py" in message


@pytest.mark.quick
def test_bad_parquet_files(demo, tokenizer, tmp_path):
    data = laion_copy(demo, tmp_path)
    last = sorted((data / "train").iterdir())[-1]
    games = [g.split() for g in texts(demo / "data/train.jsonl")[:10]]
    games[2] = ["e4", "e5"]
    last.unlink()
    write_laion(last, games)
    assert refused(data, "train", tokenizer, tmp_path).startswith(f"{last}, game 3: 'e4' is not a UCI move")
    pq.write_table(pa.table({"moves": ["e2e4 e7e5"]}), last)
    assert f"{last}: not a chess parquet file" in refused(data, "train", tokenizer, tmp_path)
    last.write_bytes(b"PAR1 but not really")
    assert f"{last}: not a parquet file" in refused(data, "train", tokenizer, tmp_path)


# ---- the login-node command --------------------------------------------------------------------------

def test_the_prepare_command(demo, tmp_path, capsys):
    from transformers import AutoTokenizer
    cache = tmp_path / "cache"
    command = [sys.executable, str(REPO / "01_download/prepare.py"), "--model", str(demo / "model"),
               "--data_dir", str(demo / "data"), "--prepared_dir", str(cache), "--max_seq_length", "64"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.count("preparing ") == 2 and "train: " in first.stdout and "validation: " in first.stdout
    demo_tokenizer = AutoTokenizer.from_pretrained(demo / "model")
    for split in ("train", "validation"):  # what training will look for is there: the model's own notation
        rows = prepared_rows(demo / "data", split, demo_tokenizer, 64, True, cache_dir=cache, notation="piece")
        assert f"{rows.folder}" in first.stdout
    assert "preparing" not in capsys.readouterr().out
    bad = data_copy(demo, tmp_path)
    replace_line(bad / "train.jsonl", 7, '{"text": "e2e4 e7e5')
    refused_run = subprocess.run(command[:5] + [str(bad)] + command[6:], capture_output=True, text=True, timeout=300)
    errors = [line for line in refused_run.stderr.splitlines() if line.startswith("error: ")]
    assert refused_run.returncode == 2 and len(errors) == 1 and "Traceback" not in refused_run.stderr
    assert f"{bad / 'train.jsonl'}:7: not valid JSON" in errors[0]


@pytest.mark.parametrize("case", ["no-row", "longer-than-the-model", "data-dir-link-loop"])
def test_the_prepare_command_refuses_what_training_would(demo, tmp_path, case):
    """Issue 23: data that makes no row of --max_seq_length tokens (training takes none), rows longer
    than the model's positions, a --data_dir that is a symbolic link to itself: one error line,
    exit status 2, where prepare.py used to report "0 rows" and succeed, or fail with a traceback."""
    data = data_copy(demo, tmp_path)
    length = {"no-row": 1024, "longer-than-the-model": 2048}.get(case, 64)
    if case == "no-row":  # one game of a few hundred tokens: less than one packed row of 1024
        (data / "validation.jsonl").write_text((data / "validation.jsonl").read_text().splitlines()[0] + "\n")
    if case == "data-dir-link-loop":
        data = tmp_path / "loop"
        data.symlink_to("loop")
    done = run_python([REPO / "01_download/prepare.py", "--model", demo / "model", "--data_dir", data,
                       "--prepared_dir", tmp_path / "cache", "--max_seq_length", length], timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "validation: 0 rows" not in done.stdout
    line = re.sub(r"\(1 game, [\d,]+ tokens\)", "(1 game, N tokens)", errors[0])  # N: the tokenizer's count
    assert line == {
        "no-row": f"error: the validation games in {data} (1 game, N tokens) make no row of 1024 tokens, and "
                  "training needs rows: add games, or pass a smaller --max_seq_length (or --no_packing) here and in "
                  "training",
        "longer-than-the-model": f"error: --max_seq_length 2048 is more than the 1,024 positions of the model "
                                 f"{demo / 'model'} (max_position_embeddings in its config.json): use "
                                 "--max_seq_length 1024 or less",
        "data-dir-link-loop": f"error: {data} is a symbolic link that leads back to itself: pass --data_dir as the "
                              "folder that holds the games",
    }[case], errors[0]
