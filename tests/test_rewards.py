"""Built-in reward plugins on known FENs (hand-computed expectations) and the plugin registry."""

import importlib.metadata
import random

import chess
import pytest

from mini_grpo.config import ConfigError
from mini_grpo.rewards import available_rewards, per_sample, register, resolve_reward
from mini_grpo.rewards import registry as registry_module
from mini_grpo.rewards.fen import expand_placement

START = chess.STARTING_FEN
AFTER_E4 = "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1"
AFTER_E4_E5 = "rnbqkbnr/pppp1ppp/8/4p3/4P3/8/PPPP1PPP/RNBQKBNR w KQkq - 0 2"
KNOWN = {  # SAN moves -> board.fen()
    "e4 d5 exd5 Qxd5": "rnb1kbnr/ppp1pppp/8/3q4/8/8/PPPP1PPP/RNBQKBNR w KQkq - 0 3",  # captures
    "e4 e5 Nf3 Nc6 Bc4 Bc5 O-O":
        "r1bqk1nr/pppp1ppp/2n5/2b1p3/2B1P3/5N2/PPPP1PPP/RNBQ1RK1 b kq - 5 4",  # castling
    "e4 a6 e5 d5": "rnbqkbnr/1pp1pppp/p7/3pP3/8/8/PPPP1PPP/RNBQKBNR w KQkq d6 0 3",  # ep square
    "e4 a6 e5 d5 exd6": "rnbqkbnr/1pp1pppp/p2P4/8/8/8/PPPP1PPP/RNBQKBNR b KQkq - 0 3",  # ep capture
}
GARBAGE = [
    "hello world",
    "e2e4 e7e5:",
    "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP",  # 7 rows
    "rnbqkbnr/pppppppp/9/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1",  # digit 9
    "rnbqkbnr/pppppppp/44/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1",  # two digits in a row
    "rnbqkbnr/ppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1",  # a row of 7 columns
    "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNX w KQkq - 0 1",  # X is no piece
]


def score(name, completions, targets):
    n = len(completions)
    return resolve_reward(name)([""] * n, completions, targets, [{}] * n)


def one(name, completion, target):
    return score(name, [completion], [target])[0]


def test_builtins_are_registered():
    assert {"fen_valid", "levenshtein", "exact_match", "board_accuracy",
            "board_delta"} <= set(available_rewards())


@pytest.mark.parametrize("name", ["fen_valid", "levenshtein", "exact_match", "board_accuracy",
                                  "board_delta"])
def test_start_position_scores_one_against_itself(name):
    assert one(name, START, START) == 1.0


@pytest.mark.parametrize("san", list(KNOWN))
def test_known_positions_match_python_chess_and_score_one(san):
    board = chess.Board()
    for move in san.split():
        board.push_san(move)
    fen = KNOWN[san]
    assert board.fen() == fen
    for name in ["fen_valid", "levenshtein", "exact_match", "board_accuracy", "board_delta"]:
        assert one(name, fen, fen) == 1.0


@pytest.mark.parametrize("text", GARBAGE + ["", "   "])
def test_garbage_and_empty_completions_score_zero(text):
    for name in ["fen_valid", "exact_match", "board_accuracy", "board_delta"]:
        assert one(name, text, AFTER_E4_E5) == 0.0


def test_empty_completion_levenshtein():
    assert score("levenshtein", ["", ""], [AFTER_E4, ""]) == [0.0, 1.0]


def test_levenshtein_and_exact_match_by_hand():
    # one substitution in four characters: 1 - 1/4; one deletion from four: 1 - 1/4
    assert score("levenshtein", ["abce", "abc", "xyz"], ["abcd", "abcd", "abc"]) == \
        [0.75, 0.75, 0.0]
    assert score("exact_match", [" abc\n", "abc", "ab"], ["abc", "abc ", "abc"]) == [1, 1, 0]


def test_missing_trailing_fields():
    placement = AFTER_E4_E5.split()[0]
    # python-chess fills in defaults (w - - 0 1), and this board is legal
    assert one("fen_valid", placement, AFTER_E4_E5) == 1.0
    assert one("fen_valid", placement + " w KQkq", AFTER_E4_E5) == 1.0
    assert one("board_accuracy", placement, AFTER_E4_E5) == 1.0  # only squares count
    # placement perfect (0.8), no field present (0 of 0.2)
    assert one("board_delta", placement, AFTER_E4_E5) == pytest.approx(0.8)
    # plus side to move and castling: 0.8 + 0.2 * 2/5
    assert one("board_delta", placement + " w KQkq", AFTER_E4_E5) == pytest.approx(0.88)
    assert one("exact_match", placement, AFTER_E4_E5) == 0.0
    # a partial target (a data file's) is scored over the fields it gives: itself is 1.0
    assert one("board_delta", placement, placement) == 1.0
    assert one("board_delta", placement + " w KQkq", placement + " w KQkq") == 1.0
    assert one("board_delta", placement + " b KQkq", placement + " w KQkq") == \
        pytest.approx((0.8 + 0.04) / 0.88)


def test_fen_valid_rejects_illegal_positions():
    assert one("fen_valid", "8/8/8/8/8/8/8/8 w - - 0 1", START) == 0.0  # no kings
    assert one("fen_valid", "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR x KQkq - 0 1",
               START) == 0.0  # side to move
    assert one("fen_valid", START + " extra", START) == 0.0  # seven fields


