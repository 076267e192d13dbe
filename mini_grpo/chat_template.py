"""Chat templates, untrusted input (a model directory's or a checkpoint's): the one place a
template is compiled and run, in a sandbox bounded in time and size.

    template = ChatTemplate(text, where="model/chat_template.jinja")   # syntax errors here
    prompt = template.render(messages, add_generation_prompt=True, bos_token="<s>")

The environment is transformers' `apply_chat_template`'s (ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII), so a template renders as it renders there, within these bounds:
- time: RENDER_SECONDS, checked at every loop iteration, call, filter, test, operator and
  write; and what runs in C between two checks (hashing, comparing) bounded by the walk: no
  value the template builds (a tuple, list or dict, a call's, filter's or operator's result,
  what it sets, a macro's varargs) or compares is more than MAX_CHARS to walk, its shared
  parts counted each time they are reached;
- size: the characters written (at every level: macros and blocks too) and every string or
  list an operation builds are at most MAX_CHARS, and all an operation builds in one render
  at most BUILD_BUDGET; repetition (`'x' * n`), `**`, `%` and format widths, concatenation,
  join / replace / indent / tojson are estimated before they run, and numbers given to a
  function or filter (widths, counts) are at most MAX_CHARS;
- reach: the sandbox's (no underscore attributes, no mutation of lists and dicts), no loader
  (include / import / extends fail), and neither `lipsum`, `wordwrap`, `urlize` nor
  `str.translate`.
The bounds hook into jinja2 where its sandbox lets them (`call`, `call_binop`, `finalize`, the
filters) and, for loops, `~` and slices, which it compiles inline, by rewriting the parsed
template (`_Bounds`).
A failure of any kind (a syntax error, `raise_exception(...)`: the template refusing the
conversation, in its own words; an undefined value, recursion, a sandbox violation, a bound, an
empty result) is a ChatTemplateError: a ConfigError (exit 2) of one line naming the template's
file and line.
"""

from __future__ import annotations

import datetime
import json
import re
import threading
import time
import traceback
from functools import cache, wraps
from typing import Any

from .fields import ConfigError

MAX_CHARS = 1 << 20  # a prompt, and any one value, longer than a run here could use
BUILD_BUDGET = 4 * MAX_CHARS  # characters and list items all operations of a render build
MAX_INT_BITS = 1 << 13  # under Python's int-string limit (4300 digits): every number prints
RENDER_SECONDS = 5.0  # a real template renders in well under a millisecond per message
MAX_SOURCE_CHARS = 1 << 20  # the template's own text

_NAME = "<template>"  # the file name jinja gives the template's frames in a traceback


class ChatTemplateError(ConfigError):
    """A chat template that cannot be used, or refuses a conversation (one line: its file)."""


class _Bound(Exception):
    """A bound of this module, raised inside the template (its line is then known)."""


