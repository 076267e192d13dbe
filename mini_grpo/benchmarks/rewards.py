"""Reward scoring throughput: completions/s per built-in plugin and for chess_fen's default set,
serial vs thread vs process. benchmark.py prints it; by hand:

    python -m mini_grpo.benchmarks.rewards

Completions are realistic: targets of random games with 0-3 random character edits, plus some
start-position FENs, prompt copies and empty strings. Pool start-up is not timed (the trainer
keeps its pool for the whole run); each figure is the best of `repeats` timed calls.
"""

from __future__ import annotations

import os
import random
import sys
import time

import chess
import numpy as np

from mini_grpo.scoring import EXECUTORS, RewardScorer
from mini_grpo.tasks.chess_fen import ALPHABET, DEFAULT_REWARDS, generate_games

BUILT_INS = ["fen_valid", "levenshtein", "exact_match", "board_accuracy", "board_delta"]


def random_edits(rng: random.Random, text: str, k: int) -> str:
    """k random substitutions, insertions or deletions of characters from the chess alphabet."""
    s = list(text)
    for _ in range(k):
        i, op = rng.randrange(len(s) + 1), rng.randrange(3)
        if op == 0 and i < len(s):
            s[i] = rng.choice(ALPHABET)
        elif op == 1:
            s.insert(i, rng.choice(ALPHABET))
        elif i < len(s):
            del s[i]
    return "".join(s)


def realistic_batch(n: int, seed: int = 0) -> tuple[list[str], list[str], list[str], list[dict]]:
    rng = random.Random(seed)
    games = generate_games(rng, n, 2, 12, False, cache={})
    prompts = [g.prompt for g in games]
    targets = [g.target for g in games]
    completions = []
    for g in games:
        u = rng.random()
        if u < 0.05:
            completions.append(chess.STARTING_FEN)
        elif u < 0.08:
            completions.append(g.prompt)
        elif u < 0.10:
            completions.append("")
        else:
            completions.append(random_edits(rng, g.target, rng.randrange(4)))
    return prompts, completions, targets, [g.meta for g in games]


def run_reward_benchmark(n: int = 4096, seed: int = 0, workers: int = 2, progress: bool = True,
                         repeats: int = 2) -> dict:
    """{"n", "workers", "cpus", "rows": {set: {executor: completions/s}}, "identical": bool}."""
    batch = realistic_batch(n, seed)
    warm = [col[:64] for col in batch]
    sets = {name: [{"name": name, "weight": 1.0}] for name in BUILT_INS}
    sets["default (chess_fen)"] = DEFAULT_REWARDS
    rows: dict[str, dict[str, float]] = {}
    identical = True
    for label, specs in sets.items():
        rows[label], reference = {}, None
        for executor in EXECUTORS:
            with RewardScorer(specs, executor=executor, workers=workers, timeout=600) as scorer:
                scorer.score(*warm)
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    res = scorer.score(*batch)
                    best = min(best, time.perf_counter() - t0)
            rows[label][executor] = n / best
            if reference is None:
                reference = res.total
            identical = identical and np.array_equal(reference, res.total)
            if progress:
                print(f"  {label:22s} {executor:8s} {n / best:12,.0f} completions/s",
                      file=sys.stderr, flush=True)
    return {"n": n, "workers": workers, "cpus": os.cpu_count(), "rows": rows,
            "identical": identical}


def format_reward_table(result: dict) -> str:
    lines = [f"reward scoring throughput, {result['n']} completions, {result['workers']} workers, "
             f"{result['cpus']} CPUs (completions/s)",
             f"{'reward':22s}" + "".join(f"{e:>12s}" for e in EXECUTORS)]
    for label, by_executor in result["rows"].items():
        lines.append(f"{label:22s}" + "".join(f"{by_executor[e]:12,.0f}" for e in EXECUTORS))
    lines.append("executors agree: " + ("yes, identical rewards" if result["identical"]
                                         else "NO, rewards differ"))
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_reward_table(run_reward_benchmark()))
