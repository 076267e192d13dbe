"""Tools a policy may call in a multi-turn rollout: Python functions, named in the config the
way reward plugins are, each with a JSON schema derived from its signature and docstring (the
shape of transformers' `get_json_schema` and TRL's `tools=`, so a TRL user's tools work
unchanged); the built-in `calculator`; and one call, as tool_calls.py reads it from the
model's reply in its family's format, run to its message.

    tools = resolve_tools(["calculator", "examples.my_tools:lookup"])
    schema = tool_schema(tools["calculator"])    # {"type": "function", "function": {...}}
    calls = parse_tool_calls(text, "hermes")     # tool_calls.py: hermes | llama3 | mistral
    message = run_call(tools, calls[0])          # the result, or "error: ..."

A tool is user code, trusted like a reward plugin. What the model writes is not: a call's JSON
is bounded in size and depth before it is parsed, at most MAX_CALLS calls of a completion
count, and an unknown tool, bad arguments, malformed JSON or an exception in the tool come
back as the tool's message (`error: ...`), never as an exception out of the rollout. A tool's
output is cut to `max_chars`. `calculator` walks the expression's syntax tree (no `eval`) and
bounds every number it makes, so `9**9**9` or a 10,000-digit product is an error at once.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures as cf
import functools
import inspect
import json
import math
import operator
import os
import re
import threading
import types
import typing
from collections.abc import Callable

from .fields import ConfigError
from .threads import block_interrupts
from .tool_calls import (  # noqa: F401  (the parser's names, imported from here before it moved)
    MAX_CALL_BYTES,
    MAX_CALL_DEPTH,
    MAX_CALLS,
    ToolCall,
    parse_tool_calls,
)

MAX_OUTPUT_CHARS = 2000  # a tool's message, by default


class ToolError(ValueError):
    """A call that cannot be answered (its message goes back to the model as `error: ...`)."""


# ---- the built-in calculator

MAX_EXPRESSION_CHARS = 1000
MAX_NODES = 256  # syntax-tree nodes: bounds the walk's depth too
MAX_DIGITS = 1000  # of any integer the calculator makes
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression to evaluate, for example "431 * 254" or "(2.5 + 3) / 7"
    """
    if not isinstance(expression, str):
        raise ToolError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ToolError(f"not an arithmetic expression: {expression[:80]!r}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ToolError(f"expression has more than {MAX_NODES} parts")
    return _format(_value(tree.body))


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _value(node.left), _value(node.right)
        _fits(type(node.op), a, b)
        try:
            return _checked(_BINARY[type(node.op)](a, b))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
    raise ToolError(f"unsupported: {type(node).__name__} (numbers and + - * / // % ** only)")


def _digits(x: int | float) -> float:
    """Decimal digits of an integer's magnitude (estimated from its bits, never printed)."""
    return abs(int(x)).bit_length() * math.log10(2) if isinstance(x, int) else 0.0


def _fits(op: type, a: int | float, b: int | float) -> None:
    """Refuses, before computing, a product or power whose integer would pass MAX_DIGITS."""
    if op is ast.Mult and _digits(a) + _digits(b) > MAX_DIGITS + 1:
        raise ToolError(f"result has more than {MAX_DIGITS} digits")
    if op is ast.Pow and isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 \
            and b * math.log10(abs(a)) > MAX_DIGITS:
        raise ToolError(f"result has more than {MAX_DIGITS} digits")
    if op is ast.Pow and isinstance(b, (int, float)) and abs(b) > 10_000 and abs(a) not in (0, 1):
        raise ToolError("exponent too large")


def _checked(x: int | float) -> int | float:
    if isinstance(x, complex):
        raise ToolError("complex result")
    if isinstance(x, float) and not math.isfinite(x):
        raise ToolError("result is not a finite number")
    if isinstance(x, int) and _digits(x) > MAX_DIGITS:
        raise ToolError(f"result has more than {MAX_DIGITS} digits")
    return x


def _format(x: int | float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return format(x, ".12g") if isinstance(x, float) else str(x)


BUILTIN_TOOLS: dict[str, Callable] = {"calculator": calculator}


# ---- naming and describing tools

def resolve_tools(names: list[str]) -> dict[str, Callable]:
    """{name the model calls: function} for the config's `tools`: built-in names or
    `package.module:function`; each must have a schema (tool_schema checks it here, at the
    start). A ConfigError names a tool that cannot be had."""
    from .rewards.registry import import_callable

    out: dict[str, Callable] = {}
    for name in names:
        fn = BUILTIN_TOOLS.get(name) or (import_callable(name, "tool") if ":" in name else None)
        if fn is None:
            raise ConfigError(f"tools: unknown tool {name!r} (built in: "
                              f"{', '.join(BUILTIN_TOOLS)}; or package.module:function)")
        if not callable(fn):
            raise ConfigError(f"tools: {name!r} is a {type(fn).__name__}, not a function")
        schema = tool_schema(fn)
        called = schema["function"]["name"]
        if called in out:
            raise ConfigError(f"tools: two tools are called {called!r}")
        out[called] = fn
    return out


def tool_schemas(names: list[str]) -> list[dict]:
    """The JSON schemas of the config's `tools` (what a prompt lists)."""
    return [tool_schema(fn) for fn in resolve_tools(names).values()]


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               list: "array", dict: "object"}


def _type_schema(tp, where: str) -> dict:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (list, tuple) or tp in (typing.List, typing.Tuple):  # noqa: UP006
        return {"type": "array", **({"items": _type_schema(args[0], where)} if args else {})}
    if origin is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return {**_type_schema(rest[0], where), "nullable": True}
        return {"type": [_type_schema(a, where)["type"] for a in rest]}
    raise ConfigError(f"{where}: type {tp!r} has no JSON schema (use int, float, str, bool, "
                      f"list, dict, Literal or Optional of them)")


_SECTION = re.compile(r"^\s*(Args|Returns|Raises|Yields|Examples?):\s*$", re.M)


def _doc_parts(doc: str) -> tuple[str, dict[str, str], str]:
    """(description, {argument: its text}, the Returns: text) of a Google-style docstring."""
    parts = _SECTION.split(doc)  # head, then (section name, its text) pairs
    sections = dict(zip(parts[1::2], parts[2::2]))
    described, name = {}, None
    for line in sections.get("Args", "").splitlines():
        m = re.match(r"^\s*(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
        if m:
            name, described[m[1]] = m[1], m[3].strip()
        elif name and line.strip():
            described[name] += " " + line.strip()
    return " ".join(parts[0].split()), described, " ".join(sections.get("Returns", "").split())


def tool_schema(fn: Callable) -> dict:
    """{"type": "function", "function": {name, description, parameters}} from the function's
    name, type hints and docstring (description, and an `Args:` line per argument), as
    transformers' get_json_schema makes it. A ConfigError names what is missing."""
    name = getattr(fn, "__name__", type(fn).__name__)
    where = f"tools: {name}"
    doc = inspect.getdoc(fn) or ""
    description, described, returns = _doc_parts(doc)
    if not description:
        raise ConfigError(f"{where}: no docstring (the model is told what a tool does by it)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise ConfigError(f"{where}: its type hints cannot be read ({e})") from None
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ConfigError(f"{where}: *args and **kwargs have no schema")
        if p.name not in hints:
            raise ConfigError(f"{where}: argument {p.name!r} has no type hint")
        if p.name not in described:
            raise ConfigError(f"{where}: argument {p.name!r} is not described under Args:")
        properties[p.name] = {**_type_schema(hints[p.name], f"{where}({p.name})"),
                              "description": described[p.name]}
        if p.default is p.empty:
            required.append(p.name)
    schema = {"name": name, "description": description,
              "parameters": {"type": "object", "properties": properties, "required": required}}
    if "return" in hints:  # as transformers says it; a type with no JSON schema is left out
        try:
            schema["return"] = _type_schema(hints["return"], where)
        except ConfigError:
            pass
        else:
            if returns:
                schema["return"]["description"] = returns
    return {"type": "function", "function": schema}


_schema = functools.lru_cache(maxsize=256)(tool_schema)  # a call checks its arguments by it


# ---- calls run to a message

_ACCEPTS = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
            "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}


def check_arguments(schema: dict, arguments: dict) -> None:
    """ToolError unless `arguments` fit the tool's parameters: no unknown names, every
    required one, each of its JSON type (and enum)."""
    params = schema["function"]["parameters"]
    props = params["properties"]
    unknown = [k for k in arguments if k not in props]
    if unknown:
        raise ToolError(f"unknown argument {unknown[0][:40]!r} (takes: {', '.join(props)})")
    missing = [k for k in params["required"] if k not in arguments]
    if missing:
        raise ToolError(f"missing argument {missing[0]!r}")
    for k, v in arguments.items():
        spec = props[k]
        kinds = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
        if v is None and spec.get("nullable"):
            continue
        if not any(_ACCEPTS[t](v) for t in kinds):
            raise ToolError(f"argument {k!r} must be {' or '.join(kinds)}")
        if "enum" in spec and v not in spec["enum"]:
            raise ToolError(f"argument {k!r} must be one of {spec['enum']}")


def run_call(tools: dict[str, Callable], call: ToolCall, max_chars: int = MAX_OUTPUT_CHARS,
             timeout: float | None = None) -> str:
    """The message that answers `call`: the tool's result as text, cut to `max_chars`, or
    `error: ...` for a call that could not be read, an unknown tool, bad arguments or an
    exception in the tool (any Exception; Ctrl-C still stops the run). An `async def` tool
    is awaited on the process's one loop for tools (_tool_loop); past `timeout` seconds its
    coroutine is cancelled there (a plain function cannot be: its caller stops waiting)."""
    try:
        if call.error:
            raise ToolError(call.error)
        if call.name not in tools:
            raise ToolError(f"unknown tool {call.name[:40]!r} (tools: {', '.join(tools)})")
        fn = tools[call.name]
        check_arguments(_schema(fn), call.arguments)
        out = fn(**call.arguments)
        if inspect.isawaitable(out):
            loop = _tool_loop()
            running = asyncio.run_coroutine_threadsafe(_awaited(out), loop)
            try:
                out = running.result(timeout)
            except cf.TimeoutError:
                running.cancel()
                _drop_if_blocked(loop)
                raise ToolError(no_answer(timeout)) from None
        text = out if isinstance(out, str) else json.dumps(out, default=str)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the model's call, or the tool, failed (a SystemExit too)
        text = f"error: {first_line(e)}"  # the model is told
    return cut(text, max_chars)


def cut(text: str, max_chars: int) -> str:
    """`text` at most `max_chars` long, its note of the cut included where there is room."""
    if len(text) <= max_chars:
        return text
    note = f" ... (cut at {max_chars} characters)"
    return text[:max_chars - len(note)] + note if max_chars > 2 * len(note) \
        else text[:max_chars]


def first_line(e: BaseException) -> str:
    """An exception's message, its first line (its type's name where it has none, or where
    making it raises)."""
    try:
        lines = str(e).strip().splitlines()
    except BaseException:  # a __str__ of the tool's that raises: never out of the rollout
        lines = []
    return lines[0] if lines else type(e).__name__


def no_answer(timeout: float) -> str:
    """Why a call or a step past `timeout` has no answer (its message: `error: ` and this)."""
    return f"no answer within {timeout:g} s (tool_timeout)"


async def _awaited(awaitable):
    return await awaitable


_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None  # (the process that runs it, it)
_LOOP_LOCK = threading.Lock()


def _tool_loop() -> asyncio.AbstractEventLoop:
    """The one event loop every `async def` tool of this process runs on, in a daemon thread
    of its own: what a tool keeps between calls (a client session, a lock) stays bound to
    the loop it was made on (a loop a call, asyncio.run's, failed such a tool from its
    second call). A forked process starts its own."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=_run_forever, args=(loop,), name="tools-async",
                             daemon=True).start()
            _LOOP = (os.getpid(), loop)
        return _LOOP[1]


def _drop_if_blocked(loop: asyncio.AbstractEventLoop, wait: float = 0.5) -> None:
    """After a call past its timeout: a loop that cannot run a no-op within `wait` seconds is
    held by a coroutine that blocks (a `time.sleep` in an `async def` tool), and every later
    call would wait behind it. It is left to its thread, and the next call starts a new one."""
    global _LOOP
    try:
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(wait)
    except cf.TimeoutError:
        with _LOOP_LOCK:
            if _LOOP is not None and _LOOP[1] is loop:
                _LOOP = None


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    block_interrupts()
    loop.run_forever()
