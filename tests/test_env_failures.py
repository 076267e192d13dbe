"""What tools and environments say is bounded by the rollout itself: output within the
documented limits never stops a run, and an environment that fails (its __init__ or reset
raises, or it answers past a conversation's bounds) is its row's failure, counted in
`tools/broken_frac` and logged once, named by the environment, not the chat template or the
tokenizer. Async tools cannot block each other; a tool's exception of any kind is an error
message."""

import asyncio
import json
import logging
import time

import pytest
from conftest import CHATML, metrics, tiny, tiny_lm_dir
from test_turns import tokenizers

from mini_grpo.engines import turns as T
from mini_grpo.engines.turns import COUNTS, MAX_MESSAGES, ToolSetup, Turns
from mini_grpo.envs import MAX_CHARS, Step, ToolEnv
from mini_grpo.fields import ConfigError
from mini_grpo.tool_calls import ToolCall
from mini_grpo.tools import cut, run_call


@pytest.fixture(autouse=True)
def fresh_log():
    T._logged.clear()  # each test sees its environment's first failure logged


def talk(tok, turns, rows, texts):
    return turns.end_turn(rows, [tok.encode(t) + [tok.eos_id] for t in texts])


def broken(turns):
    return turns.counts[:, COUNTS.index("broken")].tolist()


def big(n: int) -> str:
    """A tool's whole output.

    Args:
        n: its length
    """
    return "7" * n


def test_a_cut_result_is_within_its_limit_its_note_included():
    assert cut("x" * 10, 10) == "x" * 10
    long = cut("x" * (MAX_CHARS + 5), MAX_CHARS)
    assert len(long) == MAX_CHARS and long.endswith(f"(cut at {MAX_CHARS} characters)")
    assert cut("x" * 100, 8) == "x" * 8  # no room for the note
    # at tool_output_chars' documented maximum, the loop's answer passes its own checks
    env = ToolEnv({"big": big}, MAX_CHARS)
    step = env.step('<tool_call>{"name": "big", "arguments": {"n": 1100000}}</tool_call>')
    assert len(step.messages[0]["content"]) == MAX_CHARS and step.failed == 0


@pytest.mark.parametrize("answer", ["four calls", "one MiB", "many messages"])
def test_answers_past_what_a_conversation_holds_end_the_row_not_the_run(tmp_path, caplog,
                                                                        answer):
    """Four calls of 300,000 characters each (within tool_output_chars), an environment's
    message of 1 MiB (what the guide allows), 100,000 messages: each was the chat template's
    exit 2. Now the row ends, counted broken, the other rows go on."""
    ours, _ = tokenizers(tmp_path, CHATML)
    if answer == "four calls":
        setup = ToolSetup(lambda fmt: ToolEnv({"big": big}, MAX_CHARS, fmt), 4, 10.0,
                          tool_loop=True)
        call = '<tool_call>{"name": "big", "arguments": {"n": 300000}}</tool_call>'
        bad, name = call * 4, "the tool loop"
    else:
        class Chatty:
            def reset(self, example):
                return None

            def step(self, reply):
                if reply != "bad":
                    return Step([{"role": "user", "content": "ok"}], done=False)
                if answer == "one MiB":
                    return Step([{"role": "user", "content": "y" * MAX_CHARS}], done=False)
                return Step([{"role": "user", "content": "z"}] * 100_000, done=False)

        setup, bad = ToolSetup(Chatty, 4, 10.0, rewards=True), "bad"
        name = "environment test_env_failures:test_answers_past_what_a_conversation_holds_" \
               "end_the_row_not_the_run.<locals>.Chatty"
    turns = Turns(setup, ours, ["a", "b"])
    turns.prompt_ids()
    with caplog.at_level(logging.WARNING, logger="mini_grpo.envs"):
        nxt = talk(ours, turns, [0, 1], [bad, "fine"])
    assert nxt[0] is None and broken(turns) == [1, 0]
    assert nxt[1] is not None or answer == "four calls"  # "fine" calls no tool: it ends
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and warned[0].startswith(f"{name}: step(): ")
    assert "tools/broken_frac" in warned[0] and ("characters in all" in warned[0]
                                                  or f"than a conversation holds "
                                                     f"({MAX_MESSAGES})" in warned[0])
    assert turns.conversations()[0][-1] == {"role": "assistant", "content": bad}


def test_reset_with_too_many_messages_breaks_its_row_which_starts_from_the_prompt(tmp_path):
    ours, _ = tokenizers(tmp_path, CHATML)

    class Flood:
        def reset(self, example):
            return [{"role": "user", "content": "q"}] * 100_000 if example == "a" else None

        def step(self, reply):
            return Step([], done=True)

    turns = Turns(ToolSetup(Flood, 4, 10.0, rewards=True), ours, ["a", "b"])
    ids = turns.prompt_ids()
    assert broken(turns) == [1, 0] and len(ids) == 2
    assert turns.history[0] == ours.messages_of("a")  # the task's prompt, as it is
    assert ids[0] == ours.encode(ours.render(ours.messages_of("a")))


def test_an_unencodable_answer_is_replaced_not_an_exit_naming_the_tokenizer(tmp_path):
    ours, _ = tokenizers(tmp_path, CHATML)

    def odd() -> str:
        """A tool whose output UTF-8 cannot encode."""
        return "a\ud800b \ud83d\ude00"

    setup = ToolSetup(lambda fmt: ToolEnv({"odd": odd}, 100, fmt), 4, 10.0, tool_loop=True)
    turns = Turns(setup, ours, ["a"])
    nxt = talk(ours, turns, [0], ['<tool_call>{"name": "odd", "arguments": {}}</tool_call>'])
    assert nxt[0] is not None and broken(turns) == [0]
    assert turns.conversations()[0][-1]["content"] == "a\ufffdb \U0001f600"


