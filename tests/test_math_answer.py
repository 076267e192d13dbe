"""math_answer and answer_format (mini_grpo/rewards/answers.py) on hand-written rows."""

import pytest

from mini_grpo.rewards import available_rewards, resolve_reward
from mini_grpo.rewards.answers import extract_answer, marked_answer

GSM8K_SOLUTION = ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
                  "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer's market.\n#### 18")

CASES = [  # (completion, target, expected math_answer)
    # \boxed, nested braces, several boxes
    ("So the answer is \\boxed{72}.", "72", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{\\frac{\\frac{1}{2}}{2}}", "\\frac{\\frac{1}{2}}{2}", 1.0),  # nested: as text
    ("first \\boxed{1}, then \\boxed{2}", "2", 1.0),  # the last box wins
    ("first \\boxed{1}, then \\boxed{2}", "1", 0.0),
    ("\\boxed{7} and a truncated \\boxed{8", "7", 1.0),  # unbalanced last box: the one before
    ("\\fbox{12}", "12", 1.0),
    ("$\\boxed{\\boxed{5}}$", "5", 1.0),
    # fractions and decimals
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{\\tfrac34}", "3/4", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("\\boxed{\\frac{-1}{2}}", "-\\frac{1}{2}", 1.0),
    ("#### 0.5", "1/2", 1.0),
    ("#### 0.50", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.333333}", "\\frac{1}{3}", 1.0),  # within 1e-6 relative
    ("\\boxed{0.33}", "\\frac{1}{3}", 0.0),
    ("\\boxed{18.0000001}", "18", 0.0),  # within 1e-6, but 18 is exact
    ("\\boxed{1.5e3}", "1500", 1.0),
    ("\\boxed{2 1/2}", "2.5", 1.0),  # mixed numbers
    ("\\boxed{2\\frac{1}{2}}", "5/2", 1.0),
    ("\\boxed{1/0}", "1/0", 1.0),  # not a number: equal as text
    # signs, commas, percent, dollars, units
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{-3}", "3", 0.0),
    ("Answer: \u22127", "-7", 1.0),  # unicode minus
    ("The total is $1,234.", "#### 1234", 1.0),
    ("#### 1,000,000", "1000000", 1.0),
    ("#### 50%", "50", 1.0),  # a percent sign is ignored
    ("\\boxed{50\\%}", "50", 1.0),
    ("#### 50%", "0.5", 0.0),
    ("#### 50 percent", "50", 1.0),
    ("He paid \\boxed{\\$18.00}", "18", 1.0),
    ("#### $18", "18", 1.0),
    ("#### 5 apples", "5", 1.0),
    ("<answer>72 dollars</answer>", "72", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{3x}", "3", 0.0),  # a single letter glued to a number is no unit
    # GSM8K solutions as targets, #### and <answer> in completions
    ("9 * 2 = 18 dollars.\n#### 18", GSM8K_SOLUTION, 1.0),
    ("She makes 9 * 2 = 18 a day.", GSM8K_SOLUTION, 1.0),  # last number
    ("#### 9", GSM8K_SOLUTION, 0.0),
    ("#### 18\nThat's it, 19 words.", "18", 1.0),  # the line after ####
    ("<think>maybe 5</think><answer>6</answer>", "6", 1.0),
    ("<answer>5</answer> ... <answer>6</answer>", "6", 1.0),  # the last block
    ("<answer>6", "6", 1.0),  # unclosed block: last number
    # last number in the text
    ("First 3 apples, then 4, so 7 in all.", "7", 1.0),
    ("So the result is 10-3 = 7", "7", 1.0),
    ("The answer is 3/4.", "\\frac{3}{4}", 1.0),
    ("so it is -\\frac{1}{2}.", "-0.5", 1.0),
    ("I think it is 12.", "13", 0.0),
    # no answer, empty, text answers, whitespace
    ("I don't know.", "6", 0.0),
    ("", "6", 0.0),
    ("\\boxed{}", "6", 0.0),
    ("####", "6", 0.0),
    ("\\boxed{\\text{yes}}", "yes", 1.0),
    ("\\boxed{\\text{Yes}}", "\\text{yes}", 1.0),
    ("\\boxed{\\text{no}}", "yes", 0.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{\\left( 1,2 \\right)}", "(1, 2)", 1.0),
    ("\\boxed{  42  }", "  42 \n", 1.0),
    ("\n\n   #### \t 42   \n", "\\boxed{42}", 1.0),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 0.0),  # no symbolic equivalence
]


def call(name, completions, targets):
    n = len(completions)
    return resolve_reward(name)([""] * n, completions, targets, [{}] * n)


@pytest.mark.parametrize("completion,target,expected", CASES)
def test_math_answer_cases(completion, target, expected):
    assert call("math_answer", [completion], [target]) == [expected]


def test_extraction_order():
    text = "5 <answer>4</answer> #### 3\n \\boxed{2} 1"
    assert extract_answer(text) == "2"
    assert extract_answer(text.replace("\\boxed{2}", "")) == "3"
    assert extract_answer("5 <answer>4</answer> 1") == "4"
    assert extract_answer("5 then 1") == "1"
    assert extract_answer("no numbers") == ""
    assert extract_answer("3/4", is_target=True) == "3/4"  # a target is never cut to "4"
    assert extract_answer("  \\text{yes} ", is_target=True) == "\\text{yes}"


def test_a_target_without_answer_is_not_scored():
    assert call("math_answer", ["72", "72"], ["", " \n\\boxed{}"]) == [None, None]


@pytest.mark.parametrize("completion,expected", [
    ("so \\boxed{72}", 1.0),
    ("\\fbox{x}", 1.0),
    ("steps...\n#### 72", 1.0),
    ("<answer>72</answer>", 1.0),
    ("<answer> 72 \n</answer>", 1.0),
    ("The answer is 72.", 0.0),  # a bare number is no marked answer
    ("\\boxed{}", 0.0),
    ("\\boxed{72", 0.0),  # unbalanced
    ("####\n", 0.0),
    ("<answer>72", 0.0),  # unclosed
    ("<answer></answer>", 0.0),
    ("", 0.0),
])
def test_answer_format(completion, expected):
    assert call("answer_format", [completion], ["72"]) == [expected]
    assert (marked_answer(completion) not in (None, "")) == bool(expected)


PATHOLOGICAL = [
    "{" * 100_000,
    "}" * 100_000,
    "\\boxed{" * 20_000,
    "\\boxed{" * 20_000 + "1" + "}" * 20_000,
    "\\boxed{1}" * 20_000,
    "\\frac{" * 20_000,
    "<answer>" * 20_000,
    "</answer>" * 20_000,
    "#" * 100_000,
    "1e999999",
    "\\boxed{1e999999}",
    "\\boxed{10^{10^{10^{10}}}}",
    "\\boxed{9^{9^{9^{9}}}}",
    "9" * 5000,
    "\\boxed{" + "9" * 5000 + "}",
    "\\boxed{" + "9" * 5000 + "/" + "9" * 5000 + "}",
    "-" * 100_000 + "1",
    "1," * 50_000,
    "1 " * 50_000 + "/",
    "\\text{" * 20_000,
    "a" * 100_000 + "1",
    "\\boxed{" + "x" * 100_000 + "}",
    "\x00\ud800\U0010ffff",
]


@pytest.mark.parametrize("text", PATHOLOGICAL, ids=range(len(PATHOLOGICAL)))
def test_pathological_inputs_score_without_raising(text):
    for target in ["1", "9" * 5000]:
        assert call("math_answer", [text], [target])[0] in (0.0, 1.0)
    assert call("math_answer", ["1"], [text])[0] in (0.0, 1.0, None)  # None: target has no answer
    if marked_answer(text):  # a marked answer always equals itself
        assert call("math_answer", [text], [text]) == [1.0]
    assert call("answer_format", [text], ["1"])[0] in (0.0, 1.0)


def test_big_numbers_compare_as_text():
    assert call("math_answer", ["#### " + "9" * 5000], ["9" * 5000]) == [1.0]
    assert call("math_answer", ["#### " + "9" * 5000], ["9" * 4999 + "8"]) == [0.0]


def test_non_string_completion_scores_zero():
    assert resolve_reward("math_answer")([""], [None], ["1"], [{}]) == [0.0]
    assert resolve_reward("answer_format")([""], [None], ["1"], [{}]) == [0.0]


def test_through_the_registry_one_float_per_row():
    assert {"math_answer", "answer_format"} <= set(available_rewards())
    completions = [c for c, _, _ in CASES]
    targets = [t for _, t, _ in CASES]
    got = call("math_answer", completions, targets)
    assert got == [e for _, _, e in CASES]
    assert all(isinstance(x, float) for x in got)
    fmt = call("answer_format", completions, targets)
    assert len(fmt) == len(CASES) and all(x in (0.0, 1.0) for x in fmt)
