"""Tasks: where prompts and targets come from, and which rewards suit them.

A task builder turns the config into TaskData: training and held-out evaluation Examples (no
evaluation prompt occurs in training), the task's default rewards (the config's `rewards`
overrides them), and the alphabet a CharTokenizer is built from.

    chess_fen   random legal games -> FEN (tasks/chess_fen.py); also from `pgn_path`
    jsonl       any {"prompt", "target"} rows from `data_path` (tasks/jsonl.py)

With `data_path` set, every task reads its rows from that file instead of making its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from mini_grpo.config import ConfigError, GRPOConfig

# a file's held-out split is at most this fraction of its distinct prompts (and num_eval)
MAX_EVAL_FRACTION = 0.1


@dataclass
class Example:
    prompt: str  # the text the model sees, e.g. "e2e4 e7e5:"
    target: str  # the reference answer, e.g. a FEN
    meta: dict = field(default_factory=dict)  # extra JSON-able fields, passed to reward plugins


@dataclass
class TaskData:
    name: str
    train: list[Example]
    eval: list[Example]
    default_rewards: list[dict]  # [{"name": "board_delta", "weight": 0.7}, ...]
    alphabet: str  # every character prompts and targets may contain


def split_held_out(rows: list[Example], num_eval: int, seed: int,
                   source: str) -> tuple[list[Example], list[Example]]:
    """(train, eval): whole prompts are held out, so duplicates never straddle the split.

    Holds out min(num_eval, 10% of the distinct prompts), at least one; rows keep file order.
    """
    prompts = list(dict.fromkeys(r.prompt for r in rows))
    if len(prompts) < 2:
        raise ConfigError(f"{source}: needs at least 2 distinct prompts to hold out an "
                          f"evaluation split, got {len(prompts)}")
    k = max(1, min(num_eval, int(len(prompts) * MAX_EVAL_FRACTION)))
    random.Random(seed).shuffle(prompts)
    held = set(prompts[:k])
    return [r for r in rows if r.prompt not in held], [r for r in rows if r.prompt in held]


# the task modules import Example/TaskData from here, so they come after the definitions
from mini_grpo.tasks import chess_fen, jsonl  # noqa: E402
from mini_grpo.tasks.jsonl import load_jsonl  # noqa: E402

TASKS = {"chess_fen": chess_fen.build, "jsonl": jsonl.build}


def build_task(cfg: GRPOConfig) -> TaskData:
    if cfg.task not in TASKS:
        raise ConfigError(f"task: unknown task {cfg.task!r} (available: {', '.join(TASKS)})")
    if cfg.data_path and cfg.pgn_path:
        raise ConfigError("data_path and pgn_path are both set; choose one source of rows")
    return TASKS[cfg.task](cfg)


__all__ = ["Example", "TaskData", "TASKS", "build_task", "load_jsonl", "split_held_out"]
