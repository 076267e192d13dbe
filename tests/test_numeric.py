"""The numeric task (tasks/numeric.py) and its rewards (numeric_answer, numeric_format): every
generated answer checked by an independent solver of the question's text, the split, the
options, and the rewards on hand-picked completions."""

import re
from fractions import Fraction

import pytest
from conftest import tiny

from mini_grpo.fields import ConfigError
from mini_grpo.rewards.answers import numeric_answer, numeric_concise, numeric_format, numeric_tags
from mini_grpo.tasks import build_task
from mini_grpo.tasks.numeric import KINDS, Args, generate_split

# the value of each unit in a base unit of its kind
BASE = {"millimeter": Fraction(1, 1000), "centimeter": Fraction(1, 100), "meter": 1,
        "kilometer": 1000, "milligram": Fraction(1, 1000), "gram": 1, "kilogram": 1000,
        "milliliter": Fraction(1, 1000), "liter": 1, "second": 1, "minute": 60, "hour": 3600,
        "day": 86400, "week": 604800}
NUM = r"(\d+(?:\.\d+)?)"


def solve(prompt: str) -> Fraction:
    """The answer of a question, read from its words alone."""
    q = prompt.split("?")[0] + "?" if "?" in prompt else prompt.split(".")[0]
    n = [Fraction(x) for x in re.findall(NUM, q)]
    if m := re.match(rf"What is {NUM} ([-+*]) {NUM}\?", q):
        a, op, b = Fraction(m[1]), m[2], Fraction(m[3])
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    if "gets" in q:
        return n[0] + n[1]
    if "gives away" in q:
        return n[0] - n[1]
    if "holds" in q:
        return n[0] * n[1]
    if "shares" in q:
        return n[0] / n[1]
    if m := re.match(rf"How many (\w+?)s are in {NUM} (\w+?)s?\?", q):
        return Fraction(m[2]) * BASE[m[3]] / BASE[m[1]]
    m = re.match(rf"Convert {NUM} (\w+?)s? to (\w+?)s", prompt)
    return Fraction(m[1]) * BASE[m[2]] / BASE[m[3]]


def test_every_answer_is_right_and_the_split_is_clean():
    train, held = generate_split(400, Args(num_train=3000), seed=3)
    assert len(held) == 400 and len(train) == 3000
    assert len({ex.prompt for ex in held}) == 400  # distinct
    assert not {ex.prompt for ex in held} & {ex.prompt for ex in train}
    assert {ex.meta["kind"] for ex in held} == set(KINDS)
    for ex in train + held:
        value = Fraction(ex.meta["answer"])
        assert value == solve(ex.prompt), ex.prompt
        assert ex.target == f"<answer>{ex.meta['answer']}</answer>"
        assert ex.prompt.endswith("Put the final answer in <answer></answer> tags.")
    assert generate_split(400, Args(num_train=3000), seed=3)[1][0].prompt == held[0].prompt
    assert generate_split(400, Args(num_train=3000), seed=4)[1][0].prompt != held[0].prompt


def test_options():
    train, held = generate_split(50, Args(kinds=["convert"], num_train=100, instruction=""),
                                 seed=0)
    assert {ex.meta["kind"] for ex in train + held} == {"convert"}
    assert all(ex.prompt.endswith(("?", ".")) and "<answer>" not in ex.prompt for ex in held)
    for args, needle in ((Args(kinds=["divide"]), "task_args.kinds"),
                         (Args(kinds=[]), "task_args.kinds"),
                         (Args(num_train=0), "task_args.num_train")):
        with pytest.raises(ConfigError, match=needle):
            args.check()
    with pytest.raises(ConfigError, match="num_eval"):  # more than the kind has
        generate_split(1000, Args(kinds=["mul"], num_train=10), seed=0)  # 712 exist


def test_working_targets():
    """target: working writes the one operation before the tagged answer; it evaluates to
    the answer, the rewards read the tag, and the questions are the same as the default's."""
    train, held = generate_split(200, Args(num_train=800, target="working"), seed=3)
    plain = generate_split(200, Args(num_train=800), seed=3)
    assert [ex.prompt for ex in train + held] == [ex.prompt for ex in plain[0] + plain[1]]
    ops = {"+": Fraction.__add__, "-": Fraction.__sub__, "*": Fraction.__mul__,
           "/": Fraction.__truediv__}
    for ex in train + held:
        answer = ex.meta["answer"]
        m = re.fullmatch(rf"{NUM} ([-+*/]) {NUM} = (\S+)\. <answer>(\S+)</answer>", ex.target)
        assert m and m[4] == m[5] == answer, ex.target
        assert ops[m[2]](Fraction(m[1]), Fraction(m[3])) == Fraction(answer) == solve(ex.prompt)
        assert numeric_answer([], [ex.target], [ex.target], [{}]) == [1.0]
    assert {ex.target.split(" ")[1] for ex in train} == set(ops)  # every operation occurs
    with pytest.raises(ConfigError, match="task_args.target: must be one of answer, working"):
        build_task(tiny(task="numeric", task_args={"target": "steps"}))


def test_a_validation_split_is_set_apart_from_training_and_never_the_held_out_set():
    """num_val: evaluations run on training prompts set apart (never trained on), so settings
    are chosen without the held-out set a result is reported on; the rest stays as it was."""
    plain = build_task(tiny(task="numeric", num_eval=32, task_args={"num_train": 400}))
    data = build_task(tiny(task="numeric", num_eval=32, num_val=20,
                           task_args={"num_train": 400}))
    assert (plain.eval_split, data.eval_split) == ("held-out", "validation")
    val = {ex.prompt for ex in data.eval}
    assert len(val) == len(data.eval) == 20  # each prompt once (training rows repeat some)
    assert not val & {ex.prompt for ex in data.train}  # never trained on
    assert not val & {ex.prompt for ex in plain.eval}  # nor the held-out questions
    assert val <= {ex.prompt for ex in plain.train}  # drawn from the training questions
    assert [ex.prompt for ex in data.train] == \
        [ex.prompt for ex in plain.train if ex.prompt not in val]
    with pytest.raises(ConfigError, match="num_val"):
        tiny(num_val=-1)


