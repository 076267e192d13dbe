"""Countdown: the generator's problems and solutions, the safe answer parser, the rewards, the
task's options and evaluation extras, JSONL rows, and the task through the config."""

import builtins
import json

import pytest

from mini_grpo.config import ConfigError, load_config
from mini_grpo.rewards import countdown as rc
from mini_grpo.rewards import resolve_reward
from mini_grpo.rewards.countdown import countdown_correct, countdown_format
from mini_grpo.run import check_lengths
from mini_grpo.tasks import build_task
from mini_grpo.tasks.countdown import DEFAULT_REWARDS, Args, generate_split
from mini_grpo.tokenizer import CharTokenizer


def config(task_args=None, **overrides):
    return load_config("tiny", {"task": "countdown", "task_args": task_args or {}, **overrides},
                       env={})


def score(fn, completion, numbers, target, tag=None):
    meta = {"numbers": numbers, "target": target, **({"answer_tag": tag} if tag else {})}
    return fn(["p"], [completion], ["t"], [meta])[0]


# ---- generated problems ----

@pytest.mark.parametrize("style", ["short", "instruct"])
def test_every_generated_solution_is_accepted(style):
    args = Args(min_numbers=3, max_numbers=6, num_train=500, prompt_style=style)
    train, held = generate_split(100, args, seed=3)
    rows = train + held
    completions, metas = [ex.target for ex in rows], [ex.meta for ex in rows]
    assert countdown_correct([], completions, [], metas) == [1.0] * len(rows)
    assert countdown_format([], completions, [], metas) == [1.0] * len(rows)
    for ex in rows:
        m = ex.meta
        assert json.loads(json.dumps(m)) == m
        assert ex.target == f"<answer>{m['solution']}</answer>"
        assert m["difficulty"] == len(m["numbers"]) and 3 <= len(m["numbers"]) <= 6
        assert all(1 <= n <= 99 for n in m["numbers"]) and 1 <= m["target"] <= 1000
        assert m["target"] not in m["numbers"] and m["target"] != sum(m["numbers"])
        if style == "short":
            numbers, _, target = ex.prompt[:-1].partition(" -> ")
            assert [int(n) for n in numbers.split()] == m["numbers"]
            assert int(target) == m["target"] and ex.prompt.endswith(":")
        else:
            assert f"Using the numbers {m['numbers']}, " in ex.prompt
            assert f"equals {m['target']}." in ex.prompt
    assert {len(ex.meta["numbers"]) for ex in rows} == {3, 4, 5, 6}


def test_held_out_problems_are_distinct_and_never_trained_on():
    train, held = generate_split(300, Args(num_train=3000), seed=0)
    assert len(train) == 3000 and len(held) == 300
    key = lambda ex: (tuple(sorted(ex.meta["numbers"])), ex.meta["target"])
    assert len({ex.prompt for ex in held}) == len({key(ex) for ex in held}) == 300
    assert not {key(ex) for ex in held} & {key(ex) for ex in train}
    assert not {ex.prompt for ex in held} & {ex.prompt for ex in train}


def test_generator_is_deterministic_for_a_seed():
    args = Args(num_train=200)
    assert generate_split(20, args, seed=1) == generate_split(20, args, seed=1)
    assert generate_split(20, args, seed=1) != generate_split(20, args, seed=2)


# ---- the answer parser: nothing outside the grammar is evaluated ----

