"""One reward plugin call, the same code in a helper thread or a worker process
(scoring.RewardScorer runs them): its values checked row by row, a call that raises retried
one row at a time, async plugins run concurrently in one event loop, and the worker
process's side (its plugins, SIGINT left to the trainer).
"""

from __future__ import annotations

import asyncio
import signal
import time
import traceback
from collections.abc import Mapping, Set
from contextlib import contextmanager

import numpy as np

from mini_grpo.rewards.registry import ROW_SLOTS

# Largest |reward| a plugin may give, before and after its weight; beyond, the row fails like
# a NaN. The trainer's advantages take the total as float32 (max 3.4e38) and sum its squares:
# a few plugins at 1e12 keep that finite for any batch up to ~1e12 rows.
MAX_REWARD = 1e12
_TEXT = (str, bytes, bytearray)  # never a reward, nor a list of them
_COMPLEX = (complex, np.complexfloating)  # numpy would read 0.5+3j as 0.5 (and "0.5" too)


def _as_rewards(values, n: int, lo: int) -> tuple[np.ndarray | None, str | None]:
    """(rewards with NaN where a row failed, or None when the whole call failed; error)."""
    if isinstance(values, (Mapping, Set, *_TEXT)):
        # iterable, but not one value per row in order: a dict would be read as its keys
        return None, f"returned {type(values).__name__}, expected a list of {n} floats"
    if not isinstance(values, (list, tuple, np.ndarray)):
        try:
            values = list(values)
        except TypeError:
            return None, f"returned {type(values).__name__}, expected a list of {n} floats"
    try:
        if any(isinstance(v, (*_TEXT, *_COMPLEX)) for v in values):
            raise ValueError
        arr = np.array(values, dtype=np.float64)  # a copy; None becomes NaN
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float's range
        arr = np.array([_float_or_nan(v) for v in values]) if len(values) == n else None
    if arr is None or arr.shape != (n,):
        got = f"an array of shape {arr.shape}" if arr is not None and arr.ndim != 1 else \
            f"{len(values)} values"
        return None, f"returned {got} for {n} rows"
    bad = ~(np.abs(arr) <= MAX_REWARD)  # NaN, Inf, or so large that statistics would overflow
    if not bad.any():
        return arr, None
    i = int(np.flatnonzero(bad)[0])
    arr[bad] = np.nan
    return arr, f"returned {values[i]!r} for row {lo + i} ({int(bad.sum())} bad rows in the " \
                f"call; a reward is a finite number within +-{MAX_REWARD:g})"


def _float_or_nan(v) -> float:
    if isinstance(v, _TEXT):  # "0.5" is no reward
        return float("nan")
    if isinstance(v, _COMPLEX):  # a real number as complex is that number; 0.5+3j is none
        return float(v.real) if v.imag == 0 else float("nan")
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return float("nan")


def call(fn, lo: int, prompts, completions, targets, metas):
    """(rewards or None, seconds, error text or None) for rows lo..lo+len(completions).

    Whatever this catches is the plugin's own, KeyboardInterrupt included: it runs in a helper
    thread (serial, thread), and Python delivers signals to the main thread only, or in a
    worker process, which ignores SIGINT (init_worker). A real Ctrl-C lands in the trainer's
    main thread, waiting in RewardScorer._run, and stops the run there."""
    t0 = time.perf_counter()
    try:
        values = fn(prompts, completions, targets, metas)
        arr, err = _as_rewards(values, len(completions), lo)
    except BaseException:  # SystemExit, KeyboardInterrupt: a plugin must not end the trainer
        arr, err = None, traceback.format_exc()
        if len(completions) > 1:  # one bad row must not cost the good rows of its chunk
            arr, err = _call_by_row(fn, lo, prompts, completions, targets, metas)
    return arr, time.perf_counter() - t0, err


def _call_by_row(fn, lo: int, prompts, completions, targets, metas):
    """The rewards of a call that raised, retried one row at a time: (rewards, first error)."""
    return _merge_rows(lo, [call(fn, lo + i, prompts[i:i + 1], completions[i:i + 1],
                                  targets[i:i + 1], metas[i:i + 1])
                            for i in range(len(completions))])


