"""Chess games → token rows → the same global batches at any GPU count.

The lesson of the three steps is that they optimise the same thing. That holds only if
every step sees the same samples in each optimiser step, whatever the world size and the
gradient-accumulation split. So the data order is defined per *global* batch, and each
rank simply takes its slice of it (see `GlobalBatchSampler`).
"""
import functools
import hashlib
import json
import os
import pickle
import re
import sys
from pathlib import Path

import torch

from common.errors import UserError

UCI_MOVE = re.compile(r"^[a-h][1-8][a-h][1-8][qrbn]?$")
IGNORE_INDEX = -100  # labels with this value add nothing to the loss (padding)
# No legal game is longer than 8,848½ moves (the 75-move rule ends it): a longer line is not one game.
MAX_PLIES = 17_697
ROWS_FORMAT = 2  # part of the cache key: bump when build_rows changes what it makes


def read_games(path):
    """Read one `{"text": "e2e4 e7e5 ..."}` per line; refuse anything else with file:line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist: run `python 01_download/download.py --demo --out demo` "
                        "(or the real download) first, or pass --data_dir")
    games = []
    with path.open("rb") as lines:  # bytes, so that a line that is not UTF-8 can be named
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise UserError(f"{path}:{number}: not UTF-8 text; is this the JSONL file the download "
                                "step wrote?") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{number}: not valid JSON ({err.msg}); "
                                'each line must be {"text": "e2e4 e7e5 ..."}') from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise UserError(f'{path}:{number}: expected {{"text": "<space-separated UCI moves>"}}')
            moves = text.split()
            bad = next((move for move in moves if not UCI_MOVE.match(move)), None)
            if bad is not None:
                raise UserError(f"{path}:{number}: {bad!r} is not a UCI move (like e2e4 or e7e8q)")
            if len(moves) > MAX_PLIES:
                raise UserError(f"{path}:{number}: {len(moves):,} moves, more than any chess game can have "
                                f"({MAX_PLIES:,}): are several games on one line? Write one game per line")
            games.append(" ".join(moves))
    if not games:
        raise UserError(f"{path} holds no games: re-run the download step")
    return games


def tokenize_games(games, tokenizer):
    """Token ids of each game: BOS, the moves, EOS (so packed games stay separable)."""
    ids = tokenizer(games, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [[bos, *game, eos] for game in ids]


def build_rows(games, tokenizer, max_seq_length, pack):
    """Training rows. Games longer than a row are split, never cut short: the tail of a long game
    (how it ends) is worth as much as its opening.
    Packed: games concatenated and cut into full rows (no padding at all; a game continues in
    the next row). Unpacked: one game per row, padded later per micro-batch; a game longer than
    max_seq_length continues in rows of its own."""
    games = tokenize_games(games, tokenizer)
    if not pack:
        return [torch.tensor(game[start: start + max_seq_length]) for game in games
                for start in range(0, len(game), max_seq_length)
                if len(game) - start > 1]  # a lone last token has nothing to predict
    stream = torch.tensor([token for game in games for token in game])
    full_rows = len(stream) // max_seq_length
    return list(stream[: full_rows * max_seq_length].view(full_rows, max_seq_length))


def load_rows(data_file, tokenizer, max_seq_length, pack, cache_dir):
    """Tokenize once and cache: the cache key covers the data, the tokenizer and the settings,
    so a change to any of them re-tokenizes instead of reusing stale rows."""
    games = read_games(data_file)
    key = hashlib.sha256(json.dumps(
        [games, tokenizer.name_or_path, len(tokenizer), max_seq_length, pack, ROWS_FORMAT]).encode()).hexdigest()[:16]
    cache = Path(cache_dir) / f"{Path(data_file).stem}-{key}.pt"
    if cache.is_file():
        try:  # weights_only: a cache file (in a shared data dir) cannot run code, only be refused
            return torch.load(cache, weights_only=True), games
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
            reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            print(f"warning: {cache} is unreadable ({reason}): tokenizing again", file=sys.stderr, flush=True)
    rows = build_rows(games, tokenizer, max_seq_length, pack)
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_suffix(f".tmp{os.getpid()}")
    torch.save(rows, partial)
    os.replace(partial, cache)  # atomic: ranks tokenizing at once never read half a file
    return rows, games


class GlobalBatchSampler:
    """Yields, for this rank, the index lists of its micro-batches, step after step.

    Optimiser step s uses global batch s: `global_batch_size` rows taken from a seeded
    permutation of the data (a new one each epoch). Rank r takes the r-th contiguous slice
    and cuts it into `gradient_accumulation_steps` micro-batches. The global batch never
    depends on how it is split, so 1 GPU × 4 micro-batches and 4 GPUs × 1 see the same rows,
    and resuming at step s needs nothing but s.
    """

    def __init__(self, num_rows, batch_size_per_device, gradient_accumulation_steps,
                 rank, world_size, seed, start_step, max_steps):
        self.per_rank = batch_size_per_device * gradient_accumulation_steps
        self.global_batch_size = self.per_rank * world_size
        if num_rows < self.global_batch_size:
            raise UserError(
                f"the data has {num_rows} rows but one global batch needs {self.global_batch_size} "
                f"({batch_size_per_device} per device × {gradient_accumulation_steps} accumulation × "
                f"{world_size} ranks): use more data or a smaller batch")
        self.num_rows, self.micro = num_rows, batch_size_per_device
        self.rank, self.seed = rank, seed
        self.start_step, self.max_steps = start_step, max_steps
        self.steps_per_epoch = num_rows // self.global_batch_size

    def global_batch(self, step):
        epoch, position = divmod(step, self.steps_per_epoch)
        order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + epoch))
        start = position * self.global_batch_size
        return order[start: start + self.global_batch_size].tolist()

    def __iter__(self):
        for step in range(self.start_step, self.max_steps):
            mine = self.global_batch(step)[self.rank * self.per_rank: (self.rank + 1) * self.per_rank]
            for first in range(0, self.per_rank, self.micro):
                yield mine[first: first + self.micro]

    def __len__(self):
        return (self.max_steps - self.start_step) * (self.per_rank // self.micro)


def collate(rows, pad_id):
    """Pad a micro-batch to its longest row; padding gets no attention and no loss."""
    longest = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
        labels[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def make_loader(rows, sampler, pad_id, device):
    """A DataLoader over the sampler's micro-batches; workers and pinned memory only on GPU."""
    on_gpu = device.type == "cuda"
    return torch.utils.data.DataLoader(
        rows, batch_sampler=sampler, collate_fn=functools.partial(collate, pad_id=pad_id),
        num_workers=2 if on_gpu else 0, pin_memory=on_gpu, persistent_workers=False)


def count_loss_tokens(batch):
    """Tokens that carry a loss: every non-padding label except each row's first (nothing predicts it)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def loss_sum(model, batch):
    """Summed next-token cross-entropy over the batch's non-padding tokens.

    A sum, not a mean: the caller divides by the token count of the whole global batch, so
    every token weighs the same however the batch is split across micro-batches and ranks.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
        ignore_index=IGNORE_INDEX, reduction="sum")
