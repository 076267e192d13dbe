"""RewardScorer: run the configured reward plugins over a batch and combine them.

    with RewardScorer([{"name": "board_delta", "weight": 0.5},
                       {"name": "levenshtein", "weight": 0.5}], executor="process") as scorer:
        res = scorer.score(prompts, completions, targets, metas)
    res.total                  # (N,) weighted sum
    res.columns["levenshtein"] # (N,) one plugin, failed rows replaced by on_error
    res.metrics                # reward/<plugin>/{seconds,failures}, reward/seconds
    res = score(scorer, examples, texts, lengths, max_new_tokens)  # a task's examples

The metrics are the scorer's own health figures only: the trainer computes reward means and
stds across ranks from `columns` and `total`.

Work: each plugin's rows are cut into `workers` contiguous chunks and each (plugin, chunk) is
one call, run one at a time in a helper thread (serial), in `workers` threads (thread) or in
`workers` processes (process). The chunks are the same for the three executors, so they give
identical results, failures included. python-chess scorers are pure Python and hold the GIL:
threads only suit scorers that wait on I/O, processes give real parallelism (docs/rewards.md
has the figures). The async plugins of a batch are one job instead: a call per plugin on all
rows, run concurrently in one event loop (in a helper thread, or in one worker process);
their `per_sample` rows run at most `concurrency` at a time. Plugins get copies of the rows'
metadata, so they cannot change the dataset.

Processes are started with 'spawn', not fork: forking a trainer that runs torch and CUDA
threads can deadlock. Spawn sends plugins by reference, so they must be module-level
functions (checked here, at start-up), and re-imports the main module, so a launch script
needs the `if __name__ == "__main__":` guard. Pools start in the constructor and live until
close(), because starting workers costs about a second.

Failure isolation (plugin_calls.py): a call that raises, KeyboardInterrupt and SystemExit
included, is retried one row at a time in the same worker, so only the rows that raise alone
fail; a real Ctrl-C never lands in a plugin (plugin_calls.call), so it still stops the run. A
call that returns the wrong number of values, or a dict, set or string, fails all its rows;
NaN, Inf, None, non-numbers and rewards beyond +-MAX_REWARD, before or after weighting, fail
just their rows. A call counts as hung when no call of the batch finishes for `timeout`
seconds; its rows fail and the rest of the batch still scores. An async call is cancelled at
its own timeout, so a hung one never outlives its batch. What happens to the hung call
depends on the executor:
  process  its worker processes are killed and the pool restarts: the call is really stopped.
  serial, thread  a thread cannot be killed, so the call is abandoned: it keeps running (and
           using CPU) in the background until it returns, and new threads take over. They are
           daemon threads, so an abandoned call never keeps the process from exiting. At most
           one pool's worth (`workers`, serial 1) may still run: one more raises RewardError
           naming the plugin, so CPU-bound hangs never pile up.
Failed rows get `on_error`, a per-plugin counter goes up and the first error is logged once
("mini_grpo.scoring"); more than `max_fail_frac` of a batch's rows failing for one plugin
raises RewardError with that plugin's first error.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from mini_grpo.fields import ConfigError
from mini_grpo.plugin_calls import (
    MAX_REWARD,
    call,
    call_async,
    call_async_in_worker,
    call_in_worker,
    init_worker,
    sigint_blocked,
    worker_ready,
)
from mini_grpo.rewards import resolve_reward
from mini_grpo.rewards.registry import is_async
from mini_grpo.threads import DaemonThreadPool

log = logging.getLogger("mini_grpo.scoring")

EXECUTORS = ("serial", "thread", "process")
POOL_START_TIMEOUT = 120.0  # seconds for worker processes to import the plugins
# the longest the scorer blocks in one wait: a Ctrl-C whose signal lands after Python's last
# check and before the wait's blocking call is raised only when that call returns (CI saw a
# plugin's 20 s sleep pass so), so a wait is cut into slices of this many seconds
WAIT_SLICE = 0.25


def wait_first(pending, timeout: float):
    """concurrent.futures.wait(pending, timeout, FIRST_COMPLETED)'s done set, waited in slices
    of WAIT_SLICE seconds: between them Python runs a Ctrl-C that came in."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        done, _ = wait(pending, timeout=max(0.0, min(WAIT_SLICE, left)),
                       return_when=FIRST_COMPLETED)
        if done or left <= WAIT_SLICE:
            return done


