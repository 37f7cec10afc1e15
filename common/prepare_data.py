"""Prepared data: the games tokenized once per data set, then memory-mapped by every rank.

Tokenizing millions of games takes minutes, so it is done once: on the login node
(`python 01_download/prepare.py`), or else by the first training process that needs it while
the others wait. The result is a folder in a cache, named by a key:

    <cache>/<key>/tokens.bin    all games one after the other, each as BOS, moves, EOS (uint16/uint32)
                  offsets.npy   unpacked rows only: where each row starts in tokens.bin ...
                  lengths.npy   ... and how many tokens it has
                  meta.json     written last; a folder is published (renamed into place) only when complete

The key covers everything the rows depend on: the bytes of the data files, the tokenizer's
content, the notation the games are written in (common/notation.py), max_seq_length and
packing. A changed file or tokenizer is prepared anew, and the same data found elsewhere is
reused. Every rank maps the same files (np.memmap), so a rank's memory does not grow with the
number of games and a node's page cache holds one copy.

Sources: DATA_DIR/{split}.jsonl (one {"text": "e2e4 e7e5 ..."} per line: the demo, your own
games) or DATA_DIR/{split}/*.parquet (the schema of laion/strategic_game_chess: a `Moves` list
per game; links into the Hugging Face cache are fine). `datasets` loads them and tokenizes with
all the cores this process may use, checking every game on the way.
"""
import bisect
import errno
import hashlib
import itertools
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch

from common.errors import UserError, first_line
from common.lock import wait_for_lock
from common.notation import IllegalGame, words_of

FORMAT = 1  # part of the cache key: bump it when what is written changes
MOVE = "[a-h][1-8][a-h][1-8][qrbn]?"  # UCI: from, to, promotion
# No legal game is longer than 8,848½ moves (the 75-move rule ends it): a longer line is not one game.
MAX_PLIES = 17_697
SPLITS = ("train", "validation")


# ---- where the games are ------------------------------------------------------------------------

