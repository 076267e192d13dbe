"""Tasks: the chess game generator, the held-out split, JSONL and PGN loading and their errors."""

import json
from pathlib import Path

import chess
import pytest

from mini_grpo.config import ConfigError, load_config
from mini_grpo.tasks import Example, build_task, load_jsonl, split_held_out
from mini_grpo.tasks.chess_fen import ALPHABET, DEFAULT_REWARDS, generate_split, load_pgn
from mini_grpo.tokenizer import CharTokenizer

DATA = Path(__file__).resolve().parent / "data"
AFTER_E4_E5 = "rnbqkbnr/pppp1ppp/8/4p3/4P3/8/PPPP1PPP/RNBQKBNR w KQkq - 0 2"


TASK_ARGS = {"num_train", "min_plies", "max_plies", "move_format", "pgn_path"}


def config(**overrides):
    """A config with chess_fen's options (TASK_ARGS) passed as --task_args.KEY."""
    return load_config(overrides={f"task_args.{k}" if k in TASK_ARGS else k: v
                                  for k, v in overrides.items()}, env={})


def replay(prompt: str, san: bool) -> str:
    assert prompt.endswith(":")
    board = chess.Board()
    for move in prompt[:-1].split():
        board.push_san(move) if san else board.push_uci(move)
    return board.fen()


# ---- generated games ----

def test_generator_is_deterministic_for_a_seed():
    a = generate_split(200, 50, 2, 12, False, seed=1)
    b = generate_split(200, 50, 2, 12, False, seed=1)
    c = generate_split(200, 50, 2, 12, False, seed=2)
    assert a == b
    assert a != c


@pytest.mark.parametrize("san", [False, True])
def test_targets_agree_with_python_chess(san):
    train, held = generate_split(300, 50, 2, 12, san, seed=5)
    for ex in train + held:
        assert ex.target == replay(ex.prompt, san)
        assert 2 <= ex.meta["plies"] == len(ex.prompt[:-1].split()) <= 12


def test_train_and_held_out_prompts_are_disjoint():
    train, held = generate_split(2000, 300, 2, 12, False, seed=0)
    assert len(train) == 2000 and len(held) == 300
    held_prompts = {ex.prompt for ex in held}
    assert len(held_prompts) == 300  # held-out prompts are also distinct
    assert not held_prompts & {ex.prompt for ex in train}


def test_two_ply_games_collide_but_stay_disjoint():
    # only 20 * 20 = 400 distinct two-ply games exist
    train, held = generate_split(500, 100, 2, 2, False, seed=0)
    assert not {ex.prompt for ex in held} & {ex.prompt for ex in train}
    with pytest.raises(ConfigError, match="num_eval: found only 400 distinct games"):
        generate_split(10, 401, 2, 2, False, seed=0)


def test_alphabet_is_fixed_and_covers_uci_san_and_fen():
    texts = []
    for san in (False, True):
        train, held = generate_split(500, 20, 2, 12, san, seed=9)
        texts += [ex.prompt + ex.target for ex in train + held]
    assert set("".join(texts)) <= set(ALPHABET)
    tok = CharTokenizer(ALPHABET)
    for text in texts[:50] + ["O-O-O", "exd8=Q+", "Qh4#"]:
        tok.encode(text, strict=True)
    assert build_task(config(seed=1, num_train=10, num_eval=5)).alphabet == \
        build_task(config(seed=2, num_train=10, num_eval=5)).alphabet == ALPHABET


def test_build_chess_task_from_config():
    task = build_task(config(num_train=100, num_eval=20, move_format="san", min_plies=3,
                             max_plies=5))
    assert task.name == "chess_fen" and len(task.train) == 100 and len(task.eval) == 20
    assert task.default_rewards == DEFAULT_REWARDS
    assert all(3 <= ex.meta["plies"] <= 5 for ex in task.train)
    assert replay(task.train[0].prompt, san=True) == task.train[0].target


def test_unknown_task():
    with pytest.raises(ConfigError, match="unknown task 'go'.*chess_fen, countdown, jsonl"):
        build_task(config(task="go"))


# ---- JSONL ----

