"""numeric: questions whose answer is a number, generated from the seed, for pretrained chat
models: unit conversions (the original planning notes' homework) and short arithmetic, bare
or as a word problem.

    prompt  "How many meters are in 3.5 kilometers? Put the final answer in <answer></answer>
             tags."
    target  "<answer>3500</answer>"                 (the SFT target: the number in tags;
            "3.5 * 1000 = 3500. <answer>3500</answer>" with task_args.target: working)
    meta    {"kind": "convert", "answer": "3500"}

Kinds (`task_args.kinds`, all by default, drawn uniformly):
    add, sub, mul      "What is 47 + 38?" (two-digit numbers; mul: one digit by two)
    word_add, word_sub, word_mul, word_div
                       "Mia has 23 stickers. She gets 15 more. How many stickers does she
                        have now?" (div: equal shares that come out whole)
    convert            "How many seconds are in 7 minutes?", "Convert 4500 grams to
                        kilograms." (metric length, mass and volume, time; exact factors, a
                        value with at most one decimal, answers with at most three)

The held-out questions are drawn first and are distinct; training questions never repeat a
held-out prompt. Rewards (rewards/answers.py): 0.9 numeric_answer + 0.1 numeric_format: the
answer in the tags, else the completion's last number, within a relative tolerance of 1e-3
and the precision a decimal is written to (answers.numbers_agree);
the small format share gives a group in which nothing is right yet a gradient towards the
asked form. Evaluation extras: `correct` and `tagged` (the answer in the asked tags, right or
wrong) columns, results by kind, and two trivial answers
(the first number of the question, and 0).
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Literal

import numpy as np

from mini_grpo.fields import ConfigError
from mini_grpo.rewards.answers import numeric_answer, numeric_tags
from mini_grpo.task_registry import MAX_GENERATED, register
from mini_grpo.tasks.base import Example, TaskData

if TYPE_CHECKING:
    from mini_grpo.config import GRPOConfig

DEFAULT_REWARDS = [
    {"name": "numeric_format", "weight": 0.1},
    {"name": "numeric_answer", "weight": 0.9},
]
KINDS = ("add", "sub", "mul", "word_add", "word_sub", "word_mul", "word_div", "convert")
INSTRUCTION = "Put the final answer in <answer></answer> tags."
TRIES_PER_QUESTION = 50
ALPHABET = "".join(sorted(set(string.printable) - set("\t\r\x0b\x0c")))

NAMES = ["Mia", "Leo", "Ava", "Noah", "Emma", "Liam", "Zoe", "Omar", "Sara", "Ben", "Ivy",
         "Max", "Nina", "Sam", "Lily", "Tom"]
ITEMS = ["apples", "stickers", "marbles", "books", "pencils", "cookies", "cards", "stamps",
         "shells", "coins", "balloons", "oranges"]
BOXES = {"box": "boxes", "bag": "bags", "basket": "baskets", "jar": "jars", "pack": "packs",
         "crate": "crates"}
# (unit, plural, {other unit: how many of it one of this makes}): exact factors only
UNITS = {
    "kilometer": {"meter": 1000}, "meter": {"centimeter": 100, "millimeter": 1000},
    "centimeter": {"millimeter": 10}, "kilogram": {"gram": 1000}, "gram": {"milligram": 1000},
    "liter": {"milliliter": 1000}, "hour": {"minute": 60, "second": 3600},
    "minute": {"second": 60}, "day": {"hour": 24}, "week": {"day": 7},
}
METRIC = ("meter", "gram", "liter")  # back conversions (4500 grams -> kilograms): decimal
# factors only, so the answer stays a short decimal


@dataclass
class Args:
    """numeric's options (the config's task_args)."""
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    num_train: int = 20000  # generated training questions (at most 10 million)
    instruction: str = INSTRUCTION  # after each question ("" for none)
    # the SFT target: "answer" (<answer>85</answer>) or "working" (the one operation that
    # answers it first: "47 + 38 = 85. <answer>85</answer>")
    target: Literal["answer", "working"] = "answer"

    def check(self) -> None:
        check_args(self, KINDS)


def check_args(args, kinds: tuple[str, ...]) -> None:
    """The options a generated-questions task shares: `kinds` among `kinds`, `num_train`,
    `instruction` (a ConfigError naming the key)."""
    if not args.kinds or not all(isinstance(k, str) and k in kinds for k in args.kinds):
        raise ConfigError(f"task_args.kinds: must be a non-empty list of {', '.join(kinds)}, "
                          f"got {args.kinds!r}")
    if not 0 < args.num_train <= MAX_GENERATED:
        raise ConfigError(f"task_args.num_train: must be in 1..{MAX_GENERATED:,}, "
                          f"got {args.num_train}")
    if len(args.instruction) > 1000:
        raise ConfigError("task_args.instruction: at most 1000 characters")


def show(x: Fraction) -> str:
    """A number as an answer is written: 3500, 4.5, 0.125."""
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.3f}".rstrip("0").rstrip(".")


def plural(unit: str, value: Fraction) -> str:
    return unit if value == 1 else unit + "s"


def question(rng: random.Random, kind: str) -> tuple[str, str, Fraction]:
    """(question, the one operation that answers it, answer) of one random question of
    `kind`."""
    name, items = rng.choice(NAMES), rng.choice(ITEMS)
    if kind == "add":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"What is {a} + {b}?", f"{a} + {b}", Fraction(a + b)
    if kind == "sub":
        a = rng.randint(20, 99)
        b = rng.randint(10, a - 1)
        return f"What is {a} - {b}?", f"{a} - {b}", Fraction(a - b)
    if kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(11, 99)
        return f"What is {a} * {b}?", f"{a} * {b}", Fraction(a * b)
    if kind == "word_add":
        a, b = rng.randint(5, 60), rng.randint(5, 40)
        return (f"{name} has {a} {items}. {name} gets {b} more. How many {items} does "
                f"{name} have now?"), f"{a} + {b}", Fraction(a + b)
    if kind == "word_sub":
        a = rng.randint(15, 90)
        b = rng.randint(2, a - 3)
        return (f"{name} has {a} {items} and gives away {b} of them. How many {items} does "
                f"{name} have left?"), f"{a} - {b}", Fraction(a - b)
    if kind == "word_mul":
        a, b, box = rng.randint(2, 12), rng.randint(2, 12), rng.choice(sorted(BOXES))
        return (f"Each {box} holds {a} {items}. How many {items} are in {b} {BOXES[box]}?",
                f"{b} * {a}", Fraction(a * b))
    if kind == "word_div":
        each, n = rng.randint(2, 12), rng.randint(2, 9)
        return (f"{name} shares {each * n} {items} equally among {n} friends. How many "
                f"{items} does each friend get?"), f"{each * n} / {n}", Fraction(each)
    return conversion(rng)


def conversion(rng: random.Random) -> tuple[str, str, Fraction]:
    big = rng.choice(sorted(UNITS))
    small, factor = rng.choice(sorted(UNITS[big].items()))
    value = Fraction(rng.randint(2, 20)) if rng.random() < 0.7 else \
        Fraction(rng.randint(11, 99), 10)  # 2..20, or one decimal: 1.1..9.9
    if big.endswith(METRIC) and small.endswith(METRIC) and rng.random() < 0.4:
        many = value * factor  # back: a whole number of the small unit to the big one
        return (f"Convert {show(many)} {plural(small, many)} to {big}s.",
                f"{show(many)} / {factor}", many / factor)
    if rng.random() < 0.5:
        return (f"How many {small}s are in {show(value)} {plural(big, value)}?",
                f"{show(value)} * {factor}", value * factor)
    return (f"Convert {show(value)} {plural(big, value)} to {small}s.",
            f"{show(value)} * {factor}", value * factor)


def make_example(q: str, working: str, answer: Fraction, kind: str, args: Args) -> Example:
    text = show(answer)
    target = f"<answer>{text}</answer>"
    if args.target == "working":
        target = f"{working} = {text}. {target}"
    return Example(f"{q} {args.instruction}".strip(), target, {"kind": kind, "answer": text})


def numeric_example(rng: random.Random, kind: str, args: Args) -> Example:
    return make_example(*question(rng, kind), kind, args)


def generate(rng: random.Random, count: int, args, exclude: set, distinct: bool,
             example=numeric_example) -> list[Example]:
    """`count` examples of `args.kinds` (drawn uniformly, or by `args.weights` where it has
    them), each made by `example(rng, kind, args)`."""
    out: list[Example] = []
    seen: set = set()
    for _ in range(TRIES_PER_QUESTION * count + 1000):
        if len(out) == count:
            break
        weights = getattr(args, "weights", None)
        kind = rng.choices(args.kinds, weights)[0] if weights else rng.choice(args.kinds)
        ex = example(rng, kind, args)
        if ex.prompt in exclude or (distinct and ex.prompt in seen):
            continue
        seen.add(ex.prompt)
        out.append(ex)
    return out


def generate_split(num_eval: int, args, seed: int,
                   example=numeric_example) -> tuple[list[Example], list[Example]]:
    """(train, held-out): the held-out questions drawn first, distinct; no training question
    repeats one."""
    rng = random.Random(seed)
    held = generate(rng, num_eval, args, set(), distinct=True, example=example)
    if len(held) < num_eval:
        raise ConfigError(f"num_eval: found only {len(held)} distinct questions of the kinds "
                          f"{args.kinds}; lower num_eval")
    train = generate(rng, args.num_train, args, {ex.prompt for ex in held}, distinct=False,
                     example=example)
    if len(train) < args.num_train:
        raise ConfigError("task_args.num_train: too few questions outside the held-out ones; "
                          "lower num_eval or num_train")
    return train, held


def correct_column(examples: list[Example], completions: list[str]) -> dict:
    scores = numeric_answer([], completions, [ex.target for ex in examples],
                            [ex.meta for ex in examples])
    tagged = numeric_tags([], completions, [], [])  # the asked form, right or wrong
    return {"correct": np.asarray([s or 0.0 for s in scores], dtype=float),
            "tagged": np.asarray(tagged, dtype=float)}


_FIRST_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def first_number(ex: Example) -> str:
    m = _FIRST_NUMBER.search(ex.prompt)
    return f"<answer>{m.group() if m else 0}</answer>"


@register("numeric", Args)
def build(cfg: GRPOConfig, args: Args) -> TaskData:
    if cfg.data_path:
        raise ConfigError("task numeric: generates its questions; for rows of your own use "
                          "task: jsonl with rewards numeric_answer / numeric_format")
    train, held = generate_split(cfg.num_eval, args, cfg.seed)
    return TaskData("numeric", train, held, [dict(r) for r in DEFAULT_REWARDS], ALPHABET,
                    eval_columns=correct_column, eval_bucket=lambda ex: ex.meta.get("kind"),
                    trivial_answers={"first_number": first_number,
                                     "zero": lambda ex: "<answer>0</answer>"},
                    solved="correct")
