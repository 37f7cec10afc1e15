"""Does the model play legal chess? Validation loss, and the legal-move rate of greedy moves.

Both functions work on the rows/prefixes they are given and return *sums* (tensors), so a
distributed step can give each rank its share and add the sums up with one all_reduce.
Every rank must make the same number of forward calls (FSDP gathers weights in each one),
which is why nothing here stops early, except when every rank agrees to stop: `stop()` is asked
(a collective) before each batch, and a stop request ends the evaluation with StopEvaluation.
"""
import random

import chess
import torch

from common.data import collate, count_loss_tokens, loss_sum
from common.errors import UserError


class StopEvaluation(Exception):
    """Every rank was asked to stop (a signal) in the middle of an evaluation."""


def check_stop(stop):
    if stop is not None and stop():
        raise StopEvaluation


@torch.no_grad()
def validation_loss_sums(model, rows, batch_size, pad_id, device, stop=None):
    """(summed token loss, token count) over `rows`."""
    total, tokens = torch.zeros((), device=device), torch.zeros((), device=device)
    for first in range(0, len(rows), batch_size):
        check_stop(stop)
        batch = {k: v.to(device) for k, v in collate(rows[first: first + batch_size], pad_id).items()}
        total += loss_sum(model, batch)
        tokens += count_loss_tokens(batch)
    return total, tokens


def game_prefixes(games, count, seed):
    """Cut `count` games at a seeded random ply. The game went on after the cut, so a legal
    next move always exists."""
    rng = random.Random(seed)
    prefixes = []
    for game in games:
        moves = game.split()
        if len(moves) >= 2:
            prefixes.append(moves[: rng.randrange(1, len(moves))])
        if len(prefixes) == count:
            break
    return prefixes


def share_of_rank(items, rank, world_size, what):
    """This rank's share of the evaluation items (the same count on every rank, so that every rank
    makes the same forward calls); refused when there is not even one item per rank."""
    if len(items) < world_size:
        raise UserError(f"the validation data gives {len(items)} {what}, fewer than the {world_size} ranks that "
                        "evaluate them: use more validation games (or raise --eval_rows / --eval_games)")
    return items[rank: len(items) - len(items) % world_size: world_size]


def is_legal_continuation(prefix, move_text):
    board = chess.Board()
    for move in prefix:
        board.push_uci(move)
    try:
        return chess.Move.from_uci(move_text) in board.legal_moves
    except ValueError:  # not even shaped like a move
        return False


def tokens_per_move(tokenizer):
    """How many tokens the longest move needs: 1 for the demo's move-level tokenizer, a few
    for CodeLlama's sub-word one. Greedy decoding runs that many steps, plus one."""
    samples = [" e2e4", " a7a8q", " g1f3"]
    return 1 + max(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in samples)


@torch.no_grad()
def legal_move_sums(model, tokenizer, prefixes, batch_size, max_seq_length, device, stop=None):
    """(legal greedy moves, prefixes tried). Prompts are left-padded so every row's next token
    lands in the last column; positions count real tokens only."""
    steps = tokens_per_move(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    legal = torch.zeros((), device=device)
    for first in range(0, len(prefixes), batch_size):
        check_stop(stop)
        chunk = prefixes[first: first + batch_size]
        prompts = [[tokenizer.bos_token_id, *tokenizer(" ".join(p), add_special_tokens=False)["input_ids"]]
                   for p in chunk]
        prompts = [p[-(max_seq_length - steps):] for p in prompts]
        longest = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
        start = input_ids.shape[1]
        for _ in range(steps):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, next_token], dim=1)
            mask = torch.cat([mask, torch.ones_like(next_token)], dim=1)
        for prefix, generated in zip(chunk, input_ids[:, start:].tolist()):
            words = tokenizer.decode(generated, skip_special_tokens=True).split()
            legal += bool(words) and is_legal_continuation(prefix, words[0])
    return legal, torch.tensor(float(len(prefixes)), device=device)
