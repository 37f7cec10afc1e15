"""How a game is written for the model: UCI as the data has it, or the piece notation.

    uci     e2e4 e7e5 g1f3 ... d1h5 ... a7a8q      one word per move (the data's own format)
    piece   P e2 e4 p e7 e5 N g1 f3 ... Q d1 h5 + ... P a7 a8 =q
            each move as the piece that moves (as FEN writes it: P N B R Q K for white, p n b r q k
            for black), its from-square and its to-square, then `=q`/`=r`/`=b`/`=n` after a
            promotion and `+` after a move that gives check (as PGN marks it)

UCI stays the format of the data on disk (01_download). The piece notation is made while the data
is prepared, by replaying each game with python-chess, and only a replay can make it: which piece
stands on g1, and whether a move gives check, depends on every move before. It is what makes a
small model learn the board (the README's table): to name the piece, the model has to know where
the pieces are, and the check marker tells it when its king must be saved. The notation is a
choice for any model; a model's config.json may name the one it was trained in (`chess_notation`,
which the built-in model sets and every final model keeps), and --notation chooses another.
"""
import chess

from common.errors import UserError

NOTATIONS = ("uci", "piece")
PIECES = "PNBRQKpnbrqk"  # FEN's letters; a promotion is never confused with them: it starts with `=`
PROMOTIONS = ("=q", "=r", "=b", "=n")
CHECK = "+"
SQUARES = tuple(chess.SQUARE_NAMES)
CONFIG_KEY = "chess_notation"


class IllegalGame(ValueError):
    """A move that cannot be replayed: `ply` (1-based) and the move."""

    def __init__(self, ply, move):
        super().__init__(f"move {ply}, {move!r}, is not legal in that position")
        self.ply, self.move = ply, move


def model_notation(config):
    """The notation a model was trained in, as its config.json says (UCI if it says nothing)."""
    notation = getattr(config, CONFIG_KEY, None) or "uci"
    if notation not in NOTATIONS:
        raise UserError(f"config.json's {CONFIG_KEY} is {notation!r}, not one of {', '.join(NOTATIONS)}: correct "
                        "it there (training also takes --notation)")
    return notation


def training_notation(args, config):
    """The notation a run trains in: --notation, else the model's own. Written into the config, so
    the checkpoints' and the final model's config.json say which one the model reads."""
    notation = args.notation or model_notation(config)
    setattr(config, CONFIG_KEY, notation)
    return notation


def words_of(notation, moves):
    """A game's moves (UCI) as that notation's words, one string per move ("N g1 f3").
    The piece notation replays the game: IllegalGame if a move is not legal there."""
    if notation == "uci":
        return list(moves)
    board, words = chess.Board(), []
    for ply, text in enumerate(moves, start=1):
        try:
            move = chess.Move.from_uci(text)
        except ValueError:
            raise IllegalGame(ply, text) from None
        if not board.is_legal(move):
            raise IllegalGame(ply, text)
        word = piece_move_text(board, move)
        board.push(move)  # the check is read after the move: gives_check() would push and pop it again
        words.append(f"{word} {CHECK}" if board.is_check() else word)
    return words


def piece_move_text(board, move):
    """A legal move on `board` as the piece notation writes it, less its check marker: "N g1 f3"."""
    promotion = f" ={chess.piece_symbol(move.promotion)}" if move.promotion else ""
    return (f"{board.piece_at(move.from_square).symbol()} {chess.square_name(move.from_square)} "
            f"{chess.square_name(move.to_square)}{promotion}")


def move_text(board, notation, move):
    """One legal move on `board` in the notation: "g1f3" or "N g1 f3" ("Q d1 h5 +" if it gives check)."""
    if notation == "uci":
        return move.uci()
    return piece_move_text(board, move) + (f" {CHECK}" if board.gives_check(move) else "")


def game_text(notation, moves):
    return " ".join(words_of(notation, moves))


def vocabulary(notation):
    """The words of a notation, for a word-level tokenizer like the built-in one: 81 in the piece
    notation; in UCI every move a piece could ever make (queen lines and knight jumps from every
    square, and promotions), 1,968 words."""
    if notation == "piece":
        return [*PIECES, *SQUARES, *PROMOTIONS, CHECK]
    moves = set()
    for start in chess.SQUARES:
        for end in chess.SQUARES:
            files, ranks = abs(chess.square_file(end) - chess.square_file(start)), abs(
                chess.square_rank(end) - chess.square_rank(start))
            if start != end and (files == 0 or ranks == 0 or files == ranks or {files, ranks} == {1, 2}):
                moves.add(chess.square_name(start) + chess.square_name(end))
            if files <= 1 and (chess.square_rank(start), chess.square_rank(end)) in ((6, 7), (1, 0)):
                moves.update(chess.square_name(start) + chess.square_name(end) + piece for piece in "qrbn")
    return sorted(moves)


def longest_move_text(notation):
    """The move with the most words or characters: how far generation must run to read one move."""
    return "a7a8q" if notation == "uci" else "P a7 a8 =q +"


def first_move(notation, text):
    """The first move written in `text` (what the model generated): (the move, the piece it names,
    or None in UCI), or None if the text does not start with a well-formed move. A check marker
    is the model's claim, not part of the move, and is not judged: after the move, nor before it,
    where it closes the position's last move (a prompt ends after a move's squares, where `+`
    may still follow; had that move given check, the prompt would hold its `+`)."""
    words = text.split()
    if notation == "piece" and words[:1] == [CHECK]:
        words = words[1:]
    if notation == "uci":
        uci, piece = words[0] if words else "", None
    elif len(words) >= 3 and words[0] in PIECES and words[1] in SQUARES and words[2] in SQUARES:
        promotion = words[3][1] if len(words) > 3 and words[3] in PROMOTIONS else ""
        uci, piece = words[1] + words[2] + promotion, words[0]
    else:
        return None
    try:
        return chess.Move.from_uci(uci), piece
    except ValueError:  # not shaped like a move, or from and to the same square
        return None


def board_after(moves):
    board = chess.Board()
    for move in moves:
        board.push_uci(move)
    return board


def legal_in(board, notation, text):
    """Is the first move written in `text` legal on `board`? In the piece notation the named piece
    must also be the one on the from-square, of the side to move: `N e2 e4` is not the pawn's move."""
    found = first_move(notation, text)
    if found is None:
        return False
    move, piece = found
    if move not in board.legal_moves:
        return False
    return piece is None or board.piece_at(move.from_square).symbol() == piece
