"""RewardScorer at its limits: plugins that loop on the CPU past the timeout, that raise
KeyboardInterrupt or SystemExit, or that return rewards too large for the statistics.

Plugins live at module level: the process executor's spawned workers import this file by name.
"""

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from mini_grpo.fields import ConfigError
from mini_grpo.rewards import per_sample
from mini_grpo.scoring import MAX_REWARD, RewardError, RewardScorer

ROOT = Path(__file__).resolve().parent.parent
BATCH = ["a", "b", "c", "bad"]  # 2 chunks of 2 with workers=2; "bad" sits in the second


def spec(fn, weight=1.0):
    return {"name": f"{__name__}:{fn.__name__}", "weight": weight}


def rows(completions):
    n = len(completions)
    return [""] * n, completions, [""] * n, [{}] * n


# ---- a plugin that loops on the CPU past the timeout (serial, thread) ----

RELEASE = threading.Event()  # set: the spinning calls return
SPINNING: set = set()  # threads inside spin() now
SPUN: list = []  # every thread that ever spun, to join at the end


def spin(prompts, completions, targets, metas):
    if "spin" in completions:
        me = threading.current_thread()
        SPINNING.add(me)
        SPUN.append(me)
        try:
            while not RELEASE.is_set():  # busy: holds the GIL but for the 5 ms switches
                pass
        finally:
            SPINNING.discard(me)
    return [1.0] * len(completions)


def release_spinners():
    RELEASE.set()
    for t in SPUN:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in SPUN)
    SPUN.clear()
    RELEASE.clear()


@pytest.mark.parametrize("executor, slots", [("serial", 1), ("thread", 2)])
def test_calls_that_loop_on_the_cpu_do_not_pile_up_under_threads(executor, slots):
    scorer = RewardScorer([spec(spin)], executor=executor, workers=2, timeout=0.1,
                          max_fail_frac=1.0)
    try:
        # one hang at a time is tolerated (a call stuck on I/O may return later) ...
        res = scorer.score(*rows(["a", "b", "c", "spin"]))
        np.testing.assert_array_equal(res.columns["spin"], [1, 1, 0, 0])
        assert len(SPINNING) == 1
        release_spinners()
        # ... but calls that never return stop the scorer before they pile up: serial stops
        # when the first batch's second chunk hangs while its first still spins; thread when
        # the second batch's two calls join the first batch's two. (A call that the spinners
        # starve of its start is cancelled, not abandoned: then the stop comes a batch later.)
        outcomes = []
        for _ in range(6):
            try:
                scorer.score(*rows(["spin"] * 4))
                outcomes.append("scored")
            except RewardError as e:
                outcomes.append(str(e))
            assert len(SPINNING) <= 2 * slots  # live abandoned calls stay bounded
        scored = outcomes.count("scored")
        assert slots - 1 <= scored < 6 and outcomes[:scored] == ["scored"] * scored
        for err in outcomes[scored:]:
            hung = re.match(r"reward plugin 'spin': (\d+) calls that ran past "
                            r"reward_timeout=0\.1 s are still running", err)
            assert hung and slots < int(hung[1]) <= 2 * slots, err
            assert len(SPINNING) <= int(hung[1])  # every spinning call is one it counts
            assert f"under reward_executor: {executor}" in err
            assert err.endswith("use reward_executor: process, which stops them")
            assert "\n" not in err  # one line for the CLI
        # once the abandoned calls return, the scorer scores again
        release_spinners()
        res = scorer.score(*rows(["a", "b"]))
        np.testing.assert_array_equal(res.total, [1, 1])
    finally:
        RELEASE.set()  # never leave a spinning thread behind, even when an assert fails
        scorer.close()
        release_spinners()


# ---- KeyboardInterrupt and SystemExit from a plugin: a failed call; a real Ctrl-C stops ----

def interrupts(prompts, completions, targets, metas):
    if "bad" in completions:
        raise KeyboardInterrupt
    return [1.0] * len(completions)


async def async_interrupts(prompts, completions, targets, metas):
    await asyncio.sleep(0)
    if "bad" in completions:
        raise KeyboardInterrupt
    return [1.0] * len(completions)


@per_sample
async def async_row_interrupts(prompt, completion, target, meta):
    await asyncio.sleep(0)
    if completion == "bad":  # raised in a row's own task, which asyncio lets out of the loop
        raise KeyboardInterrupt
    return 1.0


@per_sample
async def async_row_exits(prompt, completion, target, meta):
    if completion == "bad":
        raise SystemExit("plugin called sys.exit")
    return 1.0


@pytest.mark.parametrize("executor", ["serial", "thread", "process"])
def test_keyboard_interrupt_or_system_exit_from_any_plugin_is_a_failed_row(executor, caplog):
    fns = [interrupts, async_interrupts, async_row_interrupts, async_row_exits]
    with RewardScorer([spec(fn) for fn in fns], executor=executor, workers=2, on_error=-1.0,
                      max_fail_frac=0.5) as scorer:
        with caplog.at_level(logging.WARNING, logger="mini_grpo.scoring"):
            res = scorer.score(*rows(BATCH))
            res2 = scorer.score(*rows(BATCH))  # the scorer goes on
    for fn in fns:
        np.testing.assert_array_equal(res.columns[fn.__name__], [1, 1, 1, -1])
        assert res.metrics[f"reward/{fn.__name__}/failures"] == 1
        assert scorer.failure_counts[fn.__name__] == 2
    np.testing.assert_array_equal(res2.total, res.total)
    assert "KeyboardInterrupt" in caplog.text
    assert "SystemExit: plugin called sys.exit" in caplog.text


