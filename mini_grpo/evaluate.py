"""Held-out evaluation: greedy and sampled completions scored with the run's rewards.

Reports mean total reward (with its standard error), mean per plugin, exact-match rate,
valid-FEN rate (chess tasks), mean completion length, and the same by ply bucket where the
examples carry a "plies" field.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .precision import autocast
from .rewards import resolve_reward
from .rollout import sample

PLY_BUCKETS = ((2, 4), (5, 8), (9, 12))


def _summary(total, columns, exact, valid, lengths) -> dict[str, float]:
    n = len(total)
    out = {"reward": float(np.mean(total)),
           "reward_se": float(np.std(total, ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
           "exact": float(np.mean(exact)), "length": float(np.mean(lengths)), "n": n}
    if valid is not None:
        out["valid_fen"] = float(np.mean(valid))
    for name, col in columns.items():
        out[f"reward/{name}"] = float(np.mean(col))
    return out


@torch.no_grad()
def evaluate(model, tok, examples, scorer, cfg, device, greedy: bool, batch_size: int = 256,
             seed: int = 0) -> dict:
    """Samples one completion per held-out example and scores it; returns a flat dict."""
    gen = torch.Generator(device=device).manual_seed(seed)
    texts, lengths = [], []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        with autocast(cfg, device, generation=True):
            r = sample(model, tok, [ex.prompt for ex in chunk], cfg.max_new_tokens,
                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                       greedy=greedy, generator=gen)
        texts += r.texts
        lengths += r.completion_mask.sum(1).tolist()
    prompts = [ex.prompt for ex in examples]
    targets = [ex.target for ex in examples]
    metas = [ex.meta for ex in examples]
    res = scorer.score(prompts, texts, targets, metas)
    exact = np.array([t == g for t, g in zip(texts, targets)], dtype=float)
    valid = None
    if cfg.task == "chess_fen":
        valid = np.asarray(resolve_reward("fen_valid")(prompts, texts, targets, metas), float)
    out = _summary(res.total, res.columns, exact, valid, np.asarray(lengths, float))
    plies = np.array([ex.meta.get("plies", -1) for ex in examples])
    for lo, hi in PLY_BUCKETS:
        sel = (plies >= lo) & (plies <= hi)
        if sel.any():
            sub = _summary(res.total[sel], {k: v[sel] for k, v in res.columns.items()},
                           exact[sel], None if valid is None else valid[sel],
                           np.asarray(lengths, float)[sel])
            for k in ("reward", "exact", "valid_fen", "n"):
                if k in sub:
                    out[f"plies_{lo}-{hi}/{k}"] = sub[k]
    out["samples"] = [{"prompt": p, "target": t, "completion": c}
                      for p, t, c in list(zip(prompts, targets, texts))[:4]]
    return out


START_FEN = "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1"


def trivial_baselines(examples, scorer, task_name: str) -> dict[str, float]:
    """Mean reward of answers that ignore the moves, under the run's own reward: a policy
    must beat these, or its gain may be a collapse onto a template."""
    prompts = [ex.prompt for ex in examples]
    targets = [ex.target for ex in examples]
    metas = [ex.meta for ex in examples]
    answers = {"empty": [""] * len(examples), "prompt_copy": prompts}
    if task_name == "chess_fen":
        answers["start_fen"] = [START_FEN] * len(examples)
    return {name: float(scorer.score(prompts, texts, targets, metas).total.mean())
            for name, texts in answers.items()}


def format_table(rows: dict[str, dict]) -> str:
    """Side-by-side table of evaluations, e.g. {"SFT greedy": ev0, "GRPO greedy": ev1}."""
    names = list(rows)
    keys = list(dict.fromkeys(k for ev in rows.values() for k in ev if k != "samples"))
    kw = max(len(k) for k in keys) + 2
    cw = max(12, *(len(n) + 2 for n in names))
    lines = [" " * kw + "".join(f"{n:>{cw}}" for n in names)]
    for k in keys:
        fmt = ".0f" if k.split("/")[-1] == "n" else ".4f"
        lines.append(f"{k:<{kw}}" + "".join(
            f"{rows[n].get(k, float('nan')):>{cw}{fmt}}" for n in names))
    return "\n".join(lines)
