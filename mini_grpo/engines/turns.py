"""The engine's side of multi-turn rollouts: each row's conversation, turn by turn.

    setup = ToolSetup.of(cfg)                      # None: single-turn rollouts
    turns = Turns(setup, tok, prompts)             # one per generation; an environment per row
    prompt_ids = turns.prompt_ids()                # the prompts, with the tool list
    nxt = turns.end_turn(rows, replies)            # ids to append after each reply, or None

An engine samples a row until its turn ends (an EOS token), hands the turn's ids to
`end_turn`, and appends the ids it returns (the environment's messages as the chat template
renders them, and the generation prompt) as tokens the model did not write: attended to,
never trained on. None ends the row: its environment said so (a turn without tool calls),
or it used its max_tool_calls rounds. The environments of the rows whose turns ended
together step at once, each in a daemon thread of its own (tool_timeout counts from its own
start; a step that never returns keeps no process alive). One that does not answer within
tool_timeout seconds, or raises, answers `error: ...`, and its thread is left to finish on
its own: that environment is not stepped again while it runs (its row ends at its next
turn). What an environment returns is checked (envs.checked_step: EnvError names it).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..conversation import continuation
from ..envs import Environment, Step, ToolEnv, check_messages, checked_step, env_name, no_answer
from ..threads import run_at_once

TOOL_LOOP_GRACE = 5.0  # s past tool_timeout for the tool loop's step, which bounds its calls


@dataclass(frozen=True)
class ToolSetup:
    """How an engine runs conversations: an environment per row, and the caps."""
    env: Callable[[], Environment]  # a fresh environment for one row
    max_rounds: int  # the most answered turns per row (max_tool_calls)
    timeout: float  # seconds for one environment step (tool_timeout)
    rewards: bool = False  # the environment's reward parts count (a user's environment)
    tool_loop: bool = False  # env(call_format): ToolEnv, reading calls in the model's format

    @classmethod
    def of(cls, cfg) -> ToolSetup | None:
        """The config's environment, or its tools' loop (ToolEnv); None: single-turn."""
        if cfg.environment:
            return cls(environment_class(cfg.environment), cfg.max_tool_calls,
                       cfg.tool_timeout, rewards=True)
        if not cfg.tools:
            return None
        from ..tools import resolve_tools

        tools, chars, timeout = resolve_tools(cfg.tools), cfg.tool_output_chars, cfg.tool_timeout
        return cls(lambda fmt: ToolEnv(tools, chars, fmt, timeout), cfg.max_tool_calls,
                   timeout, tool_loop=True)


def environment_class(name: str) -> Callable[[], Environment]:
    """The class `package.module:Class` names, checked for reset and step (a ConfigError)."""
    from ..fields import ConfigError
    from ..rewards.registry import import_callable

    cls = import_callable(name, "environment")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not callable(cls) or missing:
        raise ConfigError(f"environment {name!r}: must be a class with reset(prompt) and "
                          f"step(reply) methods" + (f" (no {missing[0]})" if missing else ""))
    return cls


class Turns:
    """The conversations of one generation's rows (B prompts): their messages so far, their
    environments, and counts of what happened (calls, failed calls, rounds, capped)."""

    def __init__(self, setup: ToolSetup, tok, prompts: list):
        self.setup, self.tok = setup, tok
        self.history = [tok.messages_of(p) for p in prompts]
        self.envs = [setup.env(tok.call_format) if setup.tool_loop else setup.env()
                     for _ in prompts]
        for h, env, p in zip(self.history, self.envs, prompts):
            first = env.reset(p)
            if first is not None:
                if not isinstance(first, str):  # a text is the prompt's one user message
                    check_messages(first, f"environment {env_name(env)}: reset()")
                h[:] = tok.messages_of(first)
        self.start = [len(h) for h in self.history]  # where each row's own turns begin
        self.counts = torch.zeros(len(prompts), 4)  # calls, failed calls, rounds, capped
        self.rewards = torch.zeros(len(prompts), dtype=torch.float64)  # reward parts, summed
        self.running: dict[int, cf.Future] = {}  # rows whose step timed out, and that step
        # the tool loop bounds each call itself (ToolEnv's timeout), keeping the others' answers
        self.deadline = setup.timeout + (TOOL_LOOP_GRACE if setup.tool_loop else 0.0)

    def prompt_ids(self) -> list[list[int]]:
        return [self.tok.encode(self.tok.render(h)) for h in self.history]

    def end_turn(self, rows: list[int], replies: list[list[int]]) -> list[list[int] | None]:
        """`replies[i]`: the ids of row `rows[i]`'s turn, its end-of-turn token last -> the
        ids that follow it, or None where the row is over."""
        texts = [self.tok.decode(ids) for ids in replies]  # up to the end-of-turn token
        out = []
        for g, ids, text, st in zip(rows, replies, texts, self._steps(rows, texts)):
            history = self.history[g]
            history.append({"role": "assistant", "content": text})
            c = self.counts[g]
            c[0] += st.calls
            c[1] += st.failed
            self.rewards[g] += sum(map(float, st.rewards.values()))
            if st.done or not st.messages:
                out.append(None)
            elif c[2] >= self.setup.max_rounds:
                c[3] = 1
                out.append(None)
            else:
                c[2] += 1
                out.append(continuation(self.tok, history, st.messages, ids[-1]))
                history += st.messages
        return out

    def env_rewards(self) -> list[float] | None:
        """Each row's reward parts, summed over its turns (None: they do not count)."""
        return self.rewards.tolist() if self.setup.rewards else None

    def unanswered(self, row: int) -> None:
        """Row `row`'s last answer did not fit its tokens left: it never reached the model, so
        it leaves the conversation (and its round the count); the row is cut off."""
        history = self.history[row]
        while len(history) > self.start[row] and history[-1]["role"] != "assistant":
            history.pop()
        self.counts[row, 2] -= 1

    def cut(self, row: int, ids: list[int]) -> None:
        """Row `row` ran out of tokens in its turn `ids` (its last message, unfinished)."""
        self.history[row].append({"role": "assistant", "content": self.tok.decode(ids)})

    def _steps(self, rows: list[int], texts: list[str]) -> list[Step]:
        """Each row's environment steps on its turn, all at once (module docstring); a row
        whose earlier step still runs ends instead."""
        free = [g not in self.running or self.running.pop(g).done() for g in rows]
        started = iter(run_at_once([(self.envs[g].step, (t,))
                                    for g, t, ok in zip(rows, texts, free) if ok], self.deadline))
        futures = [next(started) if ok else None for ok in free]
        out = []
        for g, f in zip(rows, futures):
            if f is not None and not f.done():
                self.running[g] = f
            out.append(Step([], done=True) if f is None else self._result(g, f))
        return out

    def _result(self, g: int, f: cf.Future) -> Step:
        if not f.done():
            why = no_answer(self.setup.timeout)
        elif f.exception() is not None:
            lines = str(f.exception()).strip().splitlines()
            why = lines[0] if lines else type(f.exception()).__name__
        else:
            return checked_step(f.result(), self.envs[g])
        # the tool loop's answers are tool messages; an environment's error comes as the
        # user's (every chat template takes that role; not every one takes `tool`)
        role = "tool" if self.setup.tool_loop else "user"
        return Step([{"role": role, "content": f"error: {why}"}], done=False, calls=1,
                    failed=1)

    def conversations(self) -> list[list[dict]]:
        """Each row's messages after its prompt: the model's turns and what answered them."""
        return [h[s:] for h, s in zip(self.history, self.start)]

    def last_replies(self) -> list[str]:
        """Each row's last message of its own (the answer a reward reads)."""
        return [next((m["content"] for m in reversed(h[s:]) if m["role"] == "assistant"), "")
                for h, s in zip(self.history, self.start)]

