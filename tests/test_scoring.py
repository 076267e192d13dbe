"""RewardScorer: weighted sums, serial/thread/process parity, failure isolation, the example.

Plugins used with the process executor live at module level here: spawned workers import this
file by name to find them.
"""

import logging
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mini_grpo.benchmarks.rewards import random_edits, realistic_batch
from mini_grpo.config import ConfigError, load_config
from mini_grpo.scoring import RewardError, RewardScorer
from mini_grpo.tasks import build_task
from mini_grpo.tasks.chess_fen import ALPHABET, DEFAULT_REWARDS

ROOT = Path(__file__).resolve().parent.parent
ALL = [{"name": n, "weight": w} for n, w in [("fen_valid", 0.1), ("levenshtein", 0.2),
       ("exact_match", 0.3), ("board_accuracy", 0.15), ("board_delta", 0.25)]]


def length(prompts, completions, targets, metas):
    return [float(len(c)) for c in completions]


def one(prompts, completions, targets, metas):
    return [1.0] * len(completions)


def from_meta(prompts, completions, targets, metas):
    return [m["bonus"] for m in metas]


def boom(prompts, completions, targets, metas):
    if "bad" in completions:
        raise ZeroDivisionError("plugin exploded")
    return [1.0] * len(completions)


def short(prompts, completions, targets, metas):
    return [1.0] * (len(completions) - 1)


def nan_on_bad(prompts, completions, targets, metas):
    return [math.nan if c == "bad" else 1.0 for c in completions]


def none_on_bad(prompts, completions, targets, metas):
    return [None if c == "bad" else 1.0 for c in completions]


def inf_on_bad(prompts, completions, targets, metas):
    return np.array([math.inf if c == "bad" else 1.0 for c in completions])


def string_on_bad(prompts, completions, targets, metas):
    return ["0.5" if c == "bad" else 1.0 for c in completions]  # a number's text is no reward


def complex_on_bad(prompts, completions, targets, metas):  # numpy would keep the real part
    return [np.complex128(0.5 + 3j) if c == "bad" else np.float32(1.0) for c in completions]


def complex_array_on_bad(prompts, completions, targets, metas):
    return np.array([0.5 + 3j if c == "bad" else 1.0 for c in completions])


def sleepy(prompts, completions, targets, metas):
    if "bad" in completions:
        time.sleep(20.0)
        marker = os.environ.get("SLEEPY_MARKER")
        if marker:  # the sleep ran to its end: a scorer that waited for it would see this
            open(marker, "w").close()
    return [1.0] * len(completions)


def exits(prompts, completions, targets, metas):
    if "bad" in completions:
        raise SystemExit("plugin called sys.exit")
    return [1.0] * len(completions)


def interrupted(prompts, completions, targets, metas):
    if "bad" in completions:
        raise KeyboardInterrupt
    return [1.0] * len(completions)


def meddle(prompts, completions, targets, metas):
    for m in metas:
        m["bonus"] = 100.0
        m["moves"].append("e2e4")
        m.clear()
    return [1.0] * len(completions)


def returns_dict(prompts, completions, targets, metas):
    return {i: 1.0 for i in range(len(completions))}  # list() of it would be the row numbers


def returns_str(prompts, completions, targets, metas):
    return "1" * len(completions)


def returns_bytes(prompts, completions, targets, metas):
    return b"1" * len(completions)


def spec(fn, weight=1.0):
    return {"name": f"{__name__}:{fn.__name__}", "weight": weight}


def rows(completions):
    n = len(completions)
    return [""] * n, completions, [""] * n, [{}] * n


def test_weighted_sum_by_hand():
    with RewardScorer([spec(length, 0.5), spec(one, 2.0)], workers=2) as scorer:
        res = scorer.score(*rows(["", "ab", "abcd"]))
    np.testing.assert_array_equal(res.columns["length"], [0, 2, 4])
    np.testing.assert_array_equal(res.total, [2.0, 3.0, 4.0])  # 0.5 * len + 2 * 1
    assert res.columns["length"].mean() == 2.0 and res.total.mean() == 3.0
    assert res.metrics["reward/length/failures"] == 0
    assert res.metrics["reward/length/seconds"] >= 0


