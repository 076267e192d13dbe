"""The tool calls in a model's reply, read in its family's format. The chat template names the
family (call_format); the model's text is untrusted, so every call is read within bounds.

    fmt = call_format(chat_template)     # "hermes" | "llama3" | "mistral"
    calls = parse_tool_calls(text, fmt)  # [ToolCall(name, arguments, error)], in order

    hermes   <tool_call>{"name": "calculator", "arguments": {...}}</tool_call>, anywhere in
             the reply (Qwen2.5, Qwen3, Hermes; our fallback prompt, TOOLS_PROMPT, asks for it)
    llama3   the reply is the call: {"name": "calculator", "parameters": {...}} ("arguments"
             too), after an optional <|python_tag|>; several separated by `;` or newlines
             (Llama 3.1 to 3.3). A reply that does not open with `{` is prose: no call.
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (v3 templates), or
             [TOOL_CALLS]calculator[ARGS]{...} (the templates since 2025), after any prose

One call's JSON is at most MAX_CALL_BYTES long and MAX_CALL_DEPTH deep, and at most MAX_CALLS
calls of a reply count (one more ToolCall says how many were left out). A call that cannot be
read is a ToolCall with its error, which answers it; nothing raises. Where the calls are not
delimited (llama3, mistral) each JSON value is decoded from windows of the text that grow up
to the bound, so a call costs time in its own length, and the first unreadable one ends the
reply's calls: what follows cannot be told from prose. Time is linear in the text's length,
memory in MAX_CALL_BYTES.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

from .fields import ConfigError
from .jsonio import check_tree

MAX_CALL_BYTES = 64 * 1024  # one call's JSON
MAX_CALL_DEPTH = 32  # its nesting
MAX_CALLS = 16  # calls of one completion that run; the rest are reported, not run

CALL_FORMATS = ("hermes", "llama3", "mistral")
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # Hermes
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x: may open a call
LLAMA3_PROMPT = "Given the following functions, please respond with a JSON for a function call"
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # Mistral
# tokens a format's calls are written with: where the vocabulary has them as special tokens,
# the decoded reply keeps them (HFTokenizer.decode), or the calls could not be found
CALL_TOKENS = {"hermes": (OPEN, CLOSE), "llama3": (PYTHON_TAG,),
               "mistral": (TOOL_CALLS, ARGS, CALL_ID)}


@dataclass(frozen=True)
class ToolCall:
    name: str  # "" where the call could not be read
    arguments: dict
    error: str = ""  # why the call could not be read: it is answered with this


def call_format(chat_template: str | None) -> str:
    """The call format of the family whose chat template this is, by the markers it writes:
    <tool_call> Hermes; [TOOL_CALLS] Mistral; <|python_tag|>, the `ipython` role or Llama's
    tool prompt Llama 3.x; anything else, or no template, Hermes (what TOOLS_PROMPT asks)."""
    text = chat_template or ""
    if OPEN in text:
        return "hermes"
    if TOOL_CALLS in text:
        return "mistral"
    if PYTHON_TAG in text or "ipython" in text or LLAMA3_PROMPT in text:
        return "llama3"
    return "hermes"


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """The calls `text` makes in format `fmt` (one of CALL_FORMATS), in order, at most
    MAX_CALLS (one more entry says how many were left out). A call whose JSON is too large,
    too deep, malformed or not of the format's shape is a ToolCall with its error."""
    if fmt not in _READERS:
        raise ValueError(f"call format {fmt!r}: one of {', '.join(CALL_FORMATS)}")
    calls: list[ToolCall] = []
    more = 0
    for read in _READERS[fmt](text):  # each call found; read only where it counts
        if len(calls) < MAX_CALLS:
            calls.append(read())
        else:
            more += 1
    if more:
        calls.append(ToolCall("", {}, f"{more} more calls left out: at most {MAX_CALLS} a turn"))
    return calls


# ---- each format's calls: generators of the calls they find, each a function that reads it

Found = Callable[[], ToolCall]


def _hermes(text: str) -> Iterator[Found]:
    start = 0
    while (i := text.find(OPEN, start)) >= 0:
        j = text.find(CLOSE, i + len(OPEN))
        if j < 0:
            return  # unclosed: the model has not finished writing it
        start = j + len(CLOSE)
        yield partial(_read_text, text, i + len(OPEN), j)


_LLAMA3_START = re.compile(rf"\s*(?:{re.escape(PYTHON_TAG)}\s*)?")
_LLAMA3_BETWEEN = re.compile(rf"(?:\s|;|{re.escape(PYTHON_TAG)})*")
_LLAMA3_KEYS = ("parameters", "arguments")


def _llama3(text: str) -> Iterator[Found]:
    i = _LLAMA3_START.match(text).end()
    while text.startswith("{", i):
        try:
            value, i = _json_at(text, i)
        except _Unreadable as e:
            yield partial(ToolCall, "", {}, str(e))
            return
        yield partial(_read_value, value, _LLAMA3_KEYS)
        i = _LLAMA3_BETWEEN.match(text, i).end()


_SPACES = re.compile(r"\s*")
# [TOOL_CALLS]name[ARGS]{...}, [CALL_ID]id between them in some templates ([ARGS] optional).
# No two runs of spaces meet without a character between them that neither takes: with an
# optional id between two, 16,000 spaces after [CALL_ID] took 5 s to refuse (quadratic)
_NAMED = re.compile(r'([^\s\[\]{}"]{1,128})\s*(?:\[CALL_ID\]\s*(?:[^\s\[\]{}"]{1,64}\s*)?)?'
                    r"(?:\[ARGS\]\s*)?(?=\{)")
