"""Does the model play legal chess? Validation loss, and the legal-move rate of greedy moves.

Both work on the rows/prefixes they are given and return *sums* (tensors), so a distributed step
can give each rank its share and add the sums up with one all_reduce (`Evaluation`: what the
training steps run). Every rank must make the same number of forward calls (FSDP gathers weights
in each one), which is why nothing here stops early, except when every rank agrees to stop:
`stop()` is asked (a collective) between batches of moves, and a stop request ends the
evaluation.

A fair test shows positions the model was not trained on: `held_out_split` keeps every game that
opens like a held-out one out of training, and `TrigramBaseline` says what move statistics alone
score on the same positions.
"""
import collections
import itertools
import random

import chess
import torch

from common.data import collate, count_loss_tokens, loss_sum
from common.errors import UserError
from common.notation import board_after, game_text, legal_in, longest_move_text
from common.prepare_data import prepared_rows, read_games


class StopEvaluation(Exception):
    """Every rank was asked to stop (a signal) in the middle of an evaluation."""


def check_stop(stop):
    if stop is not None and stop():
        raise StopEvaluation


class Evaluation:
    """The run's evaluation: the validation loss over --eval_rows rows and the legal-move rate over
    --eval_games game prefixes, this rank's share of each (the same count on every rank: every rank
    makes the same forward calls, which FSDP needs). `ranks` names what shares it out (step 6: its
    data-parallel groups, each of whose ranks evaluates the group's share)."""

    def __init__(self, args, tokenizer, notation, rank=0, world_size=1, ranks="ranks"):
        validation = prepared_rows(args.data_dir, "validation", tokenizer, args.max_seq_length, not args.no_packing,
                                   args.prepared_dir, notation=notation)
        rows = [validation[i] for i in range(min(args.eval_rows, len(validation)))]
        prefixes = game_prefixes(read_games(args.data_dir, "validation", args.eval_games), args.eval_games, args.seed)
        self.rows = share_of_rank(rows, rank, world_size, "rows", ranks)
        self.prefixes = share_of_rank(prefixes, rank, world_size, "game prefixes", ranks)
        self.tokenizer, self.notation = tokenizer, notation
        self.batch_size, self.max_seq_length = args.batch_size_per_device, args.max_seq_length

    def sums(self, model, device, stop=None):
        """(loss, tokens, legal moves, prefixes tried) of this rank's share, one tensor on the device
        to add up over the ranks; None if every rank was asked to stop meanwhile (`stop()`, a
        collective, is asked between the batches of moves, which wait for the GPU anyway)."""
        try:
            check_stop(stop)
            loss = validation_loss_sums(model, self.rows, self.batch_size, self.tokenizer.pad_token_id, device)
            legal = legal_move_sums(model, self.tokenizer, self.notation, self.prefixes, self.batch_size,
                                    self.max_seq_length, device, stop)
        except StopEvaluation:
            return None
        return torch.stack([*loss, *legal])

    @staticmethod
    def figures(sums):
        """The evaluation's figures from the sums of every rank: its one read from the GPU."""
        loss, tokens, legal, tried = sums.tolist()
        return {"eval_loss": loss / tokens, "legal_move_rate": legal / tried}


@torch.no_grad()
def validation_loss_sums(model, rows, batch_size, pad_id, device):
    """(summed token loss, token count) over `rows`, on the device: nothing is read from it here."""
    total, tokens = torch.zeros((), device=device), torch.zeros((), device=device)
    for first in range(0, len(rows), batch_size):
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


def share_of_rank(items, rank, world_size, what, ranks="ranks"):
    """This rank's share of the evaluation items (the same count on every rank, so that every rank
    makes the same forward calls); refused when there is not even one item per rank."""
    if len(items) < world_size:
        raise UserError(f"the validation data gives {len(items)} {what}, fewer than the {world_size} {ranks} that "
                        "evaluate them: use more validation games (or raise --eval_rows / --eval_games)")
    return items[rank: len(items) - len(items) % world_size: world_size]