def template_text(value: Any, where: str) -> str | None:
    """The chat template as tokenizer_config.json holds it: a string, or named templates
    (a list of {"name", "template"}) of which the "default" one is used; None when it has none."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ChatTemplateError(f"{where}: chat_template must be a string or a list of "
                                f"{{\"name\", \"template\"}} objects, got {type(value).__name__}")
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or \
                not isinstance(entry.get("template"), str):
            raise ChatTemplateError(f"{where}: chat_template[{i}] must be an object with string "
                                    f"\"name\" and \"template\"")
    return next((e["template"] for e in value if e["name"] == "default"), None)


class ChatTemplate:
    """A template compiled in the bounded sandbox; `render` is the one way it runs."""

    def __init__(self, text: str, where: str):
        self.text, self.where = text, where
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}: the chat template must be a string, got "
                                    f"{type(text).__name__}")
        if len(text) > MAX_SOURCE_CHARS:
            raise ChatTemplateError(f"{where}: the chat template is longer than "
                                    f"{MAX_SOURCE_CHARS} characters")
        try:
            self.template = _environment().from_string(text)
        except Exception as e:  # a syntax error, or a template too deep to compile
            raise self._error(e) from None

    def render(self, messages: list[dict], seconds: float = RENDER_SECONDS, **variables) -> str:
        """The conversation as text; ChatTemplateError when the template fails, refuses it,
        runs out of time or size, or renders nothing."""
        _state.deadline, _state.seconds = time.monotonic() + seconds, seconds
        _state.written = _state.built = 0
        _state.sizes = {}
        try:
            text = self.template.render(messages=messages, **variables)
        except Exception as e:  # anything the template's code raised is the template's failure
            raise self._error(e) from None
        finally:
            _state.deadline = _state.sizes = None
        if not text:
            raise ChatTemplateError(f"{self.where}: the chat template renders an empty prompt "
                                    f"for this conversation")
        return text

    def _error(self, e: Exception) -> ChatTemplateError:
        from jinja2.exceptions import TemplateSyntaxError

        line = e.lineno if isinstance(e, TemplateSyntaxError) else _template_line(e)
        at = f"{self.where}" + (f", template line {line}" if line else "")
        if isinstance(e, _Refusal):  # raise_exception(message): in the template's own words
            return ChatTemplateError(f"{at}: the chat template refuses this conversation: "
                                     f"{_one_line(e.args[0] if e.args else '')}")
        if isinstance(e, _Bound):
            return ChatTemplateError(f"{at}: chat template: {e}")
        if isinstance(e, RecursionError):
            return ChatTemplateError(f"{at}: chat template: recursion too deep")
        what = getattr(e, "message", None) or str(e) or type(e).__name__
        return ChatTemplateError(f"{at}: chat template: {type(e).__name__}: {_one_line(what)}")


def _one_line(text: Any) -> str:
    try:
        text = str(text).strip()
    except Exception:  # a value whose text cannot be made
        text = type(text).__name__
    first = text.splitlines()[0] if text else ""
    return first[:300]


def _template_line(e: Exception) -> int | None:
    """The template's line where `e` was raised: jinja gives its frames the template's name."""
    line = None
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        if frame.f_code.co_filename == _NAME:
            line = lineno
    return line


# --- the bounds -------------------------------------------------------------------------------

_state = threading.local()  # this thread's render: its deadline, what it wrote and built


def _tick() -> None:
    deadline = getattr(_state, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _Bound(f"rendering took longer than {_state.seconds:g} s")


_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
_CONTAINERS = (list, tuple, set, frozenset, dict, *_VIEWS)


def _size(value: Any, limit: int = MAX_CHARS, indent: int = 0) -> int:
    """About how many characters `value` is as text (str(), repr(), JSON with `indent`): exact
    for a string, within a small factor for numbers and containers; counting stops past
    `limit`, so a value that shares its parts many times costs no more than `limit` steps.
    A container walked whole in this render is not walked again (`_state.sizes`), so a
    template that builds on what it built walks each part once."""
    from jinja2 import Undefined
    from jinja2.utils import Cycler, Namespace

    sizes = getattr(_state, "sizes", None) if not indent else None  # by id, while rendering
    total, stack, fixed = 0, [(value, 0)], True
    while stack and total <= limit:
        v, depth = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v) + (3 if depth else 0)
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        elif sizes and id(v) in sizes:
            total += sizes[id(v)][1]
        elif isinstance(v, (*_CONTAINERS, Namespace, Cycler)):
            if isinstance(v, Namespace):  # what its repr shows; `{% set ns.x %}` changes it
                v, fixed = v._Namespace__attrs, False
            elif isinstance(v, Cycler):  # cycler(a, b).items
                v = v.items
            items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else list(v)
            total += 2 + len(items) * (2 + indent * (depth + 1))
            stack.extend((x, depth + 1) for x in items)
        elif not isinstance(v, Undefined):  # a float, a macro, a loop: a short text
            total += 30
    if sizes is not None and fixed and not stack and isinstance(value, _CONTAINERS):
        sizes[id(value)] = (value, total)  # the value kept: its id is not reused meanwhile
    return total


def _check(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise _Bound(f"{what} would be over {MAX_CHARS} characters")


def _check_numbers(args: tuple, kwargs: dict) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_CHARS:
            raise _Bound(f"a number over {MAX_CHARS} given to a function or filter")


def _check_bits(bits: int, what: str) -> None:
    if bits > MAX_INT_BITS:
        raise _Bound(f"{what}: a number over {MAX_INT_BITS} bits")


def _repeat(seq: Any, n: Any) -> None:
    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
        _check(len(seq) * max(n, 0), "a repetition ('x' * n)")


def _formatted(fmt: str, values: list, field: str) -> None:
    """`fmt % values`, `fmt.format(*values)`: its text, the widths it writes (digits in it,
    numbers among the values) and each field at most the largest value."""
    _check_numbers(tuple(values), {})
    widths = sum(int(d) if len(d) < 8 else MAX_CHARS + 1 for d in re.findall(r"\d+", fmt))
    widths += sum(abs(v) for v in values if isinstance(v, int))
    biggest = max((_size(v) for v in values), default=0)
    _check(len(fmt) + widths + fmt.count(field) * biggest, "a formatted string")


def _percent(fmt: str, args: Any) -> None:
    values = list(args.values()) if isinstance(args, dict) else \
        list(args) if isinstance(args, tuple) else [args]
    _formatted(fmt, values, "%")


def _join(sep: str | bytes, items: list) -> None:
    _check(len(sep) * len(items) + sum(_size(x) for x in items), "a joined string")


def _replace(s: str | bytes, old: Any, new: Any, count: int = -1) -> None:
    n = (s.count(old) if old else len(s) + 1) if isinstance(old, type(s)) else 0
    if count >= 0:
        n = min(n, count)
    _check(len(s) + n * _size(new), "a replaced string")


def _str_method(obj: Any, args: tuple, kwargs: dict) -> tuple:
    """Estimates for the methods of strings (and bytes) that can build more than they are
    given; returns the arguments to call with (a generator given to join, materialised)."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if not isinstance(owner, (str, bytes)):
        return args
    if name == "translate":
        raise _Bound("str.translate is not available to chat templates")
    if name == "join" and args:
        args = (list(args[0]) if not isinstance(args[0], (str, bytes)) else args[0], *args[1:])
        _join(owner, list(args[0]))
    elif name == "replace" and len(args) >= 2:
        _replace(owner, *args[:2], *(c for c in args[2:3] if isinstance(c, int)))
    elif name == "expandtabs":
        width = (args or (kwargs.get("tabsize", 8),))[0]
        _check(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") *
               (width if isinstance(width, int) else 8), "an expanded string")
    elif name in ("format", "format_map"):
        values = [*args, *kwargs.values(),
                  *(v for a in args if isinstance(a, dict) for v in a.values())]
        _formatted(owner, values, "{")
    return args


