"""Rewards for math answers (GSM8K / MATH style rows): math_answer and answer_format.

A row's target is the reference answer, bare ("72", "\\frac{3}{4}") or a whole solution that
ends in "#### 72" (GSM8K) or "\\boxed{...}" (MATH). The answer of a text is, first match wins:

  1. the content of the last `\\boxed{...}` or `\\fbox{...}` whose braces balance
     (escaped `\\{ \\}` do not count; a truncated last box falls back to the one before it)
  2. the rest of the line after the last `####`
  3. the content of the last complete `<answer>...</answer>` block
  4. the last number in the text (`72`, `-1,234.5`, `3/4`, `\\frac{3}{4}`) for a completion;
     the whole stripped text for a target.

`math_answer` is 1.0 when the two answers are equal, else 0.0. Both sides are read as numbers
when they can be: an optional sign (`-`, `+`, unicode minus), `$` or `\\$`, an integer with
optional thousands commas, a decimal, `a/b`, `\\frac{a}{b}` (`\\dfrac`, `\\tfrac`, `\\frac12`,
a sign inside or outside), a mixed number (`2 1/2`, `2\\frac{1}{2}`), then an optional `%` and
trailing unit words ("72 dollars", "5 \\text{cm}"); a leading `x =` is dropped. A percent sign
is ignored, so 50% == 50 != 0.5: GSM8K asks "what percent ..." and answers 50. Two numbers are
equal when their exact fractions are, or, when either is written as a decimal, when they are
within 1e-6 relative and one rounds to the other at the other's written precision (0.5 == 1/2
exactly, 0.333333 == 1/3 by tolerance, 0.33 != 1/3; 18.0000001 != 18, which is exact, where a
decimal's digits claimed more than they held). An exponent (1e5, 2.5E-3; at most 3 digits) is
part of the number; numbers over 100 characters are not read as numbers.

When either side is not a number, the two are compared as strings after normalising: `$`,
whitespace, `\\left`/`\\right`, `\\!` `\\,` `\\;` `\\:`, `\\displaystyle`, degree marks and a
trailing `.` are dropped, `\\text{}` `\\mathrm{}` `\\textbf{}` `\\mbox{}` wrappers unwrapped,
`\\dfrac`/`\\tfrac` read as `\\frac`, case ignored ("\\text{Yes}" == "yes"). An empty answer
never matches.

`answer_format` is 1.0 when the completion marks a non-empty final answer by rule 1, 2 or 3
(a bare last number does not count), else 0.0; it rewards the form, not correctness.

Both never raise on a completion (a row that would scores 0.0) and read only the last 10,000
characters of a text, with linear-time regexes. `math_answer` returns None (row not scored)
for a target with no answer: that is a data problem.

HuggingFace's `math-verify` (sympy) is deliberately not used: its timeouts are SIGALRM-based,
so it raises in the scorer's helper threads, and without them one answer such as
`\\boxed{9^{9^{9^{9}}}}` holds the GIL for good; it is also ~30x slower. It would add symbolic
equivalence (`2\\sqrt{3}` == `\\sqrt{12}`, `x^2+1` == `1+x^2`), which this module does not do.
"""

from __future__ import annotations

import re
from fractions import Fraction

from mini_grpo.rewards.registry import register
from mini_grpo.rewards.text import sampled_lengths

MAX_CHARS = 10_000  # only the tail of a text is read: the final answer is at the end
MAX_NUMBER_CHARS = 100  # longer "numbers" compare as strings (and never reach int())

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_RE = re.compile(r"(?<!\\)[{}]")
_N = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"  # 1,234.5 / 1234 / .5
_LAST_NUMBER_RE = re.compile(
    rf"(?:(?<![\w)\]}}])[-\u2212])?"  # a minus that is no subtraction: "-3", not "5-3"
    rf"(?:\\[dt]?frac\{{\s*-?(?:{_N})\s*\}}\{{\s*-?(?:{_N})\s*\}}|\\[dt]?frac\d\d"
    rf"|(?:{_N})(?:[eE][-+]?\d+)?(?:\s*/\s*(?:{_N}))?)")  # 1e3 whole: its last number was 3
