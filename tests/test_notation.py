"""The piece notation (common/notation.py), the evaluation that reads a generated move back
(common/chess_eval.py), the held-out split and the trigram baseline it is compared with.

The generation test uses a real LlamaForCausalLM whose weights are set by hand so that its next
token is a fixed function of the last one: what it writes is known, so decoding, the KV cache
and left padding can be checked exactly."""
import json

import chess
import pytest
import torch

from common.chess_eval import TrigramBaseline, greedy_tokens, held_out_split, legal_moves, phase_of
from common.errors import UserError
from common.notation import (IllegalGame, first_move, game_text, legal_in, model_notation, training_notation,
                             vocabulary, words_of)
from common.prepare_data import prepared_rows

# 1. e4 d5 2. exd5 c6 3. dxc6 Nf6 4. cxb7 Nbd7 5. bxa8=Q: captures and a promotion
PROMOTING = "e2e4 d7d5 e4d5 c7c6 d5c6 g8f6 c6b7 b8d7 b7a8q".split()
# castling short, and an en-passant capture
CASTLING = "e2e4 a7a6 g1f3 b7b5 f1e2 c7c6 e1g1 h7h6 e4e5 d7d5 e5d6".split()
FOOLS_MATE = "f2f3 e7e5 g2g4 d8h4".split()  # the last move gives check (mate)


@pytest.mark.quick
def test_each_move_names_its_piece_and_promotions_stand_apart():
    assert words_of("piece", PROMOTING) == ["P e2 e4", "p d7 d5", "P e4 d5", "p c7 c6", "P d5 c6", "n g8 f6",
                                            "P c6 b7", "n b8 d7", "P b7 a8 =q"]
    assert words_of("piece", CASTLING)[6] == "K e1 g1" and words_of("piece", CASTLING)[-1] == "P e5 d6"
    assert words_of("piece", FOOLS_MATE) == ["P f2 f3", "p e7 e5", "P g2 g4", "q d8 h4 +"]
    assert words_of("uci", PROMOTING) == PROMOTING
    assert game_text("piece", PROMOTING[:2]) == "P e2 e4 p d7 d5"
    pieces, promotions = set("PNBRQKpnbrqk"), {"=q", "=r", "=b", "=n"}
    assert pieces.isdisjoint(promotions) and len(vocabulary("piece")) == 12 + 64 + 4 + 1
    assert len(vocabulary("uci")) == 1968 and "a7a8q" in vocabulary("uci")


@pytest.mark.quick
def test_a_models_notation_comes_from_its_config_and_an_unknown_one_is_refused():
    from argparse import Namespace

    from transformers import LlamaConfig
    assert model_notation(LlamaConfig()) == "uci"  # a model that says nothing: the data's own notation
    unknown = LlamaConfig(chess_notation="san")
    with pytest.raises(UserError, match="config.json's chess_notation is 'san', not one of uci, piece"):
        model_notation(unknown)
    assert training_notation(Namespace(notation="piece"), unknown) == "piece" == unknown.chess_notation


@pytest.mark.quick
def test_a_move_that_cannot_be_replayed_is_named():
    with pytest.raises(IllegalGame) as caught:
        words_of("piece", ["e2e4", "e7e5", "e1e3"])
    assert (caught.value.ply, caught.value.move) == (3, "e1e3")


@pytest.mark.quick
def test_a_generated_move_is_read_back_and_its_piece_checked():
    board = chess.Board()
    assert legal_in(board, "piece", "N g1 f3 p e7")  # what follows the move does not matter
    assert legal_in(board, "piece", "P e2 e4 +")  # nor a check it claims
    assert legal_in(board, "piece", "+ P e2 e4")  # nor one it claims for the move before
    assert not legal_in(board, "piece", "+ + P e2 e4") and not legal_in(board, "piece", "+")
    assert not legal_in(board, "piece", "N e2 e4")  # a legal move, but not the knight's
    assert not legal_in(board, "piece", "n g1 f3")  # black's knight: not on g1, and not black's turn
    assert not legal_in(board, "piece", "P e2 e5")
    assert not legal_in(board, "piece", "e3 e3 P") and not legal_in(board, "piece", "P e2") and not legal_in(
        board, "piece", "")
    assert first_move("piece", "P b7 a8 =q + n g8") == (chess.Move.from_uci("b7a8q"), "P")
    assert legal_in(chess.Board("8/1P6/8/8/8/8/8/k1K5 w - - 0 1"), "piece", "P b7 b8 =n")
    assert not legal_in(chess.Board("8/1P6/8/8/8/8/8/k1K5 w - - 0 1"), "piece", "P b7 b8")  # no promotion named
    assert legal_in(board, "uci", "g1f3 e7e5") and not legal_in(board, "uci", "g1g3") and not legal_in(board, "uci",
                                                                                                          "x")


def rows_as_lists(rows):
    return [rows[i].tolist() for i in range(len(rows))]