def _result(value: Any, what: str, walk: bool = True) -> Any:
    """A value an operation built: at most MAX_CHARS long, a container at most MAX_CHARS to
    walk (`walk`: a slice walks no more than what it was cut from), and counted against the
    render's budget of everything built (many values each under the bound must not add up
    to gigabytes)."""
    if isinstance(value, (str, bytes, list, tuple)):
        _check(len(value), what)
        if getattr(_state, "deadline", None) is not None:
            _state.built += len(value)
            if _state.built > BUILD_BUDGET:
                raise _Bound(f"builds more than {BUILD_BUDGET} characters and items in all")
    elif isinstance(value, int):
        _check_bits(value.bit_length(), what)
    if walk:
        _walked(value, what)
    return value


def _walked(value: Any, what: str) -> Any:
    """A value the template builds: at most MAX_CHARS to walk, its shared parts counted each
    time they are reached. A tuple doubled 40 times is 40 small tuples, but hashing or
    comparing it walks 2^40 items in C, where no deadline is checked: so no value reaches
    the C code that hashes and compares (a dict's keys, `loop.changed`, `list.count`, the
    tests of `select`) bigger than the bound, whatever builds it."""
    _check(_size(value), what)
    return value


# filters that only look at their input's items (no text is made of it): input not size-checked
_STRUCTURAL = {"attr", "batch", "count", "d", "default", "dictsort", "first", "groupby",
               "items", "last", "length", "list", "map", "max", "min", "random", "reject",
               "rejectattr", "reverse", "select", "selectattr", "slice", "sort", "unique",
               "abs", "float", "int", "round", "safe"}


