"""Long stages speak at least every 10 s (progress.py): the evaluation, the set-up's phases.
No duration is asserted: the stage under test waits for the line it expects (bounded), and
the phases' seconds come from a clock the test sets."""

import threading
import time

from mini_grpo import progress
from mini_grpo.progress import Heartbeat, Phases


def test_a_heartbeat_speaks_while_its_stage_runs_and_never_after():
    lines, spoke = [], threading.Event()

    def say(line):
        lines.append(line)
        spoke.set()

    state = {"done": 3}
    with Heartbeat(say, lambda: f"[eval] greedy: {state['done']}/8", every=0.01):
        assert spoke.wait(60)  # the stage lasts until the heartbeat has spoken
    said = len(lines)
    time.sleep(0.05)  # a line after the stage ended would land here
    assert len(lines) == said >= 1
    assert lines[0].startswith("[eval] greedy: 3/8 (") and lines[0].endswith(" s)")


def test_phases_are_timed_one_after_the_other_and_reported_in_one_line(monkeypatch):
    clock = {"t": 100.0}
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock["t"])
    lines = []
    phases = Phases(lines.append, "[mini-grpo] set-up", every=3600)
    phases.begin("the task")
    clock["t"] += 2.0
    phases.begin("the precision probe")  # the task's phase ends here
    clock["t"] += 30.0
    phases.begin("the engine")
    clock["t"] += 0.25
    assert phases.report() == "[mini-grpo] set-up: 32 s (the task 2 s, the precision probe 30 s)"
    assert lines == ["[mini-grpo] set-up: 32 s (the task 2 s, the precision probe 30 s)"]
    phases.end()  # idempotent: nothing runs
    assert phases.seconds == {"the task": 2.0, "the precision probe": 30.0, "the engine": 0.25}


def test_the_evaluation_s_line_says_done_rate_and_time_left(monkeypatch):
    from mini_grpo.evaluate import _Status

    clock = {"t": 50.0}
    monkeypatch.setattr(time, "monotonic", lambda: clock["t"])
    s = _Status("[eval] sampled", 400, "100 validation")
    assert s.line() == "[eval] sampled: 0/400 completions of 100 validation prompts"
    s.done, clock["t"] = 100, 70.0
    assert s.line() == ("[eval] sampled: 100/400 completions of 100 validation prompts, "
                        "5.0/s, ETA 60 s")


def test_laps_time_each_phase_from_the_end_of_the_one_before():
    from mini_grpo.progress import Laps

    now = iter([0.0, 5.0, 7.0, 7.5, 10.0])
    lap = Laps(clock=lambda: next(now))  # 0.0: made
    lap.start()  # 5.0: what came before is no phase's
    lap("sync")  # 7.0
    lap("generate")  # 7.5
    lap.times["optimizer"] = 1.0  # a phase's own figure, set beside the laps
    lap("policy")  # 10.0
    assert lap.times == {"sync": 2.0, "generate": 0.5, "optimizer": 1.0, "policy": 2.5}
