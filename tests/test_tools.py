"""Tools (issue 40): schemas from a function's signature and docstring, the bounded
calculator, the parser of Hermes-style calls, and a call run to its message; whatever the
model writes comes back as a message, never as an exception or a hang."""

import json
import sys
import time
from typing import Literal

import pytest

from mini_grpo.fields import ConfigError
from mini_grpo.tools import (
    MAX_CALLS,
    ToolCall,
    ToolError,
    calculator,
    parse_tool_calls,
    resolve_tools,
    run_call,
    tool_schema,
)


def lookup(city: str, days: int = 1, unit: Literal["c", "f"] | None = None,
           tags: list[str] | None = None) -> str:
    """Looks up the weather.

    Args:
        city: the city's name
        days: how many days
            ahead
        unit: the unit
        tags: tags to filter by

    Returns:
        the forecast
    """
    return f"{city}: sunny for {days} days"


async def slow_echo(text: str) -> str:
    """Echoes its text.

    Args:
        text: what to echo
    """
    return text


_CLIENT = []  # what `client_echo` makes on its first call: the event loop it runs on


async def client_echo(text: str) -> str:
    """Echoes its text through a client it keeps between calls, which (as aiohttp's
    ClientSession) works on the event loop it was made on only.

    Args:
        text: what to echo
    """
    import asyncio

    if not _CLIENT:
        _CLIENT.append(asyncio.get_running_loop())
    if _CLIENT[0] is not asyncio.get_running_loop():
        raise RuntimeError("the client is bound to a different event loop")
    await asyncio.sleep(0)
    return text


_CANCELLED = []


async def stuck(x: int) -> str:
    """Waits forever, and says when it is cancelled.

    Args:
        x: anything
    """
    import asyncio

    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        _CANCELLED.append(x)
        raise
    return "never"


def broken(x: int) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("the backend is down\nsecond line")


@pytest.mark.parametrize("expression, want", [
    ("431 * 254", "109474"), ("(2.5 + 3) / 7", format(5.5 / 7, ".12g")), ("7 // 2", "3"),
    ("2 ** 10", "1024"), ("-3 + +4", "1"), ("10 / 4", "2.5"), ("1e3 * 2", "2000"),
    ("17 % 5", "2"), (" 999 * 999 ", "998001"), ("2 ** -1", "0.5")])
def test_the_calculator_does_arithmetic(expression, want):
    assert calculator(expression) == want


@pytest.mark.parametrize("expression, needle", [
    ("__import__('os').system('true')", "unsupported: Call"),
    ("x + 1", "unsupported: Name"), ("(1).real", "unsupported: Attribute"),
    ("[1, 2]", "unsupported: List"), ("'a' * 3", "unsupported: Constant"),
    ("1 if 1 else 2", "unsupported: IfExp"), ("1 < 2", "unsupported: Compare"),
    ("9**9**9", "digits"), ("10 ** 10000", "digits"), ("(10**600) * (10**600)", "digits"),
    ("2.0 ** 5000", "too large"), ("1 / 0", "division by zero"), ("5 % 0", "by zero"),
    ("2 ** 100000.5", "exponent too large"), ("1 +", "not an arithmetic expression"),
    ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"),
    ("1" + "+1" * 600, "longer than"), ("+".join(["1"] * 200), "parts"),
    ("1e308 * 10", "not a finite number")])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, needle):
    t0 = time.process_time()  # CPU-bound: a bound for a runaway, in CPU seconds
    with pytest.raises(ToolError, match=needle):
        calculator(expression)
    assert time.process_time() - t0 < 5


def test_a_schema_is_what_transformers_derives():
    schema = tool_schema(lookup)
    assert schema == {"type": "function", "function": {
        "name": "lookup", "description": "Looks up the weather.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "the city's name"},
            "days": {"type": "integer", "description": "how many days ahead"},
            "unit": {"type": "string", "enum": ["c", "f"], "nullable": True,
                     "description": "the unit"},
            "tags": {"type": "array", "items": {"type": "string"}, "nullable": True,
                     "description": "tags to filter by"}}},
        "return": {"type": "string", "description": "the forecast"}}}
    transformers = pytest.importorskip("transformers.utils")
    for fn in (lookup, calculator, slow_echo):
        assert tool_schema(fn) == transformers.get_json_schema(fn), fn.__name__


def test_a_tool_without_what_its_schema_needs_is_refused_by_name():
    def no_doc(x: int) -> str:
        return ""

    def no_hint(x) -> str:
        """Does x.

        Args:
            x: the x
        """

    def undocumented(x: int, y: int) -> str:
        """Does x.

        Args:
            x: the x
        """

    def star(*xs: int) -> str:
        """Does xs.

        Args:
            xs: the xs
        """

    for fn, needle in ((no_doc, "no docstring"), (no_hint, "'x' has no type hint"),
                       (undocumented, "'y' is not described"), (star, r"\*args")):
        with pytest.raises(ConfigError, match=f"tools: {fn.__name__}: .*{needle}"):
            tool_schema(fn)


