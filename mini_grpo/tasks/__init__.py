"""Tasks: where prompts and targets come from, and which rewards suit them.

A task is a module with an `Args` dataclass of its own options (the config's `task_args`,
checked with the config's rules: unknown keys and bad values name the key) and a
`build(cfg, args) -> TaskData` registered under the task's name (task_registry.register).
TaskData (tasks/base.py) holds training and held-out evaluation Examples (no evaluation
prompt occurs in training), the task's default rewards (the config's `rewards` overrides
them), the alphabet a CharTokenizer is built from, and the task's evaluation extras: per-row
columns (chess: valid_fen), a bucket per example (chess: ply ranges) and trivial answers a
policy must beat (chess: the start position). evaluate.py knows no task by name.

    chess_fen   random legal games -> FEN (tasks/chess_fen.py); also from task_args.pgn_path
    countdown   numbers and a target -> an arithmetic expression reaching it (tasks/countdown.py)
    jsonl       any {"prompt", "target"} rows from `data_path` (tasks/jsonl.py)
    numeric     unit conversions and short arithmetic with numeric answers, for pretrained
                chat models (tasks/numeric.py)
    calculator  3-digit products, mixed arithmetic and awkward unit conversions, each with a
                demonstration of the calculator tool's use (tasks/calculator.py)

With `data_path` set, every task reads its rows from that file instead of making its own.
Importing this package registers the five; task_registry imports it on the first lookup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mini_grpo.task_registry import get_task
from mini_grpo.tasks import calculator, chess_fen, countdown, jsonl, numeric
from mini_grpo.tasks.base import Example, TaskData, split_held_out
from mini_grpo.tasks.jsonl import load_jsonl

if TYPE_CHECKING:
    from mini_grpo.config import GRPOConfig


def build_task(cfg: GRPOConfig) -> TaskData:
    """The task's data; with `num_val` set, that many of its training prompts (whole prompts,
    drawn with the seed) become the split every evaluation runs on, and are not trained on."""
    task = get_task(cfg.task)
    data = task.build(cfg, task.Args(**cfg.task_args))
    if cfg.num_val:
        data.train, val = split_held_out(data.train, cfg.num_val, cfg.seed + 1,
                                         f"num_val ({cfg.task}'s training prompts)")
        first: dict[str, Example] = {}  # each prompt once (training rows may repeat one)
        for ex in val:
            first.setdefault(ex.prompt, ex)
        data.eval = list(first.values())
        data.eval_split = "validation"
    return data


__all__ = ["Example", "TaskData", "build_task", "calculator", "chess_fen", "countdown", "jsonl",
           "load_jsonl", "numeric", "split_held_out"]