class RewardError(RuntimeError):
    """A plugin failed on too many rows of one batch, or its workers could not start."""


@dataclass
class ScoreResult:
    total: np.ndarray  # (N,) float64 weighted sum
    columns: dict[str, np.ndarray]  # plugin -> (N,), after on_error substitution
    metrics: dict[str, float]  # reward/<plugin>/seconds, reward/<plugin>/failures, reward/seconds

    def take(self, rows: list[int]) -> ScoreResult:
        """The scores of rows `rows` alone (Rollout.take's); the scorer's metrics stay."""
        return ScoreResult(self.total[rows], {k: v[rows] for k, v in self.columns.items()},
                           self.metrics)


class RewardScorer:
    """Weighted reward plugins over one executor; names resolve (and pools start) at once."""

    def __init__(self, specs: list[dict], executor: str = "serial", workers: int = 2,
                 on_error: float = 0.0, timeout: float = 30.0, max_fail_frac: float = 0.5,
                 concurrency: int = 16):
        if executor not in EXECUTORS:
            raise ConfigError(f"reward_executor: must be one of {', '.join(EXECUTORS)}, "
                              f"got {executor!r}")
        if workers < 1:
            raise ConfigError(f"num_reward_workers: must be > 0, got {workers}")
        if not specs:
            raise ConfigError("rewards: no reward plugins configured")
        self.executor, self.workers, self.on_error = executor, workers, float(on_error)
        self.timeout, self.max_fail_frac = float(timeout), float(max_fail_frac)
        self.concurrency = concurrency
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
            weight = float(spec.get("weight", 1.0))
            if not abs(weight * self.on_error) <= MAX_REWARD:  # failed rows must stay in range
                raise ConfigError(f"reward_on_error: {self.on_error:g} times {key!r}'s weight "
                                  f"{weight:g} is beyond +-{MAX_REWARD:g}")
            self.keys.append(key)
            self.weights.append(weight)
            self.fns.append(fn)
        self.is_async = [is_async(fn) for fn in self.fns]
        self.failure_counts = dict.fromkeys(self.keys, 0)  # rows failed since start, per plugin
        self._logged: set[str] = set()
        self._slots = 1 if executor == "serial" else workers  # calls that run at once
        self._pool = None
        # serial, thread: (thread, plugin keys) of calls abandoned at the timeout; at most
        # `_slots` of them may still run (_check_abandoned)
        self._abandoned: list[tuple[threading.Thread, tuple[str, ...]]] = []
        self._start_pool()

    @classmethod
    def from_config(cls, cfg, task) -> RewardScorer:
        """cfg.rewards, else the task's defaults, run on cfg.reward_executor."""
        return cls(cfg.rewards or task.default_rewards, executor=cfg.reward_executor,
                   workers=cfg.num_reward_workers, on_error=cfg.reward_on_error,
                   timeout=cfg.reward_timeout, max_fail_frac=cfg.reward_max_fail_frac,
                   concurrency=cfg.reward_concurrency)

    # ---- pools ----

    def _start_pool(self) -> None:
        if self.executor != "process":
            # serial too: with the call in a helper thread, this one can stop waiting for it
            self._pool = DaemonThreadPool(self._slots)
            return
        self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context(
            "spawn"), initializer=init_worker, initargs=(self.fns,))
        # start every worker now, so that start-up time never counts against a plugin's timeout
        # (submit spawns them, in this thread)
        with sigint_blocked():
            ready = [self._pool.submit(worker_ready) for _ in range(self.workers)]
        done, late = wait(ready, timeout=POOL_START_TIMEOUT)
        errors = [f.exception() for f in done if f.exception() is not None]
        if late or errors:
            self._discard_pool()
            why = repr(errors[0]) if errors else f"not ready after {POOL_START_TIMEOUT:g} s"
            raise RewardError(f"reward worker processes did not start ({why}); "
                              f"try reward_executor: thread")

    def _discard_pool(self) -> None:
        """Drops the pool without waiting: worker processes are killed (the only way to stop a
        hung call), threads are abandoned to finish or hang on their own."""
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
            pool.shutdown(wait=self.executor == "process", cancel_futures=True)

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
        calls = [(p, lo, hi) for p in range(len(self.fns)) if not self.is_async[p]
                 for lo, hi in chunks]
        jobs = [[i] for i in range(len(calls))]
        if any(self.is_async):  # one job: every async plugin on all rows, concurrently
            jobs.append(list(range(len(calls), len(calls) + sum(self.is_async))))
            calls += [(p, 0, n) for p in range(len(self.fns)) if self.is_async[p]]
        outs = self._run(calls, jobs, (prompts, completions, targets, metas))

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
            col, w = cols[p], self.weights[p]
            with np.errstate(over="ignore"):  # a huge weight gives inf here, which fails the row
                big = ~np.isnan(col) & ~(np.abs(w * col) <= MAX_REWARD)
            if big.any() and first_error[p] is None:
                i = int(np.flatnonzero(big)[0])
                first_error[p] = f"row {i}: reward {col[i]:g} times the weight {w:g} is beyond " \
                                 f"+-{MAX_REWARD:g} ({int(big.sum())} such rows)"
            failed = np.isnan(col) | big
            col[failed] = self.on_error
            nfail = int(failed.sum())
            if nfail > self.max_fail_frac * n and too_many is None:
                too_many = (key, nfail, first_error[p])  # raised below, not logged twice
            elif nfail:
                self._record_failure(key, nfail, n, first_error[p])
            total += w * col
            columns[key] = col
            metrics[f"reward/{key}/seconds"] = seconds[p]
            metrics[f"reward/{key}/failures"] = float(nfail)
        if too_many is not None:
            key, nfail, err = too_many
            last = (err or "").strip().splitlines()[-1:] or ["?"]
            raise RewardError(f"reward plugin {key!r} failed on {nfail} of {n} rows, more than "
                              f"reward_max_fail_frac={self.max_fail_frac:g}; first error: "
                              f"{last[0]}\n{err}")
        metrics["reward/seconds"] = time.perf_counter() - t0
        return ScoreResult(total, columns, metrics)

    def _record_failure(self, key: str, nfail: int, n: int, err: str | None) -> None:
        self.failure_counts[key] += nfail
        if key not in self._logged:
            self._logged.add(key)
            log.warning("reward plugin %r failed on %d of %d rows; they get %g. Later failures "
                        "are only counted (reward/%s/failures). First error:\n%s",
                        key, nfail, n, self.on_error, key, err)

    def _run(self, calls, jobs, rows):
        """Runs each job (a list of calls) on the pool: one result per call, in order."""
        outs: list = [None] * len(calls)
        todo = list(range(len(jobs)))
        self._check_abandoned()
        while todo:
            if self._pool is None:
                self._start_pool()
            futures = {self._submit([calls[i] for i in jobs[j]], rows): j for j in todo}
            pending, broken = list(futures), False
            try:
                while pending:
                    # an async job cancels its own calls at `timeout`: give it time to report
                    slack = any(self.is_async[calls[jobs[futures[f]][0]][0]] for f in pending)
                    limit = self.timeout * (1.5 if slack else 1.0) + (1.0 if slack else 0.0)
                    done = wait_first(pending, limit)
                    if not done:
                        break
                    for f in done:
                        job = jobs[futures[f]]
                        # a stored exception, never this thread's Ctrl-C: a worker process
                        # died (crash, os._exit, OOM), or a plugin's KeyboardInterrupt got out
                        # of an event loop (a loop callback's; tasks' are contained)
                        e = f.exception()
                        if e is None:
                            for i, out in zip(job, f.result()):
                                outs[i] = out
                        else:
                            for i in job:
                                outs[i] = (None, 0.0, f"reward worker failed: {e!r}")
                            broken = True
                    pending = [f for f in pending if f not in done]
            except BaseException:  # Ctrl-C: drop this batch's calls, so the next one starts clean
                self._discard_pool()
                raise
            # Nothing finished for `timeout` seconds: the oldest unfinished jobs are the running
            # ones (every pool starts work in submission order), so those hang.
            for f in pending[:self._slots]:
                for i in jobs[futures[f]]:
                    p, lo, hi = calls[i]
                    outs[i] = (None, self.timeout, f"call on rows {lo}..{hi - 1} did not "
                               f"finish within the {self.timeout:g} s timeout")
                # a call starved of its start (threads spinning on the GIL) is cancelled, never
                # run; one under way cannot be, and its thread is found (unless it has just
                # returned: then no thread hangs)
                running = not f.cancel() and not f.done()
                thread = self._pool.thread_of(f) if running and \
                    isinstance(self._pool, DaemonThreadPool) else None
                if thread is not None:  # serial, thread: the call runs on, abandoned
                    keys = tuple(dict.fromkeys(self.keys[calls[i][0]] for i in jobs[futures[f]]))
                    self._abandoned.append((thread, keys))
            if pending or broken:
                self._discard_pool()
            if pending:
                self._check_abandoned()
            todo = [futures[f] for f in pending[self._slots:]]
        return outs

    def _check_abandoned(self) -> None:
        """Serial, thread: RewardError when more than one pool's worth of abandoned calls still
        run. Threads cannot be stopped, and a plugin that loops on the CPU would otherwise
        leave one more GIL-holding thread behind at every timeout until the trainer crawls;
        a call that waits on I/O and returns later frees its place."""
        self._abandoned = [(t, keys) for t, keys in self._abandoned if t.is_alive()]
        if len(self._abandoned) > self._slots:
            keys = ", ".join(map(repr, dict.fromkeys(k for _, ks in self._abandoned for k in ks)))
            raise RewardError(f"reward plugin {keys}: {len(self._abandoned)} calls that ran past "
                              f"reward_timeout={self.timeout:g} s are still running; a thread "
                              f"cannot be stopped, so under reward_executor: {self.executor} "
                              f"hung calls would pile up; use reward_executor: process, which "
                              f"stops them")

    def _submit(self, job: list, rows):
        """One job on the pool: a sync plugin's call, or the batch's async calls together."""
        args = [(p, lo, *(r[lo:hi] for r in rows)) for p, lo, hi in job]
        if self.executor == "process":  # pickling gives the worker its own copy of the rows
            fn, args = ((call_async_in_worker, (args, self.timeout, self.concurrency))
                        if self.is_async[job[0][0]] else (call_in_worker, args[0]))
            with sigint_blocked():  # the submit spawns a worker where one has not started yet
                return self._pool.submit(fn, *args)
        # the same deep copy a worker process gets, so that a plugin cannot change the dataset
        # or what the next plugin sees (pickle: 6x faster than copy.deepcopy on small dicts)
        args = [(self.fns[p], lo, prompts, completions, targets, pickle.loads(pickle.dumps(m)))
                for p, lo, prompts, completions, targets, m in args]
        if self.is_async[job[0][0]]:
            return self._pool.submit(call_async, args, self.timeout, self.concurrency)
        return self._pool.submit(lambda a: [call(*a)], args[0])


def score(scorer, examples: list, texts: list[str], lengths: list[int], max_new_tokens: int,
          conversations: list[list[dict]] | None = None,
          env_rewards: list[float] | None = None):
    """The scorer's result for completions `texts` of `examples` (one each), whose metadata
    gets what sampling knows of each completion: `completion_tokens` (its length),
    `max_new_tokens` (the cap it may have hit) and, for multi-turn rollouts, `messages` (the
    conversation after the prompt: the model's turns, the tools' answers; `texts` holds the
    last turn). An environment's reward parts (`env_rewards`, summed per row) add to the
    total as one more column, `env`. The trainer, evaluation and RFT score here."""
    conversations = conversations or [None] * len(examples)
    metas = [{**ex.meta, "completion_tokens": int(n), "max_new_tokens": max_new_tokens,
              **({"messages": c} if c is not None else {})}
             for ex, n, c in zip(examples, lengths, conversations)]
    res = scorer.score([ex.prompt for ex in examples], texts, [ex.target for ex in examples],
                       metas)
    if env_rewards is not None:
        env = np.asarray(env_rewards, dtype=np.float64)
        res = ScoreResult(res.total + env, {**res.columns, "env": env}, res.metrics)
    return res
