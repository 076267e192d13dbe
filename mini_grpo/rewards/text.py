"""Task-agnostic rewards: exact_match, levenshtein, overlong_penalty (DAPO) and
length_penalty."""

from __future__ import annotations

import numpy as np

from mini_grpo.rewards.registry import register


@register("exact_match")
def exact_match(prompts, completions, targets, metas):
    """1.0 when the completion equals the target, ignoring surrounding whitespace."""
    return [float(c.strip() == t.strip()) for c, t in zip(completions, targets)]


@register("levenshtein")
def levenshtein(prompts, completions, targets, metas):
    """1 - edit distance / length of the longer string; two empty strings score 1.0."""
    # one C++ call for the whole batch; workers=1 because parallelism is the scorer's job.
    # Imported here: rapidfuzz's import is 60 ms of every start, `mini-grpo sample`'s too
    from rapidfuzz import process
    from rapidfuzz.distance import Levenshtein

    sim = process.cpdist(completions, targets, scorer=Levenshtein.normalized_similarity,
                         dtype=np.float64, workers=1)
    return sim.tolist()


@register("overlong_penalty")
def overlong_penalty(prompts, completions, targets, metas):
    """DAPO's soft overlong punishment, from the lengths sampling records in each row's
    metadata (`completion_tokens`, `max_new_tokens`): 0 up to max_new_tokens - buffer tokens,
    then linearly down to -1 at max_new_tokens, buffer = max_new_tokens // 5 (DAPO: 4k of
    20k). Rows without those fields (a trivial baseline's answers) get 0."""
    out = []
    for m in metas:
        n, cap = m.get("completion_tokens"), m.get("max_new_tokens")
        if not isinstance(n, int) or not isinstance(cap, int) or cap <= 0:
            out.append(0.0)
            continue
        buffer = max(1, cap // 5)
        out.append(min(0.0, (cap - buffer - n) / buffer))
    return out


@register("length_penalty")
def length_penalty(prompts, completions, targets, metas):
    """Minus the completion's share of its cap, from the lengths sampling records
    (`completion_tokens` / `max_new_tokens`): 0 for no token, -1 at the cap. At a small
    weight beside a correctness reward it prefers the shorter of otherwise equal answers;
    with advantages scaled by the group's spread, that preference decides a group whose
    answers are all right (or all wrong), so it shortens answers fast. Rows without those
    fields get 0, as in overlong_penalty."""
    out = []
    for m in metas:
        n, cap = m.get("completion_tokens"), m.get("max_new_tokens")
        ok = isinstance(n, int) and isinstance(cap, int) and cap > 0
        out.append(-min(n, cap) / cap if ok else 0.0)
    return out
