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

from .tool_calls import CALL_FORMATS, parse_tool_calls
from .tools import MAX_OUTPUT_CHARS, run_call


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


class ToolEnv:
    """The tool loop as an environment: a turn with calls gets each call's result as a
    `tool` message (an unreadable call, an unknown tool, bad arguments or the tool's
    exception: `error: ...`); a turn without calls ends the conversation. The calls are read
    in `call_format`, the model's own (the tokenizer's call_format: tool_calls.py)."""

    def __init__(self, tools: dict[str, Callable], max_chars: int = MAX_OUTPUT_CHARS,
                 call_format: str = "hermes"):
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format {call_format!r}: one of {', '.join(CALL_FORMATS)}")
        self.tools, self.max_chars, self.call_format = tools, max_chars, call_format

    def reset(self, example) -> list[dict] | None:
        return None

    def step(self, reply: str) -> Step:
        calls = parse_tool_calls(reply, self.call_format)
        if not calls:
            return Step([], done=True)
        answers = [run_call(self.tools, c, self.max_chars) for c in calls]
        messages = [{"role": "tool", "name": c.name, "content": a}
                    for c, a in zip(calls, answers)]
        failed = sum(a.startswith("error:") for a in answers)
        return Step(messages, done=False, calls=len(calls), failed=failed)