# filters and tests that compare their input's items (or their arguments) with each other: a
# value that shares its parts (a list doubled 60 times is 60 lists, but 2^60 items to compare)
# is counted as what comparing it walks (the template's input, messages and tools, may be
# compared as much as what it builds)
_COMPARING = {"dictsort", "groupby", "max", "min", "sort", "unique"}
_COMPARING_TESTS = {"eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=",
                    "gt", "greaterthan", ">", "ge", ">=", "in"}


def _compared(value: Any) -> Any:
    """A value an `==`, `<`, `in` ... or a sort compares: at most MAX_CHARS to walk."""
    _tick()
    _check(_size(value), "a value compared (==, <, in, sort, max ...)")
    return value


def _bounded_filter(name: str, f):
    @wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        _tick()
        i = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # a context first
        value, rest = (args[i] if len(args) > i else None), args[i + 1:]
        _check_numbers(rest, kwargs)
        if name == "join":  # its items, materialised (a generator is read once)
            items = list(value) if value is not None else []
            _join(str(rest[0] if rest else kwargs.get("d", "")), items)
            args = (*args[:i], items, *rest)
        elif name == "tojson":
            indent = kwargs.get("indent", rest[1] if len(rest) > 1 else None)
            width = indent if isinstance(indent, int) else len(str(indent or ""))
            _check(_size(value, indent=width), "a JSON text")
        elif name in _COMPARING:
            _compared(value)
        elif name not in _STRUCTURAL:
            _check(_size(value), f"the text given to the {name} filter")
        if name == "replace" and len(rest) >= 2:
            _replace(str(value), str(rest[0]), str(rest[1]),
                     *(c for c in rest[2:3] if isinstance(c, int)))
        elif name == "indent":
            width = (rest or (kwargs.get("width", 4),))[0]
            width = width if isinstance(width, int) else len(str(width))
            _check(_size(value) + (str(value).count("\n") + 1) * width, "an indented string")
        elif name == "format" and isinstance(value, str):
            _percent(value, tuple(rest) or kwargs)
        return _result(f(*args, **kwargs), f"the {name} filter's result")

    return bounded


def _bounded_test(name: str, f):
    """A test, `x is eq y` or one that select / reject / selectattr run on each item: each
    call ticks, and the values a comparing test compares are walked at most MAX_CHARS."""
    @wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        _tick()
        if name in _COMPARING_TESTS:
            i = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0
            for value in (*args[i:], *kwargs.values()):
                _compared(value)
        return f(*args, **kwargs)

    return bounded


def _loop(iterable: Any):
    """Every `{% for %}` iterates through this: a loop that writes nothing still ticks."""
    for item in iterable:
        _tick()
        yield item


def _concat(parts: list) -> str:
    """`a ~ b ~ c`, estimated before it is built."""
    _tick()
    _check(sum(_size(p) for p in parts), "a concatenation (~)")
    return _result("".join(str(p) for p in parts), "a concatenation (~)")


class _Refusal(Exception):
    """raise_exception(message): the template refuses the conversation."""