REJECTED = [
    ("__import__('os').system('echo hi')", [2, 3, 7, 10], 20),
    ("(2).real+18", [2, 18], 20),
    ("abs(20)", [20], 20),
    ("max(2, 10)*2", [2, 10, 2], 20),
    ("2**3", [2, 3], 8),
    ("2**10**10", [2, 10, 10], 1024),
    ("2^3", [2, 3], 1),
    ("20.0", [20], 20),
    ("2.5*8", [2, 5, 8], 20),
    ("1e3", [1, 3], 1000),
    ("0x14", [0, 14], 20),
    ("2_0", [2, 0], 20),
    ("020", [20], 20),
    ("-2+22", [2, 22], 20),
    ("10 10", [10, 10], 1010),
    ("(10+10", [10, 10], 20),
    ("10+10)", [10, 10], 20),
    (")10+10(", [10, 10], 20),
    ("10+", [10], 10),
    ("", [20], 20),
    ("[10]+10", [10, 10], 20),
    ("10;10", [10, 10], 10),
    ("lambda: 20", [20], 20),
    ("\uff12\uff10", [20], 20),  # full-width digits
    ("9" * 60, [int("9" * 60)], int("9" * 60)),  # a huge literal
    ("(" * 40 + "20" + ")" * 40, [20], 20),  # nested too deeply
    ("+".join(["1"] * 150), [1] * 150, 150),  # too long
    ("3*7-1", [3, 7, 2], 20),  # 1 is not given
    ("7+7+3+3", [3, 7, 10], 20),  # each number once
    ("7+7+6", [7, 6, 10], 20),
]


@pytest.mark.parametrize("expr,numbers,target", REJECTED)
def test_parser_rejects_before_evaluating(monkeypatch, expr, numbers, target):
    def forbidden(*args, **kwargs):
        raise AssertionError("evaluated")
    monkeypatch.setattr(rc, "_value", forbidden)
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert rc.evaluate(expr, numbers) is None
    assert score(countdown_correct, f"<answer>{expr}</answer>", numbers, target) == 0.0


def test_parser_caps_and_division_by_zero():
    assert rc.evaluate("10/(3-3)", [3, 3, 10]) is None
    assert score(countdown_correct, "<answer>10/(3-3)</answer>", [3, 3, 10], 10) == 0.0
    assert rc.evaluate("(" * 16 + "20" + ")" * 16, [20]) == 20  # MAX_DEPTH itself is fine
    assert rc.evaluate("+".join(["1"] * 100), [1] * 100) == 100  # 199 characters
    assert rc.evaluate("7/2*4", [2, 4, 7]) == 14  # exact fractions in between
    assert rc.evaluate("0", [0]) == 0


# ---- the rewards on whole completions ----

NUMBERS, TARGET = [3, 7, 25, 50], 178  # (50-25)*7+3
ANSWERS = [  # completion, countdown_correct, countdown_format
    ("<answer>(50-25)*7+3</answer>", 1.0, 1.0),
    ("<answer> ( 50 - 25 ) * 7 + 3 </answer>", 1.0, 1.0),
    ("<answer>\n(50-25)*7\n+3\n</answer>", 1.0, 1.0),
    ("<answer>3+7*(50-25)</answer>", 1.0, 1.0),
    ("<answer>(50-25)*7+3 = 178</answer>", 1.0, 1.0),
    ("<answer>(50-25)*7+3=178</answer>\n", 1.0, 1.0),
    ("<think>50+25 is 75, too small</think> <answer>(50-25)*7+3</answer>", 1.0, 1.0),
    ("<answer>50+3</answer> then <answer>(50-25)*7+3</answer>", 1.0, 0.5),  # the last counts
    ("<answer>(50-25)*7+3</answer><answer>50+3</answer>", 0.0, 0.5),
    ("<answer>(50-25)*7+3 = 177</answer>", 0.0, 1.0),
    ("<answer>(50-25)*7+3 = 178 = 178</answer>", 0.0, 1.0),
    ("<answer>(50-25)*7+7</answer>", 0.0, 1.0),  # 7 twice
    ("<answer>(50-25)*7</answer>", 0.0, 1.0),  # 175
    ("<answer>178</answer>", 0.0, 1.0),
    ("<answer> </answer>", 0.0, 0.5),
    ("<answer></answer>", 0.0, 0.5),
    ("<answer>(50-25)*7+3", 0.0, 0.0),
    ("(50-25)*7+3", 0.0, 0.0),
    ("<ANSWER>(50-25)*7+3</ANSWER>", 0.0, 0.0),
    ("", 0.0, 0.0),
]


