"""Environments: what answers the model between its turns in a multi-turn rollout. The tool
loop is one (ToolEnv): it runs the calls of the model's turn and answers with their results.

    env = ToolEnv(resolve_tools(["calculator"]))
    step = env.step('<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>')
    step.messages        # [{"role": "tool", "name": "calculator", "content": "56088"}]
    step.done            # False: the model speaks again, after these messages

An environment has `reset(example)` (the messages a conversation starts from; None: the
task's prompt as it is) and `step(reply)` (the model's turn as text -> a Step: the messages
that follow it, whether the conversation is over, and reward parts). One instance serves one
row of one rollout, so it may keep the row's state. The engine's side (engines/turns.py)
renders the messages through the chat template and caps the rounds (max_tool_calls), above
whatever an environment says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .fields import ConfigError, show
from .plugin_calls import MAX_REWARD
from .threads import run_at_once
from .tool_calls import CALL_FORMATS, parse_tool_calls
from .tools import MAX_OUTPUT_CHARS, no_answer, run_call


@dataclass
class Step:
    """What follows the model's turn."""
    messages: list[dict]  # appended after the model's message, e.g. {"role": "tool", ...}
    done: bool  # the conversation is over: the model's turn was its last
    rewards: dict[str, float] = field(default_factory=dict)  # reward parts of this turn
    calls: int = 0  # tool calls the turn made
    failed: int = 0  # of them, answered with an error


class Environment(Protocol):
    def reset(self, example) -> list[dict] | None:
        """The conversation's first messages for this row (None: the task's prompt)."""
        ...

    def step(self, reply: str) -> Step:
        """The model's turn (its text, without the end-of-turn token) -> what follows."""
        ...


class EnvError(ConfigError):
    """An environment broke its contract (what reset or step returned, a reward part): the
    run stops with one line naming it, as for a reward plugin's."""


def env_name(env) -> str:
    return f"{type(env).__module__}:{type(env).__qualname__}"


ANSWER_ROLES = ("tool", "user", "system")  # who may answer the model's turn
MAX_CHARS = 1 << 20  # a message's value: the chat template's bound on any one value
MAX_COUNT = 1 << 24  # a step's calls: the rollout counts them in float32, exact to 2**24


def clean_text(text: str) -> str:
    """`text` as UTF-8 can encode it: a lone surrogate ("\\ud800", from a tool's output or an
    environment's message) becomes U+FFFD, a pair of them the character they stand for."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def check_messages(messages, where: str, roles: tuple[str, ...] | None = None) -> list[dict]:
    """`messages` as an environment must give them: a list of dicts of strings (at most
    MAX_CHARS each) with a `role` (among `roles`, where given) and a `content`, the other keys
    passed to the chat template; what RFT writes of them is then read back as it was
    (tasks/jsonl.py checks a file's conversations alike). EnvError naming `where` if not."""
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            and (roles is None or m["role"] in roles)
            and all(isinstance(v, str) and len(v) <= MAX_CHARS for v in m.values())
            for m in messages):
        who = "str" if roles is None else " | ".join(map(repr, roles))
        raise EnvError(f"{where}: messages must be a list of {{'role': {who}, 'content': str}} "
                       f"dicts, every value a string of at most {MAX_CHARS} characters, got "
                       f"{show(messages)}")
    return messages


def checked_step(step, env) -> Step:
    """What environment `env`'s step() returned, checked: a Step of messages, a bool `done`,
    reward parts that are finite numbers within +-MAX_REWARD (a reward plugin's bound),
    counts in 0..MAX_COUNT, of which failed at most calls (EnvError if not; 2**64 calls was
    an OverflowError)."""
    where = f"environment {env_name(env)}: step()"
    if not isinstance(step, Step):
        raise EnvError(f"{where} returned {show(step)}, not a mini_grpo.envs.Step")
    check_messages(step.messages, where, ANSWER_ROLES)
    if not isinstance(step.done, bool):
        raise EnvError(f"{where}: done must be True or False, got {show(step.done)}")
    if not isinstance(step.rewards, dict):
        raise EnvError(f"{where}: rewards must be a dict of reward parts, got "
                       f"{show(step.rewards)}")
    for name, v in step.rewards.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= MAX_REWARD:
            raise EnvError(f"{where}: reward part {show(name)} is {show(v)}; each must be a "
                           f"finite number within +-{MAX_REWARD:g}")
    for name in ("calls", "failed"):
        v = getattr(step, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
            raise EnvError(f"{where}: {name} must be an int in 0..{MAX_COUNT}, got {show(v)}")
    if step.failed > step.calls:
        raise EnvError(f"{where}: failed ({step.failed}) must be at most calls ({step.calls})")
    return step


class ToolEnv:
    """The tool loop as an environment: a turn with calls gets each call's result as a
    `tool` message (an unreadable call, an unknown tool, bad arguments or the tool's
    exception: `error: ...`); a turn without calls ends the conversation. The calls are read
    in `call_format`, the model's own (the tokenizer's call_format: tool_calls.py). With a
    `timeout`, a turn's calls run at once, each in a daemon thread, and one that has not
    answered within it is answered `error: no answer within ...`; the others keep theirs."""

    def __init__(self, tools: dict[str, Callable], max_chars: int = MAX_OUTPUT_CHARS,
                 call_format: str = "hermes", timeout: float | None = None):
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format {call_format!r}: one of {', '.join(CALL_FORMATS)}")
        self.tools, self.max_chars, self.call_format = tools, max_chars, call_format
        self.timeout = timeout

    def reset(self, example) -> list[dict] | None:
        return None

    def step(self, reply: str) -> Step:
        calls = parse_tool_calls(reply, self.call_format)
        if not calls:
            return Step([], done=True)
        if self.timeout is None:
            answers = [run_call(self.tools, c, self.max_chars) for c in calls]
        else:
            futures = run_at_once([(run_call, (self.tools, c, self.max_chars, self.timeout))
                                   for c in calls], self.timeout)
            answers = [f.result() if f.done() else f"error: {no_answer(self.timeout)}"
                       for f in futures]
        messages = [{"role": "tool", "name": c.name, "content": a}
                    for c, a in zip(calls, answers)]
        failed = sum(a.startswith("error:") for a in answers)
        return Step(messages, done=False, calls=len(calls), failed=failed)
