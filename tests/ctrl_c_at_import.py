"""A reward plugin whose module, imported in a spawned worker, sends that worker a SIGINT: a
terminal's Ctrl-C that lands while the process executor's workers are still starting up."""

import multiprocessing
import os
import signal

# a spawned worker (named so by multiprocessing before it imports the plugins), never the
# test's own process
if multiprocessing.current_process().name != "MainProcess":
    # as at a terminal, even where the suite runs in the background with SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.kill(os.getpid(), signal.SIGINT)


def ones(prompts, completions, targets, metas):
    return [1.0] * len(completions)
