"""Make the small chess sample that ships with the repo (chess_sample.parquet).

The demo must run offline, so it cannot fetch laion/strategic_game_chess; this is a look-alike with
its columns (Moves, Termination, Result) and recipe (a few random opening plies, then Stockfish
self-play), cut to a few thousand games and a tiny search budget so it builds in minutes. Games are
seeded one by one, so --workers does not matter; one engine thread with a node budget makes Stockfish
repeatable too, but only on the same Stockfish build. Without Stockfish a seeded heuristic plays.

The larger set that the learning run (benchmark/learn_chess.py) trains on, chess_learn.parquet, is
made by the same recipe with another seed and a smaller search budget (about 16 games/s on 2 cores),
with repeats and the sample's own games left out (the sample's last games are that run's held-out
evaluation games):

    python 01_download/make_chess_sample.py --games 20000 --seed 1 --nodes 100 --unique \
        --exclude 01_download/chess_sample.parquet --out 01_download/chess_learn.parquet
"""
import argparse
import collections
import multiprocessing
import os
import random
import shutil
import sys
import time
from pathlib import Path

import chess
import chess.engine
import pyarrow as pa
import pyarrow.parquet as pq

MIN_OPENING_PLIES, MAX_OPENING_PLIES = 2, 8
MAX_PLIES = 300                                 # longer games are cut off and scored as draws
CAPPED_TERMINATION = "MAX_MOVES"                # our own label: python-chess has no name for a cut-off game
DEFAULT_NODES = 500                             # tiny, fixed budget: fast, and not wall-clock dependent
ENGINE_OPTIONS = {"Threads": 1, "Hash": 16}     # one thread so the search is repeatable
GAMES_PER_TASK = 25                             # small tasks keep both workers busy until the end
PIECE_VALUE = {chess.PAWN: 1, chess.KNIGHT: 3, chess.BISHOP: 3, chess.ROOK: 5, chess.QUEEN: 9}
SCHEMA = pa.schema([("Moves", pa.list_(pa.string())), ("Termination", pa.string()), ("Result", pa.string())])


# ---- move choice ---------------------------------------------------------------------------------

def heuristic_move(board, rng):
    """Fallback player: mate if possible, else the most valuable capture, else a check, else random."""
    moves = list(board.legal_moves)
    mates = [move for move in moves if gives_mate(board, move)]
    if mates:
        return rng.choice(mates)
    captures = [move for move in moves if board.is_capture(move)]
    if captures:
        best = max(victim_value(board, move) for move in captures)
        return rng.choice([move for move in captures if victim_value(board, move) == best])
    checks = [move for move in moves if board.gives_check(move)]
    return rng.choice(checks or moves)


def victim_value(board, move):
    """Value of the captured piece (en passant captures a pawn that is not on the target square)."""
    if board.is_en_passant(move):
        return PIECE_VALUE[chess.PAWN]
    return PIECE_VALUE[board.piece_type_at(move.to_square)]


def gives_mate(board, move):
    if not board.gives_check(move):  # cheap filter: only checks can mate
        return False
    board.push(move)
    mate = board.is_checkmate()
    board.pop()
    return mate


# ---- one game --------------------------------------------------------------------------------------

def play_game(game_seed, engine, limit):
    """Random opening plies, then self-play until the game ends or MAX_PLIES is reached."""
    rng = random.Random(game_seed)
    board = chess.Board()
    for _ in range(rng.randint(MIN_OPENING_PLIES, MAX_OPENING_PLIES)):
        if board.is_game_over():
            break
        board.push(rng.choice(list(board.legal_moves)))

    while True:
        # claim_draw: like the real data, stop at threefold repetition / fifty moves rather than
        # waiting for the automatic fivefold / seventy-five-move rules
        outcome = board.outcome(claim_draw=True)
        if outcome is not None:
            return game_record(board, outcome.termination.name, outcome.result())
        if len(board.move_stack) >= MAX_PLIES:
            return game_record(board, CAPPED_TERMINATION, "1/2-1/2")
        if engine is None:
            move = heuristic_move(board, rng)
        else:
            # a fresh `game` per game sends ucinewgame, which clears the hash: no state carries
            # over from the previous game this worker happened to play
            move = engine.play(board, limit, game=game_seed).move
        board.push(move)


def game_record(board, termination, result):
    return {"Moves": [move.uci() for move in board.move_stack], "Termination": termination, "Result": result}


def play_games(task):
    """One worker task: a batch of game seeds, played with one engine process."""
    engine_path, limit, game_seeds = task
    if engine_path is None:
        return [play_game(seed, None, None) for seed in game_seeds]
    engine = chess.engine.SimpleEngine.popen_uci(engine_path)
    try:
        engine.configure(ENGINE_OPTIONS)
        return [play_game(seed, engine, limit) for seed in game_seeds]
    finally:
        engine.quit()


# ---- driver --------------------------------------------------------------------------------------

def find_engine(choice):
    """`auto`: Stockfish on PATH or Debian's /usr/games/stockfish, else None (heuristic player)."""
    if choice == "none":
        return None
    if choice != "auto":
        found = shutil.which(choice)  # a path, or a name on PATH
        if found is None:
            sys.exit(f"error: --engine {choice}: no such executable")
        return found
    found = shutil.which("stockfish")
    if found:
        return found
    debian_path = "/usr/games/stockfish"
    return debian_path if os.access(debian_path, os.X_OK) else None