def refuse_unreachable(path):
    """A path that cannot be looked at (a symbolic link that loops, a folder it may not read) is one
    line naming it; a missing one is not refused here."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as err:
        why = ("a symbolic link that leads back to itself" if err.errno == errno.ELOOP
               else f"cannot be read: {err.strerror}")
        raise UserError(f"{path} is {why}: pass --data_dir as the folder that holds the games") from None


def source_files(data_dir, split):
    """("jsonl", [DATA_DIR/split.jsonl]) or ("parquet", [DATA_DIR/split/*.parquet, sorted])."""
    data_dir = Path(data_dir)
    jsonl, parquet_dir = data_dir / f"{split}.jsonl", data_dir / split
    for path in (data_dir, jsonl, parquet_dir):
        refuse_unreachable(path)
    parquet = sorted(parquet_dir.glob("*.parquet"))
    if jsonl.is_file() and parquet:
        raise UserError(f"both {jsonl} and {parquet_dir}/*.parquet exist: keep one of them, so it is clear "
                        f"which games are the {split} split")
    if jsonl.is_file():
        return "jsonl", [jsonl]
    if parquet:
        return "parquet", parquet
    demo = data_dir.resolve() == (Path(__file__).resolve().parents[1] / "demo" / "data")
    command = ("python 01_download/download.py --demo --out demo" if demo
               else f"python 01_download/download.py --out {shlex.quote(str(data_dir.parent))}")
    raise UserError(f"no {split}.jsonl in {data_dir}: run `{command}` on a login node first, or pass --data_dir "
                    f"(the games may also be {split}/*.parquet files there)")


def check_parquet_schema(path):
    """Before `datasets` reads it: a file pyarrow cannot read, or without a list of moves per game,
    is refused. Returns its number of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow raises several types for damaged or foreign files
        raise UserError(f"{path}: not a parquet file ({first_line(err)})") from None
    moves = schema.field("Moves").type if "Moves" in schema.names else None
    if not (moves is not None and (pa.types.is_list(moves) or pa.types.is_large_list(moves))
            and (pa.types.is_string(moves.value_type) or pa.types.is_large_string(moves.value_type))):
        raise UserError(f"{path}: not a chess parquet file: it needs a column `Moves` holding a list of UCI moves "
                        "per game (the schema of laion/strategic_game_chess)")
    return pq.ParquetFile(path).metadata.num_rows


# ---- reading and checking games (in batches: `datasets.map` and read_games share this) ------------

def moves_from_lines(lines, line_numbers, path):
    """JSON lines -> (moves of each game as a pyarrow list array, where(i) -> "file:line").
    Blank lines are skipped; anything else that is not {"text": "<moves>"} is refused."""
    import pyarrow as pa
    import pyarrow.compute as pc
    texts, numbers = [], []
    for line, number in zip(lines, line_numbers):
        if not line.strip():
            continue
        here = f"{path}:{number}"
        if "\ufffd" in line:  # the loaders decode with errors="replace": this is where the bytes were not UTF-8
            raise UserError(f"{here}: not UTF-8 text; is this the JSONL file the download step wrote?")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{here}: not valid JSON ({err.msg}); "
                            'each line must be {"text": "e2e4 e7e5 ..."}') from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise UserError(f'{here}: expected {{"text": "<space-separated UCI moves>"}}')
        texts.append(text)
        numbers.append(number)
    moves = pc.ascii_split_whitespace(pa.array(texts, pa.string()))
    return moves, lambda i: f"{path}:{numbers[i]}"


def moves_from_parquet(column, row_numbers, files, first_rows):
    """A `Moves` column -> (moves of each game, where(i) -> "file, game N"). Games without moves
    are skipped, as the download step does. `first_rows[f]` is the row at which files[f] starts."""
    import pyarrow as pa
    import pyarrow.compute as pc
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    keep = pc.fill_null(pc.greater(pc.list_value_length(column), 0), False)
    rows = np.asarray(row_numbers)[keep.to_numpy(zero_copy_only=False)]

    def where(i):
        f = bisect.bisect_right(first_rows, rows[i]) - 1
        return f"{files[f]}, game {rows[i] - first_rows[f] + 1}"
    return column.filter(keep), where


def check_moves(moves, where):
    """Every move shaped like UCI, no game longer than chess allows. Vectorised: pyarrow runs the
    regular expression over whole games, and only if one fails over its moves, to name the bad one."""
    import pyarrow.compute as pc
    counts = pc.list_value_length(moves).to_numpy(zero_copy_only=False)
    games = pc.binary_join(moves, ",")
    if pc.all(pc.match_substring_regex(games, f"^{MOVE}(,{MOVE})*$")).as_py() and counts.max(initial=0) <= MAX_PLIES:
        return
    shaped = pc.fill_null(pc.match_substring_regex(pc.list_flatten(moves), f"^{MOVE}$"), False)
    bad_moves = np.flatnonzero(~shaped.to_numpy(zero_copy_only=False))
    bad_game = np.searchsorted(np.cumsum(counts), bad_moves[0], side="right") if len(bad_moves) else len(counts)
    too_long = np.flatnonzero(counts > MAX_PLIES)
    if len(too_long) and too_long[0] < bad_game:
        count = counts[too_long[0]]
        raise UserError(f"{where(too_long[0])}: {count:,} moves, more than any chess game can have ({MAX_PLIES:,}): "
                        "are several games on one line? Write one game per line")
    if len(bad_moves):
        bad = pc.list_flatten(moves)[int(bad_moves[0])].as_py()
        raise UserError(f"{where(bad_game)}: {bad!r} is not a UCI move (like e2e4 or e7e8q)")


def check_legal(moves, where):
    """Replay each game from the start position: the legal-move evaluation needs real games."""
    import chess
    for i, game in enumerate(moves.to_pylist()):
        board = chess.Board()
        for number, move in enumerate(game, start=1):
            try:
                board.push_uci(move)
            except ValueError:
                raise UserError(f"{where(i)}: move {number}, {move!r}, is not legal in that position "
                                "(each line must be one game, from the start position)") from None


# ---- tokenizing ----------------------------------------------------------------------------------

def rust_tokenizer(tokenizer):
    """The tokenizer's Rust core (vocabulary, merges, normalisation, ...), or None if it has none.
    Without padding and truncation: a call with padding=True leaves them set on it, and they must
    neither change the cache key nor cut a game short."""
    from tokenizers import Tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or (backend.padding is None and backend.truncation is None):
        return backend
    clean = Tokenizer.from_str(backend.to_str())
    clean.no_padding()
    clean.no_truncation()
    return clean


def encoder_of(tokenizer):
    """What the map workers tokenize with: the Rust tokenizer where there is one (tokenizer(texts)
    runs the same, plus Python around it), else the tokenizer itself; and the ids of its special
    tokens, and whether it may tokenize move by move."""
    rust = rust_tokenizer(tokenizer)
    special = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id,
               "unk_token": tokenizer.unk_token, "name": str(tokenizer.name_or_path),
               "by_move": rust is not None and cuts_at_whitespace_first(rust)}
    return (rust if rust is not None else tokenizer), special


def cuts_at_whitespace_first(rust):
    """Does this tokenizer cut the text at whitespace before anything else, as the demo's does? Then
    a game's tokens are its moves' tokens one after the other, and each distinct move needs
    tokenizing only once: a million games hold a hundred million moves, but only about 2,000
    different ones. (CodeLlama's does not: it runs BPE over the whole text.)"""
    return (rust.normalizer is None and type(rust.pre_tokenizer).__name__ in ("WhitespaceSplit", "Whitespace")
            and not any(any(c.isspace() for c in token.content) for token in rust.get_added_tokens_decoder().values()))


def encode(encoder, texts):
    """(all token ids of the texts, one after the other, as numpy; tokens per text)."""
    if hasattr(encoder, "encode_batch_fast"):
        lists = [encoding.ids for encoding in encoder.encode_batch_fast(texts, add_special_tokens=False)]
    else:
        lists = encoder(texts, add_special_tokens=False)["input_ids"]
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lengths.sum()))
    return ids, lengths


def encode_games(encoder, moves, by_move):
    """(the token ids of all games, one after the other; tokens per game)."""
    import pyarrow.compute as pc
    if not by_move:
        return encode(encoder, pc.binary_join(moves, " ").to_pylist())
    every_move = pc.list_flatten(moves)
    distinct = pc.unique(every_move)
    ids, lengths = encode(encoder, distinct.to_pylist())  # the tokens of each distinct move, one after the other
    which = pc.index_in(every_move, value_set=distinct).to_numpy()
    count, first = lengths[which], (np.cumsum(lengths) - lengths)[which]  # of each move: its tokens, in `ids`
    nth = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)  # 0, 1, .. within each move
    moves_so_far = np.concatenate([[0], np.cumsum(pc.list_value_length(moves).to_numpy())])
    tokens_so_far = np.concatenate([[0], np.cumsum(count)])
    return ids[np.repeat(first, count) + nth], np.diff(tokens_so_far[moves_so_far])


def tokenize_moves(moves, where, encoder, special):
    """Each game as BOS, its moves' tokens, EOS (so packed games stay separable): a list array.
    A move the tokenizer does not know is refused: trained as <unk> it would teach nothing."""
    import pyarrow as pa
    ids, lengths = encode_games(encoder, moves, special["by_move"])
    unk = special["unk"]
    if unk is not None and (ids == unk).any():
        game = int(np.searchsorted(np.cumsum(lengths), np.flatnonzero(ids == unk)[0], side="right"))
        bad = next(move for move in moves[game].as_py() if unk in encode(encoder, [move])[0])
        raise UserError(f"{where(game)}: {bad!r} is not in the tokenizer's vocabulary ({special['name']}); "
                        f"it would be trained as {special['unk_token']}. Is --notation the model's own (uci or "
                        "piece)?")
    ends = np.cumsum(lengths + 2)
    starts = ends - (lengths + 2)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int32)
    out[starts], out[ends - 1] = special["bos"], special["eos"]
    moves_at = np.ones(len(out), dtype=bool)
    moves_at[starts] = moves_at[ends - 1] = False
    out[moves_at] = ids
    offsets = pa.array(np.concatenate([[0], ends]).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(out))


def in_notation(moves, where, notation):
    """The games' moves (UCI) as the notation's words, one string per move (common/notation.py)."""
    import pyarrow as pa
    if notation == "uci":
        return moves
    games = []
    for i, game in enumerate(moves.to_pylist()):
        try:
            games.append(words_of(notation, game))
        except IllegalGame as err:
            raise UserError(f"{where(i)}: {err} (each line must be one game, from the start position)") from None
    return pa.array(games, pa.list_(pa.string()))


def tokenize_batch(batch, indices, kind, files, first_rows, encoder, special, notation):
    """The `datasets.map` function: one batch of lines (jsonl) or rows (parquet) -> token lists."""
    import pyarrow as pa
    if kind == "jsonl":
        moves, where = moves_from_lines(batch.column("text").to_pylist(), [i + 1 for i in indices], files[0])
    else:
        moves, where = moves_from_parquet(batch.column("Moves"), indices, files, first_rows)
    check_moves(moves, where)
    moves = in_notation(moves, where, notation)
    return pa.table({"ids": tokenize_moves(moves, where, encoder, special)})


# ---- rows ----------------------------------------------------------------------------------------

def unpacked_rows(game_starts, game_lengths, max_seq_length):
    """(start, length) of each unpacked row: a game in pieces of max_seq_length, in order; a last
    piece of one token is dropped (it has nothing to predict)."""
    pieces = -(-game_lengths // max_seq_length)
    game = np.repeat(np.arange(len(game_lengths)), pieces)
    piece = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    starts = game_starts[game] + piece * max_seq_length
    lengths = np.minimum(max_seq_length, game_lengths[game] - piece * max_seq_length)
    keep = lengths > 1
    return starts[keep], lengths[keep]


def write_rows(token_lists, folder, max_seq_length, pack, vocab_size):
    """The tokenized games (an Arrow table, read chunk by chunk: memory does not grow with the data)
    -> tokens.bin, and for unpacked rows offsets.npy and lengths.npy."""
    import pyarrow.compute as pc
    chunks = token_lists.column("ids").chunks

    def game_lengths(chunk):
        return pc.list_value_length(chunk).to_numpy().astype(np.int64)

    def row_count(lengths):  # unpacked: pieces of each game, less the lone last tokens
        return int((-(-lengths // max_seq_length) - (lengths % max_seq_length == 1)).sum())

    # First the sizes, so that every file is mapped at its final size and filled in place.
    games = tokens_in = rows_in = 0
    for chunk in chunks:
        lengths = game_lengths(chunk)
        games += len(lengths)
        tokens_in += int(lengths.sum())
        rows_in += 0 if pack else row_count(lengths)
    rows = tokens_in // max_seq_length if pack else rows_in
    dtype = np.uint16 if vocab_size <= 2 ** 16 else np.uint32
    tokens = np.memmap(folder / "tokens.bin", dtype=dtype, mode="w+", shape=(max(tokens_in, 1),))
    files = [tokens]
    if not pack:
        offsets = np.lib.format.open_memmap(folder / "offsets.npy", mode="w+", dtype=np.int64, shape=(rows,))
        lengths = np.lib.format.open_memmap(folder / "lengths.npy", mode="w+", dtype=np.int64, shape=(rows,))
        files += [offsets, lengths]
    token, row = 0, 0
    for chunk in chunks:
        flat = pc.list_flatten(chunk).to_numpy()
        tokens[token: token + len(flat)] = flat
        if not pack:
            chunk_lengths = game_lengths(chunk)
            starts, pieces = unpacked_rows(np.cumsum(chunk_lengths) - chunk_lengths, chunk_lengths, max_seq_length)
            offsets[row: row + len(starts)] = token + starts
            lengths[row: row + len(starts)] = pieces
            row += len(starts)
        token += len(flat)
    for array in files:
        array.flush()
    return {"games": games, "tokens": tokens_in, "rows": rows, "dtype": np.dtype(dtype).name}


class TokenRows(torch.utils.data.Dataset):
    """The rows of a prepared folder. rows[i] is a LongTensor copied from the mapped file, that row
    only; nothing else is read into memory. Pickling it (DataLoader workers) sends the folder's
    name, not the data: each process maps the files itself."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / "meta.json").read_text())
        self.pack, self.max_seq_length = self.meta["pack"], self.meta["max_seq_length"]
        self._tokens = self._offsets = self._lengths = None
        size = (self.folder / "tokens.bin").stat().st_size if (self.folder / "tokens.bin").is_file() else -1
        if size < self.meta["tokens"] * np.dtype(self.meta["dtype"]).itemsize:
            raise UserError(f"the prepared data in {self.folder} is damaged (tokens.bin is short or missing): "
                            "delete that folder, and it is prepared again")
        try:  # every file maps as plain numbers of the right count (np.load never unpickles here)
            self._open()
            if not self.pack and not (len(self._offsets) == len(self._lengths) == self.meta["rows"]):
                raise ValueError("offsets.npy and lengths.npy do not match meta.json")
        except (OSError, ValueError) as err:
            raise UserError(f"the prepared data in {self.folder} is damaged or not the kit's ({err}): delete that "
                            "folder, and it is prepared again") from None
        self._tokens = self._offsets = self._lengths = None  # mapped again where the rows are read

    def _open(self):
        self._tokens = np.memmap(self.folder / "tokens.bin", dtype=self.meta["dtype"], mode="r",
                                 shape=(self.meta["tokens"],))
        if not self.pack:
            self._offsets = np.load(self.folder / "offsets.npy", mmap_mode="r")
            self._lengths = np.load(self.folder / "lengths.npy", mmap_mode="r")

    def __len__(self):
        return self.meta["rows"]

    def row_lengths(self, indices):
        """The token counts of these rows (packed rows all have max_seq_length), read from the map."""
        if self.pack:
            return [self.max_seq_length] * len(indices)
        if self._tokens is None:
            self._open()
        return self._lengths[np.asarray(indices, dtype=np.int64)].tolist()

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        if self._tokens is None:
            self._open()
        index %= len(self)
        if self.pack:
            start, length = index * self.max_seq_length, self.max_seq_length
        else:
            start, length = int(self._offsets[index]), int(self._lengths[index])
        return torch.from_numpy(self._tokens[start: start + length].astype(np.int64))

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None, "_offsets": None, "_lengths": None}


# ---- the cache: key, lock, publish ---------------------------------------------------------------

def default_cache_dir():
    """Beside the `datasets` cache, never beside the data (which may be read-only)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]) / "chess-kit"
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "datasets" / "chess-kit"
    return Path("~/.cache/huggingface/datasets/chess-kit").expanduser()


def write_atomically(path, text):
    partial = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)


def file_digest(path, cache):
    """SHA-256 of a file's bytes, remembered in the cache by (real path, size, mtime, inode): a
    warm start reads no data, a changed file is hashed again."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    name = hashlib.sha256(f"{real}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}".encode()).hexdigest()[:32]
    memo = cache / "file-hashes" / name
    if not memo.is_file():
        with wait_for_lock(cache / "file-hashes" / f"{name}.lock"):  # many ranks: one reads the file
            if not memo.is_file():
                digest = hashlib.sha256()
                with open(real, "rb") as data:
                    for block in iter(lambda: data.read(1 << 24), b""):
                        digest.update(block)
                write_atomically(memo, digest.hexdigest())
    return memo.read_text().strip()


def tokenizer_fingerprint(tokenizer):
    """What the tokenizer does (vocabulary, merges, normalisation, special ids), not where it lives:
    a tokenizer edited in place gets a new fingerprint."""
    rust = rust_tokenizer(tokenizer)
    content = rust.to_str() if rust is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id, len(tokenizer)]
    return hashlib.sha256(json.dumps([content, special]).encode()).hexdigest()


def cache_key(kind, files, tokenizer, max_seq_length, pack, notation, cache):
    parts = {"format": FORMAT, "kind": kind, "files": [file_digest(f, cache) for f in files],
             "tokenizer": tokenizer_fingerprint(tokenizer), "max_seq_length": max_seq_length, "pack": bool(pack),
             "notation": notation}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_games(kind, files, hf_cache):
    """(the source as a `datasets.Dataset`, the files in it, the row at which each starts). One row
    per line of the jsonl, so row + 1 is the line number; or the Moves column of the parquet files."""
    import datasets
    if kind == "parquet":
        counts = {path: check_parquet_schema(path) for path in files}
        files = [path for path in files if counts[path]]  # `datasets` stumbles over a file of no rows
        if not files:
            return [], files, []
    try:
        if kind == "jsonl":  # the text loader, not the json one: a bad line must be named, not guessed around
            games = datasets.load_dataset("text", data_files=[str(f) for f in files], split="train",
                                          cache_dir=str(hf_cache), encoding_errors="replace")
        else:
            games = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train",
                                          cache_dir=str(hf_cache), columns=["Moves"])
    except Exception as err:  # datasets wraps what went wrong in several types
        cause = err.__cause__ or err
        where = files[0] if len(files) == 1 else files[0].parent
        raise UserError(f"cannot read {where} ({first_line(cause)})") from None
    first_rows = [0] if kind == "jsonl" else list(itertools.accumulate([counts[f] for f in files][:-1], initial=0))
    return games, files, first_rows


_preparing = {"pid": None, "hooked": False}  # this process's pid while it prepares


def die_with_the_preparer():
    """Runs in each child forked from this process (the `datasets` workers and their manager): if
    the preparer is killed (kill -9), they would otherwise wait for work forever."""
    if _preparing["pid"] is not None and _preparing["pid"] == os.getppid() and sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel kills us when the parent dies
        if os.getppid() != _preparing["pid"]:  # it died before we asked
            os._exit(1)


def prepare(kind, files, tokenizer, max_seq_length, pack, notation, folder, num_proc=None):
    """Tokenize and write into a temporary folder, then publish it with one rename. The caller
    holds the lock, so a temporary folder of the same key left behind was a preparer that died."""
    import datasets
    if tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
        raise UserError(f"the tokenizer {tokenizer.name_or_path} has no BOS or EOS token: packed games would run "
                        "together")
    for stale in folder.parent.glob(f"{folder.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    partial = folder.with_name(f"{folder.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    began = time.perf_counter()
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    if not _preparing["hooked"]:
        os.register_at_fork(after_in_child=die_with_the_preparer)
        _preparing["hooked"] = True
    _preparing["pid"] = os.getpid()
    try:
        partial.mkdir(parents=True)
        source = files[0] if kind == "jsonl" else files[0].parent
        empty = UserError(f"{source} holds no games: re-run the download step")
        if kind == "jsonl" and files[0].stat().st_size == 0:  # the text loader refuses an empty file
            raise empty
        games, loaded, first_rows = load_games(kind, files, partial / "datasets")
        if len(games) == 0:
            raise empty
        encoder, special = encoder_of(tokenizer)
        # A process costs about a second to start: small sets are done in this one. Replaying games
        # for the piece notation runs at about 1,000 games per second and core, tokenizing at 20 times that.
        per_process = 20_000 if notation == "uci" else 2_000
        num_proc = num_proc or max(1, min(usable_cores(), len(games) // per_process))
        print(f"preparing {source} ({len(games):,} {'lines' if kind == 'jsonl' else 'games'}) "
              f"with {num_proc} process{'es' if num_proc > 1 else ''} ...", flush=True)
        token_lists = games.with_format("arrow").map(
            tokenize_batch, batched=True, batch_size=10_000, with_indices=True, remove_columns=games.column_names,
            num_proc=num_proc if num_proc > 1 else None,
            new_fingerprint=folder.name,  # our key, not a hash of the function and tokenizer
            fn_kwargs={"kind": kind, "first_rows": first_rows, "files": loaded, "encoder": encoder, "special": special,
                       "notation": notation})
        meta = write_rows(token_lists.data, partial, max_seq_length, pack, len(tokenizer))
        if meta["games"] == 0:
            raise empty
        del games, token_lists
        shutil.rmtree(partial / "datasets")
        meta.update(format=FORMAT, max_seq_length=max_seq_length, pack=bool(pack), notation=notation,
                    sources=[str(f) for f in files],
                    tokenizer=str(tokenizer.name_or_path), seconds=round(time.perf_counter() - began, 1))
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(partial, folder)
        except OSError:  # only if another node published it and our file system showed us a stale listing
            if not (folder / "meta.json").is_file():
                raise
            shutil.rmtree(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        _preparing["pid"] = None
        if bars:
            datasets.enable_progress_bars()
    print(f"prepared {meta['games']:,} games in the {notation} notation: {meta['rows']:,} rows, {meta['tokens']:,} "
          f"tokens in {meta['seconds']} s ({meta['games'] / max(meta['seconds'], 0.1):,.0f} games/s) -> {folder}",
          flush=True)


def prepared_rows(data_dir, split, tokenizer, max_seq_length, pack, cache_dir=None, num_proc=None, notation="uci"):
    """The rows of DATA_DIR's `split` in `notation`, prepared now if no process did it before. Many
    processes may call this at once (ranks, nodes): one prepares, the others wait for it and then read."""
    kind, files = source_files(data_dir, split)
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    try:  # a cache that cannot be written (a read-only HF_HOME) is said first, with what to do ...
        cache.mkdir(parents=True, exist_ok=True)
        probe = cache / f".write-test-{socket.gethostname()}-{os.getpid()}"
        probe.touch()
        probe.unlink()
        cannot_write = None
    except OSError as err:
        cannot_write = UserError(f"cannot write the prepared data to {cache} ({err.strerror}): set --prepared_dir (or "
                                 "HF_DATASETS_CACHE) to a folder you can write; the default is under HF_HOME")
    # ... unless it has everything already: a room's shared cache, prepared before, is only read.
    try:
        key = cache_key(kind, files, tokenizer, max_seq_length, pack, notation, cache)
        folder = cache / key
        if not (folder / "meta.json").is_file():
            if cannot_write:
                raise cannot_write

            def say_who(holder):
                print(f"waiting for {holder} to prepare the {split} data ({folder})", flush=True)
            with wait_for_lock(cache / f"{key}.lock", on_wait=say_who):
                if not (folder / "meta.json").is_file():  # the one we waited for may have done it
                    prepare(kind, files, tokenizer, max_seq_length, pack, notation, folder, num_proc)
    except UserError:
        if cannot_write:  # e.g. no lock file for hashing a data file in a read-only cache
            raise cannot_write from None
        raise
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            raise
        if err.filename and not str(err.filename).startswith(str(cache)):
            raise UserError(f"cannot read {err.filename} ({err.strerror})") from None
        raise UserError(f"cannot write the prepared data to {cache} ({err.strerror}): free some space there, or "
                        "set --prepared_dir (or HF_DATASETS_CACHE) to another folder") from None
    return TokenRows(folder)


def read_games(data_dir, split, limit):
    """The first `limit` games of a split as move strings ("e2e4 e7e5 ..."), for the legal-move
    evaluation: checked like the prepared data, and replayed to make sure every move is legal."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    kind, files = source_files(data_dir, split)
    if limit <= 0:
        return []
    found = []  # (moves, where) per batch
    if kind == "jsonl":
        lines, numbers = [], []
        with open(files[0], "rb") as source:  # bytes, like the loader: blank lines do not count
            for number, raw in enumerate(source, start=1):
                if raw.strip():
                    lines.append(raw.decode("utf-8", errors="replace"))
                    numbers.append(number)
                if len(lines) == limit:
                    break
        found.append(moves_from_lines(lines, numbers, files[0]))
    else:
        count = 0
        for path in files:
            check_parquet_schema(path)
            first = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=max(limit, 1), columns=["Moves"]):
                moves, where = moves_from_parquet(batch.column("Moves"), range(first, first + len(batch)), [path], [0])
                found.append((moves[: limit - count], where))
                count, first = count + len(found[-1][0]), first + len(batch)
                if count >= limit:
                    break
            if count >= limit:
                break
    games = []
    for moves, where in found:
        check_moves(moves, where)
        check_legal(moves, where)
        games += pc.binary_join(moves, " ").to_pylist()
    if not games and limit > 0:
        raise UserError(f"{files[0] if kind == 'jsonl' else files[0].parent} holds no games: re-run the download step")
    return games[:limit]
