"""Countdown rewards: countdown_format and countdown_correct (tasks/countdown.py).

Both read the row's numbers, target and answer tag from its meta (`numbers`, `target`,
`answer_tag`, default "answer"), never from the prompt, so they score either prompt style and
JSONL rows alike. An answer block is `<TAG>...</TAG>` (the shortest match, so blocks never
overlap).

countdown_format
    1.0  exactly one answer block, with non-blank content
    0.5  answer blocks, but several of them or a blank one (the tags are learnt, not the form)
    0.0  no complete answer block
countdown_correct
    1.0 when the expression in the LAST answer block reaches the target, else 0.0. It is parsed
    by a recursive-descent parser, never by eval: integer literals, + - * / and parentheses,
    with whitespace anywhere between them. Anything else (names, dots, `**`, unary minus,
    commas, ...) is 0 before a number is computed. Each literal must be written as one of the
    given numbers (no leading zeros) and used at most as often as it is given; numbers may go
    unused. Arithmetic is exact (fractions.Fraction), so intermediate fractions are fine
    (`7/2*4` is 14); division by zero is 0. One trailing `= N` is accepted when N is the
    target (`(50-25)*7+3 = 178`): models often write the equation out. Caps: MAX_EXPR_CHARS
    characters an answer, MAX_DEPTH levels of parentheses, MAX_LITERAL_DIGITS digits a literal.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

from mini_grpo.rewards.registry import register

DEFAULT_TAG = "answer"
MAX_EXPR_CHARS = 200
MAX_DEPTH = 16  # nested parentheses
MAX_LITERAL_DIGITS = 9
_STATED = re.compile(rf"-?[0-9]{{1,{MAX_LITERAL_DIGITS}}}")


class _Reject(Exception):
    """The expression is outside the grammar or the caps."""


def answer_blocks(completion: str, tag: str = DEFAULT_TAG) -> list[str]:
    """The contents of the completion's `<tag>...</tag>` blocks, in order: each opening tag
    with the nearest closing one after it (as `<tag>(.*?)</tag>` finds them), in linear time
    (that regex rescans the rest of the text from every unclosed opening tag)."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    out, i = [], 0
    while (start := completion.find(opening, i)) >= 0:
        end = completion.find(closing, start + len(opening))
        if end < 0:  # no closing tag after this one: none after a later one either
            break
        out.append(completion[start + len(opening):end])
        i = end + len(closing)
    return out


def _tokens(expr: str) -> list[str]:
    out, i = [], 0
    while i < len(expr):
        c = expr[i]
        if c.isspace():
            i += 1
        elif c in "+-*/()":
            out.append(c)
            i += 1
        elif "0" <= c <= "9":
            j = i
            while j < len(expr) and "0" <= expr[j] <= "9":
                j += 1
            if j - i > MAX_LITERAL_DIGITS or (expr[i] == "0" and j - i > 1):
                raise _Reject
            out.append(expr[i:j])
            i = j
        else:
            raise _Reject
    return out


def parse(expr: str):
    """The expression's tree: a literal's text, or (op, left, right); _Reject when outside
    the grammar  expr := term (('+'|'-') term)*   term := factor (('*'|'/') factor)*
    factor := INT | '(' expr ')'."""
    if len(expr) > MAX_EXPR_CHARS:
        raise _Reject
    toks = _tokens(expr)
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def binary(ops, operand, depth):
        nonlocal pos
        node = operand(depth)
        while peek() in ops:
            op = toks[pos]
            pos += 1
            node = (op, node, operand(depth))
        return node

    def expression(depth):
        return binary(("+", "-"), term, depth)

    def term(depth):
        return binary(("*", "/"), factor, depth)

    def factor(depth):
        nonlocal pos
        tok = peek()
        if tok is None:
            raise _Reject
        pos += 1
        if tok.isdigit():
            return tok
        if tok != "(" or depth >= MAX_DEPTH:
            raise _Reject
        node = expression(depth + 1)
        if peek() != ")":
            raise _Reject
        pos += 1
        return node

    tree = expression(0)
    if pos != len(toks):
        raise _Reject
    return tree


def _literals(tree) -> list[int]:
    if isinstance(tree, str):
        return [int(tree)]
    return _literals(tree[1]) + _literals(tree[2])


def _value(tree) -> Fraction:
    if isinstance(tree, str):
        return Fraction(int(tree))
    op, a, b = tree[0], _value(tree[1]), _value(tree[2])
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        raise _Reject
    return a / b


def evaluate(expr: str, numbers: list[int]) -> Fraction | None:
    """The exact value of `expr` over the given numbers, or None when it breaks a rule."""
    try:
        tree = parse(expr)
        if Counter(_literals(tree)) - Counter(numbers):  # a literal not given, or used too often
            return None
        return _value(tree)
    except _Reject:
        return None


def is_solution(answer: str, numbers: list[int], target: int) -> bool:
    """True when `answer` (an expression, maybe with a trailing `= target`) reaches target."""
    if len(answer) > MAX_EXPR_CHARS:
        return False
    expr, eq, stated = answer.partition("=")
    if eq:
        stated = stated.strip()
        if not _STATED.fullmatch(stated) or int(stated) != target:
            return False
    return evaluate(expr, numbers) == target


def _fields(meta: dict) -> tuple[list[int], int, str]:
    return list(meta["numbers"]), int(meta["target"]), meta.get("answer_tag") or DEFAULT_TAG


@register("countdown_format")
def countdown_format(prompts, completions, targets, metas):
    """1.0 for exactly one non-blank answer block, 0.5 for several or a blank one, else 0."""
    out = []
    for c, m in zip(completions, metas):
        blocks = answer_blocks(c, m.get("answer_tag") or DEFAULT_TAG)
        out.append(1.0 if len(blocks) == 1 and blocks[0].strip() else 0.5 if blocks else 0.0)
    return out


@register("countdown_correct")
def countdown_correct(prompts, completions, targets, metas):
    """1.0 when the last answer block's expression reaches meta's target, else 0.0."""
    out = []
    for c, m in zip(completions, metas):
        numbers, target, tag = _fields(m)
        blocks = answer_blocks(c, tag)
        out.append(float(bool(blocks) and is_solution(blocks[-1], numbers, target)))
    return out