def drop_games(records, exclude, unique):
    """Games in the order played, less those of `exclude` (a set of move tuples) and, if `unique`,
    those that repeat an earlier game. Stockfish is deterministic: two games whose random openings
    coincide are the same game, move for move."""
    seen, kept = set(exclude), []
    for record in records:
        moves = tuple(record["Moves"])
        if moves not in seen:
            if unique:
                seen.add(moves)
            kept.append(record)
    return kept


def generate(games, seed, engine_path, limit, workers):
    # string seeds hash to independent streams; game i is the same whichever worker plays it
    seeds = [f"{seed}:{index}" for index in range(games)]
    tasks = [(engine_path, limit, seeds[start:start + GAMES_PER_TASK]) for start in range(0, games, GAMES_PER_TASK)]
    records = []
    report_every = max(1, len(tasks) // 10)
    with multiprocessing.Pool(workers) as pool:
        for done, batch in enumerate(pool.imap(play_games, tasks), start=1):  # imap keeps game order
            records.extend(batch)
            if done % report_every == 0 or done == len(tasks):
                print(f"  {len(records)}/{games} games", flush=True)
    return records


def write_parquet_atomically(records, out):
    """Written under a temporary name in the same folder, so a crash never leaves half a file."""
    table = pa.Table.from_pylist(records, schema=SCHEMA)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    try:
        pq.write_table(table, partial, compression="zstd", compression_level=19)
        os.replace(partial, out)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def check_and_summarise(out):
    """Reads the file back and replays every game: legal moves and a matching ending, or fail."""
    table = pq.read_table(out)
    if table.schema != SCHEMA:
        sys.exit(f"error: {out} has schema {table.schema}, expected {SCHEMA}")
    games = table.to_pylist()
    for number, game in enumerate(games):
        board = chess.Board()
        for move in game["Moves"]:
            parsed = chess.Move.from_uci(move)
            if parsed not in board.legal_moves:
                sys.exit(f"error: game {number}: illegal move {move} at ply {len(board.move_stack)}")
            board.push(parsed)
        outcome = board.outcome(claim_draw=True)
        ending = (outcome.termination.name, outcome.result()) if outcome else (CAPPED_TERMINATION, "1/2-1/2")
        if ending != (game["Termination"], game["Result"]):
            sys.exit(f"error: game {number}: stored {game['Termination']} {game['Result']}, replay gives {ending}")

    plies = [len(game["Moves"]) for game in games]
    results = collections.Counter(game["Result"] for game in games)
    terminations = collections.Counter(game["Termination"] for game in games)
    print(f"{out}: {len(games)} games, all replay legally; {os.path.getsize(out) / 1e6:.2f} MB")
    print(f"  plies: mean {sum(plies) / len(plies):.1f}, min {min(plies)}, max {max(plies)}")
    print("  results: " + ", ".join(f"{name} {count}" for name, count in results.most_common()))
    print("  terminations: " + ", ".join(f"{name} {count}" for name, count in terminations.most_common()))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", type=int, default=3000, help="number of games (default 3000)")
    parser.add_argument("--seed", type=int, default=0, help="seed for openings and the fallback player")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "chess_sample.parquet",
                        help="parquet file to write (default: chess_sample.parquet next to this script)")
    parser.add_argument("--engine", default="auto",
                        help="path to a UCI engine, 'none' for the heuristic player, or 'auto' (default): "
                             "Stockfish if installed, else the heuristic")
    parser.add_argument("--workers", type=int, default=2, help="parallel games, one engine each (default 2)")
    parser.add_argument("--nodes", type=int, default=DEFAULT_NODES,
                        help=f"Stockfish's search budget per move, in nodes (default {DEFAULT_NODES}); below ~100 "
                             "the time goes to talking to the engine, not to searching")
    parser.add_argument("--unique", action="store_true",
                        help="drop a game that repeats an earlier one move for move (the file then holds fewer "
                             "than --games)")
    parser.add_argument("--exclude", type=Path, action="append", default=[],
                        help="drop games that are also in this parquet file (repeatable): keeps another file's "
                             "held-out games out of this one")
    args = parser.parse_args()
    if min(args.games, args.workers, args.nodes) < 1:
        parser.error("--games, --workers and --nodes must be at least 1")
    return args


def main():
    args = parse_args()
    engine_path = find_engine(args.engine)
    limit = chess.engine.Limit(nodes=args.nodes)
    if engine_path is None:
        print("policy: heuristic fallback (mate > best capture > check > random), no engine")
    else:
        print(f"policy: {engine_path} self-play, {limit}, {ENGINE_OPTIONS}")
    started = time.monotonic()
    records = generate(args.games, args.seed, engine_path, limit, args.workers)
    if args.unique or args.exclude:
        exclude = {tuple(moves) for path in args.exclude
                   for moves in pq.read_table(path, columns=["Moves"]).column("Moves").to_pylist()}
        kept = drop_games(records, exclude, args.unique)
        print(f"dropped {len(records) - len(kept)} games that repeat another"
              + (" or are in " + ", ".join(map(str, args.exclude)) if args.exclude else ""))
        records = kept
    write_parquet_atomically(records, args.out)
    print(f"played and wrote {len(records)} games in {time.monotonic() - started:.0f} s")
    check_and_summarise(args.out)


if __name__ == "__main__":
    main()
