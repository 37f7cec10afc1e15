"""play.py: whole games of a model against a random mover (board, PGN, GIF, illegal attempts counted),
and the model as a UCI engine driven by python-chess's own engine client. Real processes and real
models: the built-in demo (piece notation, a token per word) and a Hugging Face Llama whose UCI moves
are sub-word tokens, built here."""
import os
import random
import re
import subprocess
import sys

import chess
import chess.engine
import chess.pgn
import pytest
from PIL import Image

from common.notation import move_text, words_of
from conftest import REPO, run_python

PLAY = str(REPO / "play.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
SUMMARY = re.compile(r"^result (\S+) \((.+)\), (\d+) plies; the model \((white|black)\) made (\d+) illegal attempts "
                     r"in its (\d+) moves$")
UCI_PLIES = 40  # a cap on the UCI games, which otherwise may run to the 75-move rule


def play(*args, env=ENV):
    return run_python([PLAY, *args], env=env, timeout=300)


@pytest.fixture(scope="module")
def sub_word_model(tmp_path_factory):
    """A real Hugging Face Llama whose UCI moves are two or three sub-word tokens (e2 ##e4, a7 ##a8 ##q),
    saved with save_pretrained; its config.json names no notation, so it reads UCI. Its weights make
    it a bigram model (every decoder layer adds nothing, so the next token depends on the last one
    only), and the table makes it open e2e4, then write g1f3 on every later move: legal on its second
    move, illegal from the third on. A game shows both its moves as written and its fallbacks."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    torch.set_num_threads(1)
    squares = [file + rank for file in "abcdefgh" for rank in "12345678"]
    words = ["<pad>", "<unk>", "<s>", "</s>", *squares, *("##" + s for s in squares), *("##" + p for p in "qrbn")]
    core = Tokenizer(models.WordPiece({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    assert tokenizer("e2e4 a7a8q", add_special_tokens=False)["input_ids"] == [
        words.index(w) for w in ("e2", "##e4", "a7", "##a8", "##q")]
    size = 144  # at least the 136 tokens, and 4 heads of 36
    config = LlamaConfig(vocab_size=size, hidden_size=size, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    after = {"<s>": "e2", "e2": "##e4", "g1": "##f3", **{"##" + square: "g1" for square in squares}}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(size))
        model.lm_head.weight.zero_()
        for before, token in after.items():
            model.lm_head.weight[words.index(token), words.index(before)] = 1.0
    out = tmp_path_factory.mktemp("sub_word") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def uci_engine(model):
    """`play.py --uci` started by python-chess's engine client."""
    engine = chess.engine.SimpleEngine.popen_uci([sys.executable, PLAY, "--model", str(model), "--uci"],
                                                 timeout=120, env=ENV, cwd=REPO)
    assert engine.id["name"] == f"chess-kit {model}"
    return engine


def uci_game(engine, model_color, seed, max_plies=UCI_PLIES):
    """A game of the engine against random moves (the client refuses an illegal bestmove): the final
    board and, per model move, its info string or None. A new game object makes the client send
    ucinewgame."""
    rng, board, notes, game = random.Random(seed), chess.Board(), [], object()
    while not board.is_game_over(claim_draw=True) and board.ply() < max_plies:
        if board.turn == model_color:
            result = engine.play(board, chess.engine.Limit(time=0.1), game=game, info=chess.engine.INFO_BASIC)
            assert result.move in board.legal_moves
            notes.append(result.info.get("string"))
            board.push(result.move)
        else:
            board.push(rng.choice(list(board.legal_moves)))
    return board, notes


def test_a_game_against_the_random_mover(demo, tmp_path):
    """The untrained demo model as black (a game that ends by repetition in about 50 plies): a PGN
    python-chess reads back as the finished game, every move legal, the illegal attempts printed as
    many as the PGN's comments, and a GIF with a frame per position."""
    pgn = tmp_path / "out" / "game.pgn"
    result = play("--model", demo / "model", "--pgn", pgn, "--seed", 4, "--color", "black")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    summary = SUMMARY.match(lines[-1])
    assert summary, lines[-1]
    outcome, termination, plies, side, attempts, moves = summary.groups()
    with pgn.open() as file:
        game = chess.pgn.read_game(file)
    assert not game.errors  # every move parsed, and legal where it was played
    board = game.end().board()
    assert board.ply() == int(plies) and len(board.move_stack) == int(plies) > 2
    assert game.headers["Result"] == outcome and game.headers["Termination"] == termination
    if board.is_game_over(claim_draw=True):
        assert outcome == board.result(claim_draw=True)
    else:  # adjudicated at --max_plies
        assert int(plies) == 300 and outcome == "1/2-1/2"
    assert side == "black" and game.headers["Black"].startswith(str(demo / "model"))
    assert int(moves) == int(plies) // 2
    comments = [node for node in game.mainline() if node.comment.startswith("illegal attempt")]
    assert len(comments) == int(attempts) <= int(moves)
    assert all(node.turn() == chess.WHITE for node in comments)  # on the model's (black's) moves only
    assert sum("(model, illegal attempt: " in line for line in lines) == int(attempts)
    # Each move printed in SAN, with the board after it
    sans = [line.split()[1] for line in lines if re.match(r"^\d+\.(\.\.)? ", line)]
    assert sans == [node.san() for node in game.mainline()]
    assert str(board) in result.stdout
    gif = pgn.with_suffix(".gif")
    assert gif.read_bytes()[:6] == b"GIF89a"
    with Image.open(gif) as picture:
        assert picture.n_frames == int(plies) + 1 and picture.size == (240, 240)


def test_uci_games_of_the_built_in_model(demo):
    """One engine, a game on each side: every bestmove legal, the untrained model's illegal attempts
    said in info strings."""
    engine = uci_engine(demo / "model")
    try:
        for color, seed in ((chess.WHITE, 1), (chess.BLACK, 2)):
            board, notes = uci_game(engine, color, seed)
            assert board.is_game_over(claim_draw=True) or board.ply() == UCI_PLIES
            assert len(notes) == (board.ply() + (color == chess.WHITE)) // 2
            assert all(note is None or note.startswith("illegal attempt: ") for note in notes)
        engine.quit()
    finally:
        engine.close()


def test_uci_game_of_a_sub_word_model(sub_word_model, tmp_path):
    """The bigram model's moves as written while legal (e2e4, g1f3), its fallbacks after; and only
    protocol on stdout. A position that is not from the start gets a legal move too, with a word on
    what the model reads (issue 36, case 6)."""
    after_e4 = "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1"
    commands = ["uci", "isready", "ucinewgame", f"position fen {after_e4}", "go depth 3",
                f"position fen {chess.STARTING_FEN} moves e2e4 e7e5", "go movetime 100", "stop",
                "position startpos moves e2e4 e7e5 g1f3 b8c6", "go infinite", "isready", "stop", "quit"]
    raw = subprocess.Popen([sys.executable, PLAY, "--model", str(sub_word_model), "--uci"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    engine = uci_engine(sub_word_model)
    try:
        board, notes = uci_game(engine, chess.WHITE, seed=4, max_plies=20)
        engine.quit()
    finally:
        engine.close()
    stdout, stderr = raw.communicate("\n".join(commands) + "\n", timeout=120)
    assert raw.returncode == 0, stderr[-3000:]
    assert [m.uci() for m in board.move_stack[0:4:2]] == ["e2e4", "g1f3"] and notes[:2] == [None, None]
    assert notes[2] == "illegal attempt: g1f3 (playing the legal move the model scores highest)"
    assert all(note is not None for note in notes[2:])
    lines = stdout.splitlines()
    assert lines[6].startswith("bestmove ") and chess.Move.from_uci(lines[6].split()[1]) in chess.Board(
        after_e4).legal_moves
    assert lines[:6] + lines[7:-1] == [
        f"id name chess-kit {sub_word_model}", "id author chess-kit play.py", "uciok", "readyok",
        "info string the game before this position is unknown: the model reads only the moves played since, as if "
        "the game had started there (send `position startpos moves ...` for the whole game)",
        "info string illegal attempt: e2e4 (playing the legal move the model scores highest)",  # white's first
        "bestmove g1f3",
        "readyok", "info string illegal attempt: g1f3 (playing the legal move the model scores highest)"]
    assert re.fullmatch(r"bestmove [a-h][1-8][a-h][1-8]", last_line := stdout.splitlines()[-1]), last_line


def test_a_missing_model_is_one_error_line(tmp_path):
    missing = tmp_path / "no_model"
    uci = subprocess.Popen([sys.executable, PLAY, "--model", str(missing), "--uci"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    game = play("--model", missing)
    stdout, stderr = uci.communicate("uci\nisready\n", timeout=120)
    for result_stderr, code in ((game.stderr, game.returncode), (stderr, uci.returncode)):
        lines = result_stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: model {missing} is neither"), lines
    assert game.stdout == "" and stdout.splitlines()[-1] == "uciok"


@pytest.mark.quick
def test_stockfish_asked_for_but_missing(tmp_path):
    result = play("--opponent", "stockfish", env={**ENV, "PATH": str(tmp_path)})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: --opponent stockfish: no `stockfish` on PATH") and result.stderr.count(
        "\n") == 1


def test_stockfish_opponent_through_its_uci_engine(sub_word_model, tmp_path):
    """--opponent stockfish drives whatever `stockfish` is on PATH over UCI: here play.py's own UCI
    engine stands in (Stockfish is not installed on every machine)."""
    stand_in = tmp_path / "bin" / "stockfish"
    stand_in.parent.mkdir()
    stand_in.write_text(f"#!/bin/sh\nexec {sys.executable} {PLAY} --model {sub_word_model} --uci\n")
    stand_in.chmod(0o755)
    pgn = tmp_path / "game.pgn"
    result = play("--model", sub_word_model, "--opponent", "stockfish", "--color", "white", "--max_plies", 8,
                  "--pgn", pgn, env={**ENV, "PATH": f"{stand_in.parent}{os.pathsep}{ENV['PATH']}"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    with pgn.open() as file:
        game = chess.pgn.read_game(file)
    assert game.headers["Black"] == "Stockfish (depth 1)" and game.headers["Termination"].startswith("adjudication")
    moves = list(game.mainline())
    assert [node.uci() for node in moves[:3:2]] == ["e2e4", "g1f3"]  # the model's first two moves, as written
    assert not moves[0].comment and not moves[2].comment and moves[4].comment.startswith("illegal attempt: g1f3")
    assert result.stdout.strip().splitlines()[-1].endswith("made 2 illegal attempts in its 4 moves")


def test_one_pass_scores_each_legal_move_as_its_own_pass_would(demo):
    """The legal moves' tokens sit side by side after the game's cached keys, kept apart by the
    attention mask: each move's summed log-probability is what a forward pass of the game and that
    move alone gives, and the cache holds the game again afterwards."""
    import torch

    import play
    torch.set_num_threads(1)
    player = play.ModelPlayer(str(demo / "model"), "cpu")
    board, rng = chess.Board(), random.Random(0)
    for _ in range(30):
        board.push(rng.choice(list(board.legal_moves)))
    words = words_of(player.notation, [move.uci() for move in board.move_stack])
    prompt = player.prompt(words)
    written, first = player.greedy(prompt)
    tails = [player.prompt(words + [move_text(board, "piece", move)])[len(prompt):] for move in board.legal_moves]
    assert {len(tail) for tail in tails} <= {3, 4} and 3 in {len(tail) for tail in tails}  # piece, from, to (+)
    one_pass = player.scores(prompt, tails, first)
    for tail, score in zip(tails, one_pass):
        log_probs = player.model(input_ids=torch.tensor([prompt + tail])).logits[0].log_softmax(-1)
        alone = sum(float(log_probs[len(prompt) - 1 + i, token]) for i, token in enumerate(tail))
        assert abs(score - alone) < 1e-4
    assert player.greedy(prompt)[0] == written


# ---- issue 36: the UCI engine survives every line a GUI sends, and answers every go ------------------------

FOOLS_MATE = "rnb1kbnr/pppp1ppp/8/4p3/6Pq/5P2/PPPPP2P/RNBQKBNR w KQkq - 1 3"  # white is mated
STALEMATE = "7k/5Q2/6K1/8/8/8/8/8 b - - 0 1"
AFTER_E4 = "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1"  # as python-chess sends it


def board_of(fen=chess.STARTING_FEN, moves=()):
    board = chess.Board(fen)
    for move in moves:
        board.push_uci(move)
    return board


def test_uci_answers_every_go_a_gui_sends(demo):
    """Cases 6-8: a FEN with or without the game before it, null moves, searchmoves, checkmate and
    stalemate, positions that cannot be set up, options and noise: every `go` gets exactly one
    bestmove, a legal move of the position (of the searchmoves, if any) or 0000 where there is
    none; the engine lives on to `quit`."""
    unknown = "info string the game before this position is unknown"
    # (position command, go command, the board the answer must be legal on (None: bestmove 0000), note expected)
    cases = [
        (f"position fen {AFTER_E4}", "go depth 3", board_of(AFTER_E4), True),
        ("position startpos moves 0000", "go", board_of(moves=["0000"]), True),
        ("position startpos moves e2e4 0000", "go wtime 1000 btime 1000", board_of(moves=["e2e4", "0000"]), True),
        ("position startpos moves e2e4", "go searchmoves e7e5 d7d5 movetime 50", board_of(moves=["e2e4"]), False),
        (f"position fen {chess.STARTING_FEN} moves e2e4 e7e5", "go searchmoves d2d4 b1c3",
         board_of(moves=["e2e4", "e7e5"]), False),
        ("position startpos moves e2e4 e7e5", "go searchmoves e2e4 a1a8", board_of(moves=["e2e4", "e7e5"]), False),
        # the position the last game reached, as a FEN: the game before it is known
        (f"position fen {board_of(moves=['e2e4', 'e7e5']).fen()} moves g1f3", "go",
         board_of(moves=["e2e4", "e7e5", "g1f3"]), False),
        (f"position fen {FOOLS_MATE}", "go", None, True),
        (f"position fen {STALEMATE}", "go infinite", None, True),
        ("position startpos moves e2e5", "go", None, False),
        ("position fen not a fen", "go", None, False),
        ("position", "go", None, False),
        ("position fen 8/8/8/8/8/8/8/8 w - - 0 1", "go", None, False),  # no kings
    ]
    searchmoves = {3: {"e7e5", "d7d5"}, 4: {"d2d4", "b1c3"}}
    commands = ["uci", "debug on", "setoption name Hash value 16", "", "isready", "ucinewgame"]
    for position, go, _, _ in cases:
        commands += [position, go] + (["stop"] if "infinite" in go else [])
    commands += ["register later", "\x00\x01", "isready", "quit"]
    engine = subprocess.Popen([sys.executable, PLAY, "--model", str(demo / "model"), "--uci"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    stdout, stderr = engine.communicate("\n".join(commands) + "\n", timeout=180)
    assert engine.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    lines = stdout.splitlines()
    assert lines[:4] == [f"id name chess-kit {demo / 'model'}", "id author chess-kit play.py", "uciok", "readyok"]
    assert lines[-1] == "readyok"
    answers, notes = [], []
    for line in lines[4:-1]:
        notes.append(line)
        if line.startswith("bestmove "):
            answers.append((line.split()[1], notes))
            notes = []
    assert len(answers) == len(cases), lines
    for number, ((position, go, board, note), (answer, said)) in enumerate(zip(cases, answers)):
        if board is None:
            assert answer == "0000", (position, answer)
        else:
            assert chess.Move.from_uci(answer) in board.legal_moves, (position, answer)
            assert answer in searchmoves.get(number, {answer}), (go, answer)
        assert any(line.startswith(unknown) for line in said) == note, (position, said)
    assert "searchmoves: none of e2e4 a1a8 is legal here" in stdout


def test_python_chess_client_plays_from_a_fen_with_null_moves_and_root_moves(sub_word_model):
    """What a GUI does through python-chess: a board set up from a FEN, a null move pushed, the
    moves to choose from restricted (sent as searchmoves)."""
    engine = uci_engine(sub_word_model)
    try:
        board = chess.Board(AFTER_E4)
        assert engine.play(board, chess.engine.Limit(time=0.1)).move in board.legal_moves
        board = chess.Board()
        board.push_uci("e2e4")
        board.push(chess.Move.null())
        assert engine.play(board, chess.engine.Limit(time=0.1)).move in board.legal_moves
        board = chess.Board()
        only = [chess.Move.from_uci("a2a3"), chess.Move.from_uci("h2h4")]
        assert engine.play(board, chess.engine.Limit(time=0.1), root_moves=only).move in only  # e2e4 unless limited
        assert not engine.play(chess.Board(FOOLS_MATE), chess.engine.Limit(time=0.1)).move  # bestmove 0000: null
        engine.quit()
    finally:
        engine.close()


# ---- issue 36: a game's files never replace what exists; bad output options before the game ---------------

def test_an_existing_game_is_kept_and_the_next_goes_beside_it(demo, tmp_path):
    """Case 4: --pgn PATH where PATH and its GIF exist (the default path on a second game): both are
    kept, and the game goes to game-2.pgn and game-2.gif; then to game-3.*."""
    pgn = tmp_path / "game.pgn"
    pgn.write_text("a user's game\n")
    pgn.with_suffix(".gif").write_bytes(b"a user's picture")
    for number in (2, 3):
        result = play("--model", demo / "model", "--pgn", pgn, "--max_plies", 4)
        assert result.returncode == 0, result.stderr[-3000:]
        written = tmp_path / f"game-{number}.pgn"
        assert f"wrote {written} and {written.with_suffix('.gif')}" in result.stdout
        assert f"({pgn} exists: kept; this game is in {written})" in result.stdout
        with written.open() as file:
            assert chess.pgn.read_game(file).end().board().ply() == 4
        assert written.with_suffix(".gif").read_bytes()[:6] == b"GIF89a"
    assert pgn.read_text() == "a user's game\n" and pgn.with_suffix(".gif").read_bytes() == b"a user's picture"


@pytest.mark.quick
@pytest.mark.parametrize("options, says", [
    (["--pgn", "{tmp}/x.gif"], "--pgn {tmp}/x.gif would be overwritten by the game's GIF"),  # case 5
    (["--gif", "{tmp}/anim"], "--gif '{tmp}/anim': the animation is a GIF file"),  # case 15
    (["--pgn", ""], "--pgn is empty"),  # case 15
    (["--pgn", "{tmp}"], "--pgn {tmp} is a folder"),
    (["--games", "2", "--gif", "{tmp}/a.gif"], "--gif draws one game"),
    (["--games", "0"], "--games must be at least 1 (got 0)"),
    (["--max_plies", "0"], "--max_plies must be at least 1 (got 0)"),
    (["--uci", "--games", "5", "--pgn", "{tmp}/y.pgn"], "--games, --pgn do not apply to --uci"),  # issue 43 case 7
    (["--uci", "--opponent", "stockfish"], "--opponent does not apply to --uci"),
])
def test_bad_output_options_are_one_line_before_the_game(tmp_path, options, says):
    """Refused before the model loads: one error line, nothing played, nothing written."""
    (tmp_path / "x.gif").write_bytes(b"kept")
    result = play(*[option.format(tmp=tmp_path) for option in options])
    assert result.returncode == 2 and result.stdout == "", result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.startswith("error: " + says.format(tmp=tmp_path)) and result.stderr.count("\n") == 1, \
        result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["x.gif"]
    assert (tmp_path / "x.gif").read_bytes() == b"kept"


# ---- issue 35, point 2: games against the random mover, counted ----------------------------------------------

def test_games_against_the_random_mover_are_counted(demo, tmp_path):
    """--games 4: the colours alternate, a line per game, and the totals add up to the games in the
    PGN (results, checkmates, the illegal attempts commented on the model's moves)."""
    pgn = tmp_path / "games.pgn"
    result = play("--model", demo / "model", "--games", 4, "--max_plies", 40, "--color", "black", "--pgn", pgn)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    games = []
    with pgn.open() as file:
        while (game := chess.pgn.read_game(file)) is not None:
            games.append(game)
    assert len(games) == 4 and not (tmp_path / "games.gif").exists() and "\n. . ." not in result.stdout  # no boards
    colors = ["black", "white", "black", "white"]
    wins = draws = losses = mates = attempts = moves = 0
    for number, (game, color) in enumerate(zip(games, colors), start=1):
        summary = SUMMARY.match(lines[number - 1].removeprefix(f"game {number} of 4: "))
        assert summary and summary[4] == color, lines[number - 1]
        model_is_white = color == "white"
        assert game.headers["White" if model_is_white else "Black"].startswith(str(demo / "model"))
        assert game.headers["Result"] == summary[1] and game.headers["Round"] == str(number)
        board = game.end().board()
        assert board.ply() == int(summary[3]) <= 40
        won = summary[1] == ("1-0" if model_is_white else "0-1")
        wins, draws, losses = wins + won, draws + (summary[1] == "1/2-1/2"), losses + (summary[1] in ("1-0", "0-1")
                                                                                       and not won)
        mates += won and board.is_checkmate()
        commented = sum(node.comment.startswith("illegal attempt") for node in game.mainline())
        assert commented == int(summary[5])
        attempts, moves = attempts + commented, moves + int(summary[6])
    assert lines[4] == f"wrote {pgn}"
    assert lines[5] == (f"4 games against the random mover (seed 0), the model white in 2 and black in 2: {wins} wins, "
                        f"{draws} draws, {losses} losses; {mates} checkmates given; {attempts} illegal attempts in "
                        f"its {moves} moves ({100 * attempts / moves:.1f}%)")


# ---- issue 35, point 4: inference keeps no autograd graph ----------------------------------------------------

def test_a_played_game_holds_no_tensor_that_needs_a_gradient(demo):
    """The model loaded in one thread and played in another, as the UCI engine does (a thread's
    grad mode is its own): no parameter, cached key or value, or score asks for a gradient or
    holds a graph."""
    import threading

    import torch

    import play
    torch.set_num_threads(1)
    loaded = {}
    loader = threading.Thread(target=lambda: loaded.update(player=play.ModelPlayer(str(demo / "model"), "cpu")))
    loader.start()
    loader.join()
    player, board, rng = loaded["player"], chess.Board(), random.Random(0)
    while board.ply() < 40 and not board.is_game_over():
        board.push(player.move(board)[0] if board.turn == chess.WHITE else rng.choice(list(board.legal_moves)))
    cached = [value for part in (player.cache, *getattr(player.cache, "layers", [])) for value in vars(part).values()
              if isinstance(value, torch.Tensor)]
    assert cached and player.cache.get_seq_length() > 40
    scores = player.log_probs_after(player.prompt(play.words_since_root(board, player.notation)))
    for tensor in [*player.model.parameters(), *player.model.buffers(), *cached, scores]:
        assert not tensor.requires_grad and tensor.grad_fn is None


def peak_rss_mib(pid):
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)[1]) / 1024


def test_the_engine_s_peak_memory_stays_flat_over_a_200_ply_game(demo):
    """The UCI engine plays both sides of a 200-ply game, a `position startpos moves ...` and a `go`
    a ply: its peak resident memory after ply 200 is within 10% of that after ply 20 (with a graph
    kept per move it grew from 367 MB to 5.35 GB)."""
    engine = subprocess.Popen([sys.executable, PLAY, "--model", str(demo / "model"), "--uci"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV, cwd=REPO)
    try:
        moves, peaks = [], {}
        for ply in range(1, 201):
            engine.stdin.write(f"position startpos moves {' '.join(moves)}\ngo movetime 10\n")
            engine.stdin.flush()
            while not (line := engine.stdout.readline()).startswith("bestmove"):
                assert line, "the engine ended"
            moves.append(line.split()[1])
            assert moves[-1] != "0000", f"the game ended at ply {ply}"
            if ply in (20, 200):
                peaks[ply] = peak_rss_mib(engine.pid)
        engine.stdin.write("quit\n")
        engine.stdin.flush()
        assert engine.wait(timeout=60) == 0
    finally:
        engine.kill()
    assert peaks[200] <= 1.1 * peaks[20], peaks


def test_the_evaluation_and_generation_build_no_graph(demo):
    """The legal-move evaluation, the validation loss and Hugging Face's generate (the README's
    snippet) run every forward pass with gradients off, on a model whose parameters ask for them."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.chess_eval import answers, validation_loss_sums
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(demo / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(demo / "model")
    assert all(p.requires_grad for p in model.parameters())
    grad_modes = []
    model.register_forward_hook(lambda module, inputs, output: grad_modes.append(torch.is_grad_enabled()))
    games = [json.loads(line)["text"].split() for line in (demo / "data/validation.jsonl").read_text().splitlines()[:4]]
    answers(model, tokenizer, "piece", [game[:10] for game in games], 2, 256, torch.device("cpu"))
    ids = tokenizer("P e2 e4 p e7 e5", return_tensors="pt").input_ids
    validation_loss_sums(model, [ids[0], ids[0][:4]], 2, tokenizer.pad_token_id, torch.device("cpu"))
    model.generate(ids, max_new_tokens=3, do_sample=False)
    assert len(grad_modes) > 10 and not any(grad_modes)
