"""countdown: reach a target with + - * / over a few given numbers, each used at most once.

The standard small RLVR benchmark (TinyZero's), generated here, with a solution for every row:

    prompt  "3 7 25 50 -> 178:"               (prompt_style short, for from-scratch char models)
    target  "<answer>(50-25)*7+3</answer>"    (the solution in answer tags: the SFT target)
    meta    {"numbers": [3, 7, 25, 50], "target": 178, "solution": "(50-25)*7+3",
             "answer_tag": "answer", "difficulty": 4}

prompt_style instruct is TinyZero's instruction for pretrained chat models ("Using the numbers
[3, 7, 25, 50], create an equation that equals 178. ..."); answer_tag names the tags.

Generation, from random.Random(seed): n numbers (n uniform in min_numbers..max_numbers) drawn
uniformly from 1..99, repeats allowed; then, until one value is left, two of them are combined
by an operation chosen uniformly among those whose result is a positive integer <= 1000
(a+b and a*b up to 1000, a-b for a > b, a/b when b divides a). So every intermediate value of
the solution is a positive integer, the target is in 1..1000, the solution uses every number
(n is the difficulty; answers may use any of them), and it is written with parentheses only
where precedence needs them. The prompt lists the numbers in the order drawn. A problem whose
target is one of its numbers (a one-literal answer) or their sum (a shortcut a policy could
collapse onto) is redrawn. The held-out problems are drawn first and are distinct; a training
problem with the same numbers (in any order) and target as a held-out one is redrawn.

Rows from `data_path` (JSONL): meta `numbers`, a list of integers, and a `target` that is an
integer ("178"; with a `solution` field the SFT target becomes that solution in tags) or an
answer such as "<answer>(50-25)*7+3</answer>" that reaches a whole number over the numbers
(rows dumped from this task load as they are).

Rewards (rewards/countdown.py): 0.1 countdown_format + 0.9 countdown_correct. Correctness is
the goal; the small format share gives groups in which nothing is solved yet a gradient
towards well-formed answers, while a well-formed wrong answer (0.1) stays far below any right
one (1.0). Evaluation extras: a solved column, results by number count (numbers_3, ...) and
two trivial answers, the sum of all numbers and the target itself (both always wrong for
generated problems: they score the format share only).
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from mini_grpo.fields import ConfigError, show
from mini_grpo.rewards.countdown import answer_blocks, countdown_correct, evaluate
from mini_grpo.task_registry import MAX_GENERATED, register
from mini_grpo.tasks.base import Example, TaskData, split_held_out
from mini_grpo.tasks.jsonl import load_jsonl

if TYPE_CHECKING:
    from mini_grpo.config import GRPOConfig

# every printable ASCII character: digits, operators and tags for the short style, and the
# words and punctuation of the instruct style, whatever the answer tag
ALPHABET = "".join(sorted(set(string.digits + string.ascii_letters + string.punctuation + " ")))

DEFAULT_REWARDS = [
    {"name": "countdown_format", "weight": 0.1},
    {"name": "countdown_correct", "weight": 0.9},
]

MIN_NUMBER, MAX_NUMBER = 1, 99
MAX_VALUE = 1000  # bound on every intermediate value of a solution, and so on the target
NUMBERS_RANGE = (3, 6)  # allowed min_numbers..max_numbers
TRIES_PER_PROBLEM = 20  # give up (ConfigError) after this many draws per requested problem
INTEGER = re.compile(r"-?[0-9]{1,18}")  # a JSONL row's target written as a number
PREC = {"+": 1, "-": 1, "*": 2, "/": 2, "": 3}  # "" marks a literal


@dataclass
class Args:
    """countdown's options (the config's task_args)."""
    min_numbers: int = 3  # fewest numbers in a problem (3..6)
    max_numbers: int = 4
    num_train: int = 20000  # generated training problems (at most 10 million)
    prompt_style: Literal["short", "instruct"] = "short"
    answer_tag: str = "answer"  # answers go in <answer_tag>...</answer_tag>

    def check(self) -> None:
        lo, hi = NUMBERS_RANGE
        if not lo <= self.min_numbers <= hi:
            raise ConfigError(f"task_args.min_numbers: must be in {lo}..{hi}, "
                              f"got {self.min_numbers}")
        if not lo <= self.max_numbers <= hi:
            raise ConfigError(f"task_args.max_numbers: must be in {lo}..{hi}, "
                              f"got {self.max_numbers}")
        if self.min_numbers > self.max_numbers:
            raise ConfigError(f"task_args.min_numbers: must be <= max_numbers "
                              f"({self.max_numbers}), got {self.min_numbers}")
        if not 0 < self.num_train <= MAX_GENERATED:
            raise ConfigError(f"task_args.num_train: must be in 1..{MAX_GENERATED:,}, "
                              f"got {self.num_train}")
        if not (self.answer_tag.isascii() and self.answer_tag.isidentifier()):
            raise ConfigError(f"task_args.answer_tag: must be letters, digits and '_' (not "
                              f"first a digit), got {self.answer_tag!r}")


def format_prompt(numbers: list[int], target: int, style: str, tag: str) -> str:
    if style == "short":
        return f"{' '.join(map(str, numbers))} -> {target}:"
    return (f"Using the numbers {numbers}, create an equation that equals {target}. You can use "
            f"basic arithmetic operations (+, -, *, /) and each number at most once. Show your "
            f"work in <think> </think> tags and return the final answer in <{tag}> </{tag}> "
            f"tags, for example <{tag}> (1 + 2) / 3 </{tag}>.")


def wrap(answer: str, tag: str) -> str:
    return f"<{tag}>{answer}</{tag}>"


def _combine(op: str, a: tuple, b: tuple) -> tuple:
    """(value, text, op) of `a op b`, parenthesising an operand only where it must be."""
    (va, ta, oa), (vb, tb, ob) = a, b
    if PREC[oa] < PREC[op]:
        ta = f"({ta})"
    if PREC[ob] < PREC[op] or (PREC[ob] == PREC[op] and op in "-/"):
        tb = f"({tb})"
    value = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va // vb}[op]
    return value, ta + op + tb, op


def random_problem(rng: random.Random, n: int) -> tuple[list[int], int, str]:
    """(numbers, target, solution): a random expression tree over all n numbers."""
    numbers = [rng.randint(MIN_NUMBER, MAX_NUMBER) for _ in range(n)]
    pool = [(v, str(v), "") for v in numbers]
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        a, b = pool[i], pool[j]
        if a[0] < b[0]:  # larger first, so a-b and a/b can stay positive integers
            a, b = b, a
        ops = [op for op, ok in (("+", a[0] + b[0] <= MAX_VALUE), ("-", a[0] > b[0]),
                                 ("*", a[0] * b[0] <= MAX_VALUE), ("/", a[0] % b[0] == 0)) if ok]
        op = rng.choice(ops)  # never empty: a > b allows -, a == b allows /
        if op in "+*" and rng.random() < 0.5:
            a, b = b, a
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [_combine(op, a, b)]
    return numbers, pool[0][0], pool[0][1]


def make_example(numbers: list[int], target: int, solution: str, style: str,
                 tag: str) -> Example:
    return Example(format_prompt(numbers, target, style, tag), wrap(solution, tag),
                   {"numbers": numbers, "target": target, "solution": solution,
                    "answer_tag": tag, "difficulty": len(numbers)})


def generate_problems(rng: random.Random, count: int, args: Args,
                      exclude: set | frozenset = frozenset(),
                      distinct: bool = False) -> list[Example]:
    """Up to `count` problems whose (sorted numbers, target) avoid `exclude` (and each other,
    if distinct)."""
    out: list[Example] = []
    seen: set = set()
    for _ in range(TRIES_PER_PROBLEM * count + 1000):
        if len(out) == count:
            break
        numbers, target, solution = random_problem(
            rng, rng.randint(args.min_numbers, args.max_numbers))
        key = (tuple(sorted(numbers)), target)
        if target in numbers or target == sum(numbers) or key in exclude or (
                distinct and key in seen):
            continue
        seen.add(key)
        out.append(make_example(numbers, target, solution, args.prompt_style, args.answer_tag))
    return out


def problem_key(ex: Example) -> tuple:
    return tuple(sorted(ex.meta["numbers"])), ex.meta["target"]


def generate_split(num_eval: int, args: Args, seed: int) -> tuple[list[Example], list[Example]]:
    rng = random.Random(seed)
    held = generate_problems(rng, num_eval, args, distinct=True)
    if len(held) < num_eval:
        raise ConfigError(f"num_eval: found only {len(held)} distinct problems; lower num_eval")
    train = generate_problems(rng, args.num_train, args, exclude={problem_key(e) for e in held})
    if len(train) < args.num_train:
        raise ConfigError("num_train: too few problems outside the held-out ones; lower num_eval")
    return train, held


def _row_error(ex: Example, tag: str) -> str | None:
    """Why a JSONL row is not a countdown problem, or None; fills in its meta."""
    numbers = ex.meta.get("numbers")
    if not (isinstance(numbers, list) and numbers
            and all(type(n) is int and n >= 0 for n in numbers)):
        return f"\"numbers\" must be a non-empty list of non-negative integers, got {numbers!r}"
    tag = ex.meta.get("answer_tag") or tag
    text = ex.target.strip()
    if INTEGER.fullmatch(text):
        target = int(text)
        solution = ex.meta.get("solution")
        if solution is not None:  # SFT's target: it must reach the row's target
            value = evaluate(solution.partition("=")[0], numbers) \
                if isinstance(solution, str) else None
            if value != target:
                return (f"\"solution\" {show(solution)} does not reach the target {target} "
                        f"with the numbers {numbers}")
            ex.target = wrap(solution, tag)
    else:
        blocks = answer_blocks(text, tag)
        value = evaluate(blocks[-1].partition("=")[0], numbers) if blocks else None
        if value is None or value.denominator != 1:
            return (f"target {ex.target[:80]!r} is neither an integer nor a <{tag}> answer "
                    f"that reaches a whole number with the numbers {numbers}")
        target = int(value)
    ex.meta.update(target=target, answer_tag=tag, difficulty=len(numbers))
    return None


def load_rows(path: str, tag: str) -> list[Example]:
    return load_jsonl(path, check=lambda ex: _row_error(ex, tag))  # errors name the line


def solved_column(examples: list[Example], completions: list[str]) -> dict:
    metas = [ex.meta for ex in examples]
    return {"solved": np.asarray(countdown_correct([], completions, [], metas), dtype=float)}


def numbers_bucket(ex: Example) -> str | None:
    numbers = ex.meta.get("numbers")
    return f"numbers_{len(numbers)}" if isinstance(numbers, list) else None


@register("countdown", Args)
def build(cfg: GRPOConfig, args: Args) -> TaskData:
    alphabet = ALPHABET
    if cfg.data_path:
        rows = load_rows(cfg.data_path, args.answer_tag)
        train, held = split_held_out(rows, cfg.num_eval, cfg.seed, cfg.data_path)
        alphabet = "".join(sorted(set(ALPHABET).union(*(r.prompt + r.target for r in rows))))
    else:
        train, held = generate_split(cfg.num_eval, args, cfg.seed)
    tag = lambda ex: ex.meta["answer_tag"]
    trivial = {
        "sum_all": lambda ex: wrap("+".join(map(str, ex.meta["numbers"])), tag(ex)),
        "echo_target": lambda ex: wrap(str(ex.meta["target"]), tag(ex)),
    }
    return TaskData("countdown", train, held, [dict(r) for r in DEFAULT_REWARDS], alphabet,
                    eval_columns=solved_column, eval_bucket=numbers_bucket,
                    trivial_answers=trivial, solved="solved")
