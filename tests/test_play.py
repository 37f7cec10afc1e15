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
from conftest import REPO

PLAY = str(REPO / "play.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
SUMMARY = re.compile(r"^result (\S+) \((.+)\), (\d+) plies; the model \((white|black)\) made (\d+) illegal attempts "
                     r"in its (\d+) moves$")
UCI_PLIES = 40  # a cap on the UCI games, which otherwise may run to the 75-move rule


def play(*args, env=ENV):
    return subprocess.run([sys.executable, PLAY, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=REPO)


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
    protocol on stdout, a position that is not from the start refused politely."""
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
    assert stdout.splitlines()[:-1] == [
        f"id name chess-kit {sub_word_model}", "id author chess-kit play.py", "uciok", "readyok",
        "info string this engine plays only games from the start position (the model reads the whole game): "
        "send `position startpos moves ...`",
        "info string no position to play from", "bestmove (none)",
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