def test_load_jsonl_rows_and_metadata():
    rows = load_jsonl(DATA / "rows.jsonl")  # the blank second line is skipped
    assert [r.prompt for r in rows] == ["e2e4:", "e2e4 e7e5:", "e2e4 d7d5 e4d5 d8d5:"]
    assert rows[1].target == AFTER_E4_E5
    assert rows[0].meta == {"source": "hand", "plies": 1}
    assert rows[1].meta == {} and rows[2].meta == {"tags": ["capture"]}


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "a", "target": "b"}', '{"prompt": "a", "target": }'],
     r"bad\.jsonl:2: malformed JSON"),
    (['{"prompt": "a", "target": "b"}', '', '["a", "b"]'], r"bad\.jsonl:3: expected an object"),
    (['{"prompt": "a"}'], r'bad\.jsonl:1: missing "target"'),
    (['{"prompt": 3, "target": "b"}'], r'bad\.jsonl:1: "prompt" must be a string'),
    # a lone surrogate (it reached the tokenizer mid-run), a row deep enough to break the
    # scorer's pickling of its metadata (500 levels; json itself stops at ~1000), a
    # completion SFT would train on that is not text
    (['{"prompt": "a", "target": "b\\ud800"}'], r"bad\.jsonl:1: a string that is not valid "
     r"Unicode \(a lone surrogate"),
    (['{"prompt": "a", "target": "b", "m": ' + "[" * 500 + "]" * 500 + "}"],
     r"bad\.jsonl:1: nested deeper than 64 levels"),
    (['{"prompt": "a", "target": "b", "completion": 5}'],
     r'bad\.jsonl:1: "completion" \(what SFT trains on in place of the target, as RFT writes '
     r"it\) must be a string, got int"),
    # what Python's json reads and JSON has not: accepted silently before
    (['{"prompt": "a", "target": "b", "score": NaN}'],
     r"bad\.jsonl:1: NaN is no JSON number \(a non-finite value is not JSON\)"),
    (['{"prompt": "a", "target": "b"}', '{"prompt": "a", "target": "b", "w": -Infinity}'],
     r"bad\.jsonl:2: -Infinity is no JSON number"),
    (['{"prompt": "a", "target": "b", "target": "c"}'],
     r"bad\.jsonl:1: key 'target' is given twice in one object"),
    (['{"prompt": "a", "target": "b", "m": [{"x": 1, "x": 1}]}'],
     r"bad\.jsonl:1: key 'x' is given twice in one object"),
    ([], r"bad\.jsonl: no rows"),
    (['', '  '], r"bad\.jsonl: no rows"),
])
def test_malformed_jsonl(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    # complete lines: a last line with no newline that does not parse is a torn write,
    # skipped with a warning (tests/test_rft.py)
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(ConfigError, match=message):
        load_jsonl(path)


def test_jsonl_characters_the_tokenizer_cannot_encode(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "e2e4:", "target": "x"}\n\n'
                    '{"prompt": "e2e4:", "target": "Zürich"}\n')
    load_jsonl(path)  # without a tokenizer anything goes
    with pytest.raises(ConfigError, match=r"rows\.jsonl:3: row 2: .*cannot encode: 'Ziü'"):
        load_jsonl(path, CharTokenizer(ALPHABET))


def test_missing_data_file():
    with pytest.raises(ConfigError, match="nowhere.jsonl: cannot read data file"):
        load_jsonl("nowhere.jsonl")


def test_split_holds_out_whole_prompts():
    rows = [Example(f"p{i % 40}", "t") for i in range(100)]  # 40 prompts, most repeated
    train, held = split_held_out(rows, num_eval=512, seed=0, source="x")
    held_prompts = {r.prompt for r in held}
    assert len(held_prompts) == 4  # capped at 10% of the distinct prompts
    assert not held_prompts & {r.prompt for r in train}
    assert len(train) + len(held) == 100
    with pytest.raises(ConfigError, match="at least 2 distinct prompts"):
        split_held_out([Example("p", "t")] * 3, 10, 0, "x")


