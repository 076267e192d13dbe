"""Reward plugins in the shapes users bring (ours, **columns, TRL's two, per_sample, async),
inspected once at registration, all scoring the same rows to the same values; async plugins
of a batch overlap in one event loop and fail like sync ones."""

import asyncio
import time

import numpy as np
import pytest

from mini_grpo.config import ConfigError
from mini_grpo.rewards import per_sample
from mini_grpo.rewards.registry import adapt
from mini_grpo.scoring import RewardScorer

PROMPTS = ["a", "b", "c", "d"]
COMPLETIONS = ["x1", "y22", "z", "bad"]
TARGETS = ["x1", "y2", "zz", "q"]
METAS = [{"bonus": 0.5}, {"bonus": 0.25}, {}, {"bonus": 1.0}]
# exact match + the row's bonus column (None when the row has none): the same in every shape
WANT = [1.5, 0.25, 0.0, 1.0]


def _one(completion, target, bonus):
    return float(completion == target) + (bonus or 0.0)


def native(prompts, completions, targets, metas):
    return [_one(c, t, m.get("bonus")) for c, t, m in zip(completions, targets, metas)]


def with_columns(prompts, completions, targets, **columns):
    return [_one(c, t, b) for c, t, b in zip(completions, targets, columns["bonus"])]


def trl_prompts(prompts, completions, **kwargs):
    assert len(prompts) == len(completions)
    return [_one(c, t, b) for c, t, b in zip(completions, kwargs["target"], kwargs["bonus"])]


def trl_completions(completions, target, bonus, **kwargs):  # columns as named parameters
    assert len(kwargs["prompts"]) == len(completions) and set(kwargs["prompts"]) <= set(PROMPTS)
    return [_one(c, t, b) for c, t, b in zip(completions, target, bonus)]


@per_sample
def one_row(prompt, completion, target, meta):
    return _one(completion, target, meta.get("bonus"))


async def async_native(prompts, completions, targets, metas):
    await asyncio.sleep(0)
    return native(prompts, completions, targets, metas)


@per_sample
async def async_row(prompt, completion, target, meta):
    await asyncio.sleep(0)
    return _one(completion, target, meta.get("bonus"))


async def async_trl(completions, **kwargs):
    await asyncio.sleep(0)
    return trl_prompts(completions=completions, **kwargs)


SHAPES = [native, with_columns, trl_prompts, trl_completions, one_row, async_native,
          async_row, async_trl]


@pytest.mark.parametrize("executor", ["serial", "process"])
def test_every_accepted_shape_scores_the_same_rows_to_the_same_values(executor):
    specs = [{"name": f"test_reward_shapes:{fn.__name__}"} for fn in SHAPES]
    with RewardScorer(specs, executor=executor, workers=2) as scorer:
        res = scorer.score(PROMPTS, COMPLETIONS, TARGETS, METAS)
    for fn in SHAPES:
        assert res.columns[fn.__name__].tolist() == WANT, fn.__name__
        assert res.metrics[f"reward/{fn.__name__}/failures"] == 0


def test_a_signature_that_fits_no_shape_is_refused_with_the_shapes():
    def two(a, b):
        return []

    def no_kwargs(completions, target):
        return []

    for fn in (two, no_kwargs):
        with pytest.raises(ConfigError, match="fits none of the accepted shapes: fn\\(prompts, "
                                              "completions, targets, metas\\)"):
            adapt("f", fn)


EVENTS: list = []


async def _sleeper(tag, completions):
    EVENTS.append(("start", tag, time.monotonic()))
    await asyncio.sleep(0.2)
    EVENTS.append(("end", tag, time.monotonic()))
    return [1.0] * len(completions)


async def sleep_a(prompts, completions, targets, metas):
    return await _sleeper("a", completions)


async def sleep_b(prompts, completions, targets, metas):
    return await _sleeper("b", completions)


async def sleep_c(completions, **kwargs):
    return await _sleeper("c", completions)


def test_async_plugins_of_a_batch_overlap():
    EVENTS.clear()
    specs = [{"name": f"test_reward_shapes:sleep_{t}"} for t in "abc"]
    with RewardScorer(specs, executor="serial") as scorer:
        res = scorer.score(PROMPTS, COMPLETIONS, TARGETS, METAS)
    assert res.total.tolist() == [3.0] * 4
    kinds = [e[0] for e in EVENTS]
    # every plugin started before any finished: they ran at once, not one after the other
    assert kinds == ["start"] * 3 + ["end"] * 3, EVENTS


CALLS: list = []


@per_sample
async def counted_row(prompt, completion, target, meta):
    CALLS.append(+1)
    in_flight = sum(CALLS)
    await asyncio.sleep(0.01)
    CALLS.append(-1)
    return float(in_flight)


def test_per_sample_async_rows_run_at_most_reward_concurrency_at_once():
    CALLS.clear()
    n = 12
    with RewardScorer([{"name": "test_reward_shapes:counted_row"}], executor="serial",
                      concurrency=3) as scorer:
        res = scorer.score(["p"] * n, ["c"] * n, ["t"] * n, [{}] * n)
    assert res.columns["counted_row"].max() == 3.0  # the bound was reached, never passed


async def raises_on_bad(prompts, completions, targets, metas):
    if "bad" in completions:
        raise ValueError("cannot score 'bad'")
    return [1.0] * len(completions)


async def hangs(prompts, completions, targets, metas):
    await asyncio.sleep(3600)


def test_a_raising_or_hanging_async_plugin_is_isolated_and_counted():
    specs = [{"name": "test_reward_shapes:raises_on_bad"}, {"name": "test_reward_shapes:hangs"},
             {"name": "test_reward_shapes:native"}]
    with RewardScorer(specs, executor="serial", timeout=0.5, max_fail_frac=1.0,
                      on_error=-1.0) as scorer:
        res = scorer.score(PROMPTS, COMPLETIONS, TARGETS, METAS)
        # rows retried alone: only the row that raises on its own fails
        assert res.columns["raises_on_bad"].tolist() == [1.0, 1.0, 1.0, -1.0]
        assert res.metrics["reward/raises_on_bad/failures"] == 1
        assert res.columns["hangs"].tolist() == [-1.0] * 4  # cancelled at the timeout
        assert res.metrics["reward/hangs/failures"] == 4
        assert res.columns["native"].tolist() == WANT  # the sync plugin is untouched
        again = scorer.score(PROMPTS, COMPLETIONS, TARGETS, METAS)  # the scorer goes on
        assert np.array_equal(again.columns["native"], res.columns["native"])
        assert scorer.failure_counts == {"raises_on_bad": 2, "hangs": 8, "native": 0}


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_the_http_verifier_example_scores_like_the_builtin(executor, monkeypatch):
    from conftest import ROOT

    from mini_grpo.config import load_config
    from mini_grpo.rewards.countdown import countdown_correct
    from mini_grpo.tasks import build_task

    monkeypatch.syspath_prepend(str(ROOT))  # `examples.http_verifier` imports from the root
    task = build_task(load_config("tiny", {"task": "countdown", "num_eval": "8"}, env={}))
    exs = task.eval
    completions = [ex.target if i % 2 else "<answer>1+1</answer>" for i, ex in enumerate(exs)]
    args = ([ex.prompt for ex in exs], completions, [ex.target for ex in exs],
            [ex.meta for ex in exs])
    with RewardScorer([{"name": "examples.http_verifier:verified"}], executor=executor,
                      workers=2) as scorer:
        got = scorer.score(*args).columns["verified"]
    assert got.tolist() == countdown_correct(*args)
    assert got.sum() == len(exs) // 2  # the targets are solutions: every other row solved