_MISTRAL_SHAPE = (f'a call is {TOOL_CALLS}[{{"name": "...", "arguments": {{...}}}}] or '
                  f"{TOOL_CALLS}name{ARGS}{{...}}")


def _mistral(text: str) -> Iterator[Found]:
    i = text.find(TOOL_CALLS)
    while i >= 0:
        i = _SPACES.match(text, i + len(TOOL_CALLS)).end()
        try:
            if text.startswith("[", i):  # v3: a list of calls
                i = yield from _mistral_list(text, i)
            elif text.startswith("{", i):  # one call, without its list
                value, i = _json_at(text, i)
                yield partial(_read_value, value)
            elif m := _NAMED.match(text, i):
                arguments, i = _json_at(text, m.end())
                yield partial(_read_value, {"name": m[1], "arguments": arguments})
            else:
                raise _Unreadable(_MISTRAL_SHAPE)
        except _Unreadable as e:
            yield partial(ToolCall, "", {}, str(e))
            return
        i = text.find(TOOL_CALLS, i)


def _mistral_list(text: str, i: int) -> Iterator[Found]:
    """The calls of `[{...}, ...]` at text[i], one at a time; returns the index after it."""
    i = _SPACES.match(text, i + 1).end()
    if text.startswith("]", i):
        return i + 1
    while True:
        if not text.startswith("{", i):
            raise _Unreadable(_MISTRAL_SHAPE)
        value, i = _json_at(text, i)
        yield partial(_read_value, value)
        i = _SPACES.match(text, i).end()
        if text.startswith("]", i):
            return i + 1
        if not text.startswith(",", i):
            raise _Unreadable(_NOT_JSON)
        i = _SPACES.match(text, i + 1).end()


_READERS = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral}


# ---- one call's JSON, bounded

class _Unreadable(Exception):
    """A call that cannot be read; its message is the call's error."""


_TOO_LONG = f"call longer than {MAX_CALL_BYTES} bytes"
_NOT_JSON = "cannot read the call: not valid JSON"
_TOO_DEEP = f"cannot read the call: nested deeper than {MAX_CALL_DEPTH} levels"
_WINDOW = 256  # characters of the first window: most calls are shorter
_DECODER = json.JSONDecoder()


def _read_text(text: str, i: int, j: int) -> ToolCall:
    """The call whose JSON is text[i:j] (a Hermes block's body)."""
    try:
        return _read_value(_json(text[i:j]))
    except _Unreadable as e:
        return ToolCall("", {}, str(e))


def _read_value(value, keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """A call's decoded JSON, {"name": ..., keys[0] (or another of keys): arguments}."""
    try:
        check_tree(value, "call", max_depth=MAX_CALL_DEPTH)
    except ConfigError as e:
        return ToolCall("", {}, f"cannot read the call: {e}")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall("", {}, f'a call is {{"name": "...", "{keys[0]}": {{...}}}}')
    arguments = value.get(next((k for k in keys if k in value), keys[0]), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = _json(arguments)
            check_tree(arguments, "arguments", max_depth=MAX_CALL_DEPTH)
        except (_Unreadable, ConfigError):
            arguments = None
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], {}, "arguments must be a JSON object")
    return ToolCall(value["name"], arguments)


def _json(body: str):
    """The JSON value of a call's whole text (its nesting not yet checked)."""
    if _too_long(body):
        raise _Unreadable(_TOO_LONG)
    try:
        return json.loads(body)
    except RecursionError:
        raise _Unreadable(_TOO_DEEP) from None
    except ValueError:  # malformed, or a number too long to convert
        raise _Unreadable(_NOT_JSON) from None


def _json_at(text: str, i: int):
    """(the JSON object or array that starts at text[i], its nesting not yet checked; the
    index after it), decoded from a window of the text that grows fourfold while the value runs
    past it, up to MAX_CALL_BYTES characters and one: a value costs time in its own length,
    and a longer one is refused unread."""
    n = _WINDOW
    while True:
        window = text[i:i + n]
        try:
            value, end = _DECODER.raw_decode(window)
            break
        except json.JSONDecodeError as e:
            if i + n >= len(text) or not _cut(e, n):  # malformed where the text is whole
                raise _Unreadable(_NOT_JSON) from None
            if n > MAX_CALL_BYTES:
                raise _Unreadable(_TOO_LONG) from None
            n = min(4 * n, MAX_CALL_BYTES + 1)
        except RecursionError:
            raise _Unreadable(_TOO_DEEP) from None
        except ValueError:  # a number too long to convert
            raise _Unreadable(_NOT_JSON) from None
    if _too_long(window[:end]):
        raise _Unreadable(_TOO_LONG)
    return value, i + end


def _cut(e: json.JSONDecodeError, n: int) -> bool:
    """Whether decoding failed because a window of `n` characters cut the value off: inside a
    string, or within a literal's length (-Infinity) of its end."""
    return e.msg.startswith("Unterminated string") or e.pos >= n - 16


def _too_long(text: str) -> bool:
    return len(text) > MAX_CALL_BYTES or (
        len(text) > MAX_CALL_BYTES // 4 and
        len(text.encode("utf-8", "surrogatepass")) > MAX_CALL_BYTES)
