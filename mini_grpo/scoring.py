"""RewardScorer: run the configured reward plugins over a batch and combine them.

    with RewardScorer([{"name": "board_delta", "weight": 0.5},
                       {"name": "levenshtein", "weight": 0.5}], executor="process") as scorer:
        res = scorer.score(prompts, completions, targets, metas)
    res.total                  # (N,) weighted sum
    res.columns["levenshtein"] # (N,) one plugin, failed rows replaced by on_error
    res.metrics                # reward/<plugin>/{mean,std,seconds,failures}, reward/total/...

Work: each plugin's rows are cut into `workers` contiguous chunks and each (plugin, chunk) is
one call, run in this thread (serial), a ThreadPoolExecutor (thread) or a ProcessPoolExecutor
(process). The chunks are the same for the three executors, so they give identical results,
failures included. python-chess scorers are pure Python and hold the GIL: threads only suit
scorers that wait on I/O, processes give real parallelism (docs/rewards.md has the figures).

Processes are started with 'spawn', not fork: forking a trainer that runs torch and CUDA
threads can deadlock. Spawn sends plugins by reference, so they must be module-level
functions (checked here, at start-up), and re-imports the main module, so a launch script
needs the `if __name__ == "__main__":` guard. Pools start in the constructor and live until
close(), because starting workers costs about a second.

Failure isolation: a call that raises or returns the wrong number of values fails all its rows;
NaN, Inf, None or non-numbers fail just their rows; a pooled call counts as hung when no call of
the batch finishes for `timeout` seconds (then its workers are killed, or, for threads,
abandoned, and the pool restarts), and a serial call that overruns the timeout fails after the
fact. Failed rows get `on_error`, a per-plugin counter goes up and the first error is logged
once ("mini_grpo.scoring"); more than `max_fail_frac` of a batch's rows failing for one plugin
raises RewardError with that plugin's first error.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from mini_grpo.config import ConfigError
from mini_grpo.rewards import resolve_reward

log = logging.getLogger("mini_grpo.scoring")

EXECUTORS = ("serial", "thread", "process")
POOL_START_TIMEOUT = 120.0  # seconds for worker processes to import the plugins


class RewardError(RuntimeError):
    """A plugin failed on too many rows of one batch, or its workers could not start."""


@dataclass
class ScoreResult:
    total: np.ndarray  # (N,) float64 weighted sum
    columns: dict[str, np.ndarray]  # plugin -> (N,), after on_error substitution
    metrics: dict[str, float]


# ---- one plugin call: the same code runs in this thread, a pool thread or a worker process ----

def _as_rewards(values, n: int, lo: int) -> tuple[np.ndarray | None, str | None]:
    """(rewards with NaN where a row failed, or None when the whole call failed; error)."""
    if not isinstance(values, (list, tuple, np.ndarray)):
        try:
            values = list(values)
        except TypeError:
            return None, f"returned {type(values).__name__}, expected a list of {n} floats"
    try:
        arr = np.array(values, dtype=np.float64)  # a copy; None becomes NaN
    except (TypeError, ValueError):
        arr = np.array([_float_or_nan(v) for v in values]) if len(values) == n else None
    if arr is None or arr.shape != (n,):
        got = f"an array of shape {arr.shape}" if arr is not None and arr.ndim != 1 else \
            f"{len(values)} values"
        return None, f"returned {got} for {n} rows"
    bad = ~np.isfinite(arr)
    if not bad.any():
        return arr, None
    i = int(np.flatnonzero(bad)[0])
    arr[bad] = np.nan
    return arr, f"returned {values[i]!r} for row {lo + i} ({int(bad.sum())} bad rows in the call)"


def _float_or_nan(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _call(fn, lo: int, prompts, completions, targets, metas):
    """(rewards or None, seconds, error text or None) for rows lo..lo+len(completions)."""
    t0 = time.perf_counter()
    try:
        values = fn(prompts, completions, targets, metas)
        arr, err = _as_rewards(values, len(completions), lo)
    except Exception:
        arr, err = None, traceback.format_exc()
    return arr, time.perf_counter() - t0, err


_worker_fns: list = []  # this worker process's plugins, set once by _init_worker


def _init_worker(fns: list) -> None:
    _worker_fns[:] = fns


def _call_in_worker(index: int, lo: int, *rows):
    return _call(_worker_fns[index], lo, *rows)


def _ready() -> bool:
    return True


class RewardScorer:
    """Weighted reward plugins over one executor; names resolve (and pools start) at once."""

    def __init__(self, specs: list[dict], executor: str = "serial", workers: int = 2,
                 on_error: float = 0.0, timeout: float = 30.0, max_fail_frac: float = 0.5):
        if executor not in EXECUTORS:
            raise ConfigError(f"reward_executor: must be one of {', '.join(EXECUTORS)}, "
                              f"got {executor!r}")
        if workers < 1:
            raise ConfigError(f"num_reward_workers: must be > 0, got {workers}")
        if not specs:
            raise ConfigError("rewards: no reward plugins configured")
        self.executor, self.workers, self.on_error = executor, workers, float(on_error)
        self.timeout, self.max_fail_frac = float(timeout), float(max_fail_frac)
        self.keys: list[str] = []  # column and metric names: the name after any "module:"
        self.weights: list[float] = []
        self.fns: list = []
        for spec in specs:
            name, fn = spec["name"], resolve_reward(spec["name"])  # bad names fail here, early
            key = name.rpartition(":")[2]
            if key in self.keys:
                raise ConfigError(f"rewards: two entries would both be logged as {key!r}")
            if executor == "process":
                try:
                    pickle.dumps(fn)
                except Exception as e:
                    raise ConfigError(f"reward {name!r}: cannot be sent to worker processes "
                                      f"({e}); make it a module-level function or use "
                                      f"reward_executor: thread") from None
            self.keys.append(key)
            self.weights.append(float(spec.get("weight", 1.0)))
            self.fns.append(fn)
        self.failure_counts = dict.fromkeys(self.keys, 0)  # rows failed since start, per plugin
        self._logged: set[str] = set()
        self._pool = None
        if executor != "serial":
            self._start_pool()

    @classmethod
    def from_config(cls, cfg, task) -> RewardScorer:
        """cfg.rewards, else the task's defaults; parallel_rewards: false means serial."""
        return cls(cfg.rewards or task.default_rewards,
                   executor=cfg.reward_executor if cfg.parallel_rewards else "serial",
                   workers=cfg.num_reward_workers, on_error=cfg.reward_on_error,
                   timeout=cfg.reward_timeout, max_fail_frac=cfg.reward_max_fail_frac)

    # ---- pools ----

    def _start_pool(self) -> None:
        if self.executor == "thread":
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="reward")
            return
        self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context(
            "spawn"), initializer=_init_worker, initargs=(self.fns,))
        # start every worker now, so that start-up time never counts against a plugin's timeout
        ready = [self._pool.submit(_ready) for _ in range(self.workers)]
        done, late = wait(ready, timeout=POOL_START_TIMEOUT)
        errors = [f.exception() for f in done if f.exception() is not None]
        if late or errors:
            self._discard_pool()
            why = repr(errors[0]) if errors else f"not ready after {POOL_START_TIMEOUT:g} s"
            raise RewardError(f"reward worker processes did not start ({why}); "
                              f"try reward_executor: thread")

    def _discard_pool(self) -> None:
        """Drops the pool without waiting: killing workers is the only way to stop a hung call."""
        pool, self._pool = self._pool, None
        if isinstance(pool, ProcessPoolExecutor):
            for p in list(pool._processes.values()):  # no public API for this before 3.14
                p.kill()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            # a hung plugin thread cannot be stopped, so threads are not waited for
            pool.shutdown(wait=isinstance(pool, ProcessPoolExecutor), cancel_futures=True)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- scoring ----

    def score(self, prompts: list[str], completions: list[str], targets: list[str],
              metas: list[dict] | None = None) -> ScoreResult:
        n = len(completions)
        metas = [{} for _ in range(n)] if metas is None else metas
        if not len(prompts) == len(targets) == len(metas) == n:
            raise ValueError(f"score: got {len(prompts)} prompts, {n} completions, "
                             f"{len(targets)} targets and {len(metas)} metas")
        t0 = time.perf_counter()
        edges = [n * i // self.workers for i in range(self.workers + 1)]
        chunks = [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]
        calls = [(p, lo, hi) for p in range(len(self.fns)) for lo, hi in chunks]
        rows = (prompts, completions, targets, metas)
        outs = self._run_serial(calls, rows) if self.executor == "serial" else \
            self._run_pooled(calls, rows)

        cols = [np.full(n, np.nan) for _ in self.fns]
        seconds = [0.0] * len(self.fns)
        first_error: list[str | None] = [None] * len(self.fns)
        for (p, lo, hi), (arr, secs, err) in zip(calls, outs):
            seconds[p] += secs
            if arr is not None:
                cols[p][lo:hi] = arr
            if err is not None and first_error[p] is None:
                first_error[p] = err

        total = np.zeros(n)
        columns, metrics, too_many = {}, {}, None
        for p, key in enumerate(self.keys):
            col = cols[p]
            failed = np.isnan(col)
            col[failed] = self.on_error
            nfail = int(failed.sum())
            if nfail:
                self._record_failure(key, nfail, n, first_error[p])
                if nfail > self.max_fail_frac * n and too_many is None:
                    too_many = (key, nfail, first_error[p])
            total += self.weights[p] * col
            columns[key] = col
            metrics[f"reward/{key}/mean"] = float(col.mean()) if n else 0.0
            metrics[f"reward/{key}/std"] = float(col.std()) if n else 0.0
            metrics[f"reward/{key}/seconds"] = seconds[p]
            metrics[f"reward/{key}/failures"] = float(nfail)
        if too_many is not None:
            key, nfail, err = too_many
            raise RewardError(f"reward plugin {key!r} failed on {nfail} of {n} rows, more than "
                              f"reward_max_fail_frac={self.max_fail_frac:g}; first error:\n{err}")
        metrics["reward/total/mean"] = float(total.mean()) if n else 0.0
        metrics["reward/total/std"] = float(total.std()) if n else 0.0
        metrics["reward/seconds"] = time.perf_counter() - t0
        return ScoreResult(total, columns, metrics)

    def _record_failure(self, key: str, nfail: int, n: int, err: str | None) -> None:
        self.failure_counts[key] += nfail
        if key not in self._logged:
            self._logged.add(key)
            log.warning("reward plugin %r failed on %d of %d rows; they get %g. Later failures "
                        "are only counted (reward/%s/failures). First error:\n%s",
                        key, nfail, n, self.on_error, key, err)

    def _run_serial(self, calls, rows):
        outs = []
        for p, lo, hi in calls:
            arr, secs, err = _call(self.fns[p], lo, *(r[lo:hi] for r in rows))
            if secs > self.timeout:  # cannot interrupt our own thread; fail it after the fact
                arr, err = None, f"call on rows {lo}..{hi - 1} took {secs:.3g} s, " \
                                 f"more than the {self.timeout:g} s timeout"
            outs.append((arr, secs, err))
        return outs

    def _run_pooled(self, calls, rows):
        outs: list = [None] * len(calls)
        todo = list(range(len(calls)))
        while todo:
            if self._pool is None:
                self._start_pool()
            futures = {self._submit(*calls[i], rows): i for i in todo}
            pending, broken = list(futures), False
            while pending:
                done, _ = wait(pending, timeout=self.timeout, return_when=FIRST_COMPLETED)
                if not done:
                    break
                for f in done:
                    try:
                        outs[futures[f]] = f.result()
                    except Exception as e:  # a worker process died (crash, os._exit, OOM)
                        outs[futures[f]] = (None, 0.0, f"reward worker failed: {e!r}")
                        broken = True
                pending = [f for f in pending if f not in done]
            # Nothing finished for `timeout` seconds: the oldest unfinished calls are the running
            # ones (both pools start work in submission order), so those hang.
            for f in pending[:self.workers]:
                p, lo, hi = calls[futures[f]]
                outs[futures[f]] = (None, self.timeout, f"call on rows {lo}..{hi - 1} did not "
                                    f"finish within the {self.timeout:g} s timeout")
            if pending or broken:
                self._discard_pool()
            todo = [futures[f] for f in pending[self.workers:]]
        return outs

    def _submit(self, p: int, lo: int, hi: int, rows):
        chunk = [r[lo:hi] for r in rows]
        if self.executor == "process":
            return self._pool.submit(_call_in_worker, p, lo, *chunk)
        return self._pool.submit(_call, self.fns[p], lo, *chunk)