@pytest.mark.parametrize("completion,correct,fmt", ANSWERS)
def test_answer_table(completion, correct, fmt):
    assert score(countdown_correct, completion, NUMBERS, TARGET) == correct
    assert score(countdown_format, completion, NUMBERS, TARGET) == fmt


def test_answer_blocks_match_the_regex_and_unclosed_tags_are_linear():
    import random
    import re

    from mini_grpo.rewards.countdown import answer_blocks

    rng = random.Random(0)
    pieces = ["<answer>", "</answer>", "<ans", "1+2", "\n", "answer>", "</answer"]
    for _ in range(500):  # the same blocks as <answer>(.*?)</answer> finds
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        assert answer_blocks(text) == re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    flood = "<answer>" * 100_000  # ~800 KB: quadratic in the regex, one pass here
    assert answer_blocks(flood + "</answer>") == ["<answer>" * 99_999]
    assert answer_blocks(flood) == []
    assert score(countdown_correct, flood, NUMBERS, TARGET) == 0.0


def test_answer_tag_comes_from_meta_and_numbers_may_go_unused():
    assert score(countdown_correct, "<final>50+25</final>", NUMBERS, 75, tag="final") == 1.0
    assert score(countdown_format, "<final>50+25</final>", NUMBERS, 75, tag="final") == 1.0
    assert score(countdown_correct, "<answer>50+25</answer>", NUMBERS, 75, tag="final") == 0.0
    assert score(countdown_correct, "<answer>50+25</answer>", NUMBERS, "75") == 1.0


def test_rewards_are_registered_and_default():
    assert resolve_reward("countdown_format") is countdown_format
    assert resolve_reward("countdown_correct") is countdown_correct
    assert sum(r["weight"] for r in DEFAULT_REWARDS) == pytest.approx(1.0)


# ---- options, evaluation extras, config ----

@pytest.mark.parametrize("task_args,key", [
    ({"min_numbers": 2}, "task_args.min_numbers"),
    ({"min_numbers": 7, "max_numbers": 6}, "task_args.min_numbers"),
    ({"min_numbers": 5}, "task_args.min_numbers"),  # > max_numbers (4)
    ({"max_numbers": 7}, "task_args.max_numbers"),
    ({"num_train": 0}, "task_args.num_train"),
    ({"num_train": 10**12}, r"task_args.num_train: must be in 1..10,000,000"),  # bounded
    ({"answer_tag": "my answer"}, "task_args.answer_tag"),
    ({"answer_tag": ""}, "task_args.answer_tag"),
    ({"prompt_style": "long"}, "task_args.prompt_style"),
    ({"max_plies": 4}, "task_args"),
])
def test_task_args_are_checked(task_args, key):
    with pytest.raises(ConfigError, match=key):
        config(task_args)


def test_through_the_config():
    cfg = config()
    assert cfg.task == "countdown" and cfg.task_args["min_numbers"] == 3
    data = build_task(cfg)
    assert data.name == "countdown" and data.default_rewards == DEFAULT_REWARDS
    assert len(data.eval) == cfg.num_eval and len(data.train) == cfg.task_args["num_train"]
    tok = CharTokenizer(data.alphabet)
    for ex in data.train + data.eval:
        tok.encode(ex.prompt + ex.target, strict=True)
    check_lengths(cfg, tok, [ex.prompt for ex in data.train + data.eval])
    big = Args(min_numbers=6, max_numbers=6, num_train=300)
    for ex in sum(generate_split(10, big, seed=0), []):  # the longest short prompts fit too
        assert len(ex.prompt) + 1 + cfg.max_new_tokens <= cfg.block_size
        assert len(ex.target) + 1 <= cfg.max_new_tokens


