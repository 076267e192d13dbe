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
template (`_Bounds`). The bounds themselves are template_bounds.py's.
A failure of any kind (a syntax error, `raise_exception(...)`: the template refusing the
conversation, in its own words; an undefined value, recursion, a sandbox violation, a bound, an
empty result) is a ChatTemplateError: a ConfigError (exit 2) of one line naming the template's
file and line.
"""

from __future__ import annotations

import datetime
import json
import traceback
from functools import cache
from typing import Any

from . import template_bounds as bounds
from .fields import ConfigError

RENDER_SECONDS = 5.0  # a real template renders in well under a millisecond per message
MAX_SOURCE_CHARS = 1 << 20  # the template's own text

_NAME = "<template>"  # the file name jinja gives the template's frames in a traceback


class ChatTemplateError(ConfigError):
    """A chat template that cannot be used, or refuses a conversation (one line: its file)."""


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
        bounds.start(seconds)
        try:
            text = self.template.render(messages=messages, **variables)
        except Exception as e:  # anything the template's code raised is the template's failure
            raise self._error(e) from None
        finally:
            bounds.stop()
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
        if isinstance(e, bounds.Bound):
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


class _Refusal(Exception):
    """raise_exception(message): the template refuses the conversation."""


def _bounds_class():
    """The jinja2 NodeTransformer class that rewrites a parsed template (_Bounds)."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def filtered(expr, name: str, lineno: int | None = None):  # `expr | name`: a bound
        return nodes.Filter(expr, name, [], [], None, None, lineno=lineno or expr.lineno)

    class _Bounds(NodeTransformer):
        """Rewrites a parsed template: every loop ticks, `~` is estimated before it runs,
        slices are counted, literal text is counted as it is written (through `finalize`),
        the tuples, lists and dicts it writes and the values it sets are walked (bounds.walked)."""

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

    return _Bounds


def _sandbox_class():
    """transformers' sandbox (jinja2's ImmutableSandboxedEnvironment) with its templates
    rewritten by _bounds_class and every operator and call counted and bounded."""
    from jinja2.runtime import Macro
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    bounds_pass = _bounds_class()

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%", "+"])

        def _parse(self, source, name, filename):
            tree = bounds_pass().visit(super()._parse(source, name, filename))
            tree.set_environment(self)
            return tree

        def call_binop(self, context, operator, left, right):
            bounds.tick()
            if operator == "*":
                bounds.repeat(left, right)
                bounds.repeat(right, left)
                if isinstance(left, int) and isinstance(right, int):
                    bounds.check_bits(left.bit_length() + right.bit_length(), "a product")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                    right > 0 and abs(left) > 1:
                bounds.check_bits(left.bit_length() * right, "a power")
            elif operator == "%" and isinstance(left, str):
                bounds.percent(left, right)
            return bounds.result(super().call_binop(context, operator, left, right),
                           f"the result of {operator}")

        def call(__self, __context, __obj, *args, **kwargs):
            bounds.tick()
            bounds.check_numbers(args, {k: v for k, v in kwargs.items() if not k.startswith("_")})
            if isinstance(__obj, Macro) and (__obj.catch_varargs or __obj.catch_kwargs):
                bounds.walked((args, kwargs), "a macro's arguments")  # its varargs, its kwargs
            args = bounds.str_method(__obj, args, kwargs)
            return bounds.result(super().call(__context, __obj, *args, **kwargs), "a call's result")

    return Bounded


@cache
def _environment():
    """The sandbox, built once: transformers' environment with the bounds above."""
    from jinja2 import pass_context

    Bounded = _sandbox_class()

    @pass_context
    def finalize(context, value):
        bounds.wrote(value)
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
    env.filters = {name: bounds.bounded_filter(name, f) for name, f in env.filters.items()}
    env.tests = {name: bounds.bounded_test(name, f) for name, f in env.tests.items()}
    env.filters["_loop"] = pass_context(lambda context, it: bounds.loop(it))  # never folded early
    env.filters["_concat"] = bounds.concat
    env.filters["_sliced"] = lambda value: bounds.result(value, "a slice", walk=False)
    env.filters["_built"] = lambda value: bounds.result(value, "a tuple, list or dict")
    env.filters["_set"] = lambda value: bounds.walked(value, "a value set ({% set %})")
    env.filters["_compared"] = pass_context(lambda context, value: bounds.compared(value))
    del env.globals["lipsum"]
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env

