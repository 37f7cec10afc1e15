"""Play chess against a model: whole games against a random mover (or Stockfish), or the model as a
UCI engine that any chess GUI can play against.

    python play.py --model runs/fsdp/final                  # a game against a random mover: board, PGN, GIF
    python play.py --model runs/fsdp/final --games 20       # 20 games, colours alternating: the totals
    python play.py --model runs/fsdp/final --uci            # the UCI protocol on stdin/stdout, for a chess GUI

The model reads the game so far in its own notation (config.json's chess_notation, common/notation.py)
and writes its next move greedily, with no autograd graph kept. When what it writes is not a legal move
there (or not a move at all), that is counted as an illegal attempt and the legal move the model
scores highest is played instead, so every game ends. A game prints the board after each move and
writes the game as PGN (each illegal attempt a comment on the move played instead) and as an
animated GIF; its last line says the result, the plies and the model's illegal attempts. A PGN or
GIF that exists is kept: the game goes beside it (game-2.pgn and game-2.gif, ...). `--games N` plays
N games, the model's side alternating, prints a line per game and the totals (wins, draws, losses,
checkmates given, illegal attempts), and writes every game into the PGN. `--opponent stockfish
--color black` plays Stockfish (if installed) with the model as black. A game ends by the rules
(checkmate, stalemate, a claimable draw) or is adjudicated a draw at --max_plies: 300 plies fill the
built-in model's context.

As a UCI engine it answers every `go` with a legal move (of the `searchmoves`, if given) or
`bestmove 0000` where there is none. A GUI that sends a FEN without the game before it, or a null
move (0000), gets a move too: the model then reads the moves since that position only (an info
string says so), unless the FEN is a position of the game it was sent before.
"""
import asyncio
import datetime
import itertools
import os
import random
import shutil
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import chess
import chess.engine
import chess.pgn

from common.arguments import Parser, at_least
from common.errors import UserError, exit_on_user_error, first_line
from common.notation import first_move, legal_in, model_notation, move_text

REPO = Path(__file__).resolve().parent
# Set before transformers is imported: in UCI mode stdout is the protocol's, and a game's output is the board.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SQUARE_PX = 30  # 240-pixel boards
FRAME_MS, LAST_FRAME_MS = 600, 4000
LIGHT, DARK = (240, 217, 181), (181, 136, 99)
LAST_MOVE, FALLBACK_MOVE = (205, 210, 106), (230, 110, 90)  # the model's fallback moves show in red
GLYPHS = dict(zip("kqrbnp", "♚♛♜♝♞♟"))  # filled glyphs for both sides; white ones get a dark outline


# ---- the model as a player --------------------------------------------------------------------------