def test_metrics_are_only_the_scorers_health():
    # means and stds over all ranks are the trainer's job, from res.columns and res.total
    with RewardScorer([spec(length), spec(one)], workers=2) as scorer:
        res = scorer.score(*rows(["", "ab", "abcd"]))
    assert sorted(res.metrics) == ["reward/length/failures", "reward/length/seconds",
                                   "reward/one/failures", "reward/one/seconds", "reward/seconds"]


def test_plugins_see_the_rows_metadata():
    res = RewardScorer([spec(from_meta)]).score(["p", "q"], ["a", "b"], ["t", "u"],
                                                [{"bonus": 0.25}, {"bonus": 0.5}])
    np.testing.assert_array_equal(res.total, [0.25, 0.5])


@pytest.mark.parametrize("executor", ["serial", "thread"])
def test_plugins_cannot_change_the_callers_metadata(executor):
    metas = [{"bonus": 0.25, "moves": []}, {"bonus": 0.5, "moves": ["d2d4"]}]
    with RewardScorer([spec(meddle), spec(from_meta)], executor=executor) as scorer:
        res = scorer.score(["p", "q"], ["a", "b"], ["t", "u"], metas)
    assert metas == [{"bonus": 0.25, "moves": []}, {"bonus": 0.5, "moves": ["d2d4"]}]
    np.testing.assert_array_equal(res.columns["from_meta"], [0.25, 0.5])  # not meddle's 100


def test_empty_batch():
    res = RewardScorer([spec(one)]).score([], [], [], [])
    assert res.total.shape == (0,) and res.columns["one"].shape == (0,)
    assert res.metrics["reward/one/failures"] == 0.0


def test_bad_names_fail_at_construction():
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        RewardScorer([{"name": "board_delta"}, {"name": "nope"}], executor="thread")
    with pytest.raises(ConfigError, match="reward_executor"):
        RewardScorer([{"name": "board_delta"}], executor="gpu")
    with pytest.raises(ConfigError, match="logged as 'exact_match'"):
        RewardScorer([{"name": "exact_match"}, {"name": "mini_grpo.rewards.text:exact_match"}])


def test_process_executor_needs_picklable_plugins(monkeypatch):
    from mini_grpo.rewards import registry
    monkeypatch.setitem(registry.REWARDS, "a_lambda", lambda p, c, t, m: [0.0] * len(c))
    with pytest.raises(ConfigError, match="module-level function"):
        RewardScorer([{"name": "a_lambda"}], executor="process")


def test_from_config_uses_task_defaults_or_config():
    cfg = load_config(overrides={"task_args": {"num_train": 20}, "num_eval": 5}, env={})
    task = build_task(cfg)
    cfg.reward_executor = "serial"
    with RewardScorer.from_config(cfg, task) as scorer:
        assert scorer.executor == "serial"
        assert scorer.keys == [r["name"] for r in DEFAULT_REWARDS]
    cfg.rewards, cfg.reward_executor = [{"name": "exact_match"}], "thread"
    with RewardScorer.from_config(cfg, task) as scorer:
        assert scorer.executor == "thread" and scorer.keys == ["exact_match"]


def test_from_config_reads_only_the_reward_fields():
    # no parallel_rewards: the config maps that legacy switch to reward_executor itself
    cfg = SimpleNamespace(rewards=[{"name": "exact_match"}], reward_executor="thread",
                          num_reward_workers=3, reward_on_error=-1.0, reward_timeout=2.0,
                          reward_max_fail_frac=0.25, reward_concurrency=5)
    with RewardScorer.from_config(cfg, task=None) as scorer:
        assert (scorer.executor, scorer.workers, scorer.on_error, scorer.timeout,
                scorer.max_fail_frac, scorer.concurrency) == ("thread", 3, -1.0, 2.0, 0.25, 5)


def test_serial_thread_process_identical_on_ten_thousand_completions():
    prompts, completions, targets, metas = realistic_batch(10_000, seed=3)
    rng = random.Random(1)  # and pure noise made of FEN characters
    for i in range(0, 10_000, 7):
        completions[i] = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(80)))
    completions[1] = random_edits(rng, targets[1], 1)
    results = {}
    for executor in ["serial", "thread", "process"]:
        with RewardScorer(ALL, executor=executor, workers=3) as scorer:
            results[executor] = scorer.score(prompts, completions, targets, metas)
    ref = results["serial"]
    assert ref.total.std() > 0.1  # the batch is varied enough to make the comparison mean much
    for executor in ["thread", "process"]:
        np.testing.assert_array_equal(results[executor].total, ref.total)
        for key in ref.columns:
            np.testing.assert_array_equal(results[executor].columns[key], ref.columns[key])


