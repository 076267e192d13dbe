"""DaemonThreadPool: the reward scorer's thread pool, whose threads never keep the trainer
from exiting (a plugin call that never returns is abandoned, not waited for); run_at_once,
calls each in a thread of its own under one timeout (tools, environments)."""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait


def block_interrupts() -> None:
    """For a helper thread: the kernel hands a process's Ctrl-C (SIGINT, SIGTERM) to any
    thread not blocking it; blocked here, it reaches the main thread, which raises
    KeyboardInterrupt at once (else only once the helper's call returned: seen in CI, 20 s)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


def run_at_once(calls: list[tuple[Callable, tuple]], timeout: float | None) -> list[Future]:
    """Each (fn, args) of `calls` in a daemon thread of its own, all started at once; waits
    at most `timeout` seconds for them all. Returns their futures: those not done by then are
    left running, and keep no process from exiting."""
    pool = DaemonThreadPool(len(calls))
    futures = [pool.submit(fn, *args) for fn, args in calls]
    try:
        wait(futures, timeout=timeout)
    finally:
        pool.shutdown(wait=False)  # threads still in a call exit when it returns
    return futures


class DaemonThreadPool(Executor):
    """A thread pool of daemon threads, taking calls in submission order.

    ThreadPoolExecutor joins its threads when the interpreter exits, even after
    shutdown(wait=False), so a plugin call that never returns would keep the trainer alive
    forever. A daemon thread is dropped at exit instead.
    """

    def __init__(self, workers: int):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._running: dict[Future, threading.Thread] = {}  # calls under way, and their thread
        self._threads = [threading.Thread(target=self._work, name=f"reward-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        block_interrupts()
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            # known as running before it can run: a caller that fails to cancel a future
            # (cancel() is False once it runs) always finds its thread
            self._running[future] = threading.current_thread()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args))
                    except BaseException as e:  # KeyboardInterrupt too: the caller decides
                        future.set_exception(e)
            finally:
                del self._running[future]

    def submit(self, fn, /, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def thread_of(self, future: Future) -> threading.Thread | None:
        """The thread running `future`'s call, None when the call is not under way. Cancel the
        future first: when cancel() fails, the call has started and this finds its thread."""
        return self._running.get(future)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Idle threads exit now, busy ones when their call returns (hung ones never do)."""
        while cancel_futures:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)
        if wait:
            for t in self._threads:
                t.join()