def ctrl_c(prompts, completions, targets, metas):
    os.killpg(os.getpgrp(), signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    time.sleep(20)
    return [1.0] * len(completions)


CTRL_C = """
import signal, sys, time
from mini_grpo.scoring import RewardScorer

# Ctrl-C as in a terminal, even where this suite was started in the background: a shell then
# starts it with SIGINT ignored, which every child inherits (no KeyboardInterrupt at all)
signal.signal(signal.SIGINT, signal.default_int_handler)

with RewardScorer([{"name": "test_scoring_limits:ctrl_c"}], executor=sys.argv[1], workers=2,
                  timeout=30) as scorer:
    t0 = time.perf_counter()
    try:
        scorer.score([""], ["x"], [""], None)
    except KeyboardInterrupt:
        print(f"stopped after {time.perf_counter() - t0:.3f} s")
"""


@pytest.mark.parametrize("executor", ["serial", "process"])
def test_a_real_ctrl_c_still_stops_scoring(executor):
    # its own session, so that the SIGINT to the process group reaches only it and its workers
    # (under process, one busy with the plugin, one idle)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", CTRL_C, executor], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60, start_new_session=True)
    assert out.returncode == 0, out.stderr
    said = out.stdout.strip()
    assert said.startswith("stopped after "), out.stdout
    # not after the plugin's 20 s sleep: the bound is the sleep's half, not a speed
    assert float(said.split()[2]) < 10, said
    assert "Traceback" not in out.stderr  # workers ignore the group's SIGINT


def test_a_ctrl_c_while_the_workers_start_up_leaves_them_running():
    # each worker gets its SIGINT while it imports the plugin, before init_worker: blocked
    # since the spawn, it waits for the no-op handler instead of ending the worker in a
    # traceback (seen on a slow CPU; here the SIGINT comes in every worker, every time)
    with RewardScorer([{"name": "ctrl_c_at_import:ones"}], executor="process",
                      workers=2) as scorer:
        res = scorer.score(["", ""], ["x", "y"], ["", ""], None)
        np.testing.assert_array_equal(res.total, [1.0, 1.0])
        assert res.metrics["reward/ones/failures"] == 0


# ---- rewards too large for the statistics fail like NaN, without a numpy warning ----

HUGE = {"max": 1e308, "neg": -1e308, "over": 1.5 * MAX_REWARD, "int": 10**400,
        "edge": MAX_REWARD, "ok": 1.0}


def huge(prompts, completions, targets, metas):
    return [HUGE[c] for c in completions]


def as_number(prompts, completions, targets, metas):
    return [float(c) for c in completions]


def test_rewards_too_large_for_the_statistics_fail_their_rows_without_a_warning(caplog):
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="mini_grpo.scoring"):
        warnings.simplefilter("error")  # a numpy overflow warning fails the test
        with RewardScorer([spec(huge, 2.0)], workers=2, on_error=-1.0,
                          max_fail_frac=1.0) as scorer:
            res = scorer.score(*rows(list(HUGE)))  # chunks: max, neg, over | int, edge, ok
        # MAX_REWARD passes alone, but not times the weight 2
        np.testing.assert_array_equal(res.columns["huge"], [-1, -1, -1, -1, -1, 1])
        np.testing.assert_array_equal(res.total, [-2, -2, -2, -2, -2, 2])
        assert res.metrics["reward/huge/failures"] == 5
        # the trainer's statistics: the total as float32, the sum of its squares
        assert np.isfinite(np.square(res.total.astype(np.float32)).sum())
    assert "returned 1e+308 for row 0 (3 bad rows in the call; a reward is a finite number " \
           "within +-1e+12)" in caplog.text


def test_weighted_rewards_beyond_the_bound_fail_their_rows(caplog):
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="mini_grpo.scoring"):
        warnings.simplefilter("error")
        # weight 1e3: 1e9 -> 1e12 stays, 2e9 -> 2e12 fails
        res = RewardScorer([spec(as_number, 1e3)], workers=1).score(*rows(["1e9", "2e9", "1"]))
        np.testing.assert_array_equal(res.columns["as_number"], [1e9, 0, 1])
        np.testing.assert_array_equal(res.total, [1e12, 0, 1e3])
        assert "row 1: reward 2e+09 times the weight 1000 is beyond +-1e+12" in caplog.text
        # weight 1e300: 1e10 x 1e300 overflows float64, quietly, and fails like the rest
        res = RewardScorer([spec(as_number, 1e300)], workers=1,
                           max_fail_frac=1.0).score(*rows(["1e10", "0"]))
        np.testing.assert_array_equal(res.total, [0, 0])
        assert res.metrics["reward/as_number/failures"] == 1


def test_reward_on_error_must_stay_in_range_after_weighting():
    with pytest.raises(ConfigError, match="reward_on_error: 1e\\+10 times 'as_number''s weight "
                                          "1000 is beyond"):
        RewardScorer([spec(as_number, 1e3)], on_error=1e10)


def test_the_thread_pool_finds_every_started_call_and_cancels_the_rest():
    """The contract _run relies on: cancel() fails only for a call that has started, and then
    thread_of finds the thread running it; a cancelled call never runs."""
    from mini_grpo.threads import DaemonThreadPool
    gate, ran = threading.Event(), []
    pool = DaemonThreadPool(1)
    try:
        first = pool.submit(gate.wait, 10)
        second = pool.submit(ran.append, "second")
        for _ in range(1000):  # the worker takes the first call (bounded wait, not a timing)
            if first.running():
                break
            time.sleep(0.01)
        assert not first.cancel()
        assert pool.thread_of(first) is pool._threads[0]
        assert second.cancel() and pool.thread_of(second) is None
    finally:
        gate.set()
        pool.shutdown(wait=True)
    assert first.result() is True and ran == []