def texts(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.quick
def test_prepared_games_are_the_piece_notations_tokens(demo, tmp_path):
    """Prepared once by replaying each game (in two processes here): each row is BOS, the game in
    the piece notation, EOS, as the tokenizer reads that text."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(demo / "model")
    rows = prepared_rows(demo / "data", "validation", tokenizer, 1024, False, cache_dir=tmp_path, num_proc=2,
                         notation="piece")
    expected = [[tokenizer.bos_token_id, *tokenizer(game_text("piece", game.split()), add_special_tokens=False)[
        "input_ids"], tokenizer.eos_token_id] for game in texts(demo / "data/validation.jsonl")]
    assert rows_as_lists(rows) == expected
    assert tokenizer.unk_token_id not in {t for row in expected for t in row}
    assert rows.meta["notation"] == "piece"
    again = prepared_rows(demo / "data", "validation", tokenizer, 1024, False, cache_dir=tmp_path, notation="piece")
    assert again.folder == rows.folder  # cached by content, the notation part of the key


@pytest.mark.quick
def test_the_wrong_notation_for_a_tokenizer_is_one_line(demo, tmp_path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(demo / "model")  # the piece notation's words only
    with pytest.raises(UserError, match=r"validation.jsonl:1: '[a-h][1-8][a-h][1-8]' is not in the tokenizer's "
                                        r"vocabulary .*--notation"):
        prepared_rows(demo / "data", "validation", tokenizer, 64, True, cache_dir=tmp_path, notation="uci")


@pytest.mark.quick
def test_an_illegal_training_game_is_named_where_it_is(demo, tmp_path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(demo / "model")
    data = tmp_path / "data"
    data.mkdir()
    games = texts(demo / "data/validation.jsonl")[:3]
    games[1] = "e2e4 e7e5 e1e3"
    (data / "train.jsonl").write_text("".join(json.dumps({"text": g}) + "\n" for g in games))
    with pytest.raises(UserError, match=r"train.jsonl:2: move 3, 'e1e3', is not legal in that position"):
        prepared_rows(data, "train", tokenizer, 64, True, cache_dir=tmp_path / "cache", notation="piece")


@pytest.mark.quick
def test_held_out_games_share_no_long_opening_with_training_games():
    """The last openings are held out, with every game that opens the same way for 10 plies,
    wherever it stands in the list."""
    opening = "e2e4 e7e5 g1f3 b8c6 f1c4 g8f6 d2d3 f8c5 c2c3 d7d6".split()
    a1, a2, a3 = (" ".join(opening + [tail]) for tail in ("e1g1", "b1d2", "h2h3"))
    b, c = "d2d4 d7d5 c2c4", " ".join(opening[:9] + ["a7a6", "e1g1"])  # c leaves the opening at ply 10
    train, held_out = held_out_split([a1, b, a2, c, a3], 2)
    assert (train, held_out) == ([b], [a1, a2, c, a3])
    assert held_out_split([a1, b, a2, c, a3], 1) == ([b, c], [a1, a2, a3])


@pytest.mark.quick
def test_the_trigram_table_plays_the_commonest_next_move():
    table = TrigramBaseline(["e2e4 e7e5 g1f3", "e2e4 e7e5 g1f3", "e2e4 e7e5 f2f4", "d2d4 d7d5"])
    assert table.move(["e2e4", "e7e5"]) == "g1f3"
    assert table.move([]) == "e2e4"  # white's commonest first move
    assert table.move(["a2a3", "h7h6"]) in ("g1f3", "e2e4")  # unseen: backs off to white's commonest
    assert table.is_legal(["e2e4", "e7e5"]) and not table.is_legal(["e2e3", "a7a6"])  # e2e4, the pawn has left
    assert [phase_of(ply) for ply in (0, 19, 20, 79, 80)] == ["opening", "opening", "middle", "middle", "late"]


def scripted_llama(tokenizer, next_word):
    """A real Llama whose greedy next token is next_word[last token's word]: the embedding writes the
    token's one-hot into the residual stream, every layer adds nothing (zero output projections),
    and the head maps each one-hot to the wanted next token."""
    from transformers import LlamaConfig, LlamaForCausalLM
    vocab = tokenizer.get_vocab()
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(len(vocab), 128))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for word, following in next_word.items():
            model.lm_head.weight[vocab[following], vocab[word]] = 1.0
    return model


@pytest.mark.quick
def test_generation_reads_each_moves_tokens_back(demo):
    """A prompt ending in e4 makes the model write n g8 f6 (legal after 1. e4), one ending in d5
    makes it write Q e2 e4 (a square the queen is not on), in the order asked; prompts of different
    lengths share a left-padded batch, and the KV cache gives the tokens a full recomputation gives."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(demo / "model")
    model = scripted_llama(tokenizer, {"e4": "n", "n": "g8", "g8": "f6", "f6": "P", "d5": "Q", "Q": "e2", "e2": "e4"})
    prefixes = [["e2e4"], ["e2e4", "d7d5", "e4e5", "g8f6", "d2d4", "d7d5"][:2]]
    assert legal_moves(model, tokenizer, "piece", prefixes, 2, 64, torch.device("cpu")) == [True, False]
    # batched by prompt length (the shorter first), answered in the order asked
    assert legal_moves(model, tokenizer, "piece", [prefixes[1], prefixes[0], prefixes[1]], 2, 64,
                       torch.device("cpu")) == [False, True, False]
    prompts = [[tokenizer.bos_token_id, *tokenizer(game_text("piece", p), add_special_tokens=False)["input_ids"]]
               for p in prefixes]
    written = greedy_tokens(model, prompts, 4, tokenizer.pad_token_id, torch.device("cpu"))
    assert [tokenizer.decode(w) for w in written] == ["n g8 f6 P", "Q e2 e4 n"]
    one_by_one = [greedy_tokens(model, [p], 4, tokenizer.pad_token_id, torch.device("cpu"))[0] for p in prompts]
    assert written == one_by_one
