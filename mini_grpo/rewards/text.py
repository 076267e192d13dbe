"""Task-agnostic rewards: exact_match, levenshtein, and overlong_penalty (DAPO)."""

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
        if (lengths := sampled_lengths(m)) is None:
            out.append(0.0)
            continue
        n, cap = lengths
        buffer = max(1, cap // 5)
        out.append(min(0.0, (cap - buffer - n) / buffer))
    return out


def sampled_lengths(meta: dict) -> tuple[int, int] | None:
    """(completion_tokens, max_new_tokens) as sampling recorded them in a row's metadata, or
    None where it did not (a trivial baseline's answers) or they make no sense."""
    n, cap = meta.get("completion_tokens"), meta.get("max_new_tokens")
    ok = isinstance(n, int) and isinstance(cap, int) and 0 <= n and cap > 0
    return (n, cap) if ok else None
