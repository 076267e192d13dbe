"""Task-agnostic string rewards: exact_match and levenshtein."""

from __future__ import annotations

import numpy as np
from rapidfuzz import process
from rapidfuzz.distance import Levenshtein

from mini_grpo.rewards.registry import register


@register("exact_match")
def exact_match(prompts, completions, targets, metas):
    """1.0 when the completion equals the target, ignoring surrounding whitespace."""
    return [float(c.strip() == t.strip()) for c, t in zip(completions, targets)]


@register("levenshtein")
def levenshtein(prompts, completions, targets, metas):
    """1 - edit distance / length of the longer string; two empty strings score 1.0."""
    # one C++ call for the whole batch; workers=1 because parallelism is the scorer's job
    sim = process.cpdist(completions, targets, scorer=Levenshtein.normalized_similarity,
                         dtype=np.float64, workers=1)
    return sim.tolist()
