"""pass@k in evaluation: the unbiased estimator (Chen et al. 2021) against its closed form and
against counting every draw, and a sampled evaluation of several completions per prompt."""

import itertools
import math

import numpy as np
import pytest
from conftest import tiny

from mini_grpo.evaluate import evaluate, pass_at, pass_at_k
from mini_grpo.run import setup


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_chance_that_k_draws_hold_a_solved_one(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            closed = 1 - math.comb(n - c, k) / math.comb(n, k)
            # every set of k of the n completions, the first c of them solved
            draws = list(itertools.combinations(range(n), k))
            counted = sum(any(i < c for i in d) for d in draws) / len(draws)
            assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)
            assert closed == pytest.approx(counted, abs=1e-12)


def test_pass_at_averages_examples_and_takes_powers_of_two_and_n():
    solved = np.array([[1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    out = pass_at(solved)
    assert list(out) == ["pass@1", "pass@2", "pass@4", "pass@6"]
    assert out["pass@1"] == pytest.approx((1 / 6 + 0 + 1) / 3)
    assert out["pass@2"] == pytest.approx((1 - math.comb(5, 2) / math.comb(6, 2) + 1) / 3)
    assert out["pass@6"] == pytest.approx(2 / 3)
    assert pass_at(None) == {}
    half = pass_at(np.array([[0.5, 1.0]]))  # partial credit is not solved
    assert half["pass@1"] == 0.5


def test_a_sampled_evaluation_of_several_completions_reports_pass_at_k(tmp_path):
    with setup(tiny(tmp_path / "run", eval_samples=4, num_eval=6, temperature=1.5)) as run:
        run.sync_engine()
        greedy = evaluate(run, greedy=True)
        sampled = evaluate(run, greedy=False)
    assert not any(k.startswith("pass@") for k in greedy) and greedy["n"] == 6
    assert sampled["n"] == 6  # examples: each one's figures the mean of its 4 completions
    ks = [sampled[f"pass@{k}"] for k in (1, 2, 4)]
    assert ks == sorted(ks) and 0 <= ks[0] <= ks[-1] <= 1
    assert sampled["pass@1"] == pytest.approx(sampled["exact"])  # chess: solved is exact
    assert len(sampled["samples"]) == 4 and len({s["prompt"] for s in sampled["samples"]}) == 4