class ModelPlayer:
    """The model, its tokenizer and notation, and the KV cache of the game it read last: a game grows a
    move at a time, so each move reads only its own few new tokens, not the whole game again."""

    def __init__(self, name, device):
        import torch

        from common.chess_eval import tokens_per_move
        from common.device import pick_device
        from common.model import load_config, load_model, load_tokenizer
        config = load_config(name)
        self.notation = model_notation(config)
        self.tokenizer = load_tokenizer(name, config)
        self.device = pick_device(device)
        # Inference only: no parameter asks for a gradient, and every forward pass runs under
        # torch.inference_mode() (a thread's own setting: the UCI engine loads the model in one thread
        # and plays in another), so no pass keeps an autograd graph, nor the KV cache one.
        self.model = load_model(name, config=config).to(self.device).eval().requires_grad_(False)
        self.no_graphs = torch.inference_mode
        self.steps = tokens_per_move(self.tokenizer, self.notation)
        # Past the model's positions the oldest moves are dropped, as the legal-move evaluation does.
        self.context = getattr(config, "max_position_embeddings", None) or 4096
        self.ids, self.cache = [], None

    def encode(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, words):
        """The game as the model was trained to read it: BOS, then the moves' words."""
        bos = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]
        return bos + (self.encode(" ".join(words)) if words else [])

    def log_probs_after(self, ids):
        """The next token's log-probabilities after `ids`; the cache then holds exactly `ids`. What the
        cache already holds is kept (cut back to the first token that differs) and only the rest is read."""
        import torch
        same = 0
        while same < min(len(ids) - 1, len(self.ids)) and ids[same] == self.ids[same]:
            same += 1
        if same == 0:
            self.cache = None
        else:
            self.keep_in_cache(same)
        with self.no_graphs():
            out = self.model(input_ids=torch.tensor([ids[same:]], device=self.device),
                             position_ids=torch.arange(same, len(ids), device=self.device)[None],
                             past_key_values=self.cache, use_cache=True)
            self.cache, self.ids = out.past_key_values, list(ids)
            return out.logits[0, -1].float().log_softmax(-1)

    def keep_in_cache(self, count):
        """Drops the cached tokens after the first `count` (crop's negative form: every version has it)."""
        self.ids = self.ids[:count]
        extra = self.cache.get_seq_length() - count
        if extra > 0:
            with self.no_graphs():
                self.cache.crop(-extra)

    def greedy(self, prompt):
        """The tokens_per_move tokens the model writes after `prompt`, each its most likely one, and the
        log-probabilities of the first (to score the legal moves with, if need be)."""
        written, first = [], self.log_probs_after(prompt)
        for _ in range(self.steps):
            written.append(int((self.log_probs_after(prompt + written) if written else first).argmax()))
        return written, first

    def scores(self, prompt, tails, first):
        """The summed log-probability of each tail (a candidate move's tokens) after `prompt`, in one
        forward pass: the tails sit side by side after the prompt's cached keys, and the attention
        mask lets each token see the prompt and its own tail's earlier tokens only. The game is read
        once, and the cache is not copied per candidate (for a 7B model that would be gigabytes).
        `first`: the log-probabilities after the prompt, which scores each tail's first token."""
        with self.no_graphs():
            return self._scores(prompt, tails, first)

    def _scores(self, prompt, tails, first):
        import torch
        self.keep_in_cache(len(prompt))  # the prompt alone: greedy left its own tokens after it
        packed = [token for tail in tails for token in tail]
        owner = torch.tensor([i for i, tail in enumerate(tails) for _ in tail], device=self.device)
        offset = torch.tensor([j for tail in tails for j in range(len(tail))], device=self.device)
        sees = (owner[:, None] == owner[None, :]) & (offset[None, :] <= offset[:, None])
        sees = torch.cat([torch.ones(len(packed), len(prompt), dtype=torch.bool, device=self.device), sees], dim=1)
        dtype = self.model.dtype
        mask = torch.zeros(sees.shape, dtype=dtype, device=self.device).masked_fill(~sees, torch.finfo(dtype).min)
        out = self.model(input_ids=torch.tensor([packed], device=self.device),
                         position_ids=(len(prompt) + offset)[None], attention_mask=mask[None, None],
                         past_key_values=self.cache, use_cache=True)
        self.keep_in_cache(len(prompt))  # back to the game alone
        log_probs = out.logits[0].float().log_softmax(-1)
        totals, start = [], 0
        for tail in tails:  # a tail's first token is scored by the prompt's last position, the rest by its own
            totals.append(float(first[tail[0]]) + sum(float(log_probs[start + j - 1, tail[j]])
                                                      for j in range(1, len(tail))))
            start += len(tail)
        return totals

    def move(self, board, among=None):
        """The model's move on `board`: (its move, None), or, when what it wrote is not a legal move
        there (or not one of `among`, the moves it may choose: UCI's searchmoves), (the move of those
        it scores highest, what it wrote). It reads the moves played since the board's first position:
        the whole game from the start position, or those since a position given as a FEN."""
        words = words_since_root(board, self.notation)
        full = self.prompt(words)
        prompt = full[-(self.context - self.steps):]
        written, first = self.greedy(prompt)
        text = self.tokenizer.decode(written, skip_special_tokens=True)
        moves = list(board.legal_moves) if among is None else list(among)
        if legal_in(board, self.notation, text) and first_move(self.notation, text)[0] in moves:
            return first_move(self.notation, text)[0], None
        candidates = [move_text(board, self.notation, move) for move in moves]
        tails = []
        for candidate in candidates:
            ids = self.prompt(words + [candidate])
            # A tokenizer that splits at spaces writes the game, then the move: the move's tokens are the
            # rest. One that does not gets the move's own tokens.
            tails.append(ids[len(full):] if ids[:len(full)] == full else self.encode(candidate))
        scores = self.scores(prompt, tails, first)
        return moves[max(range(len(moves)), key=scores.__getitem__)], self.attempt(text)

    def attempt(self, text):
        """What the model wrote, cut to one move's words: `N g1 f3`, `e2e4`, or (nothing)."""
        words = text.split()
        count = 1 if self.notation == "uci" else 4 if len(words) > 3 and words[3].startswith("=") else 3
        return " ".join(words[:count]).replace("{", "(").replace("}", ")") or "(nothing)"


