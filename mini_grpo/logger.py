"""Run logging: console progress, metrics.jsonl, and the trackers in `report_to`.

Only rank 0 creates a RunLogger; the same scalar names go to `metrics.jsonl` (one JSON object
per logged step, with "step"), TensorBoard (`<out_dir>/tb`) and Weights & Biases (optional:
`pip install -e .[wandb]`; its project is WANDB_PROJECT, default mini-grpo, and WANDB_MODE=
offline keeps the run in `<out_dir>/wandb` for a later `wandb sync`). SFT and RFT metrics carry
their own step (`sft/step`, `rft/step`) in W&B, since its steps must only grow.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from pathlib import Path

from .config import ConfigError
from .outputs import LineFile, OutputWriteError, write_reason


class RunLogger:
    def __init__(self, out_dir: str | Path, total_steps: int,
                 report_to=("tensorboard",), config: dict | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.jsonl = LineFile(self.out_dir / "metrics.jsonl")  # whole lines, or none
        self.console = sys.stdout  # where progress lines go (benchmark.py: stderr)
        self.prefix = ""  # put before each progress line
        self.tb = self.wandb = None
        if "tensorboard" in report_to:  # the event file itself: a step's values go as one event
            from torch.utils.tensorboard.writer import FileWriter

            # TensorBoard opens its event file with "wb" under a name made of the time, host
            # and pid: a random suffix makes it one that no link (a user's file under a
            # planted or copied name) can have been waiting at
            self.tb = self._written("tb", lambda: FileWriter(
                str(self.out_dir / "tb"), filename_suffix=f".{secrets.token_hex(8)}"))
        if "wandb" in report_to:
            self.wandb = _wandb_run(self.out_dir, config)
        self.start_clock(0)

    def cut(self, size: int | None) -> None:
        """metrics.jsonl back to `size` bytes (None: as it is): the rows a killed run logged
        after the checkpoint this one continues from, which it logs again. Only at the end
        of a row: a size that is not (a file edited since) leaves the file as it is."""
        if size is None or not 0 <= size < self.jsonl.size:
            return
        if size and os.pread(self.jsonl.fd, 1, size - 1) != b"\n":
            print(f"[mini-grpo] {self.jsonl.path}: {size} bytes is not the end of a row; "
                  f"nothing cut", file=sys.stderr, flush=True)
            return
        os.ftruncate(self.jsonl.fd, size)  # the file opened, checked: no other name's
        self.jsonl.size = size

    @property
    def tb_file(self) -> Path | None:
        """This run's TensorBoard event file (None: no TensorBoard)."""
        name = getattr(getattr(self.tb, "event_writer", None), "_file_name", None)
        return None if name is None else Path(name)

    def start_clock(self, step: int) -> None:
        """ETAs count from here: call when the timed loop starts at `step` (0 = fresh)."""
        self.t0, self.first_step = time.perf_counter(), step

    def scalars(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        values = {prefix + k: float(v) for k, v in metrics.items()}
        row = {"step": step, **{k: v if math.isfinite(v) else str(v) for k, v in values.items()}}
        if self.tb is not None:
            self._written("tb", self._tb_scalars, step, values)
        if self.wandb is not None:
            stage = prefix.split("/")[0] if prefix in ("sft/", "rft/") else ""
            self.wandb.log({**{k: v for k, v in row.items() if k != "step"},
                            f"{stage}/step" if stage else "step": step})
        self._append(row)

    def _tb_scalars(self, step: int, values: dict[str, float]) -> None:
        """A step's scalars as one TensorBoard event. An event each (add_scalar) built and freed
        some 200 protobuf arenas a GRPO step, and protobuf's Python runtime calls malloc_trim(0)
        at every 10,000th free: every ~45 steps it handed back the freed heap pages that
        cpu_malloc_cache keeps (the LM job's RSS fell 0.2-0.3 GB, and the next steps faulted
        them back in)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary()
        for tag, v in values.items():
            summary.value.add(tag=tag, simple_value=v)  # in the summary's own arena
        self.tb.add_summary(summary, step)

    def _append(self, row: dict) -> None:
        self.jsonl.append(json.dumps(row) + "\n")

    def _written(self, name: str, fn, *args):
        """fn(*args); its OSError (a full disk under TensorBoard's writer) as one line naming
        <out_dir>/name."""
        try:
            return fn(*args)
        except OSError as e:
            raise OutputWriteError(f"cannot write {self.out_dir / name}: {write_reason(e)}") \
                from e

    def text(self, step: int, tag: str, text: str) -> None:
        if self.tb is not None:
            from torch.utils.tensorboard.summary import text as text_summary
            self._written("tb", self.tb.add_summary, text_summary(tag, text), step)
        if self.wandb is not None:
            self.wandb.log({f"text/{tag}": text, "step": step})

    def event(self, step: int, message: str) -> None:
        """Something the user must notice: console, TensorBoard text and the JSONL."""
        print(f"[mini-grpo] step {step}: {message}", flush=True)
        self.text(step, "events", message)
        self._append({"step": step, "event": message})

    def progress(self, step: int, metrics: dict[str, float],
                 time_left: float | None = None) -> None:
        """One console line: step, the given metrics, and an ETA from the mean step time, or
        `time_left` (seconds to a time limit) where that comes first."""
        done = step - self.first_step
        per_step = (time.perf_counter() - self.t0) / max(done, 1)
        eta, why = per_step * (self.total_steps - step), ""
        if time_left is not None and time_left < eta:
            eta, why = max(time_left, 0.0), " (max_minutes)"
        parts = " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        print(f"{self.prefix}step {step}/{self.total_steps} {parts} | {per_step:.2f}s/step "
              f"ETA {eta / 60:.1f}m{why}", file=self.console, flush=True)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self._written("tb", self.tb.close)
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(out_dir: Path, config: dict | None):
    try:
        import wandb
    except ImportError:
        raise ConfigError("report_to: wandb needs the wandb package: pip install -e .[wandb]"
                          ) from None
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mini-grpo"), dir=str(out_dir),
                     config=config, name=out_dir.name)
    for stage in ("sft", "rft"):
        run.define_metric(f"{stage}/step")
        run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
    return run