def test_board_accuracy_by_hand():
    # the start position differs from the target on e7, e5, e4, e2: 60 of 64 squares
    assert one("board_accuracy", START, AFTER_E4_E5) == 60 / 64
    # after 1.e4 only e7 and e5 differ: 62 of 64
    assert one("board_accuracy", AFTER_E4, AFTER_E4_E5) == 62 / 64
    # an empty board matches the 32 empty squares of the start position
    assert one("board_accuracy", "8/8/8/8/8/8/8/8 w - - 0 1", START) == 0.5


def test_board_delta_by_hand():
    # Start FEN against 1.e4 e5: the changed squares e2 e4 e7 e5 are all wrong (0 of 4);
    # fields w KQkq - 0 match, fullmove 1 != 2: 0.8 * 0 + 0.2 * 4/5
    assert one("board_delta", START, AFTER_E4_E5) == pytest.approx(0.16)
    # After 1.e4: e2 and e4 right, e7 and e5 wrong (2 of 4); fields: b != w, KQkq, -, 0 match,
    # 1 != 2: 0.8 * 2/4 + 0.2 * 3/5
    assert one("board_delta", AFTER_E4, AFTER_E4_E5) == pytest.approx(0.52)
    # Right answer plus a knight the moves never touched on f3: g1 and f3 join the squares
    # that count, both wrong (4 of 6); all five fields right: 0.8 * 4/6 + 0.2
    extra_knight = "rnbqkbnr/pppp1ppp/8/4p3/4P3/5N2/PPPP1PPP/RNBQKB1R w KQkq - 0 2"
    assert one("board_delta", extra_knight, AFTER_E4_E5) == pytest.approx(0.8 * 4 / 6 + 0.2)
    # nothing changed and nothing should have: placement 1.0, all fields right
    assert one("board_delta", START, START) == 1.0
    # fields after the sixth are ignored
    assert one("board_delta", AFTER_E4_E5 + " junk", AFTER_E4_E5) == 1.0


def test_board_rewards_reject_targets_that_are_not_fens():
    with pytest.raises(ValueError, match="target is not a FEN"):
        one("board_delta", START, "not a fen")
    with pytest.raises(ValueError, match="target is not a FEN"):
        one("board_accuracy", START, "")


def test_placement_parser_agrees_with_python_chess():
    rng = random.Random(0)
    fens = list(KNOWN.values()) + [START, AFTER_E4, AFTER_E4_E5]
    texts = GARBAGE + ["8/8/8/8/8/8/8/8", "Q~7/8/8/8/8/8/8/8", "~8/8/8/8/8/8/8/8", "/" * 7]
    for _ in range(3000):
        s = list(rng.choice(fens).split()[0])
        for _ in range(rng.randrange(3)):
            s[rng.randrange(len(s))] = rng.choice("12345678890pnbrqkPNBRQKx/~")
        texts.append("".join(s))
    for text in texts:
        try:
            chess.BaseBoard(text)
            ok = True
        except ValueError:
            ok = False
        squares = expand_placement(text)
        assert (squares is not None) == ok, text
        if ok:
            board = chess.BaseBoard(text)
            expected = "".join((board.piece_at(sq).symbol() if board.piece_at(sq) else ".")
                               for sq in chess.SQUARES_180)
            assert squares == expected, text


# ---- registry ----

def test_per_sample_adapter():
    fn = per_sample(lambda p, c, t, m: len(c) + m["bonus"])
    assert fn(["a", "b"], ["xy", ""], ["t", "t"], [{"bonus": 1}, {"bonus": 0}]) == [3, 0]


def test_register_and_resolve(monkeypatch):
    monkeypatch.setattr(registry_module, "REWARDS", dict(registry_module.REWARDS))

    @register("always_half")
    def always_half(prompts, completions, targets, metas):
        return [0.5] * len(completions)

    assert resolve_reward("always_half") is always_half
    assert "always_half" in available_rewards()


def test_resolve_module_path():
    from mini_grpo.rewards.text import exact_match
    assert resolve_reward("mini_grpo.rewards.text:exact_match") is exact_match


def test_unknown_name_lists_available():
    with pytest.raises(ConfigError, match="unknown reward 'nope'.*board_delta.*levenshtein"):
        resolve_reward("nope")


@pytest.mark.parametrize("name, message", [
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("mini_grpo.rewards.text:nothing", "has no attribute 'nothing'"),
    ("mini_grpo.rewards.fen:DELTA_PLACEMENT_WEIGHT", "not callable"),
    ("mini_grpo.rewards.fen:board_delta_one", "fits none of the accepted shapes: fn\\(prompts"),
])
def test_bad_module_paths(name, message):
    with pytest.raises(ConfigError, match=message):
        resolve_reward(name)


def test_entry_point_plugins(monkeypatch):
    ep = importlib.metadata.EntryPoint(name="from_a_package",
                                       value="mini_grpo.rewards.text:levenshtein",
                                       group="mini_grpo.rewards")
    monkeypatch.setattr(registry_module, "_entry_points", lambda: {ep.name: ep})
    from mini_grpo.rewards.text import levenshtein
    assert resolve_reward("from_a_package") is levenshtein
    assert "from_a_package" in available_rewards()