def test_instruct_prompt_names_the_tags():
    data = build_task(config({"prompt_style": "instruct", "answer_tag": "final", "num_train": 8},
                             num_eval=4))
    tok = CharTokenizer(data.alphabet)
    for ex in data.train + data.eval:
        assert "<think> </think>" in ex.prompt and "<final> </final>" in ex.prompt
        assert ex.target.startswith("<final>") and ex.target.endswith("</final>")
        tok.encode(ex.prompt + ex.target, strict=True)
    assert countdown_correct([], [ex.target for ex in data.eval], [],
                             [ex.meta for ex in data.eval]) == [1.0] * 4


def test_evaluation_extras():
    data = build_task(config({"min_numbers": 3, "max_numbers": 5}, num_eval=60))
    assert {data.eval_bucket(ex) for ex in data.eval} == {"numbers_3", "numbers_4", "numbers_5"}
    assert all(data.eval_bucket(ex) == f"numbers_{len(ex.meta['numbers'])}" for ex in data.eval)
    solved = data.eval_columns(data.eval, [ex.target for ex in data.eval])["solved"]
    assert solved.tolist() == [1.0] * 60
    wrong = data.eval_columns(data.eval, ["<answer>1+1</answer>"] * 60)["solved"]
    assert wrong.tolist() == [0.0] * 60
    assert set(data.trivial_answers) == {"sum_all", "echo_target"}
    for fn in data.trivial_answers.values():
        texts = [fn(ex) for ex in data.eval]
        metas = [ex.meta for ex in data.eval]
        assert countdown_correct([], texts, [], metas) == [0.0] * 60
        assert countdown_format([], texts, [], metas) == [1.0] * 60
    ex = data.eval[0]
    assert data.trivial_answers["sum_all"](ex) == \
        "<answer>" + "+".join(map(str, ex.meta["numbers"])) + "</answer>"


# ---- JSONL rows ----

def test_jsonl_rows(tmp_path):
    rows = [{"prompt": f"{a} {b} {c} -> {a + b * c}:", "target": str(a + b * c),
             "numbers": [a, b, c], "solution": f"{a}+{b}*{c}"}
            for a, b, c in [(1, 2, 3), (4, 5, 6), (7, 8, 9)] * 3 + [(2, 3, 4)] * 2]
    args = Args(num_train=10)
    ex = generate_split(1, args, seed=0)[0][0]  # a dumped row: the target is tagged
    rows += [{"prompt": ex.prompt, "target": ex.target, "numbers": ex.meta["numbers"]}] * 10
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = build_task(config(data_path=str(path)))
    loaded = data.train + data.eval
    assert len(loaded) == len(rows) and data.eval
    for r in loaded:
        assert r.meta["answer_tag"] == "answer"
        assert r.meta["difficulty"] == len(r.meta["numbers"])
        assert countdown_correct([], [r.target], [], [r.meta]) == [1.0]
    assert {r.meta["target"] for r in loaded} == {7, 34, 79, 14, ex.meta["target"]}

    bad = [rows[0], {"prompt": "1 2 -> 3:", "target": "3", "numbers": [1, "2"]}]
    path.write_text(json.dumps(bad[0]) + "\n\n" + json.dumps(bad[1]) + "\n")  # line 3
    with pytest.raises(ConfigError, match=r"rows.jsonl:3: row 2: \"numbers\""):
        build_task(config(data_path=str(path)))
    bad[1] = {"prompt": "1 2 -> 3:", "target": "<answer>1*2*3</answer>", "numbers": [1, 2]}
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(ConfigError, match="row 2: target '<answer>1\\*2\\*3</answer>'"):
        build_task(config(data_path=str(path)))
    # a solution is SFT's target: one that does not reach the row's target is refused
    bad[1] = {"prompt": "1 2 -> 3:", "target": "3", "numbers": [1, 2], "solution": "1*2"}
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(ConfigError, match=r"rows.jsonl:2: row 2: \"solution\" '1\*2' does "
                       r"not reach the target 3 with the numbers \[1, 2\]"):
        build_task(config(data_path=str(path)))
    bad[1]["solution"] = "1+2"
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    assert build_task(config(data_path=str(path), num_eval=1)).train
