"""Tasks: where prompts and targets come from, and which rewards suit them.

A task is a module with `build(cfg) -> TaskData` and an `Args` dataclass of its own options
(the config's `task_args`, checked here with the config's rules: unknown keys and bad values
name the key). TaskData holds training and held-out evaluation Examples (no evaluation prompt
occurs in training), the task's default rewards (the config's `rewards` overrides them), the
alphabet a CharTokenizer is built from, and the task's evaluation extras: per-row columns
(chess: valid_fen), a bucket per example (chess: ply ranges) and trivial answers a policy must
beat (chess: the start position). evaluate.py knows no task by name.

    chess_fen   random legal games -> FEN (tasks/chess_fen.py); also from task_args.pgn_path
    countdown   numbers and a target -> an arithmetic expression reaching it (tasks/countdown.py)
    jsonl       any {"prompt", "target"} rows from `data_path` (tasks/jsonl.py)

With `data_path` set, every task reads its rows from that file instead of making its own.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from mini_grpo.config import ConfigError, GRPOConfig, coerce_fields

# a file's held-out split is at most this fraction of its distinct prompts (and num_eval)
MAX_EVAL_FRACTION = 0.1


@dataclass
class Example:
    prompt: str  # the text the model sees, e.g. "e2e4 e7e5:" (a chat row: its last message)
    target: str  # the reference answer, e.g. a FEN
    meta: dict = field(default_factory=dict)  # extra JSON-able fields, passed to reward plugins
    messages: list[dict] | None = None  # a chat row's conversation, rendered by the template

    @property
    def model_input(self) -> str | list[dict]:
        """What the tokenizer encodes as the prompt (Tokenizer.encode_prompt)."""
        return self.messages if self.messages is not None else self.prompt


@dataclass
class TaskData:
    name: str
    train: list[Example]
    eval: list[Example]
    default_rewards: list[dict]  # [{"name": "board_delta", "weight": 0.7}, ...]
    alphabet: str  # every character prompts and targets may contain
    # evaluation extras, all optional: per-row columns of (examples, completions), e.g.
    # {"valid_fen": array of 0/1}; a bucket name per example (None: in no bucket), e.g.
    # "plies_2-4"; trivial answers that ignore the prompt's content, scored as baselines
    eval_columns: Callable[[list[Example], list[str]], dict] | None = None
    eval_bucket: Callable[[Example], str | None] | None = None
    trivial_answers: dict[str, Callable[[Example], str]] = field(default_factory=dict)


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
from mini_grpo.tasks import chess_fen, countdown, jsonl  # noqa: E402
from mini_grpo.tasks.jsonl import load_jsonl  # noqa: E402

TASKS = {"chess_fen": chess_fen, "countdown": countdown, "jsonl": jsonl}


def _task(name: str):
    if name not in TASKS:
        raise ConfigError(f"task: unknown task {name!r} (available: {', '.join(TASKS)})")
    return TASKS[name]


def resolve_task_args(name: str, args: dict) -> dict:
    """The task's arguments with its defaults filled in, checked against its Args fields."""
    schema = _task(name).Args
    given = coerce_fields(schema, args, "task_args.")
    resolved = schema(**given)
    check = getattr(resolved, "check", None)
    if check is not None:
        check()
    return dataclasses.asdict(resolved)


def build_task(cfg: GRPOConfig) -> TaskData:
    module = _task(cfg.task)
    return module.build(cfg, module.Args(**cfg.task_args))


__all__ = ["Example", "TaskData", "TASKS", "build_task", "load_jsonl", "resolve_task_args",
           "split_held_out"]
