"""Chess-aware rewards for FEN completions: fen_valid, board_accuracy, board_delta.

A FEN has six space-separated fields: placement, side to move, castling, en passant, halfmove
clock, fullmove number. `fen_valid` asks python-chess; the two partial-credit rewards compare
the placement square by square with `expand_placement`, a pure-Python parser that accepts
exactly what python-chess accepts (tests check the parity) and is ~5x faster than building a
chess.Board, which matters because scoring is GIL-bound Python.
"""

from __future__ import annotations

import chess

from mini_grpo.rewards.registry import register

PIECES = frozenset("pnbrqkPNBRQK")
DIGITS = frozenset("12345678")
# share of board_delta that goes to the placement; the rest is split over the five other fields
DELTA_PLACEMENT_WEIGHT = 0.8


def expand_placement(field: str) -> str | None:
    """The placement field as 64 characters, a8 b8 ... h1 with '.' for empty, or None.

    Rules mirror python-chess's BaseBoard: 8 rows separated by '/', each summing to 8 columns,
    no two digits in a row, '~' (a promoted piece) only right after a piece.
    """
    rows = field.split("/")
    if len(rows) != 8:
        return None
    out = []
    for row in rows:
        cols, prev = 0, ""
        for c in row:
            if c in DIGITS:
                if prev == "digit":
                    return None
                out.append("." * int(c))
                cols, prev = cols + int(c), "digit"
            elif c in PIECES:
                out.append(c)
                cols, prev = cols + 1, "piece"
            elif c == "~" and prev == "piece":
                prev = ""
            else:
                return None
        if cols != 8:
            return None
    return "".join(out)


START = expand_placement(chess.STARTING_BOARD_FEN)


def _target_squares(target: str) -> tuple[str, list[str]]:
    fields = target.split()
    squares = expand_placement(fields[0]) if fields else None
    if squares is None:
        # a data problem, not a model one: fail loudly instead of scoring every row 0
        raise ValueError(f"target is not a FEN: {target!r}")
    return squares, fields


def is_valid_fen(text: str) -> bool:
    """python-chess parses it (missing trailing fields take their defaults) and is_valid()."""
    fields = text.split()
    if not fields or expand_placement(fields[0]) is None:  # cheap early exit for garbage
        return False
    try:
        return chess.Board(text).is_valid()
    except ValueError:
        return False


@register("fen_valid")
def fen_valid(prompts, completions, targets, metas):
    return [float(is_valid_fen(c)) for c in completions]


def board_accuracy_one(completion: str, target: str) -> float:
    """Fraction of the 64 squares holding the target's piece (or emptiness).

    Only the placement counts; the other five fields are ignored (board_delta scores them).
    """
    want, _ = _target_squares(target)
    fields = completion.split()
    got = expand_placement(fields[0]) if fields else None
    if got is None:
        return 0.0
    return sum(a == b for a, b in zip(got, want)) / 64


def board_delta_one(completion: str, target: str) -> float:
    """Credit for what the moves changed, so that echoing the start position earns ~nothing.

    Placement (weight 0.8): accuracy over the squares where the target differs from the start
    position or the completion differs from it; 1.0 when neither changed any square.
    Fields (weight 0.2, 0.04 each): side to move, castling, en passant, halfmove clock and
    fullmove number, each an exact string match; a missing field counts as wrong and fields
    after the sixth are ignored. A target that gives fewer fields (a partial FEN, which a data
    file may hold) is scored over those it gives, so that it scores itself 1.0.
    """
    want, want_fields = _target_squares(target)
    fields = completion.split()
    got = expand_placement(fields[0]) if fields else None
    if got is None:
        return 0.0
    hits = total = 0
    for g, w, s in zip(got, want, START):
        if g != s or w != s:
            total += 1
            hits += g == w
    placement = hits / total if total else 1.0
    field_hits = sum(a == b for a, b in zip(fields[1:6], want_fields[1:6]))
    score = DELTA_PLACEMENT_WEIGHT * placement + (1 - DELTA_PLACEMENT_WEIGHT) * field_hits / 5
    given = len(want_fields[1:6])
    if given < 5:  # the most a completion can reach against this target
        score /= DELTA_PLACEMENT_WEIGHT + (1 - DELTA_PLACEMENT_WEIGHT) * given / 5
    return score


@register("board_accuracy")
def board_accuracy(prompts, completions, targets, metas):
    return [board_accuracy_one(c, t) for c, t in zip(completions, targets)]


@register("board_delta")
def board_delta(prompts, completions, targets, metas):
    return [board_delta_one(c, t) for c, t in zip(completions, targets)]
