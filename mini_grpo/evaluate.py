"""Held-out evaluation: greedy and sampled completions scored with the run's rewards.

Reports mean total reward (with its standard error), mean per plugin, exact-match rate (the
`exact_match` reward's definition: equal up to surrounding whitespace), mean completion length,
and whatever the task adds through its hooks (tasks/__init__.py): per-row columns such as
chess's valid-FEN rate, and the same figures per bucket (chess: ply ranges). Knows no task.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from .engines import Sampling
from .engines.turns import COUNTS
from .precision import release_freed_memory
from .progress import Heartbeat
from .rewards.text import exact_match
from .scoring import score

if TYPE_CHECKING:
    from .run import Run


def _summary(total, columns: dict, lengths) -> dict[str, float]:
    n = len(total)
    out = {"reward": float(np.mean(total)),
           "reward_se": float(np.std(total, ddof=1) / math.sqrt(n)) if n > 1 else 0.0}
    for name, col in columns.items():
        out[name] = float(np.mean(col))
    out["length"] = float(np.mean(lengths))
    out["n"] = n
    return out


class _Status:
    """An evaluation's progress line: completions done of all, their rate, the time left."""

    def __init__(self, name: str, total: int, prompts: str):
        self.name, self.total, self.prompts = name, total, prompts
        self.done, self.start = 0, time.monotonic()

    def line(self) -> str:
        seconds = time.monotonic() - self.start
        rate = self.done / seconds if self.done and seconds > 0 else 0.0
        eta = f", {rate:.1f}/s, ETA {(self.total - self.done) / rate:.0f} s" if rate else ""
        return f"{self.name}: {self.done}/{self.total} completions of {self.prompts} " \
               f"prompts{eta}"


@torch.no_grad()
def evaluate(run: Run, greedy: bool, seed: int = 0, batch_size: int = 256,
             amp: bool = True) -> dict:
    """Completions of each held-out example of run.task, scored; returns a flat dict: one
    greedy completion, or `eval_samples` sampled ones, each example's figures the mean over
    its completions (so reward_se is over examples), and with more than one, pass@k of the
    task's solved column (pass_at_k). Samples through the run's engine (Run.sampler), with
    the weights it was last synced with."""
    cfg, task = run.cfg, run.task
    n = 1 if greedy else cfg.eval_samples
    examples = [ex for ex in task.eval for _ in range(n)]  # an example's n rows together
    engine, sampling = run.sampler(alone=True), Sampling.of(cfg, greedy)
    gen = torch.Generator(device=run.device).manual_seed(seed)
    texts, lengths, talks, counts, env = [], [], [], [], []
    mode = "greedy" if greedy else "sampled"
    # a long evaluation says how far it is, at least every 10 s (a batch can take minutes on
    # a slow machine): a slow machine is not a hung one
    status = _Status(f"[eval] {mode}", len(examples), f"{len(task.eval)} {task.eval_split}")
    with Heartbeat(run.print0, status.line):
        for i in range(0, len(examples), batch_size):
            run.print0(f"{status.line()} ({time.monotonic() - status.start:.0f} s)")
            # before each batch, the pages of what training or the batch before freed go
            # back: in a heap that training left in pieces, each batch's caches land in new
            # places
            release_freed_memory(run.device)
            chunk = examples[i:i + batch_size]
            r = engine.generate([ex.model_input for ex in chunk], sampling, gen,
                                run.precision.autocast(generation=True, enabled=amp))
            status.done += len(chunk)
            texts += r.texts
            lengths += r.lengths()
            if r.conversations is not None:  # multi-turn
                talks += r.conversations
                counts.append(r.turn_counts.cpu())
                env += r.env_rewards or []
    prompts = [ex.prompt for ex in examples]
    targets = [ex.target for ex in examples]
    res = score(run.scorer, examples, texts, lengths, cfg.max_new_tokens, talks or None,
                env or None)
    columns = {"exact": np.asarray(exact_match(prompts, texts, targets, []), dtype=float)}
    if task.eval_columns is not None:
        columns.update(task.eval_columns(examples, texts))
    columns.update({f"reward/{k}": v for k, v in res.columns.items()})

    def per_example(col) -> np.ndarray:  # (E * n,) -> (E,): each example's mean
        return np.asarray(col, dtype=float).reshape(-1, n).mean(1)

    total, lengths = per_example(res.total), per_example(lengths)
    solved = np.asarray(columns[task.solved]).reshape(-1, n) if n > 1 else None
    columns = {k: per_example(v) for k, v in columns.items()}
    out = {**_summary(total, columns, lengths), **pass_at(solved)}
    if task.eval_bucket is not None:
        buckets = np.array([task.eval_bucket(ex) or "" for ex in task.eval])
        keep = {"reward", "n", *(k for k in columns if not k.startswith("reward/"))}
        for name in sorted(set(buckets) - {""}):
            sel = buckets == name
            sub = _summary(total[sel], {k: v[sel] for k, v in columns.items()}, lengths[sel])
            sub.update(pass_at(None if solved is None else solved[sel]))
            out.update({f"{name}/{k}": v for k, v in sub.items()
                        if k in keep or k.startswith("pass@")})
    if counts:  # per row: tool calls, rounds; shares of calls that failed, of rows capped
        c = dict(zip(COUNTS, torch.cat(counts).double().mean(0).tolist()))
        out.update({"tools/calls": c["calls"], "tools/rounds": c["rounds"],
                    "tools/capped_frac": c["capped"], "tools/broken_frac": c["broken"],
                    "tools/failed_frac": c["failed"] / max(c["calls"], 1e-12)})
    out["samples"] = [{"prompt": p, "target": t, "completion": c}  # each example's first
                      for p, t, c in list(zip(prompts, targets, texts))[::n][:4]]
    for s, talk in zip(out["samples"], talks[::n]):
        s["messages"] = talk
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that k of n completions drawn without replacement hold one of the c solved
    ones: 1 - C(n - c, k) / C(n, k), the unbiased estimator of Chen et al. (2021), as their
    product form (no large binomials)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at(solved: np.ndarray | None) -> dict[str, float]:
    """{"pass@k": mean over examples} for k = 1, 2, 4, ... and n, from (E, n) 0/1 solved
    flags of n completions each; {} for one completion each (None)."""
    if solved is None:
        return {}
    n = solved.shape[1]
    c = (solved >= 1).sum(1)  # a column of partial credit: only full marks solve
    ks = sorted({*(2**i for i in range(n.bit_length()) if 2**i <= n), n})
    return {f"pass@{k}": float(np.mean([pass_at_k(n, int(ci), k) for ci in c])) for k in ks}


def trivial_baselines(task, scorer) -> dict[str, float]:
    """Mean reward of answers that ignore the moves, under the run's own reward: a policy
    must beat these, or its gain may be a collapse onto a template."""
    examples = task.eval
    prompts = [ex.prompt for ex in examples]
    targets = [ex.target for ex in examples]
    metas = [ex.meta for ex in examples]
    answers = {"empty": [""] * len(examples), "prompt_copy": prompts}
    answers.update({name: [fn(ex) for ex in examples]
                    for name, fn in task.trivial_answers.items()})
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
