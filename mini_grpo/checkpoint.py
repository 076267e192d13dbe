"""Checkpoints: atomic save, newest-valid resume, retention. Loaded with weights_only=True.

A checkpoint is one `step_NNNNNNN.pt` file holding plain tensors and Python values: model and
optimizer state, step, RNG states, the resolved config and the tokenizer's alphabet. It is
written to a temporary file, flushed to disk and renamed, so a kill mid-write never leaves a
broken newest checkpoint; a file that still fails to load is skipped with a warning.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^step_(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint the user named cannot be used (exit code 2)."""


def save_checkpoint(state: dict[str, Any], directory: str | Path, step: int,
                    keep: int = 0) -> Path:
    """Writes state atomically as directory/step_<step>.pt; keeps the newest `keep` (0 = all)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:07d}.pt"
    tmp = directory / f".{path.name}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if keep > 0:
        for old in list_checkpoints(directory)[:-keep]:
            old.unlink(missing_ok=True)
    return path


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files in step order, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: str | Path, map_location="cpu") -> dict[str, Any]:
    """Loads one checkpoint; a missing or unreadable file is a CheckpointError naming it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, wrong format, non-allowlisted pickle ...
        raise CheckpointError(f"{path}: cannot load checkpoint ({type(e).__name__}: {e})") \
            from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: not a mini-grpo checkpoint (no 'model' entry)")
    return state


def latest_checkpoint(directory: str | Path, map_location="cpu"):
    """(path, state) of the newest checkpoint that loads, or (None, None); warns on bad ones."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return path, load_checkpoint(path, map_location)
        except CheckpointError as e:
            warnings.warn(f"skipping corrupt checkpoint: {e}", stacklevel=2)
    return None, None


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])