def test_tools_are_named_as_reward_plugins_are(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(
        "def lookup(city: str) -> str:\n"
        "    '''Looks a city up.\n\n    Args:\n        city: its name\n    '''\n"
        "    return city.upper()\n"
        "NOT_A_TOOL = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = resolve_tools(["calculator", "my_tools:lookup"])
    assert list(tools) == ["calculator", "lookup"]
    assert run_call(tools, ToolCall("lookup", {"city": "paris"})) == "PARIS"
    for names, needle in ((["abacus"], "unknown tool 'abacus'"),
                          (["my_tools:missing"], "has no attribute"),
                          (["no_such_module:f"], "cannot import module"),
                          (["my_tools:NOT_A_TOOL"], "not a function"),
                          (["calculator", "calculator"], "two tools are called")):
        with pytest.raises(ConfigError, match=needle):
            resolve_tools(names)
    sys.modules.pop("my_tools", None)


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_calls_are_read_in_order_and_bad_ones_say_why():
    text = ("Let me compute. " + call("calculator", expression="431 * 254") + " and "
            + call("lookup", city="Oslo") + "<tool_call>{not json}</tool_call>"
            + '<tool_call>["calculator"]</tool_call>'
            + '<tool_call>{"name": "lookup", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
            + '<tool_call>{"name": "lookup", "arguments": 3}</tool_call>'
            + "<tool_call>" + json.dumps({"name": "calculator"}))  # unclosed: not yet a call
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "431 * 254"}),
                         ToolCall("lookup", {"city": "Oslo"})]
    assert "not valid JSON" in calls[2].error and "is {" in calls[3].error
    assert calls[4] == ToolCall("lookup", {"city": "Rome"})  # arguments as a JSON string
    assert calls[5].error == "arguments must be a JSON object"
    assert len(calls) == 6
    assert parse_tool_calls("no call here") == []


def test_hostile_calls_are_bounded():
    t0 = time.process_time()  # CPU-bound: a bound for a runaway, in CPU seconds
    huge = parse_tool_calls("<tool_call>" + "x" * 10_000_000 + "</tool_call>")
    assert len(huge) == 1 and "longer than" in huge[0].error
    deep = parse_tool_calls("<tool_call>" + "[" * 10_000 + "]" * 10_000 + "</tool_call>")
    assert len(deep) == 1 and deep[0].error
    nested = {"name": "lookup", "arguments": {"city": "x"}}
    for _ in range(40):
        nested["arguments"] = {"a": nested["arguments"]}
    assert "deeper" in parse_tool_calls(f"<tool_call>{json.dumps(nested)}</tool_call>")[0].error
    many = parse_tool_calls(call("calculator", expression="1+1") * 10_000)
    assert len(many) == MAX_CALLS + 1
    assert many[-1].error == f"{10_000 - MAX_CALLS} more calls left out: at most {MAX_CALLS} a turn"
    assert time.process_time() - t0 < 20


def test_every_failure_is_the_tools_message():
    tools = {"calculator": calculator, "lookup": lookup, "broken": broken, "echo": slow_echo}
    answer = lambda text: [run_call(tools, c) for c in parse_tool_calls(text)]  # noqa: E731
    assert answer(call("calculator", expression="431 * 254")) == ["109474"]
    assert answer(call("calculator", expression="__import__('os')")) == [
        "error: unsupported: Call (numbers and + - * / // % ** only)"]
    assert answer(call("abacus", x=1)) == [
        "error: unknown tool 'abacus' (tools: calculator, lookup, broken, echo)"]
    assert answer(call("lookup")) == ["error: missing argument 'city'"]
    assert answer(call("lookup", city="Oslo", when="now")) == [
        "error: unknown argument 'when' (takes: city, days, unit, tags)"]
    assert answer(call("lookup", city="Oslo", days="2")) == [
        "error: argument 'days' must be integer"]
    assert answer(call("lookup", city="Oslo", days=True)) == [
        "error: argument 'days' must be integer"]
    assert answer(call("lookup", city="Oslo", unit="k")) == [
        "error: argument 'unit' must be one of ['c', 'f']"]
    assert answer(call("lookup", city="Oslo", unit=None)) == ["Oslo: sunny for 1 days"]
    assert answer(call("broken", x=1)) == ["error: the backend is down"]
    assert answer(call("echo", text="hi")) == ["hi"]  # an async def tool, awaited
    assert answer("<tool_call>{oops}</tool_call>") == ["error: cannot read the call: not valid "
                                                      "JSON"]
    # what an async tool keeps between calls stays bound to the loop every call runs on (a
    # loop a call, asyncio.run's, failed this from the second call), from any thread
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda i: run_call({"client_echo": client_echo}, ToolCall(
            "client_echo", {"text": str(i)})), range(4))) == ["0", "1", "2", "3"]
    # past the timeout an async tool's coroutine is cancelled on its loop, not left to run
    assert run_call({"stuck": stuck}, ToolCall("stuck", {"x": 7}), timeout=0.2) == \
        "error: no answer within 0.2 s (tool_timeout)"
    for _ in range(100):  # the cancellation lands on the loop's thread
        if _CANCELLED:
            break
        time.sleep(0.05)
    assert _CANCELLED == [7]
    long = run_call(tools, ToolCall("echo", {"text": "x" * 5000}), max_chars=100)
    assert long == "x" * 72 + " ... (cut at 100 characters)"  # 100 in all, the note too