def test_jsonl_task_and_chess_task_with_data_path(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}?", "target": f"a{i}", "id": i}) + "\n"
                            for i in range(30)))
    task = build_task(config(task="jsonl", data_path=str(path), num_eval=2))
    assert len(task.eval) == 2 and len(task.train) == 28
    assert task.alphabet == "".join(sorted(set("0123456789?aq")))
    assert {r["name"] for r in task.default_rewards} == {"levenshtein", "exact_match"}
    assert task.train[0].meta.keys() == {"id"}
    # chess_fen reads the file but keeps its rewards and alphabet, and rejects foreign characters
    with pytest.raises(ConfigError, match="row 1: .*cannot encode: '\\?'"):
        build_task(config(task="chess_fen", data_path=str(path)))
    chess_task = build_task(config(task="chess_fen", data_path=str(DATA / "rows.jsonl")))
    assert chess_task.default_rewards == DEFAULT_REWARDS and chess_task.alphabet == ALPHABET
    assert len(chess_task.train) == 2 and len(chess_task.eval) == 1
    with pytest.raises(ConfigError, match="data_path: task 'jsonl' needs"):
        build_task(config(task="jsonl"))


# ---- PGN ----

def test_load_pgn(caplog):
    rows = load_pgn(DATA / "games.pgn", min_plies=2, max_plies=4)
    by_prompt = {r.prompt: r for r in rows}
    # games 1, 2 and 4 give plies 2..4; game 3 starts from a set-up position and is skipped
    assert len(rows) == 9 and {r.meta["game"] for r in rows} == {1, 2, 4}
    assert by_prompt["e2e4 e7e5:"].target == AFTER_E4_E5
    assert by_prompt["e2e4 d7d5 e4d5 d8d5:"].target == \
        "rnb1kbnr/ppp1pppp/8/3q4/8/8/PPPP1PPP/RNBQKBNR w KQkq - 0 3"
    assert by_prompt["e2e4 a7a6 e4e5 d7d5:"].target == \
        "rnbqkbnr/1pp1pppp/p7/3pP3/8/8/PPPP1PPP/RNBQKBNR w KQkq d6 0 3"
    assert "skipped 1 games" in caplog.text
    for r in rows:
        assert r.target == replay(r.prompt, san=False)


def test_load_pgn_san_castling_and_shared_openings():
    rows = load_pgn(DATA / "games.pgn", min_plies=0, max_plies=12, san=True)
    by_prompt = {r.prompt: r for r in rows}
    assert by_prompt[":"].target == chess.STARTING_FEN
    assert by_prompt["e4 e5 Nf3 Nc6 Bc4 Bc5 O-O:"].target == \
        "r1bqk1nr/pppp1ppp/2n5/2b1p3/2B1P3/5N2/PPPP1PPP/RNBQ1RK1 b kq - 5 4"
    assert by_prompt["e4 a6 e5 d5 exd6:"].target == \
        "rnbqkbnr/1pp1pppp/p2P4/8/8/8/PPPP1PPP/RNBQKBNR b KQkq - 0 3"
    # ":" and "e4:" open three games but appear once: 1 + 1 + (7-1) + (4-1) + (5-1)
    assert len(rows) == 15 and len(by_prompt) == 15


def test_malformed_pgn_names_file_line_and_game(tmp_path):
    path = tmp_path / "bad.pgn"
    path.write_text('[Event "ok"]\n\n1. e4 e5 *\n\n\n[Event "bad"]\n\n1. e4 e5 2. Ke3 *\n')
    with pytest.raises(ConfigError, match=r"bad\.pgn:6: game 2: illegal san: 'Ke3'"):
        load_pgn(path)
    empty = tmp_path / "empty.pgn"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="empty.pgn: no games found"):
        load_pgn(empty)
    with pytest.raises(ConfigError, match="has 20 plies"):
        load_pgn(DATA / "games.pgn", min_plies=20, max_plies=30)


def test_chess_task_from_pgn():
    task = build_task(config(pgn_path=str(DATA / "games.pgn"), min_plies=1, max_plies=12))
    prompts = [r.prompt for r in task.train + task.eval]
    assert len(prompts) == len(set(prompts)) == 14
    assert len(task.eval) == 1  # 10% of 14 distinct prompts, at least one
    with pytest.raises(ConfigError, match="choose one source"):
        build_task(config(pgn_path=str(DATA / "games.pgn"), data_path=str(DATA / "rows.jsonl")))


# ---- task arguments, data checks and evaluation extras ----