# ---- failure isolation: 4 rows in 2 chunks of 2; "bad" sits in the second chunk ----

BATCH = ["a", "b", "c", "bad"]


@pytest.mark.parametrize("executor", ["serial", "thread", "process"])
def test_raising_plugin_fails_only_the_rows_that_raise_alone_and_logs_once(executor, caplog):
    # the chunk ["c", "bad"] raises, so its rows are retried one by one: only "bad" fails
    with RewardScorer([spec(boom), spec(one)], executor=executor, workers=2, on_error=-1.0,
                      max_fail_frac=0.5) as scorer:
        with caplog.at_level(logging.WARNING, logger="mini_grpo.scoring"):
            res = scorer.score(*rows(BATCH))
            scorer.score(*rows(BATCH))
    np.testing.assert_array_equal(res.columns["boom"], [1, 1, 1, -1])
    np.testing.assert_array_equal(res.columns["one"], [1, 1, 1, 1])
    assert res.metrics["reward/boom/failures"] == 1
    assert scorer.failure_counts == {"boom": 2, "one": 0}
    warnings = [r for r in caplog.records if r.name == "mini_grpo.scoring"]
    assert len(warnings) == 1
    assert "ZeroDivisionError: plugin exploded" in warnings[0].getMessage()
    assert "Traceback" in warnings[0].getMessage()
    assert "row 3" in warnings[0].getMessage()


@pytest.mark.parametrize("executor", ["serial", "thread", "process"])
def test_system_exit_in_a_plugin_is_a_failed_row_not_the_end_of_the_run(executor, caplog):
    with RewardScorer([spec(exits)], executor=executor, workers=2, max_fail_frac=0.5) as scorer:
        with caplog.at_level(logging.WARNING, logger="mini_grpo.scoring"):
            res = scorer.score(*rows(BATCH))
    np.testing.assert_array_equal(res.columns["exits"], [1, 1, 1, 0])
    assert "SystemExit: plugin called sys.exit" in caplog.text


@pytest.mark.parametrize("executor", ["serial", "thread", "process"])
def test_keyboard_interrupt_in_a_plugin_is_a_failed_row_not_the_end_of_the_run(executor,
                                                                            caplog):
    # only a real Ctrl-C stops the run (test_scoring_limits.py)
    with RewardScorer([spec(interrupted)], executor=executor, workers=2,
                      max_fail_frac=0.5) as scorer:
        with caplog.at_level(logging.WARNING, logger="mini_grpo.scoring"):
            res = scorer.score(*rows(BATCH))
    np.testing.assert_array_equal(res.columns["interrupted"], [1, 1, 1, 0])
    assert "KeyboardInterrupt" in caplog.text


@pytest.mark.parametrize("fn", [returns_dict, returns_str, returns_bytes])
def test_a_mapping_or_string_is_not_a_list_of_rewards(fn, caplog):
    with caplog.at_level(logging.WARNING, logger="mini_grpo.scoring"):
        res = RewardScorer([spec(fn)], workers=2, max_fail_frac=1.0).score(*rows(BATCH))
    np.testing.assert_array_equal(res.columns[fn.__name__], [0, 0, 0, 0])
    kind = {returns_dict: "dict", returns_str: "str", returns_bytes: "bytes"}[fn]
    assert f"returned {kind}, expected a list of 2 floats" in caplog.text


def test_wrong_number_of_values_fails_the_chunk():
    res = RewardScorer([spec(short)], workers=2, max_fail_frac=1.0).score(*rows(BATCH))
    np.testing.assert_array_equal(res.columns["short"], [0, 0, 0, 0])
    assert res.metrics["reward/short/failures"] == 4


@pytest.mark.parametrize("fn", [nan_on_bad, none_on_bad, inf_on_bad, string_on_bad,
                                complex_on_bad, complex_array_on_bad])