_NUMBER_RES = [  # full matches, after sign, `$`, `%` and units are gone
    re.compile(rf"(?P<a>{_N})(?:[eE](?P<e>[-+]?\d{{1,3}}))?"),
    re.compile(rf"(?:(?P<w>\d+)\s+)?(?P<a>{_N})\s*/\s*(?P<b>{_N})"),
    re.compile(rf"(?:(?P<w>\d+)\s*)?\\frac\s*\{{\s*(?P<sa>-?)\s*(?P<a>{_N})\s*\}}"
               rf"\s*\{{\s*(?P<sb>-?)\s*(?P<b>{_N})\s*\}}"),
    re.compile(r"(?:(?P<w>\d+)\s*)?\\frac(?P<a>\d)(?P<b>\d)"),
]
_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_VAR_PREFIX_RE = re.compile(r"[A-Za-z](?:_\w+)?\s*=")
_DROP = ["\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "^{\\circ}",
         "^\\circ", "\u00b0", "\\$", "$"]
_REPLACE = [("\u2212", "-"), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("{,}", ","),
            ("\\%", "%"), ("\\ ", " ")]
_UNIT_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ."
# a word of scale right after the number multiplies it ("3.5 thousand" is 3500); stripped as
# a unit, "85 thousand" had been 85
_SCALES = {"hundred": 100, "thousand": 10**3, "million": 10**6, "billion": 10**9,
           "trillion": 10**12}