def test_task_args_are_validated_by_the_task_with_errors_that_name_the_key():
    cfg = load_config(overrides={"task_args.max_plies": "8"}, env={})
    assert cfg.task_args == {"num_train": 50000, "min_plies": 2, "max_plies": 8,
                             "move_format": "uci", "pgn_path": ""}  # defaults filled in
    for over, needle in [({"task_args.max_pliez": "8"}, "did you mean 'max_plies'"),
                         ({"task_args.max_plies": "x"}, "task_args.max_plies: expected an"),
                         ({"task_args.max_plies": "1"}, "task_args.max_plies: must be >="),
                         ({"task_args.move_format": "lan"}, "task_args.move_format: must be"),
                         ({"max_plies": "8"}, "moved into the task's arguments"),
                         ({"task": "jsonl", "task_args.num_train": "5"}, "unknown key")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(overrides=over, env={})


def test_a_chess_jsonl_target_that_is_not_a_fen_is_rejected_at_load(tmp_path):
    path = tmp_path / "rows.jsonl"
    good = {"prompt": "e2e4:", "target": chess.Board().fen()}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "d2d4:", "target": "8/8 w"})
                    + "\n")
    with pytest.raises(ConfigError, match=r"rows.jsonl:2: row 2: target '8/8 w' is not a FEN"):
        build_task(config(data_path=str(path)))


def test_deeply_nested_jsonl_row_is_a_clear_error(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100000 + "]" * 100000 + "\n")
    with pytest.raises(ConfigError, match="deep.jsonl:1: JSON nested too deeply"):
        load_jsonl(path)


def test_a_jsonl_integer_over_pythons_digit_limit_names_file_and_line(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"prompt": "a", "target": "b"}) + "\n"
                    + '{"prompt": "a", "target": "b", "n": ' + "9" * 100_000 + "}\n")
    with pytest.raises(ConfigError, match="big.jsonl:2: an integer longer than 4300 digits"):
        load_jsonl(path)


def test_a_jsonl_line_past_16_mib_is_refused_unread(tmp_path):
    """A line is read in bounded chunks: one longer than MAX_LINE is refused naming the file
    and line once that much is read (a 100 MB line was read whole, 2.7 GB); the memory it
    takes stays near the bound, not the line's length."""
    import tracemalloc

    from mini_grpo.tasks.jsonl import MAX_LINE

    path = tmp_path / "long.jsonl"
    row = json.dumps({"prompt": "a", "target": "b"}).encode() + b"\n"
    with open(path, "wb") as f:
        f.write(row + b'{"prompt": "' + b"a" * (3 * MAX_LINE) + b'", "target": "b"}\n')
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=r"long\.jsonl:2: a line longer than 16777216 "
                                              r"bytes \(16 MiB\), the most a row may be"):
            load_jsonl(path)
        assert tracemalloc.get_traced_memory()[1] < 2.5 * MAX_LINE
    finally:
        tracemalloc.stop()
    path.write_bytes(row + b'{"prompt": "' + b"a" * (MAX_LINE - 30) + b'", "target": "b"}\n')
    assert len(load_jsonl(path)) == 2  # at the bound: read


@pytest.mark.parametrize("key, value, needle", [
    ("num_train", "1000000000000", "task_args.num_train: must be in 1..10,000,000"),
    ("max_plies", "1000000000", "task_args.max_plies: must be <= 1000"),
])
def test_generated_data_is_bounded(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        config(**{key: value})


def test_chess_task_brings_its_own_evaluation_extras():
    task = build_task(config(num_train=10, num_eval=5))
    cols = task.eval_columns(task.eval[:2], [task.eval[0].target, "not a fen"])
    assert cols["valid_fen"].tolist() == [1.0, 0.0]
    assert task.eval_bucket(Example("p", "t", {"plies": 6})) == "plies_5-8"
    assert task.eval_bucket(Example("p", "t", {})) is None
    assert task.trivial_answers["start_fen"](task.eval[0]) == chess.STARTING_FEN
    jsonl_task = build_task(config(task="jsonl", data_path=str(DATA / "rows.jsonl")))
    assert jsonl_task.eval_columns is None and jsonl_task.trivial_answers == {}
