"""The engine's side of multi-turn rollouts: each row's conversation, turn by turn.

    setup = ToolSetup.of(cfg)                      # None: single-turn rollouts
    turns = Turns(setup, tok, prompts)             # one per generation; an environment per row
    prompt_ids = turns.prompt_ids()                # the prompts, with the tool list
    nxt = turns.end_turn(rows, replies)            # ids to append after each reply, or None

An engine samples a row until its turn ends (an EOS token), hands the turn's ids to `end_turn`,
and appends the ids it returns (the environment's messages as the chat template renders them,
and the generation prompt) as tokens the model did not write: attended to, never trained on.
None ends the row: its environment said so (a turn without tool calls), or it used its
max_tool_calls rounds. The environments of the rows whose turns ended together step at once,
each in a daemon thread of its own (tool_timeout counts from its own start; a step that never
returns keeps no process alive). One that does not answer within tool_timeout seconds, or
raises, answers `error: ...`, and its thread is left to finish on its own: that environment is
not stepped again while it runs (its row ends at its next turn). The tool loop (ToolEnv) is
timed in one layer too, its own: each call gets tool_timeout, so its step ends by then with the
answers that came. What an environment returns is checked (envs.checked_step: EnvError names
it). What it says is bounded here, by the rollout: an environment whose __init__ or reset
raises, or whose answers are past a conversation's bounds (MAX_MESSAGES, MAX_CHARS) or do not
render, breaks its row alone (COUNTS' `broken`, logged once per environment and kind), and text
UTF-8 cannot encode is replaced (envs.clean_text).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..chat_template import ChatTemplateError
from ..conversation import continuation
from ..envs import (
    MAX_CHARS,
    Environment,
    Step,
    ToolEnv,
    check_messages,
    checked_step,
    clean_text,
    env_name,
    no_answer,
)
from ..threads import run_at_once
from ..tools import first_line
from .base import Rollout

# Turns.counts' columns, per row: tool calls, of them failed, rounds answered, capped by
# max_tool_calls, broken (its environment failed: __init__ or reset raised, or what it said
# is over a conversation's bounds)
COUNTS = ("calls", "failed", "rounds", "capped", "broken")
CALLS, FAILED, ROUNDS, CAPPED, BROKEN = range(len(COUNTS))  # their columns, by name
MAX_MESSAGES = 2048  # a conversation's messages: as many as RFT's output may read back with

log = logging.getLogger("mini_grpo.envs")
_logged: set[str] = set()  # each environment's failures of one kind are logged once


@dataclass(frozen=True)
class ToolSetup:
    """How an engine runs conversations: an environment per row, and the caps."""
    env: Callable[[], Environment]  # a fresh environment for one row
    max_rounds: int  # the most answered turns per row (max_tool_calls)
    timeout: float  # seconds for one environment step (tool_timeout)
    rewards: bool = False  # the environment's reward parts count (a user's environment)
    tool_loop: bool = False  # env(call_format): ToolEnv, reading calls in the model's format
    schemas: tuple = ()  # the tools' JSON schemas, as the prompt lists them (tool loop)

    @classmethod
    def of(cls, cfg) -> ToolSetup | None:
        """The config's environment, or its tools' loop (ToolEnv), each resolved (imported,
        checked) once, by the run's set-up (Run.tools); None: single-turn."""
        if cfg.environment:
            return cls(environment_class(cfg.environment), cfg.max_tool_calls,
                       cfg.tool_timeout, rewards=True)
        if not cfg.tools:
            return None
        from ..tools import resolve_tools, tool_schema

        tools, chars, timeout = resolve_tools(cfg.tools), cfg.tool_output_chars, cfg.tool_timeout
        return cls(lambda fmt: ToolEnv(tools, chars, fmt, timeout), cfg.max_tool_calls,
                   timeout, tool_loop=True, schemas=tuple(map(tool_schema, tools.values())))


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
    environments, and counts of what happened (COUNTS). An environment that fails (its
    __init__ or reset raises, or what it says is over a conversation's bounds) ends its row,
    counted broken: the run goes on."""

    def __init__(self, setup: ToolSetup, tok, prompts: list):
        self.setup, self.tok, self.prompts = setup, tok, prompts
        self.name = "the tool loop" if setup.tool_loop else (
            f"environment {getattr(setup.env, '__module__', '?')}:"
            f"{getattr(setup.env, '__qualname__', type(setup.env).__name__)}")
        self.history = [tok.messages_of(p) for p in prompts]
        self.counts = torch.zeros(len(prompts), len(COUNTS))  # per row: COUNTS
        self.envs: list[Environment | None] = [self._made(g) for g in range(len(prompts))]
        for g, (env, p) in enumerate(zip(self.envs, prompts)):
            if env is None:
                continue
            try:
                first = env.reset(p)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # the row's failure (a SystemExit too); the others go on
                self._broke(g, "reset()", _raised(e))
                continue
            if first is not None:
                if not isinstance(first, str):  # a text is the prompt's one user message
                    check_messages(first, f"environment {env_name(env)}: reset()")
                first = tok.messages_of(first)
                why = _over_bounds(first)
                if why:
                    self._broke(g, "reset()", why)
                else:
                    self.history[g] = _cleaned(first)
        self.start = [len(h) for h in self.history]  # where each row's own turns begin
        self.rewards = torch.zeros(len(prompts), dtype=torch.float64)  # reward parts, summed
        self.running: dict[int, cf.Future] = {}  # rows whose step timed out, and that step
        # one layer bounds a step's time: a user's environment here, the tool loop in ToolEnv,
        # each of its calls (so that a slow one does not cost the others' answers), which
        # ends its step within tool_timeout
        self.deadline = None if setup.tool_loop else setup.timeout

    def prompt_ids(self) -> list[list[int]]:
        """Each row's conversation so far, rendered and encoded: the task's prompt, or what
        its environment's reset() gave (where that does not render, the row is broken and
        starts from the task's prompt)."""
        out = []
        for g, h in enumerate(self.history):
            try:
                out.append(self.tok.encode(self.tok.render(h)))
            except ChatTemplateError as e:
                if self.envs[g] is None or h == self.tok.messages_of(self.prompts[g]):
                    raise  # the task's own prompt: the task's problem, not the environment's
                self._broke(g, "reset()", f"its messages do not render ({e})")
                self.history[g] = self.tok.messages_of(self.prompts[g])
                self.start[g] = len(self.history[g])
                out.append(self.tok.encode(self.tok.render(self.history[g])))
        return out

    def end_turn(self, rows: list[int], replies: list[list[int]]) -> list[list[int] | None]:
        """`replies[i]`: the ids of row `rows[i]`'s turn, its end-of-turn token last -> the
        ids that follow it, or None where the row is over."""
        texts = [self.tok.decode(ids) for ids in replies]  # up to the end-of-turn token
        out = []
        for g, ids, text, st in zip(rows, replies, texts, self._steps(rows, texts)):
            history = self.history[g]
            history.append({"role": "assistant", "content": text})
            c = self.counts[g]
            c[CALLS] += st.calls
            c[FAILED] += st.failed
            self.rewards[g] += sum(map(float, st.rewards.values()))
            if st.done or not st.messages:
                out.append(None)
            elif c[ROUNDS] >= self.setup.max_rounds:
                c[CAPPED] = 1
                out.append(None)
            else:
                why = _over_bounds(history + st.messages)
                if why is None:
                    messages = _cleaned(st.messages)
                    try:
                        nxt = continuation(self.tok, history, messages, ids[-1])
                    except ChatTemplateError as e:
                        why = f"its messages do not render ({e})"
                if why is not None:  # the row ends here, its failure counted
                    self._broke(g, "step()", why)
                    out.append(None)
                    continue
                c[ROUNDS] += 1
                out.append(nxt)
                history += messages
        return out

    def _made(self, g: int) -> Environment | None:
        """Row `g`'s environment; None where making it raised (the row is broken)."""
        try:
            return self.setup.env(self.tok.call_format) if self.setup.tool_loop \
                else self.setup.env()
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # as reset's
            self._broke(g, "__init__", _raised(e))
            return None

    def _broke(self, g: int, where: str, why: str) -> None:
        """Row `g`'s environment failed in `where`: the row ends at its next turn (its first,
        from the task's prompt, where reset had not given one), is counted broken, and the
        first such failure of each kind is logged."""
        self.counts[g, BROKEN] = 1
        if where != "__init__":
            self.envs[g] = None
        key = f"{self.name} {where}"
        if key not in _logged:
            _logged.add(key)
            log.warning("%s: %s: %s; its row ends (counted in tools/broken_frac; later "
                        "failures of this kind are only counted)", self.name, where, why)

    def env_rewards(self) -> list[float] | None:
        """Each row's reward parts, summed over its turns (None: they do not count)."""
        return self.rewards.tolist() if self.setup.rewards else None

    def unanswered(self, row: int) -> None:
        """Row `row`'s last answer did not fit its tokens left: it never reached the model, so
        it leaves the conversation (and its round the count); the row is cut off."""
        history = self.history[row]
        while len(history) > self.start[row] and history[-1]["role"] != "assistant":
            history.pop()
        self.counts[row, ROUNDS] -= 1

    def cut(self, row: int, ids: list[int]) -> None:
        """Row `row` ran out of tokens in its turn `ids` (its last message, unfinished)."""
        self.history[row].append({"role": "assistant", "content": self.tok.decode(ids)})

    def _steps(self, rows: list[int], texts: list[str]) -> list[Step]:
        """Each row's environment steps on its turn, all at once (module docstring); a row
        whose earlier step still runs ends instead."""
        free = [self.envs[g] is not None and (g not in self.running
                                              or self.running.pop(g).done()) for g in rows]
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
            why = first_line(f.exception())
            key = f"{self.name} step()"
            if key not in _logged:
                _logged.add(key)
                log.warning("%s: step() raised %s: %s; answered 'error: ...' (counted in "
                            "tools/failed_frac; later failures are only counted)", self.name,
                            type(f.exception()).__name__, why)
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



class TurnState:
    """The engine's side of one generation's multi-turn rows, which both engines drive (the
    native one token by token, vLLM's in rounds of requests), so the rules are written once:
    where each row's turn began, the ids that answered its turns at the columns they take
    (`forced`, `is_forced`: attended to, not the model's own), and how a row ends. `turns`:
    the conversations (Turns, or a test's stand-in with end_turn, cut and unanswered).

    The rules: max_new_tokens (N) counts every token after the prompt; a turn ends at an
    end-of-turn token; its answer is taken only with room for one token of the model's own
    after it, else the row is cut off (Turns.unanswered: the answer never reached the model);
    a row whose conversation is over (None) is finished; a row out of tokens mid-turn is not,
    and its unfinished turn is the conversation's last message (Turns.cut, in `rollout`)."""

    def __init__(self, turns, rows: int, max_new_tokens: int, device=None):
        self.turns, self.N = turns, max_new_tokens
        self.forced = torch.zeros((rows, max_new_tokens), dtype=torch.long, device=device)
        self.is_forced = torch.zeros((rows, max_new_tokens), dtype=torch.bool, device=device)
        self.turn_start = [0] * rows  # each row's current turn's first column (N: all told)
        self.over = [False] * rows  # its conversation ended it: finished

    def end_turns(self, rows: list[int], completions: list[list[int]]) -> list[list[int] | None]:
        """Rows `rows` ended a turn: `completions[i]`, row rows[i]'s ids so far, its
        end-of-turn token last -> the ids the row takes next (from column len(completion)
        on, also set in `forced`), or None where the row ends (its conversation is over, or
        the answer has no room: cut off)."""
        nxt = self.turns.end_turn(rows, [c[self.turn_start[g]:] for g, c in zip(rows, completions)])
        out = []
        for g, used, ids in zip(rows, map(len, completions), nxt):
            if ids is not None and len(ids) < self.N - used:
                self.forced[g, used:used + len(ids)] = torch.tensor(ids, dtype=torch.long)
                self.is_forced[g, used:used + len(ids)] = True
                self.turn_start[g] = used + len(ids)
                out.append(ids)
                continue
            if ids is None:
                self.over[g] = True
            else:  # no room for the answer and a token of its own
                self.turns.unanswered(g)
            self.turn_start[g] = self.N
            out.append(None)
        return out

    def rollout(self, r: Rollout) -> Rollout:
        """The engine's rollout `r` of these rows as a multi-turn one: each unfinished turn
        handed to its conversation (Turns.cut), the model's own tokens, finished where the
        conversation ended the row, and the conversations' texts, messages, counts and
        rewards."""
        lengths = r.lengths()
        for g, ids in enumerate(r.completion_ids.tolist()):
            if not self.over[g] and self.turn_start[g] < lengths[g]:
                self.turns.cut(g, ids[self.turn_start[g]:lengths[g]])
        device = r.completion_ids.device
        n = r.completion_ids.size(1)
        return replace(r, model_mask=r.completion_mask & ~self.is_forced[:, :n].to(device),
                       finished=torch.tensor(self.over, dtype=torch.bool, device=device),
                       texts=self.turns.last_replies(), conversations=self.turns.conversations(),
                       env_rewards=self.turns.env_rewards(),
                       turn_counts=self.turns.counts.to(device))


def _raised(e: BaseException) -> str:
    return f"raised {type(e).__name__}: {first_line(e)}"


def _cleaned(messages: list[dict]) -> list[dict]:
    """Messages with every text made encodable (clean_text: no lone surrogates), once they
    are within a conversation's bounds (_over_bounds; cleaning only shortens a text): 3000
    messages of 1 MiB of surrogates, cleaned first, took 0.4 s each, 20 minutes."""
    return [{k: clean_text(v) if isinstance(v, str) else v for k, v in m.items()}
            for m in messages]


def _over_bounds(messages: list[dict]) -> str | None:
    """Why a conversation is over its bounds (None: within them): at most MAX_MESSAGES
    messages, and the values the chat template writes (all but the model's own turns, which
    render as a stand-in) at most MAX_CHARS characters in all, the most one render writes."""
    if len(messages) > MAX_MESSAGES:
        return f"{len(messages)} messages, more than a conversation holds ({MAX_MESSAGES})"
    chars = sum(len(v) for m in messages if m["role"] != "assistant" for v in m.values())
    if chars > MAX_CHARS:
        return (f"its messages are {chars} characters in all, more than a chat template "
                f"writes ({MAX_CHARS})")
    return None