def _merge_rows(lo: int, rows: list) -> tuple[np.ndarray, str | None]:
    """One row's `call` results each, from row `lo` on -> (rewards, first error)."""
    arr = np.array([np.nan if r is None else r[0] for r, _, _ in rows])
    errs = [(lo + i, err) for i, (_, _, err) in enumerate(rows) if err is not None]
    if not errs:
        return arr, None
    return arr, f"row {errs[0][0]}, retried alone after the call on rows " \
                f"{lo}..{lo + len(rows) - 1} raised:\n{errs[0][1]}"


async def _acall(fn, lo: int, prompts, completions, targets, metas, timeout: float):
    """`call` for an async plugin, cancelled after `timeout` seconds."""
    t0, hi = time.perf_counter(), lo + len(completions)
    try:
        values = await asyncio.wait_for(fn(prompts, completions, targets, metas), timeout)
        arr, err = _as_rewards(values, len(completions), lo)
    except TimeoutError:
        arr, err = None, f"call on rows {lo}..{hi - 1} did not finish within the " \
                         f"{timeout:g} s timeout"
    except BaseException:
        arr, err = None, traceback.format_exc()
        if len(completions) > 1:  # rows retried alone, concurrently
            rows = await asyncio.gather(*(_acall(fn, lo + i, prompts[i:i + 1],
                                                 completions[i:i + 1], targets[i:i + 1],
                                                 metas[i:i + 1], timeout)
                                          for i in range(len(completions))))
            arr, err = _merge_rows(lo, rows)
    return arr, time.perf_counter() - t0, err


class PluginInterrupt(Exception):
    """A plugin's own KeyboardInterrupt or SystemExit, carried as an ordinary exception."""


async def _contained(coro):
    try:
        return await coro
    except (KeyboardInterrupt, SystemExit) as e:
        raise PluginInterrupt(f"the plugin raised {type(e).__name__}") from e


def _contained_task(loop, coro, **kwargs) -> asyncio.Task:
    """Task factory: asyncio re-raises a task's KeyboardInterrupt or SystemExit out of the
    event loop, which would end every call of the batch (the per-row tasks of `per_sample`
    included); as a PluginInterrupt, it fails only the call, like any other exception."""
    return asyncio.Task(_contained(coro), loop=loop, **kwargs)


def call_async(calls: list, timeout: float, concurrency: int) -> list:
    """[(fn, lo, prompts, completions, targets, metas)] -> their `call` results, run
    concurrently in one event loop of this thread."""
    async def run_all():
        asyncio.get_running_loop().set_task_factory(_contained_task)
        ROW_SLOTS.set(asyncio.Semaphore(concurrency))
        return await asyncio.gather(*(_acall(*c, timeout) for c in calls))
    return asyncio.run(run_all())


_worker_fns: list = []  # this worker process's plugins, set once by init_worker


def init_worker(fns: list) -> None:
    # Ctrl-C at a terminal reaches the whole process group; the trainer stops and kills its
    # workers, so a worker ignores it, and a KeyboardInterrupt in one is a plugin's. A no-op
    # handler, not SIG_IGN, which the plugins' own subprocesses would inherit. SIGINT has been
    # blocked since the worker was spawned (sigint_blocked): one that came while it imported
    # the plugins waits until now, and lands in the no-op.
    signal.signal(signal.SIGINT, _no_op)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _worker_fns[:] = fns


@contextmanager
def sigint_blocked():
    """SIGINT blocked in this thread while it spawns worker processes, which inherit the mask:
    a Ctrl-C during a worker's start-up (seconds, importing torch and the plugins) then waits
    for init_worker instead of ending the worker in a KeyboardInterrupt traceback. The trainer
    loses nothing: the kernel hands its own SIGINT to another thread, or keeps it pending here
    until the block ends."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _no_op(signum, frame) -> None:
    pass


def call_in_worker(index: int, lo: int, *rows):
    return [call(_worker_fns[index], lo, *rows)]


def call_async_in_worker(calls: list, timeout: float, concurrency: int) -> list:
    return call_async([(_worker_fns[i], *rest) for i, *rest in calls], timeout, concurrency)


def worker_ready() -> bool:
    return True