def tokens_per_move(tokenizer, notation):
    """How many tokens the longest move needs, plus one: 2 for a one-token-per-move vocabulary, 6
    for the built-in piece notation's (piece, from, to, promotion, check), a few more for CodeLlama's
    sub-words. Greedy decoding runs that many steps."""
    text = " " + longest_move_text(notation)
    return 1 + len(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def greedy_tokens(model, prompts, steps, pad_id, device):
    """The `steps` tokens the model writes greedily after each prompt (lists of ids). Prompts are
    left-padded so every row's next token lands in the last column; positions count real tokens
    only. The prompt is read once; each new token reuses its keys and values (the KV cache)."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
    written = []
    for _ in range(steps):
        written.append(out.logits[:, -1].argmax(-1, keepdim=True))
        if len(written) == steps:
            break
        mask = torch.cat([mask, torch.ones_like(written[-1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=written[-1], attention_mask=mask, position_ids=positions,
                    past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(written, dim=1).tolist()


@torch.no_grad()
def answers(model, tokenizer, notation, prefixes, batch_size, max_seq_length, device, stop=None):
    """For each prefix (a list of UCI moves), shown in `notation`: the text the model writes
    greedily after it, long enough to hold one move."""
    steps = tokens_per_move(tokenizer, notation)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # Prompts of like length go together: a batch is padded to its longest prompt, and in the order
    # given a batch of 32 random cuts of games came to 3 times the real tokens (sorted: 1.07 times)
    order = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i]))
    texts = [None] * len(prefixes)
    for first in range(0, len(order), batch_size):
        check_stop(stop)
        chunk = order[first: first + batch_size]
        prompts = [[tokenizer.bos_token_id,
                    *tokenizer(game_text(notation, prefixes[i]), add_special_tokens=False)["input_ids"]] for i in chunk]
        prompts = [p[-(max_seq_length - steps):] for p in prompts]
        for i, written in zip(chunk, greedy_tokens(model, prompts, steps, pad_id, device)):
            texts[i] = tokenizer.decode(written, skip_special_tokens=True)
    return texts


def legal_moves(model, tokenizer, notation, prefixes, batch_size, max_seq_length, device, stop=None):
    """For each prefix: is the model's greedy next move legal there? What it writes is read back as
    a move in the notation and checked with python-chess."""
    texts = answers(model, tokenizer, notation, prefixes, batch_size, max_seq_length, device, stop)
    return [legal_in(board_after(prefix), notation, text) for prefix, text in zip(prefixes, texts)]


def legal_move_sums(model, tokenizer, notation, prefixes, batch_size, max_seq_length, device, stop=None):
    """(legal greedy moves, prefixes tried), as tensors to add up over ranks."""
    verdicts = legal_moves(model, tokenizer, notation, prefixes, batch_size, max_seq_length, device, stop)
    return torch.tensor(float(sum(verdicts)), device=device), torch.tensor(float(len(prefixes)), device=device)


# ---- held-out games and a baseline to compare with -------------------------------------------------

def held_out_split(games, count, shared_plies=10):
    """(training games, held-out games): `count` games held out with every game that opens the same
    way for `shared_plies` plies, so no training game shares a prefix that long with a held-out
    one and the evaluation sees positions the model has not been shown. Games are "e2e4 e7e5 ..."
    strings; the held-out ones are the last openings in the list's order."""
    def opening(game):
        return tuple(game.split()[:shared_plies])
    held_openings = set()
    for game in reversed(games):
        if len(held_openings) == count:
            break
        held_openings.add(opening(game))
    train = [game for game in games if opening(game) not in held_openings]
    held_out = [game for game in games if opening(game) in held_openings]
    return train, held_out


def phase_of(ply):
    """opening (< 20 plies played), middle (20-79) or late (80 and more)."""
    return "opening" if ply < 20 else "middle" if ply < 80 else "late"


class TrigramBaseline:
    """The most common next move after the last two moves, for the side to move (backing off to
    the last move, then to any position of that side): what move statistics alone achieve."""

    def __init__(self, games):
        # (side to move, the moves before..., the move) counted with zip: millions of moves in seconds
        counts = collections.Counter()
        for game in games:
            moves = game.split()
            counts.update(zip(itertools.cycle((0, 1)), moves))
            counts.update(zip(itertools.cycle((1, 0)), moves, moves[1:]))
            counts.update(zip(itertools.cycle((0, 1)), moves, moves[1:], moves[2:]))
        # each context's commonest move; a tie goes to the move seen first (as Counter.most_common)
        self.best, best_count = {}, {}
        for (*context, move), count in counts.items():
            context = tuple(context)
            if count > best_count.get(context, 0):
                self.best[context], best_count[context] = move, count

    def move(self, prefix):
        side = len(prefix) % 2
        for context in ((side, *prefix[-2:]), (side, *prefix[-1:]), (side,)):
            if context in self.best:
                return self.best[context]
        return None

    def is_legal(self, prefix):
        move = self.move(prefix)
        return move is not None and chess.Move.from_uci(move) in board_after(prefix).legal_moves