def words_since_root(board, notation):
    """The moves played on `board` since its first position, as the notation's words."""
    replay, words = board.root(), []
    for move in board.move_stack:
        words.append(move_text(replay, notation, move))
        replay.push(move)
    return words


def load_player(args):
    return ModelPlayer(args.model, args.device)


# ---- a game against an opponent, with its board, PGN and GIF ------------------------------------------

@contextmanager
def opponent_for(args):
    """(a function from a board to the opponent's move, the opponent's name)."""
    if args.opponent == "random":
        rng = random.Random(args.seed)
        yield (lambda board: rng.choice(list(board.legal_moves))), f"random mover (seed {args.seed})"
        return
    path = shutil.which("stockfish")
    if path is None:
        raise UserError("--opponent stockfish: no `stockfish` on PATH; install it (apt install stockfish, or conda "
                        "install -c conda-forge stockfish) or play the random mover (--opponent random)")
    try:
        engine = chess.engine.SimpleEngine.popen_uci(path)
    except (OSError, chess.engine.EngineError, asyncio.TimeoutError) as err:
        raise UserError(f"cannot start Stockfish at {path} ({first_line(err)})") from None
    limit = chess.engine.Limit(depth=args.stockfish_depth)

    def stockfish_move(board):
        try:
            return engine.play(board, limit).move
        except (chess.engine.EngineError, chess.engine.EngineTerminatedError) as err:
            raise UserError(f"Stockfish ({path}) failed during the game: {first_line(err)}") from None
    try:
        yield stockfish_move, f"Stockfish (depth {args.stockfish_depth})"
    finally:
        engine.close()


class BoardPictures:
    """The boards of a game as GIF frames. Matplotlib draws each piece's glyph once; every frame is
    then the squares and those sprites put together by Pillow (drawing 300 boards of text with
    matplotlib would take longer than the game)."""

    def __init__(self, flipped):
        import numpy as np
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patheffects import withStroke
        from PIL import Image
        self.flipped, self.frames, self.sprites = flipped, [], {}
        figure = Figure(figsize=(SQUARE_PX / 100, SQUARE_PX / 100), dpi=100)
        figure.patch.set_alpha(0)
        canvas = FigureCanvasAgg(figure)
        for symbol in "KQRBNPkqrbnp":
            figure.clear()
            white = symbol.isupper()
            figure.text(0.5, 0.45, GLYPHS[symbol.lower()], ha="center", va="center", family="DejaVu Sans",
                        fontsize=SQUARE_PX * 0.72, color="white" if white else "black",
                        path_effects=[withStroke(linewidth=1.5, foreground="black")] if white else [])
            canvas.draw()
            self.sprites[symbol] = Image.fromarray(np.asarray(canvas.buffer_rgba()).copy())
        # One palette for every frame, made from every piece on every square colour: frames then differ
        # only where pieces moved, and the GIF stores just those squares.
        colours = (LIGHT, DARK, LAST_MOVE, FALLBACK_MOVE)
        sample = Image.new("RGB", (12 * SQUARE_PX, len(colours) * SQUARE_PX))
        for row, colour in enumerate(colours):
            for column, sprite in enumerate(self.sprites.values()):
                tile = Image.new("RGB", (SQUARE_PX, SQUARE_PX), colour)
                tile.paste(sprite, (0, 0), sprite)
                sample.paste(tile, (column * SQUARE_PX, row * SQUARE_PX))
        self.palette = sample.quantize(colors=64)

    def add(self, board, fallback=False):
        """A frame of `board`, its last move's squares marked (in red when the model fell back)."""
        from PIL import Image, ImageDraw
        frame = Image.new("RGB", (8 * SQUARE_PX, 8 * SQUARE_PX))
        draw = ImageDraw.Draw(frame)
        last = board.move_stack[-1] if board.move_stack else None
        for square in chess.SQUARES:
            file, rank = chess.square_file(square), chess.square_rank(square)
            x, y = (7 - file, rank) if self.flipped else (file, 7 - rank)  # white at the bottom, unless flipped
            corner = (x * SQUARE_PX, y * SQUARE_PX)
            colour = DARK if (file + rank) % 2 == 0 else LIGHT
            if last and square in (last.from_square, last.to_square):
                colour = FALLBACK_MOVE if fallback else LAST_MOVE
            draw.rectangle((*corner, corner[0] + SQUARE_PX - 1, corner[1] + SQUARE_PX - 1), fill=colour)
            piece = board.piece_at(square)
            if piece:
                sprite = self.sprites[piece.symbol()]
                frame.paste(sprite, corner, sprite)
        self.frames.append(frame.quantize(palette=self.palette, dither=Image.Dither.NONE))

    def save(self, file):
        durations = [FRAME_MS] * (len(self.frames) - 1) + [LAST_FRAME_MS]
        self.frames[0].save(file, format="GIF", save_all=True, append_images=self.frames[1:], duration=durations,
                            loop=0)


