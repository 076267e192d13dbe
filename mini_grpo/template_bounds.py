"""The bounds a chat template renders under (chat_template.py's sandbox calls into these):
the time, checked at every loop iteration, call, filter, test, operator and write; and the size
of what a render writes and builds, estimated before it is built where it would be built in C.
A render runs between `start(seconds)` and `stop()`, one at a time in each thread; a bound
reached raises `Bound`, inside the template, so its line is known.
"""

from __future__ import annotations

import re
import threading
import time
from functools import wraps
from typing import Any

MAX_CHARS = 1 << 20  # a prompt, and any one value, longer than a run here could use
BUILD_BUDGET = 4 * MAX_CHARS  # characters and list items all operations of a render build
MAX_INT_BITS = 1 << 13  # under Python's int-string limit (4300 digits): every number prints


class Bound(Exception):
    """A bound of this module, raised inside the template (its line is then known)."""


_state = threading.local()  # this thread's render: its deadline, what it wrote and built


def start(seconds: float) -> None:
    """A render starts: its deadline, and nothing written or built yet."""
    _state.deadline, _state.seconds = time.monotonic() + seconds, seconds
    _state.written = _state.built = 0
    _state.sizes = {}


def stop() -> None:
    _state.deadline = _state.sizes = None


def wrote(value: Any) -> None:
    """The render writes `value` (jinja's finalize): all it writes is at most MAX_CHARS."""
    tick()
    if getattr(_state, "deadline", None) is not None:
        _state.written += size(value, MAX_CHARS - _state.written)
        if _state.written > MAX_CHARS:
            raise Bound(f"writes more than {MAX_CHARS} characters")


