"""What every task returns: Examples (prompt, target, meta) in a TaskData, and the held-out
split of rows read from a file. The task modules import these from here, never through the
package (mini_grpo/tasks/__init__.py imports them)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from mini_grpo.fields import ConfigError

# a file's held-out split is at most this fraction of its distinct prompts (and num_eval)
MAX_EVAL_FRACTION = 0.1


@dataclass
class Example:
    prompt: str  # the text the model sees, e.g. "e2e4 e7e5:" (a chat row: its last message)
    target: str  # the reference answer, e.g. a FEN
    meta: dict = field(default_factory=dict)  # extra JSON-able fields, passed to reward plugins
    messages: list[dict] | None = None  # a chat row's conversation, rendered by the template
    # the file and line a row was read from ("" for generated rows): what an error names
    where: str = field(default="", compare=False)

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
    # the 0/1 column a completion counts as solved by (pass@k): `exact`, or one of eval_columns
    solved: str = "exact"
    # what `eval` is: "held-out", or "validation" (training prompts set apart: num_val)
    eval_split: str = "held-out"


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