class Played(NamedTuple):
    """How a game went, for the model."""
    result: str  # 1-0, 0-1, 1/2-1/2
    termination: str
    plies: int
    color: str  # the model's
    attempts: int  # its illegal attempts
    moves: int  # its moves

    @property
    def outcome(self):
        """win, draw or loss, for the model."""
        return "draw" if self.result == "1/2-1/2" else "win" if (self.result == "1-0") == (self.color == "white") \
            else "loss"

    def __str__(self):
        return (f"result {self.result} ({self.termination}), {self.plies} plies; the model ({self.color}) made "
                f"{self.attempts} illegal attempts in its {self.moves} moves")


def play_game(args, player, opponent, opponent_name, color, show=True):
    """Plays a game to its end, the model as `color`; with `show`, prints each move and board and
    draws the GIF's frames. Returns the PGN game, the pictures (None without `show`) and Played."""
    board, game = chess.Board(), chess.pgn.Game()
    model_side = chess.WHITE if color == "white" else chess.BLACK
    model_name = f"{args.model} ({player.notation} notation)"
    game.headers.update(Event="play.py", Site="-", Date=datetime.date.today().strftime("%Y.%m.%d"), Round="-",
                        White=model_name if model_side == chess.WHITE else opponent_name,
                        Black=opponent_name if model_side == chess.WHITE else model_name)
    pictures = BoardPictures(flipped=model_side == chess.BLACK) if show else None
    if show:
        pictures.add(board)
    node, model_moves, attempts = game, 0, 0
    while not board.is_game_over(claim_draw=True) and board.ply() < args.max_plies:
        attempt = None
        if board.turn == model_side:
            move, attempt = player.move(board)
            model_moves += 1
        else:
            move = opponent(board)
        number = f"{board.fullmove_number}{'.' if board.turn == chess.WHITE else '...'}"
        san = board.san(move)
        board.push(move)
        node = node.add_variation(move)
        who = "model" if board.turn != model_side else "opponent"
        if attempt is not None:
            attempts += 1
            node.comment = f"illegal attempt: {attempt} (played instead: the legal move the model scores highest)"
            who += f", illegal attempt: {attempt}; played its best-scored legal move"
        if show:
            print(f"{number} {san}   ({who})\n{board}\n", flush=True)
            pictures.add(board, fallback=attempt is not None)
    outcome = board.outcome(claim_draw=True)
    if outcome is None:  # --max_plies reached: adjudicated a draw, as match software does at a move limit
        result, termination = "1/2-1/2", f"adjudication: {args.max_plies} plies (--max_plies)"
    else:
        result, termination = outcome.result(), outcome.termination.name.lower().replace("_", " ")
    game.headers.update(Result=result, Termination=termination)
    return game, pictures, Played(result, termination, board.ply(), color, attempts, model_moves)