_SCALE_RE = re.compile(r"\s+(" + "|".join(_SCALES) + r")\b", re.IGNORECASE)
_TOLERANCE = Fraction(1, 10**6)


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} whose braces balance, else None."""
    opens = [m.end() - 1 for m in _BOX_RE.finditer(text)]
    if not opens:
        return None
    close_of, stack = {}, []
    for m in _BRACE_RE.finditer(text, opens[0]):  # one pass matches every brace
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            close_of[stack.pop()] = m.start()
    for i in reversed(opens):
        if i in close_of:
            return text[i + 1:close_of[i]]
    return None


def marked_answer(text: str) -> str | None:
    """The answer a text marks by \\boxed{}, `####` or <answer> (rules 1-3), else None."""
    return _marked(text)[1]


def _marked(text: str) -> tuple[str | None, str | None]:
    """(which mark: "boxed", "####" or "tags"; the answer it marks), or (None, None)."""
    text = text[-MAX_CHARS:]
    boxed = _last_boxed(text)
    if boxed is not None:
        return "boxed", boxed.strip()
    i = text.rfind("####")
    if i >= 0:
        return "####", text[i + 4:].strip().split("\n", 1)[0].strip()
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    if start >= 0:
        return "tags", text[start + len("<answer>"):end].strip()
    return None, None


def extract_answer(text: str, *, is_target: bool = False) -> str:
    """The answer of a completion (rules 1-4, "" when none) or of a target (1-3, else all)."""
    marked = marked_answer(text)
    if marked is not None:
        return marked
    if is_target:
        return text.strip()
    numbers = _LAST_NUMBER_RE.findall(text[-MAX_CHARS:])  # no groups: whole matches
    return numbers[-1] if numbers else ""


def _normalise(s: str) -> str:
    for old, new in _REPLACE:
        s = s.replace(old, new)
    s = _WRAPPER_RE.sub(r"\1", _WRAPPER_RE.sub(r"\1", s))  # twice: \text{\textbf{x}}
    for old in _DROP:
        s = s.replace(old, "")
    return s.strip().rstrip(".").strip()


def _strip_units(s: str) -> str:
    """'72 dollars' -> '72'; a single letter must follow a space, so '3x' stays."""
    stem = s.rstrip(_UNIT_CHARS)
    tail = s[len(stem):]
    if stem and (tail[:1] == " " or len(tail.strip(" .")) >= 2):
        return stem
    return s


def to_number(s: str) -> tuple[Fraction, Fraction | None] | None:
    """(exact value, half a unit of its last written digit where it is written as a decimal,
    else None) of a normalised answer, or None if not a number: "3.25" -> (13/4, 1/200),
    "1.5e3" -> (1500, 50), "7/2" -> (7/2, None)."""
    if len(s) > MAX_NUMBER_CHARS:
        return None
    s = s.rsplit("=", 1)[1].strip() if _VAR_PREFIX_RE.match(s) else s
    scale = 1
    m = _SCALE_RE.search(s)  # after a number, before units alone: "85 thousand dollars"
    if m and not s[:m.start()].rstrip(" .")[-1:].isalpha() and \
            s[m.end():].strip(_UNIT_CHARS) == "":
        s, scale = s[:m.start()], _SCALES[m[1].lower()]
    s = _strip_units(s).rstrip(" %")
    s = _strip_units(s).strip()  # "50% of them" / "50 percent"
    sign = 1
    if s and s[0] in "+-":
        sign, s = (-1 if s[0] == "-" else 1), s[1:].lstrip()
    for pattern in _NUMBER_RES:
        m = pattern.fullmatch(s)
        if m is None:
            continue
        d = m.groupdict()
        a = Fraction(d["a"].replace(",", ""))
        exponent = int(d.get("e") or 0)
        if d.get("b") is not None:
            b = Fraction(d["b"].replace(",", ""))
            if b == 0:
                return None
            a = a / b * (-1 if d.get("sa") else 1) * (-1 if d.get("sb") else 1)
        if d.get("w"):
            a = int(d["w"]) + a if a >= 0 else -int(d["w"]) + a
        half_unit = None
        if "." in s or d.get("e"):
            places = len(d["a"].partition(".")[2]) - exponent
            half_unit = Fraction(1, 2) * Fraction(10) ** -places * scale
        return sign * a * Fraction(10) ** exponent * scale, half_unit
    return None


def numbers_agree(answer: tuple[Fraction, Fraction | None],
                  target: tuple[Fraction, Fraction | None], rel_tol: float | Fraction) -> bool:
    """Whether an answer's number (to_number's) is the target's: equal, or within `rel_tol`
    of the larger and within the precision either writes: the answer is the target rounded
    at the answer's last digit (an integer answer: to a whole number), or the target is a
    decimal and the answer rounds to it. So 3.333 is 10/3 and 94 is 93.98, but 162100.0 is
    not 162213: a decimal's digits claim no more than they hold, and an integer or fraction
    target is exact."""
    (a, a_half), (t, t_half) = answer, target
    if a == t:
        return True
    if a_half is None and t_half is None:
        return False  # exact both: no slack
    if a_half is None:
        a_half = Fraction(1, 2) if a.denominator == 1 else Fraction(0)
    slack = max(a_half, t_half or Fraction(0))
    return abs(a - t) <= min(slack, Fraction(rel_tol) * max(abs(a), abs(t)))


def answers_equal(answer: str, reference: str) -> bool:
    """Whether an extracted answer equals the reference: as numbers if both are, else text."""
    a, r = _normalise(answer), _normalise(reference)
    if not a or not r:
        return False
    x, y = to_number(a), to_number(r)
    if x is not None and y is not None:
        return numbers_agree(x, y, _TOLERANCE)
    return "".join(a.split()).casefold() == "".join(r.split()).casefold()


def _math_answer_row(completion: str, target: str) -> float | None:
    try:
        reference = extract_answer(target, is_target=True)
    except Exception:
        return None
    if not _normalise(reference):
        return None
    try:
        return float(answers_equal(extract_answer(completion), reference))
    except Exception:  # a completion can be anything: it scores 0, the trainer goes on
        return 0.0


@register("math_answer")
def math_answer(prompts, completions, targets, metas):
    """1.0 when the completion's final answer equals the target's (see the module docstring)."""
    return [_math_answer_row(c, t) for c, t in zip(completions, targets)]


def _answer_format_row(completion: str) -> float:
    try:
        return float(bool(marked_answer(completion)))
    except Exception:
        return 0.0


@register("answer_format")
def answer_format(prompts, completions, targets, metas):
    """1.0 when the completion marks a final answer (\\boxed{}, `####` or <answer>), else 0.0."""
    return [_answer_format_row(c) for c in completions]


# numeric answers (tasks/numeric.py): a number against a number, within a relative tolerance

REL_TOL = 1e-3  # where either side is a decimal: 3.333 for 10/3 counts, 3.3 does not
# (numbers_agree: and within the precision the decimal is written to)


def _numeric_row(completion: str, target: str, rel_tol: float) -> float | None:
    reference = to_number(_normalise(extract_answer(target, is_target=True)))
    if reference is None:
        return None  # a target that is no number: a data problem, the row is not scored
    try:
        got = to_number(_normalise(extract_answer(completion)))
    except Exception:  # a completion can be anything: it scores 0, the trainer goes on
        return 0.0
    if got is None:
        return 0.0
    return float(numbers_agree(got, reference, rel_tol))


@register("numeric_answer")
def numeric_answer(prompts, completions, targets, metas):
    """1.0 when the completion's answer (its <answer> tag, \\boxed{} or `####`, else its last
    number) is the target's number: exactly, or where either is written as a decimal within
    a relative tolerance (REL_TOL, or the row's meta `rel_tol`) and the precision it is
    written to (numbers_agree); else 0.0. None for a target that is no number."""
    out = []
    for c, t, m in zip(completions, targets, metas):
        tol = m.get("rel_tol", REL_TOL) if isinstance(m, dict) else REL_TOL
        tol = tol if isinstance(tol, float) and 0 <= tol < 1 else REL_TOL
        out.append(_numeric_row(c, t, tol))
    return out


@register("numeric_concise")
def numeric_concise(prompts, completions, targets, metas):
    """numeric_answer's score times the share of the cap the completion left unused
    (1 - completion_tokens / max_new_tokens): a right answer of 12 tokens under a cap of 48
    scores 0.75, a wrong one 0 at any length. Beside numeric_answer at a small weight it
    prefers the shorter of right answers and nothing else: a length penalty on every row
    (wrong ones too) taught the LM job's model to answer with EOS alone by step 26, where
    most groups had no right answer (docs/history.md). Rows without recorded lengths
    score as numeric_answer."""
    out = []
    for right, m in zip(numeric_answer(prompts, completions, targets, metas), metas):
        lengths = sampled_lengths(m) if isinstance(m, dict) else None
        if right is None or lengths is None:
            out.append(right)
            continue
        n, cap = lengths
        out.append(right * (1.0 - min(n, cap) / cap))
    return out


def _number_in(answer_of, completion: str) -> float:
    """1.0 when `answer_of(completion)` finds an answer and it reads as a number, else 0.0."""
    try:
        answer = answer_of(completion)
        return float(answer is not None and to_number(_normalise(answer)) is not None)
    except Exception:
        return 0.0


@register("numeric_format")
def numeric_format(prompts, completions, targets, metas):
    """1.0 when the completion marks its final answer (<answer> tags, \\boxed{} or `####`)
    and that answer is a number, else 0.0: the form, not correctness."""
    return [_number_in(marked_answer, c) for c in completions]


def tagged_answer(text: str) -> str | None:
    """The content of the last complete <answer>...</answer> block when that block is the
    answer the text marks (no \\boxed{} or `####` anywhere in it overrides it), else None."""
    mark, answer = _marked(text)
    return answer if mark == "tags" else None


@register("numeric_tags")
def numeric_tags(prompts, completions, targets, metas):
    """1.0 when the completion gives its final answer in <answer></answer> tags, the form the
    numeric task asks for, and that answer is a number, else 0.0. Unlike numeric_format,
    `#### 12` and \\boxed{12} score 0: a model rewarded for any mark learns whichever its
    pretraining favours (GSM8K's `#### 12\\nThe answer is: 12`, three times as long)."""
    return [_number_in(tagged_answer, c) for c in completions]
