"""Run logging: console progress, TensorBoard scalars and text, and metrics.jsonl.

Only rank 0 creates a RunLogger; the same scalar names go to TensorBoard and to
`metrics.jsonl` (one JSON object per logged step, with "step").
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path


class RunLogger:
    def __init__(self, out_dir: str | Path, total_steps: int, tensorboard: bool = True):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.jsonl = open(self.out_dir / "metrics.jsonl", "a")
        self.console = sys.stdout  # where progress lines go (benchmark.py: stderr)
        self.prefix = ""  # put before each progress line
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.out_dir / "tb"))
        self.start_clock(0)

    def start_clock(self, step: int) -> None:
        """ETAs count from here: call when the timed loop starts at `step` (0 = fresh)."""
        self.t0, self.first_step = time.perf_counter(), step

    def scalars(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        row = {"step": step}
        for k, v in metrics.items():
            v = float(v)
            row[prefix + k] = v if math.isfinite(v) else str(v)
            if self.tb is not None:
                self.tb.add_scalar(prefix + k, v, step)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        if self.tb is not None:
            self.tb.add_text(tag, text, step)

    def event(self, step: int, message: str) -> None:
        """Something the user must notice: console, TensorBoard text and the JSONL."""
        print(f"[mini-grpo] step {step}: {message}", flush=True)
        self.text(step, "events", message)
        self.jsonl.write(json.dumps({"step": step, "event": message}) + "\n")
        self.jsonl.flush()

    def progress(self, step: int, metrics: dict[str, float]) -> None:
        """One console line: step, the given metrics, and an ETA from the mean step time."""
        done = step - self.first_step
        per_step = (time.perf_counter() - self.t0) / max(done, 1)
        eta = per_step * (self.total_steps - step)
        parts = " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        print(f"{self.prefix}step {step}/{self.total_steps} {parts} | {per_step:.2f}s/step "
              f"ETA {eta / 60:.1f}m", file=self.console, flush=True)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