def play_games(args, player, opponent, opponent_name):
    """--games N: N games, the model's colour alternating from --color; a line per game, then the
    totals. Returns the PGN games and the totals' line."""
    colors = [args.color, "black" if args.color == "white" else "white"]
    games, played = [], []
    for number in range(1, args.games + 1):
        game, _, outcome = play_game(args, player, opponent, opponent_name, colors[(number - 1) % 2], show=False)
        game.headers["Round"] = str(number)
        games.append(game)
        played.append(outcome)
        print(f"game {number} of {args.games}: {outcome}", flush=True)
    return games, totals(played, opponent_name)


def totals(played, opponent_name):
    """One line: wins, draws and losses, the checkmates the model gave and its illegal attempts."""
    count = {outcome: sum(game.outcome == outcome for game in played) for outcome in ("win", "draw", "loss")}
    mates = sum(game.outcome == "win" and game.termination == "checkmate" for game in played)
    moves, attempts = sum(game.moves for game in played), sum(game.attempts for game in played)
    as_white = sum(game.color == "white" for game in played)
    return (f"{len(played)} games against the {opponent_name}, the model white in {as_white} and black in "
            f"{len(played) - as_white}: {count['win']} wins, {count['draw']} draws, {count['loss']} losses; "
            f"{mates} checkmates given; {attempts} illegal attempts in its {moves} moves "
            f"({100 * attempts / max(1, moves):.1f}%)")


def numbered(path, number):
    return path if number == 1 else path.with_name(f"{path.stem}-{number}{path.suffix}")


def output_paths(args):
    """The PGN's and the GIF's paths (no GIF with --games N > 1), their folders made and tried
    before a move is played. A file that exists is never replaced: the game goes beside it, under
    the first numbered name that is free for both (game-2.pgn and game-2.gif, ...)."""
    pgn = Path(args.pgn)
    gif = None if args.games > 1 else Path(args.gif) if args.gif else pgn.with_suffix(".gif")
    for path, option in ((pgn, "--pgn"), (gif, "--gif")):
        if path is not None and path.is_dir():
            raise UserError(f"{option} {path} is a folder: name a file in it")
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                probe = path.parent / f".play-write-test-{os.getpid()}"
                probe.touch()
                probe.unlink()
            except OSError as err:
                raise UserError(f"cannot write {option} {path} ({err.strerror}): choose another {option}") from None
    number = next(n for n in itertools.count(1) if not any(
        numbered(path, n).exists() for path in (pgn, gif) if path is not None))
    return numbered(pgn, number), gif and numbered(gif, number)


def write_outputs(pgn, gif, games, pictures):
    """The PGN (every game) and the GIF (one game); a file that appeared meanwhile is not replaced."""
    try:
        with pgn.open("x", encoding="utf-8") as file:
            file.write("".join(str(game) + "\n\n" for game in games))
        if gif is not None:
            with gif.open("xb") as file:
                pictures.save(file)
    except OSError as err:
        raise UserError(f"cannot write the game ({err.strerror}: {err.filename}): choose another --pgn/--gif") from None
    print(f"wrote {pgn}" + (f" and {gif}" if gif else ""), flush=True)


# ---- the UCI protocol ---------------------------------------------------------------------------------

UNKNOWN_PAST = ("the game before this position is unknown: the model reads only the moves played since, as if "
                "the game had started there (send `position startpos moves ...` for the whole game)")


def uci_position(words, previous):
    """The board a `position` command sets up, and the info strings to send. The model reads a game
    from its start: `startpos moves ...` gives it all; a FEN the game before it only if it is a
    position of the `previous` board's game (as a GUI that sends the current position gives it);
    otherwise the model reads the moves since that position, and so after a null move (0000),
    which no notation can write. A position that cannot be set up: (None, why)."""
    moves = words[words.index("moves") + 1:] if "moves" in words else []
    if words[:1] == ["fen"]:
        try:
            board = chess.Board(" ".join(words[1:words.index("moves") if "moves" in words else len(words)]))
        except ValueError as err:
            return None, [f"position: not a FEN ({first_line(err)}); position ignored"]
        board = earlier_position(previous, board.fen()) or board
    elif words[:1] == ["startpos"]:
        board = chess.Board()
    else:
        return None, ["position: expected startpos or fen; position ignored"]
    for text in moves:
        try:
            move = chess.Move.from_uci(text)
        except ValueError:
            move = None
        if move is not None and not move:  # a null move: the side to move passes
            board.push(move)
            board = chess.Board(board.fen())
        elif move is None or move not in board.legal_moves:
            return None, [f"position: {text} is not a legal move in that game; position ignored"]
        else:
            board.push(move)
    if not board.is_valid():
        return None, ["position: not a position of a legal game (board.status() is not valid); position ignored"]
    return board, [] if board.root() == chess.Board() else [UNKNOWN_PAST]