@cache
def _environment():
    """The sandbox, built once: transformers' environment with the bounds above."""
    from jinja2 import nodes, pass_context
    from jinja2.runtime import Macro
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    def filtered(expr, name: str, lineno: int | None = None):  # `expr | name`: a bound
        return nodes.Filter(expr, name, [], [], None, None, lineno=lineno or expr.lineno)

    class _Bounds(NodeTransformer):
        """Rewrites a parsed template: every loop ticks, `~` is estimated before it runs,
        slices are counted, literal text is counted as it is written (through `finalize`),
        the tuples, lists and dicts it writes and the values it sets are walked (_walked)."""

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = filtered(node.iter, "_loop", node.lineno)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            return filtered(nodes.List(node.nodes, lineno=node.lineno), "_concat")

        def visit_Getitem(self, node):  # a slice copies, outside the sandbox's getitem
            self.generic_visit(node)
            return filtered(node, "_sliced") if isinstance(node.arg, nodes.Slice) else node

        def visit_TemplateData(self, node):
            return nodes.Const(node.data, lineno=node.lineno)

        def visit_Compare(self, node):  # ==, <, in ...: each side walked at most MAX_CHARS
            self.generic_visit(node)
            node.expr = filtered(node.expr, "_compared")
            for operand in node.ops:
                operand.expr = filtered(operand.expr, "_compared")
            return node

        def visit_Tuple(self, node):  # `(a, a)`, but not the names of `{% set a, b = ... %}`
            self.generic_visit(node)
            return filtered(node, "_built") if node.ctx == "load" else node

        def visit_List(self, node):
            self.generic_visit(node)
            return filtered(node, "_built")

        visit_Dict = visit_List

        def visit_Assign(self, node):  # `{% set x = ... %}`, `{% set ns.x = ... %}`
            self.generic_visit(node)
            node.node = filtered(node.node, "_set")
            return node

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%", "+"])

        def _parse(self, source, name, filename):
            tree = _Bounds().visit(super()._parse(source, name, filename))
            tree.set_environment(self)
            return tree

        def call_binop(self, context, operator, left, right):
            _tick()
            if operator == "*":
                _repeat(left, right)
                _repeat(right, left)
                if isinstance(left, int) and isinstance(right, int):
                    _check_bits(left.bit_length() + right.bit_length(), "a product")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                    right > 0 and abs(left) > 1:
                _check_bits(left.bit_length() * right, "a power")
            elif operator == "%" and isinstance(left, str):
                _percent(left, right)
            return _result(super().call_binop(context, operator, left, right),
                           f"the result of {operator}")

        def call(__self, __context, __obj, *args, **kwargs):
            _tick()
            _check_numbers(args, {k: v for k, v in kwargs.items() if not k.startswith("_")})
            if isinstance(__obj, Macro) and (__obj.catch_varargs or __obj.catch_kwargs):
                _walked((args, kwargs), "a macro's arguments")  # its varargs, its kwargs
            args = _str_method(__obj, args, kwargs)
            return _result(super().call(__context, __obj, *args, **kwargs), "a call's result")

    @pass_context
    def finalize(context, value):
        _tick()
        if getattr(_state, "deadline", None) is not None:
            _state.written += _size(value, MAX_CHARS - _state.written)
            if _state.written > MAX_CHARS:
                raise _Bound(f"writes more than {MAX_CHARS} characters")
        return value

    def raise_exception(message):
        raise _Refusal(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, finalize=finalize,
                  extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    for name in ("wordwrap", "urlize"):  # slow on long text, and of no use to a chat template
        del env.filters[name]
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.tests = {name: _bounded_test(name, f) for name, f in env.tests.items()}
    env.filters["_loop"] = pass_context(lambda context, it: _loop(it))  # never folded early
    env.filters["_concat"] = _concat
    env.filters["_sliced"] = lambda value: _result(value, "a slice", walk=False)
    env.filters["_built"] = lambda value: _result(value, "a tuple, list or dict")
    env.filters["_set"] = lambda value: _walked(value, "a value set ({% set %})")
    env.filters["_compared"] = pass_context(lambda context, value: _compared(value))
    del env.globals["lipsum"]
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env