def test_task_through_the_config():
    cfg = tiny(task="numeric", num_eval=32, task_args={"num_train": 200})
    data = build_task(cfg)
    assert [r["name"] for r in data.default_rewards] == ["numeric_format", "numeric_answer"]
    completions = [ex.target for ex in data.eval[:2]] + ["I do not know", "<answer>0</answer>"]
    cols = data.eval_columns(data.eval[:4], completions)
    assert cols["correct"].tolist()[:3] == [1.0, 1.0, 0.0]
    assert cols["tagged"].tolist() == [1.0, 1.0, 0.0, 1.0]  # the form, right or wrong
    assert data.eval_bucket(data.eval[0]) in KINDS
    ex = data.eval[0]
    assert data.trivial_answers["first_number"](ex) == \
        f"<answer>{re.search(NUM, ex.prompt)[1]}</answer>"


@pytest.mark.parametrize("completion, target, want", [
    ("The answer is 3500.", "<answer>3500</answer>", 1.0),  # the last number
    ("<answer>4.5</answer> so 3 more", "<answer>4.5</answer>", 1.0),  # the tag wins
    ("<answer>3499</answer>", "3500", 0.0),  # integers: exactly
    ("<answer>3.333</answer>", "3.3333", 1.0),  # decimals: within 1e-3 relative
    ("<answer>3.3</answer>", "3.3333", 0.0),
    ("4,500 grams", "4500", 1.0),
    ("<answer>4.50 kg</answer>", "4.5", 1.0),
    # a word of scale multiplies (it was stripped as a unit: 85 thousand scored right for 85)
    ("<answer>85 thousand</answer>", "85", 0.0),
    ("<answer>3.5 thousand</answer>", "3500", 1.0),
    ("<answer>85 Million dollars</answer>", "85000000", 1.0),
    # a decimal claims no more than its digits hold: 162100.0 was within 1e-3 of 162213
    ("<answer>162100.0</answer>", "162213", 0.0),
    ("<answer>162213.4</answer>", "162213", 0.0),
    ("<answer>162213.0</answer>", "162213", 1.0),
    ("<answer>94</answer>", "93.98", 1.0),  # the target rounded at the answer's precision
    ("<answer>1000</answer>", "1000.6", 0.0),  # which rounds to 1001
    # an exponent is part of its number: the last number of "1e3" had been 3
    ("The answer is 1e3.", "3", 0.0),
    ("The answer is 1e3.", "1000", 1.0),
    ("<answer>2.5E-3</answer>", "0.0025", 1.0),
    ("<answer>1e99999</answer>", "1", 0.0),  # past 3 digits of exponent: no number
    ("no number at all", "12", 0.0),
    ("", "12", 0.0),
    ("12", "twelve", None),  # a target that is no number is not scored
])
def test_numeric_answer(completion, target, want):
    assert numeric_answer([], [completion], [target], [{}]) == [want]


def test_numeric_answer_row_tolerance_and_format():
    assert numeric_answer([], ["3.3"], ["3.3333"], [{"rel_tol": 0.05}]) == [1.0]
    assert numeric_format([], ["<answer>12</answer>", "<answer>twelve</answer>", "12",
                               "\\boxed{7}", "<answer>12"], [], [{}] * 5) == \
        [1.0, 0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("completion, want", [
    ("<answer>12</answer>", 1.0),
    ("so <answer> 1,200 </answer>.", 1.0),  # spaces, commas, text after the block
    ("<answer>4.50 kg</answer>", 1.0),  # units are read off as numeric_answer reads them
    ("<answer>twelve</answer>", 0.0),  # the form holds no number
    ("#### 12\nThe answer is: 12", 0.0),  # numeric_format's other marks do not count here
    ("\\boxed{12}", 0.0),
    ("<answer>12</answer> #### 13", 0.0),  # a `####` anywhere marks the answer instead
    ("12 x 8 = 96.", 0.0),
    ("<answer>12", 0.0),  # an unclosed block
    ("", 0.0),
])
def test_numeric_tags_rewards_only_the_asked_form(completion, want):
    assert numeric_tags([], [completion], ["12"], [{}]) == [want]
    if want:  # where the tags are right, the looser numeric_format agrees
        assert numeric_format([], [completion], ["12"], [{}]) == [1.0]


def test_numeric_concise_pays_for_unused_tokens_only_where_the_answer_is_right():
    rows = [("12 x 1 = 12.", 12), ("so it is 12", 36), ("13", 1), ("", 0), ("12", 60)]
    metas = [{"completion_tokens": n, "max_new_tokens": 48} for _, n in rows]
    got = numeric_concise([], [c for c, _ in rows], ["12"] * len(rows), metas)
    # right: 1 - 12/48 and 1 - 36/48; wrong at any length (the empty answer too): 0; a
    # length past the cap counts as the cap
    assert got == [0.75, 0.25, 0.0, 0.0, 0.0]
    # no recorded lengths (a trivial baseline's answer): numeric_answer's score; no number
    # in the target: not scored
    assert numeric_concise([], ["12", "12"], ["12", "twelve"], [{}, metas[0]]) == [1.0, None]
