"""Bring-your-own data: a JSONL file with one {"prompt": ..., "target": ...} object per line.

A row may give `messages` instead of `prompt`: a conversation, a list of {"role": ...,
"content": ...} objects ending with a message for the model to answer (not an assistant's),
which the tokenizer's chat template renders (a Hugging Face model's tokenizer; a system
message from `system_prompt` is added when the row has none). Its last message's content is
the row's prompt text: what reward plugins get as `prompts`, and what held-out splits and
RFT group rows by. Fields other than prompt/messages and target become the row's `meta` and
reach reward plugins as is. A `conversation` field is a multi-turn demonstration (RFT writes
one for each row of a run with tools or an environment; SFT trains on it in such a run): the
messages after the prompt, the model's (assistant) first and last, checked like `messages`.
Blank lines are skipped; anything else that is not such an object is an error naming the file
and line, so a typo never silently drops training data: NaN and Infinity (which Python's json
reads, JSON has not) and a key given twice in one object (json keeps the last) included. The
one exception is a last line with no newline that does not parse: a write cut short by a kill,
skipped with a warning. A line is read in bounded chunks: one longer than MAX_LINE (16 MiB) is
refused before it is read whole.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mini_grpo.envs import ANSWER_ROLES, MAX_CHARS
from mini_grpo.fields import ConfigError, show, unreadable
from mini_grpo.jsonio import check_tree
from mini_grpo.task_registry import register
from mini_grpo.tasks.base import Example, TaskData, split_held_out

if TYPE_CHECKING:
    from mini_grpo.config import GRPOConfig

log = logging.getLogger("mini_grpo.tasks")

DEFAULT_REWARDS = [{"name": "levenshtein", "weight": 0.5}, {"name": "exact_match", "weight": 0.5}]

# a conversation's messages: who may speak (the model, and whoever may answer it: the same
# rule as for an environment's messages, so what RFT writes reads back), how many
# (max_tool_calls' 64 rounds of a turn and 17 answers fit), and a value's length
ROLES = ("assistant", *ANSWER_ROLES)
MAX_MESSAGES = 2048
# a line's bytes, its line end aside: a longer one is refused as soon as that much is read (a
# 100 MB line was read whole and parsed, 2.7 GB)
MAX_LINE = 1 << 24


@dataclass
class Args:
    """jsonl takes no options of its own: data_path and num_eval are the config's."""


def load_jsonl(path, tokenizer=None,
               check: Callable[[Example], str | None] | None = None) -> list[Example]:
    """Rows of the file; with a tokenizer, a row it cannot encode is an error naming the row,
    and so is a row for which `check(example)` returns a reason (the task's check, which may
    fill in the row's meta)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read data file ({e.strerror})") from None
    rows: list[Example] = []
    with f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), 1):
            where = f"{path}:{lineno}"
            if len(raw) > MAX_LINE and not raw.endswith(b"\n"):  # read no further
                raise ConfigError(f"{where}: a line longer than {MAX_LINE} bytes (16 MiB), the "
                                  f"most a row may be; not read")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                if not raw.endswith(b"\n"):  # cut short by a kill inside a character
                    log.warning("%s: truncated last line skipped (not valid UTF-8)", where)
                    break
                raise ConfigError(f"{where}: not valid UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line, parse_constant=_not_json, object_pairs_hook=_object)
            except _NotJSON as e:
                raise ConfigError(f"{where}: {e}") from None
            except RecursionError:
                raise ConfigError(f"{where}: JSON nested too deeply") from None
            except json.JSONDecodeError as e:
                if not raw.endswith(b"\n"):  # a last line cut short by a kill mid-write
                    log.warning("%s: truncated last line skipped (%s)", where, e.msg)
                    break
                raise ConfigError(f"{where}: malformed JSON ({e.msg}, column {e.colno})") from None
            except ValueError as e:  # an integer over Python's int-string limit
                raise ConfigError(f"{where}: {unreadable(e)}") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{where}: expected an object with \"prompt\" and \"target\", "
                                  f"got {type(obj).__name__}")
            # nesting bounded (a row some hundreds of levels deep broke the scorer, which
            # pickles its metadata) and strings valid Unicode (a lone surrogate reached the
            # tokenizer mid-run)
            check_tree(obj, where)
            messages = _messages(obj.pop("messages"), where) if "messages" in obj else None
            if messages is not None:
                if "prompt" in obj:
                    raise ConfigError(f"{where}: give \"prompt\" or \"messages\", not both")
                obj["prompt"] = messages[-1]["content"]
            if "conversation" in obj:
                _conversation(obj["conversation"], where)
            if "completion" in obj and not isinstance(obj["completion"], str):
                raise ConfigError(f"{where}: \"completion\" (what SFT trains on in place of "
                                  f"the target, as RFT writes it) must be a string, got "
                                  f"{type(obj['completion']).__name__}")
            for key in ("prompt", "target"):
                if key not in obj:
                    raise ConfigError(f"{where}: missing \"{key}\"")
                if not isinstance(obj[key], str):
                    raise ConfigError(f"{where}: \"{key}\" must be a string, "
                                      f"got {type(obj[key]).__name__}")
            prompt, target = obj.pop("prompt"), obj.pop("target")
            if tokenizer is not None:
                bad = tokenizer.unknown_chars(prompt + target)
                if bad:
                    raise ConfigError(f"{where}: row {len(rows) + 1}: characters the tokenizer "
                                      f"cannot encode: {''.join(bad)!r}")
            ex = Example(prompt, target, obj, messages, where)
            why = check(ex) if check is not None else None
            if why:
                raise ConfigError(f"{where}: row {len(rows) + 1}: {why}")
            rows.append(ex)
    if not rows:
        raise ConfigError(f"{path}: no rows (the file is empty)")
    return rows


class _NotJSON(ValueError):
    """What Python's json reads that JSON has not: NaN and Infinity, a key given twice."""