def tick() -> None:
    deadline = getattr(_state, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise Bound(f"rendering took longer than {_state.seconds:g} s")


_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
_CONTAINERS = (list, tuple, set, frozenset, dict, *_VIEWS)


def size(value: Any, limit: int = MAX_CHARS, indent: int = 0) -> int:
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


def check(chars: int, what: str) -> None:
    if chars > MAX_CHARS:
        raise Bound(f"{what} would be over {MAX_CHARS} characters")


def check_numbers(args: tuple, kwargs: dict) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_CHARS:
            raise Bound(f"a number over {MAX_CHARS} given to a function or filter")


def check_bits(bits: int, what: str) -> None:
    if bits > MAX_INT_BITS:
        raise Bound(f"{what}: a number over {MAX_INT_BITS} bits")


def repeat(seq: Any, n: Any) -> None:
    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
        check(len(seq) * max(n, 0), "a repetition ('x' * n)")


def _formatted(fmt: str, values: list, field: str) -> None:
    """`fmt % values`, `fmt.format(*values)`: its text, the widths it writes (digits in it,
    numbers among the values) and each field at most the largest value."""
    check_numbers(tuple(values), {})
    widths = sum(int(d) if len(d) < 8 else MAX_CHARS + 1 for d in re.findall(r"\d+", fmt))
    widths += sum(abs(v) for v in values if isinstance(v, int))
    biggest = max((size(v) for v in values), default=0)
    check(len(fmt) + widths + fmt.count(field) * biggest, "a formatted string")


def percent(fmt: str, args: Any) -> None:
    values = list(args.values()) if isinstance(args, dict) else \
        list(args) if isinstance(args, tuple) else [args]
    _formatted(fmt, values, "%")


def _join(sep: str | bytes, items: list) -> None:
    check(len(sep) * len(items) + sum(size(x) for x in items), "a joined string")


def _replace(s: str | bytes, old: Any, new: Any, count: int = -1) -> None:
    n = (s.count(old) if old else len(s) + 1) if isinstance(old, type(s)) else 0
    if count >= 0:
        n = min(n, count)
    check(len(s) + n * size(new), "a replaced string")


def str_method(obj: Any, args: tuple, kwargs: dict) -> tuple:
    """Estimates for the methods of strings (and bytes) that can build more than they are
    given; returns the arguments to call with (a generator given to join, materialised)."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if not isinstance(owner, (str, bytes)):
        return args
    if name == "translate":
        raise Bound("str.translate is not available to chat templates")
    if name == "join" and args:
        args = (list(args[0]) if not isinstance(args[0], (str, bytes)) else args[0], *args[1:])
        _join(owner, list(args[0]))
    elif name == "replace" and len(args) >= 2:
        _replace(owner, *args[:2], *(c for c in args[2:3] if isinstance(c, int)))
    elif name == "expandtabs":
        width = (args or (kwargs.get("tabsize", 8),))[0]
        check(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") *
               (width if isinstance(width, int) else 8), "an expanded string")
    elif name in ("format", "format_map"):
        values = [*args, *kwargs.values(),
                  *(v for a in args if isinstance(a, dict) for v in a.values())]
        _formatted(owner, values, "{")
    return args


def result(value: Any, what: str, walk: bool = True) -> Any:
    """A value an operation built: at most MAX_CHARS long, a container at most MAX_CHARS to
    walk (`walk`: a slice walks no more than what it was cut from), and counted against the
    render's budget of everything built (many values each under the bound must not add up
    to gigabytes)."""
    if isinstance(value, (str, bytes, list, tuple)):
        check(len(value), what)
        if getattr(_state, "deadline", None) is not None:
            _state.built += len(value)
            if _state.built > BUILD_BUDGET:
                raise Bound(f"builds more than {BUILD_BUDGET} characters and items in all")
    elif isinstance(value, int):
        check_bits(value.bit_length(), what)
    if walk:
        walked(value, what)
    return value


def walked(value: Any, what: str) -> Any:
    """A value the template builds: at most MAX_CHARS to walk, its shared parts counted each
    time they are reached. A tuple doubled 40 times is 40 small tuples, but hashing or
    comparing it walks 2^40 items in C, where no deadline is checked: so no value reaches
    the C code that hashes and compares (a dict's keys, `loop.changed`, `list.count`, the
    tests of `select`) bigger than the bound, whatever builds it."""
    check(size(value), what)
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


def compared(value: Any) -> Any:
    """A value an `==`, `<`, `in` ... or a sort compares: at most MAX_CHARS to walk."""
    tick()
    check(size(value), "a value compared (==, <, in, sort, max ...)")
    return value


def bounded_filter(name: str, f):
    @wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        tick()
        i = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # a context first
        value, rest = (args[i] if len(args) > i else None), args[i + 1:]
        check_numbers(rest, kwargs)
        if name == "join":  # its items, materialised (a generator is read once)
            items = list(value) if value is not None else []
            _join(str(rest[0] if rest else kwargs.get("d", "")), items)
            args = (*args[:i], items, *rest)
        elif name == "tojson":
            indent = kwargs.get("indent", rest[1] if len(rest) > 1 else None)
            width = indent if isinstance(indent, int) else len(str(indent or ""))
            check(size(value, indent=width), "a JSON text")
        elif name in _COMPARING:
            compared(value)
        elif name not in _STRUCTURAL:
            check(size(value), f"the text given to the {name} filter")
        if name == "replace" and len(rest) >= 2:
            _replace(str(value), str(rest[0]), str(rest[1]),
                     *(c for c in rest[2:3] if isinstance(c, int)))
        elif name == "indent":
            width = (rest or (kwargs.get("width", 4),))[0]
            width = width if isinstance(width, int) else len(str(width))
            check(size(value) + (str(value).count("\n") + 1) * width, "an indented string")
        elif name == "format" and isinstance(value, str):
            percent(value, tuple(rest) or kwargs)
        return result(f(*args, **kwargs), f"the {name} filter's result")

    return bounded


def bounded_test(name: str, f):
    """A test, `x is eq y` or one that select / reject / selectattr run on each item: each
    call ticks, and the values a comparing test compares are walked at most MAX_CHARS."""
    @wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        tick()
        if name in _COMPARING_TESTS:
            i = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0
            for value in (*args[i:], *kwargs.values()):
                compared(value)
        return f(*args, **kwargs)

    return bounded


def loop(iterable: Any):
    """Every `{% for %}` iterates through this: a loop that writes nothing still ticks."""
    for item in iterable:
        tick()
        yield item


def concat(parts: list) -> str:
    """`a ~ b ~ c`, estimated before it is built."""
    tick()
    check(sum(size(p) for p in parts), "a concatenation (~)")
    return result("".join(str(p) for p in parts), "a concatenation (~)")