def earlier_position(game, fen):
    """`game` (a board) as it stood at the latest of its positions that `fen` describes, or None."""
    if game is None:
        return None
    replay, found = game.root(), None
    for move in [None, *game.move_stack]:
        if move is not None:
            replay.push(move)
        if replay.fen() == fen:
            found = replay.copy()
    return found


def uci_go(player, board, words):
    """The lines that answer `go`: the model's move, said at once (whatever the limits), of the
    `searchmoves` if there are any; `bestmove 0000` where there is no move to make."""
    if board is None:
        return ["info string no position to play from (the last position command was refused)", "bestmove 0000"]
    legal = list(board.legal_moves)
    if not legal:  # checkmate or stalemate
        return ["bestmove 0000"]
    wanted = search_moves(words)
    among = [move for move in legal if move.uci() in wanted] if wanted else legal
    lines = []
    if wanted and not among:
        lines.append(f"info string searchmoves: none of {' '.join(wanted)} is legal here; any legal move may be played")
        among = legal
    try:
        move, attempt = player.move(board, among)
    except Exception as err:  # the GUI waits for bestmove whatever happens: say why, and play a legal move
        print(f"play.py: the model failed on {board.fen()}: {first_line(err)}", file=sys.stderr, flush=True)
        return [f"info string the model failed here ({first_line(err)}): playing {among[0].uci()}",
                f"bestmove {among[0].uci()}"]
    if attempt is not None:
        lines.append(f"info string illegal attempt: {attempt} (playing the legal move the model scores highest)")
    return lines + [f"bestmove {move.uci()}"]


GO_WORDS = {"searchmoves", "ponder", "wtime", "btime", "winc", "binc", "movestogo", "depth", "nodes", "mate",
            "movetime", "infinite"}


def search_moves(words):
    """The moves after `searchmoves` in a `go` command, up to its next keyword."""
    if "searchmoves" not in words:
        return []
    after = words[words.index("searchmoves") + 1:]
    return list(itertools.takewhile(lambda word: word not in GO_WORDS, after))


def uci_loop(args):
    """Reads commands until `quit` or the end of stdin. The model loads in the background, so that
    `uci` is answered at once (GUIs wait only seconds for uciok); isready and go wait for it."""
    protocol, sys.stdout = sys.stdout, sys.stderr  # anything else printed (a library's notice) goes to stderr
    if hasattr(sys.stdin, "reconfigure"):  # a stray byte is an unknown command, not the end of the engine
        sys.stdin.reconfigure(errors="replace")
    loaded = {}

    def load():
        try:
            loaded["player"] = load_player(args)
        except BaseException as err:  # raised again in the main thread: a UserError is its one error line
            loaded["error"] = err
    loader = threading.Thread(target=load, daemon=True)
    loader.start()

    def player():
        loader.join()
        if "error" in loaded:
            raise loaded["error"]
        return loaded["player"]

    def say(*lines):
        for line in lines:
            print(line, file=protocol, flush=True)

    board, held = chess.Board(), []
    for line in sys.stdin:
        command, *words = line.split() or [""]
        if command == "uci":
            say(f"id name chess-kit {args.model}", "id author chess-kit play.py", "uciok")
        elif command == "isready":
            player()
            say("readyok")
        elif command == "ucinewgame":
            board = chess.Board()
        elif command == "position":
            board, notes = uci_position(words, board)
            say(*(f"info string {note}" for note in notes))
        elif command == "go":
            answer = uci_go(player(), board, words)
            if "infinite" in words or "ponder" in words:  # the protocol wants bestmove only after stop
                held = answer
            else:
                say(*answer)
        elif command in ("stop", "ponderhit"):
            say(*held)
            held = []
        elif command == "quit":
            break
        elif command:  # debug, setoption, register, ...: there are no options to set
            print(f"play.py: ignored UCI command {line.strip()!r}", file=sys.stderr, flush=True)