def test_nan_none_inf_strings_fail_only_their_rows(fn, caplog):
    with caplog.at_level(logging.WARNING, logger="mini_grpo.scoring"):
        res = RewardScorer([spec(fn)], workers=2, on_error=0.25).score(*rows(BATCH))
    np.testing.assert_array_equal(res.columns[fn.__name__], [1, 1, 1, 0.25])
    assert res.metrics[f"reward/{fn.__name__}/failures"] == 1
    assert "for row 3" in caplog.text


@pytest.mark.parametrize("executor", ["serial", "thread", "process"])
def test_hung_plugin_times_out_and_the_rest_still_scores(executor, tmp_path, monkeypatch):
    marker = tmp_path / "slept"
    monkeypatch.setenv("SLEEPY_MARKER", str(marker))
    # 1.5 s: on a GPU machine running 14 test workers, 0.3 s let a healthy call of the process
    # pool go without finishing, and it was counted as hung
    with RewardScorer([spec(sleepy), spec(length)], executor=executor, workers=2, timeout=1.5,
                      max_fail_frac=0.5) as scorer:
        res = scorer.score(*rows(BATCH))
        # it did not wait for the 20 s sleep (timeout 1.5 s); with a 5 s sleep the process
        # case failed on the 2-core Xeon, in the suite and alone (cause not yet found)
        assert not marker.exists()
        np.testing.assert_array_equal(res.columns["sleepy"], [1, 1, 0, 0])
        np.testing.assert_array_equal(res.columns["length"], [1, 1, 1, 3])
        assert scorer.failure_counts["sleepy"] == 2
        res = scorer.score(*rows(["a", "b"]))  # the pool was restarted
        np.testing.assert_array_equal(res.total, [2, 2])


# A script whose plugin never returns on the chunk holding "bad"; argv[1] is the executor.
HANG = """
import sys, threading
from mini_grpo.rewards import register
from mini_grpo.scoring import RewardScorer

@register("hang")
def hang(prompts, completions, targets, metas):
    if "bad" in completions:
        threading.Event().wait()
    return [1.0] * len(completions)

with RewardScorer([{"name": "hang"}], executor=sys.argv[1], workers=2, timeout=1.0) as scorer:
    print(scorer.score([""] * 4, ["a", "b", "c", "bad"], [""] * 4, None).columns["hang"])
"""


@pytest.mark.parametrize("executor", ["serial", "thread"])
def test_a_plugin_that_never_returns_neither_hangs_scoring_nor_the_exit(executor):
    # before: serial waited for the call forever, thread for its pool's threads at exit
    out = subprocess.run([sys.executable, "-c", HANG, executor], cwd=ROOT, capture_output=True,
                         text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1. 1. 0. 0.]"


@pytest.mark.parametrize("executor", ["serial", "process"])
def test_failure_fraction_over_the_limit_stops_with_the_traceback(executor):
    # 2 of 4 rows fail: allowed at max_fail_frac=0.5, not at 0.4
    with RewardScorer([spec(boom)], executor=executor, workers=2, max_fail_frac=0.4) as scorer:
        with pytest.raises(RewardError, match="'boom' failed on 2 of 4 rows") as info:
            scorer.score(*rows(["a", "bad", "c", "bad"]))
    assert isinstance(info.value, RuntimeError)
    assert "Traceback" in str(info.value) and "plugin exploded" in str(info.value)


def test_example_plugin_through_the_config(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # `examples.my_reward` is importable from the root
    cfg = load_config(str(ROOT / "examples" / "my_reward.yaml"),
                      overrides={"task_args": {"num_train": 20}, "num_eval": 8}, env={})
    task = build_task(cfg)
    assert cfg.reward_executor == "process"
    with RewardScorer.from_config(cfg, task) as scorer:
        targets = [ex.target for ex in task.eval]
        res = scorer.score([ex.prompt for ex in task.eval], targets, targets,
                           [ex.meta for ex in task.eval])
        assert res.columns["piece_count"].mean() == 1.0
        res = scorer.score(["e2e4:"], ["8/8/8/8/8/8/8/8 w - - 0 1"],
                           ["rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1"], [{}])
        assert res.columns["piece_count"][0] == 0.0  # 0 pieces against 32
