"""calculator: questions a small model cannot answer in its head but can with a calculator
(the `tools: [calculator]` job, configs/smollm2_calculator.yaml), generated from the seed.

    prompt  "What is 431 * 254? Put the final answer in <answer></answer> tags."
    target  "<answer>109474</answer>"
    meta    {"kind": "mul3", "answer": "109474", "conversation": [
                {"role": "assistant", "content": "<tool_call>\\n{\\"name\\": \\"calculator\\",
                 \\"arguments\\": {\\"expression\\": \\"431 * 254\\"}}\\n</tool_call>"},
                {"role": "tool", "name": "calculator", "content": "109474"},
                {"role": "assistant", "content": "<answer>109474</answer>"}]}

Kinds (`task_args.kinds`, all by default, drawn with `weights`):
    mul3      "What is 431 * 254?" (3-digit by 3-digit)
    mixed     "What is 37 * 48 + 912?", "What is (812 - 345) * 17?"
    convert   "How many centimeters are in 37 inches?", "Convert 58 miles to kilometers."
              (factors such as 2.54, 1.609344, 0.45359237; whole values from 2 to 99)

`conversation` is a demonstration of the tool's use: the call, the calculator's own answer
and the final answer. SFT trains on it where the run has tools (sft.py), on the target where
it has none. Rewards, evaluation extras and the held-out split are numeric's.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

from mini_grpo.fields import ConfigError
from mini_grpo.task_registry import register
from mini_grpo.tasks.base import Example, TaskData
from mini_grpo.tasks.numeric import (
    ALPHABET,
    DEFAULT_REWARDS,
    INSTRUCTION,
    check_args,
    correct_column,
    first_number,
    generate_split,
    show,
)
from mini_grpo.tools import calculator

if TYPE_CHECKING:
    from mini_grpo.config import GRPOConfig

KINDS = ("mul3", "mixed", "convert")
# (unit, its plural, the unit asked for, its plural, factor as written): one of the first
# makes `factor` of the second
FACTORS = [("inch", "inches", "centimeter", "centimeters", "2.54"),
           ("foot", "feet", "meter", "meters", "0.3048"),
           ("mile", "miles", "kilometer", "kilometers", "1.609344"),
           ("pound", "pounds", "kilogram", "kilograms", "0.45359237"),
           ("gallon", "gallons", "liter", "liters", "3.785411784"),
           ("ounce", "ounces", "gram", "grams", "28.349523125")]


@dataclass
class Args:
    """calculator's options (the config's task_args)."""
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    weights: list[float] = field(default_factory=lambda: [2.0, 1.0, 1.0])  # of each kind
    num_train: int = 20000  # generated training questions (at most 10 million)
    instruction: str = INSTRUCTION  # after each question ("" for none)

    def check(self) -> None:
        check_args(self, KINDS)
        if len(self.weights) != len(self.kinds) or not all(
                isinstance(w, (int, float)) and 0 < w < 1e6 for w in self.weights):
            raise ConfigError(f"task_args.weights: one positive number per kind "
                              f"({len(self.kinds)}), got {self.weights!r}")


def question(rng: random.Random, kind: str) -> tuple[str, str, Fraction]:
    """(question, the expression that answers it, the answer) of one question of `kind`."""
    if kind == "mul3":
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return f"What is {a} * {b}?", f"{a} * {b}", Fraction(a * b)
    if kind == "mixed":
        if rng.random() < 0.5:
            a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(100, 999)
            return f"What is {a} * {b} + {c}?", f"{a} * {b} + {c}", Fraction(a * b + c)
        a = rng.randint(300, 999)
        b, c = rng.randint(100, a - 50), rng.randint(12, 99)
        return f"What is ({a} - {b}) * {c}?", f"({a} - {b}) * {c}", Fraction((a - b) * c)
    one, ones, other, others, factor = rng.choice(FACTORS)
    v = rng.randint(2, 99)
    q = f"How many {others} are in {v} {ones}?" if rng.random() < 0.5 else \
        f"Convert {v} {ones} to {others}."
    return q, f"{v} * {factor}", v * Fraction(factor)


def calculator_example(rng: random.Random, kind: str, args: Args) -> Example:
    q, expression, answer = question(rng, kind)
    result = calculator(expression)
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    conversation = [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                    {"role": "tool", "name": "calculator", "content": result},
                    {"role": "assistant", "content": f"<answer>{result}</answer>"}]
    text = show(answer)
    return Example(f"{q} {args.instruction}".strip(), f"<answer>{text}</answer>",
                   {"kind": kind, "answer": text, "conversation": conversation})


@register("calculator", Args)
def build(cfg: GRPOConfig, args: Args) -> TaskData:
    if cfg.data_path:
        raise ConfigError("task calculator: generates its questions; for rows of your own "
                          "use task: jsonl")
    train, held = generate_split(cfg.num_eval, args, cfg.seed, example=calculator_example)
    return TaskData("calculator", train, held, [dict(r) for r in DEFAULT_REWARDS], ALPHABET,
                    eval_columns=correct_column, eval_bucket=lambda ex: ex.meta.get("kind"),
                    trivial_answers={"first_number": first_number,
                                     "zero": lambda ex: "<answer>0</answer>"},
                    solved="correct")