def _not_json(token: str):
    raise _NotJSON(f"{token} is no JSON number (a non-finite value is not JSON)")


def _object(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are each given once (json keeps the last silently)."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise _NotJSON(f"key {show(k)} is given twice in one object")
            seen.add(k)
    return obj


def _messages(value, where: str) -> list[dict]:
    """A row's conversation, checked: [{"role": str, "content": str}, ...], not ending with
    an assistant's message."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: \"messages\" must be a non-empty list of "
                          f"{{\"role\", \"content\"}} objects")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: messages[{i}] must be an object with string \"role\" "
                              f"and \"content\", got {m!r}"[:300])
    if value[-1]["role"] == "assistant":
        raise ConfigError(f"{where}: the last message is the assistant's; a prompt ends with "
                          f"a message for the model to answer")
    return value


def _conversation(value, where: str) -> None:
    """A row's multi-turn demonstration, checked before SFT renders it: 1 to MAX_MESSAGES
    messages, each an object of strings (at most MAX_CHARS long) with a role among ROLES and
    a content, the first and the last the model's."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_MESSAGES:
        raise ConfigError(f"{where}: \"conversation\" must be a list of 1 to {MAX_MESSAGES} "
                          f"{{\"role\", \"content\"}} objects, got {show(value)}")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and m.get("role") in ROLES and "content" in m and all(
                isinstance(v, str) and len(v) <= MAX_CHARS for v in m.values())):
            raise ConfigError(f"{where}: conversation[{i}] must be an object of strings (at "
                              f"most {MAX_CHARS} characters) with a \"role\" ("
                              f"{', '.join(ROLES)}) and a \"content\", got {show(m)}")
    if value[0]["role"] != "assistant" or value[-1]["role"] != "assistant":
        raise ConfigError(f"{where}: \"conversation\" must open and end with the model's "
                          f"(assistant) message")


@register("jsonl", Args)
def build(cfg: GRPOConfig, args: Args) -> TaskData:
    if not cfg.data_path:
        raise ConfigError("data_path: task 'jsonl' needs a JSONL file of {prompt, target} rows")
    rows = load_jsonl(cfg.data_path)
    train, held = split_held_out(rows, cfg.num_eval, cfg.seed, cfg.data_path)
    alphabet = "".join(sorted({c for r in rows for c in r.prompt + r.target}))
    return TaskData("jsonl", train, held, [dict(r) for r in DEFAULT_REWARDS], alphabet)
