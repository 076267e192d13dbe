"""distributed_train.py with test hooks installed (mini_grpo.faults), for torchrun tests:

    torchrun ... tests/fault_worker.py --fault=crash:3 -- --config tiny ...
    python tests/fault_worker.py --nan_steps=2,3 -- --config tiny ...

    --fault=crash:N    the last rank exits abruptly at GRPO step N (first attempt only, so an
                       elastic restart can finish the job)
    --fault=raise:N    the last rank raises at step N
    --nan_steps=A,B    the last rank's loss and gradient are poisoned at those steps
    --fault=kill:PID:N the last rank kills process PID (a vLLM server) at step N
    --slow_rank0=S     rank 0 takes S seconds more for each of its spells of work alone
                       (evaluations, export: Run.rank0_with_weights)

In-process tests install the same hooks with `installed(...)`.
"""

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mini_grpo import faults  # noqa: E402


def _last_rank(dist) -> bool:
    return dist.rank == dist.world_size - 1


def fault(kind: str, at: int, pid: int = 0):
    def hook(step, dist):
        if kind == "kill":
            if step == at and _last_rank(dist):
                print(f"[fault] killing process {pid} at step {step}", flush=True)
                os.kill(pid, signal.SIGKILL)
            return
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step == at and _last_rank(dist) and first_attempt:
            if kind == "crash":
                print(f"[fault] rank {dist.rank} exits abruptly at step {step}", flush=True)
                os._exit(13)
            raise RuntimeError(f"injected fault on rank {dist.rank} at step {step}")
    return hook


def nan_at(steps):
    """Sets the last rank's loss and first gradient to NaN at `steps`."""
    steps = set(steps)

    def hook(step, dist, loss, model):
        if _last_rank(dist) and step in steps:
            loss.fill_(float("nan"))
            next(model.parameters()).grad.fill_(float("nan"))
    return hook


def slow(seconds: float):
    def hook(dist):
        print(f"[fault] rank {dist.rank} works alone {seconds:g} s longer", flush=True)
        time.sleep(seconds)
    return hook


@contextlib.contextmanager
def installed(fault_spec: str = "", nan_steps=(), slow_rank0: float = 0):
    """The hooks installed for the duration of the block."""
    added = []
    if slow_rank0:
        added.append((faults.RANK0_ALONE, slow(slow_rank0)))
    if fault_spec:
        kind, *numbers = fault_spec.split(":")
        pid, at = (int(numbers[0]), int(numbers[1])) if kind == "kill" else (0, int(numbers[0]))
        added.append((faults.STEP_START, fault(kind, at, pid)))
    if nan_steps:
        added.append((faults.AFTER_BACKWARD, nan_at(nan_steps)))
    for hooks, h in added:
        hooks.append(h)
    try:
        yield
    finally:
        for hooks, h in added:
            hooks.remove(h)


def main() -> int:
    args = sys.argv[1:]
    split = args.index("--") if "--" in args else len(args)
    ours, rest = args[:split], args[split + 1:]
    spec, nans, slow_rank0 = "", (), 0.0
    for a in ours:
        key, _, value = a.partition("=")
        if key == "--fault":
            spec = value
        elif key == "--nan_steps":
            nans = [int(s) for s in value.split(",") if s]
        elif key == "--slow_rank0":
            slow_rank0 = float(value)
        else:
            raise SystemExit(f"fault_worker: unknown flag {a}")
    import distributed_train

    sys.argv = [sys.argv[0], *rest]
    with installed(spec, nans, slow_rank0):
        return distributed_train.main()


if __name__ == "__main__":
    sys.exit(main())