def test_an_environment_that_raises_in_init_or_reset_breaks_its_row_alone(tmp_path, caplog):
    ours, _ = tokenizers(tmp_path, CHATML)
    made = []

    class Fragile:
        def __init__(self):
            made.append(1)
            if len(made) == 2:
                raise RuntimeError("init broke\nsecond line")

        def reset(self, example):
            if example == "c":
                raise RuntimeError("reset broke")
            return None

        def step(self, reply):
            return Step([{"role": "user", "content": "go on"}], done=False)

    with caplog.at_level(logging.WARNING, logger="mini_grpo.envs"):
        turns = Turns(ToolSetup(Fragile, 4, 10.0, rewards=True), ours, ["a", "b", "c", "d"])
        turns.prompt_ids()
        nxt = talk(ours, turns, [0, 1, 2, 3], ["x"] * 4)
        Turns(ToolSetup(Fragile, 4, 10.0, rewards=True), ours, ["c"])  # logged once
    assert broken(turns) == [0, 1, 1, 0] and [n is None for n in nxt] == [False, True, True,
                                                                            False]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert ": __init__: raised RuntimeError: init broke; its row ends" in warned[0]
    assert ": reset(): raised RuntimeError: reset broke; its row ends" in warned[1]


def test_a_reset_raising_any_base_exception_but_ctrl_c_breaks_its_row(tmp_path):
    """A SystemExit or a BaseException whose str() raises, from reset or __init__, was out
    of the rollout (a traceback); Ctrl-C still stops the run."""
    ours, _ = tokenizers(tmp_path, CHATML)

    class Exits:
        def __init__(self):
            if made:
                raise made.pop()

        def reset(self, example):
            raise SystemExit(3) if example == "a" else Unprintable()

        def step(self, reply):
            return Step([], done=True)

    made = [GeneratorExit()]
    turns = Turns(ToolSetup(Exits, 4, 10.0, rewards=True), ours, ["x", "a", "b"])
    assert broken(turns) == [1, 1, 1]
    made = [KeyboardInterrupt()]
    with pytest.raises(KeyboardInterrupt):
        Turns(ToolSetup(Exits, 4, 10.0, rewards=True), ours, ["a"])


def test_an_environment_on_a_model_without_a_chat_template_is_refused_at_setup(tmp_path):
    from mini_grpo.run import setup

    with pytest.raises(ConfigError, match="environment: a multi-turn conversation needs the "
                                          "chat template"):
        setup(tiny(tmp_path / "run", environment="examples.guess_number:GuessNumber"))


def test_one_blocking_async_tool_does_not_poison_the_later_ones():
    async def blocking() -> str:
        """Blocks its loop."""
        time.sleep(1.5)
        return "late"

    async def healthy() -> str:
        """Answers at once."""
        await asyncio.sleep(0)
        return "ok"

    tools = {"blocking": blocking, "healthy": healthy}
    assert run_call(tools, ToolCall("blocking", {}), timeout=0.3) == \
        "error: no answer within 0.3 s (tool_timeout)"
    assert run_call(tools, ToolCall("healthy", {}), timeout=1.0) == "ok"


class Unprintable(BaseException):
    def __str__(self):
        raise ValueError("no")


def test_a_tool_raising_anything_but_ctrl_c_answers_an_error():
    def weird() -> str:
        """Raises what cannot be shown."""
        raise Unprintable()

    def leaves() -> str:
        """Asks the process to exit."""
        raise SystemExit(3)

    def interrupted() -> str:
        """As Ctrl-C does."""
        raise KeyboardInterrupt

    tools = {"weird": weird, "leaves": leaves, "interrupted": interrupted}
    assert run_call(tools, ToolCall("weird", {})) == "error: Unprintable"
    assert run_call(tools, ToolCall("leaves", {})) == "error: 3"
    with pytest.raises(KeyboardInterrupt):
        run_call(tools, ToolCall("interrupted", {}))


FLAKY = '''
from mini_grpo.envs import Step

class Flaky:
    """Breaks on every other row: its reset raises, or it answers with 1 MiB."""
    rows = 0

    def __init__(self):
        Flaky.rows += 1
        self.kind = Flaky.rows % 3

    def reset(self, prompt):
        if self.kind == 1:
            raise RuntimeError("reset broke")
        return None

    def step(self, reply):
        if self.kind == 2:
            return Step([{"role": "user", "content": "y" * (1 << 20)}], done=False)
        return Step([{"role": "user", "content": "again"}], done=False)
'''


def test_a_run_whose_environment_breaks_rows_finishes_with_them_counted(tmp_path,
                                                                        monkeypatch):
    from mini_grpo.job import train

    (tmp_path / "flaky_env.py").write_text(FLAKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = tiny_lm_dir(tmp_path / "lm")
    cfg = tiny(tmp_path / "run", init_from=str(model), task="jsonl",
               data_path="examples/guess_number.jsonl", environment="flaky_env:Flaky",
               rewards=json.dumps([{"name": "examples.guess_number:guesses", "weight": 1.0}]),
               max_steps=2, eval_every=100, max_new_tokens=24, block_size=256,
               prompts_per_step=2, group_size=3, save_every=100, max_tool_calls=2)
    train(cfg)
    rows = [r for r in metrics(tmp_path / "run") if "tools/broken_frac" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["tools/broken_frac"] >= 1 / 3 for r in rows)  # reset's rows at least
