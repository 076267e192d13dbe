"""Directories a command writes whole (exports, imports): never over a user's files, never half.

    path = replace_dir("runs/x/hf", HF_FILES, lambda tmp: ...write files into tmp...)

A directory is written only where it is absent, empty, or one that mini-grpo wrote before (its
MARKER file) holding only names that writer writes (`owned`). Anything else is refused with a
ConfigError naming the path and a file in it (exit 2), before any work: a run directory, a
user's notes, a file where the directory should be. The new files go to a temporary sibling
that replaces the old directory by renames; a failed write (disk full, I/O error) removes the
temporary directory, leaves the old one as it was, and is an OutputWriteError of one line (exit
1).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from .fields import ConfigError

MARKER = ".mini-grpo-export"  # in every directory written here: one it may replace next time


class OutputWriteError(RuntimeError):
    """A file or directory could not be written (disk full, I/O error); nothing was replaced."""


def write_reason(e: BaseException) -> str:
    """One line for a failed write: "disk full" wherever ENOSPC is in the chain (torch.save
    hides it in the context of a RuntimeError, safetensors in the text of its own error)."""
    seen, cause = set(), e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return "disk full"
        if "No space left on device" in str(cause):
            return "disk full"
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        cause = cause.__cause__ or cause.__context__
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def check_replaceable(output: str | Path, owned: re.Pattern) -> Path:
    """The absolute, normalised path of a directory that may be (re)written: absent, empty, or
    marked and holding only `owned` names; ConfigError naming it otherwise. `a/b/..` is `a`."""
    out = Path(os.path.abspath(output))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {output}: exists and is not a directory; not overwritten")
    if out == Path(os.getcwd()) or Path(os.getcwd()).is_relative_to(out):
        raise ConfigError(f"output {output}: is the current directory or holds it; not "
                          f"overwritten (choose a new directory)")
    above = next(p for p in out.parents if p.exists())
    if not above.is_dir():
        raise ConfigError(f"output {output}: {above} is not a directory")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    foreign = [n for n in names if not owned.fullmatch(n)] if MARKER in names else names
    if foreign:
        raise ConfigError(f"output {output}: exists and holds files mini-grpo did not write "
                          f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                          f"not overwritten (choose a new directory)")
    return out


def replace_dir(output: str | Path, owned: re.Pattern, fill: Callable[[Path], None]) -> Path:
    """Checks `output` (check_replaceable), has `fill` write into a temporary sibling, marks
    it and swaps it in; the old directory goes only once the new one is complete."""
    out = check_replaceable(output, owned)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    old = out.with_name(f".{out.name}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        fill(tmp)
        (tmp / MARKER).write_text("written by mini-grpo: it may replace this directory\n")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException as e:  # the old directory back, no temporary one left, then why
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)
        if isinstance(e, OSError) or write_reason(e) == "disk full":
            raise OutputWriteError(f"cannot write {output}: {write_reason(e)}") from e
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out