# ---- main ---------------------------------------------------------------------------------------------

def arguments(argv=None):
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("model", default=str(REPO / "demo" / "model"),
               help="the model's directory (a final/ folder of a run, or the built-in demo) or Hugging Face id")
    parser.add("uci", action="store_true", help="speak UCI on stdin/stdout for a chess GUI, instead of one game")
    parser.add("opponent", choices=["random", "stockfish"], default="random",
               help="who the model plays: a random mover (--seed), or Stockfish if installed (--stockfish_depth)")
    parser.add("color", choices=["white", "black"], default="white", help="the model's side (in the first game)")
    parser.add("games", type=at_least(1), default=1,
               help="games to play, the model's side alternating from --color: a line per game and the totals "
                    "(wins, draws, losses, checkmates given, illegal attempts); every game into the PGN, no boards "
                    "and no GIF when more than 1")
    parser.add("seed", type=int, default=0, help="the random mover's seed")
    parser.add("stockfish_depth", type=at_least(1), default=1, help="Stockfish's search depth per move (1: weakest)")
    parser.add("max_plies", type=at_least(1), default=300, help="adjudicate a draw after this many plies")
    parser.add("pgn", default="runs/play/game.pgn",
               help="where the game is written as PGN; if the file exists, it is kept and the game goes beside it "
                    "(game-2.pgn, ...)")
    parser.add("gif", default=None, help="where the animated GIF goes (default: the --pgn path with .gif)")
    parser.add("device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when a GPU is usable")
    args = parser.parse_args(argv)
    # Under --uci the GUI chooses the sides, runs the games and keeps their record: only --model and --device apply.
    ignored = [name for name in vars(args) if name not in ("model", "device", "uci")
               and getattr(args, name) != parser.get_default(name)]
    if args.uci and ignored:
        raise UserError(f"{', '.join('--' + name for name in ignored)} do{'es' if len(ignored) == 1 else ''} not apply "
                        "to --uci (the chess GUI chooses the sides, plays the games and keeps their record): leave "
                        f"{'it' if len(ignored) == 1 else 'them'} out, or play without --uci")
    if not args.pgn.strip():
        raise UserError("--pgn is empty: name the file the game is written to, e.g. --pgn runs/play/game.pgn")
    if args.gif is not None and args.games > 1:
        raise UserError("--gif draws one game: leave it out with --games (every game goes into the PGN)")
    if args.gif is not None and Path(args.gif).suffix.lower() != ".gif":
        raise UserError(f"--gif {args.gif!r}: the animation is a GIF file; give it a name that ends in .gif")
    gif = Path(args.gif) if args.gif else Path(args.pgn).with_suffix(".gif")
    if args.games == 1 and gif.resolve() == Path(args.pgn).resolve():
        raise UserError(f"--pgn {args.pgn} would be overwritten by the game's GIF ({gif}): name the PGN "
                        f"{Path(args.pgn).with_suffix('.pgn')}, or the GIF with --gif")
    return args


def main(argv=None):
    args = arguments(argv)
    if args.uci:
        return uci_loop(args)
    pgn, gif = output_paths(args)
    with opponent_for(args) as (opponent, opponent_name):  # a missing Stockfish is said before the model loads
        player = load_player(args)
        if args.games > 1:
            (games, summary), pictures = play_games(args, player, opponent, opponent_name), None
        else:
            game, pictures, summary = play_game(args, player, opponent, opponent_name, args.color)
            games = [game]
    write_outputs(pgn, gif, games, pictures)
    if pgn != Path(args.pgn):
        print(f"({args.pgn} exists: kept; {'this game is' if len(games) == 1 else 'these games are'} in {pgn})",
              flush=True)
    print(summary, flush=True)


if __name__ == "__main__":
    exit_on_user_error(main)
