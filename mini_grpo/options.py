"""How a GRPOConfig option is declared, once, where its field is:

    lr: float = opt(3e-5, "grpo", ">= 0")          # default, roles, range
    use_amp: bool = opt(True, "sft", env="USE_AMP")   # ... and its environment variable

Everything that used to name options in lists of its own is derived from these declarations:
the range checks (`check_ranges`), the environment variables (`env_vars`), the keys a saved
SFT stage, RFT data or GRPO checkpoint is compared on (`keys_with`), the loss's settings, the
`--help` page and docs/guide.md's table (config_help.py). Every field declares at least one role
(`undeclared` finds those that do not; tests/test_config.py fails on them), so a new option
cannot be added without saying whether it shapes a stage or is fixed on resume.

A leaf beside fields.py: it imports nothing else of mini_grpo.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import typing
from typing import Any

from .fields import ConfigError

# what an option does to a run; every field names at least one
ROLES = {
    "sft": "shapes the SFT stage: a saved stage trained with another value is not reused",
    "rft_data": "shapes RFT's generated data: data made with another value is not resumed",
    "rft": "shapes the SFT on RFT's data",
    "resume": "fixed on resume: a GRPO checkpoint does not continue under another value",
    "resume_lora": "fixed on resume where the checkpoint holds LoRA adapters",
    "loss": "a setting of the GRPO loss (grpo.LossSettings, of the same name)",
    "grpo": "shapes GRPO's updates; may change when a run resumes",
    "run": "how and where the job runs, not what it learns",
}

_INTERVAL = re.compile(r"^([(\[])\s*(\S+),\s*(\S+)\s*([)\]])$")


def opt(default: Any, roles: str, check: str = "", env: str = "", at_most: int = 0,
        path: bool = False) -> Any:
    """A config field: its `default` (a list or dict is copied per instance), its `roles`
    (space-separated names of ROLES), its range `check` ("> 0", ">= 0", an interval such as
    "(0, 1]", or integers "0..N"), the most it may be (`at_most`, rows to generate), the
    environment variable that sets it (`env`), and whether it names a file or directory
    (`path`: a leading ~ is the user's home, expand_paths)."""
    names = roles.split()
    bad = [r for r in names if r not in ROLES]
    if not names or bad:
        raise TypeError(f"opt: roles must name some of {', '.join(ROLES)}, got {roles!r}")
    _checker(check)  # a malformed check fails when the class is defined
    meta = {"roles": frozenset(names), "check": check, "env": env, "at_most": at_most,
            "path": path}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _checker(check: str):
    """(is the value in range, the message's phrase) for a check spec; None for none."""
    if not check:
        return None
    if check in ("> 0", ">= 0"):
        return (lambda v: v > 0 if check == "> 0" else v >= 0), f"must be {check}"
    if m := re.fullmatch(r"(-?\d+)\.\.(\d+)", check):
        lo, hi = int(m[1]), int(m[2])
        return (lambda v: lo <= v <= hi), f"must be in {check}"
    if m := _INTERVAL.match(check):
        lo, hi = float(m[2]), float(m[3])
        return (lambda v: (lo < v if m[1] == "(" else lo <= v)
                and (v < hi if m[4] == ")" else v <= hi)), f"must be in {check}"
    raise TypeError(f"opt: a check is '> 0', '>= 0', an interval or 'LO..HI', got {check!r}")


def expand_paths(cfg) -> None:
    """Each path field's leading `~` or `~user` expanded as a shell expands it: no shell does
    after `--out_dir=`, in quotes, in YAML or in an environment value (a run made a folder
    named ~). A ~user of no user is a ConfigError opening with the field's name."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not (f.metadata.get("path") and value.startswith("~")):
            continue
        path = os.path.expanduser(value)
        if path.startswith("~"):
            raise ConfigError(f"{f.name}: {value!r}: no user {value[1:].split('/')[0]!r} whose "
                              f"home ~ could name (write the path out; ./{value} for a folder "
                              f"of that name)")
        setattr(cfg, f.name, path)


def check_ranges(cfg) -> None:
    """Each field's declared range: ConfigError opening with the field's name."""
    for f in dataclasses.fields(cfg):
        value, meta = getattr(cfg, f.name), f.metadata
        checker = _checker(meta.get("check", ""))
        if checker and not checker[0](value):
            raise ConfigError(f"{f.name}: {checker[1]}, got {value}")
        if meta.get("at_most") and value > meta["at_most"]:
            raise ConfigError(f"{f.name}: must be <= {meta['at_most']:,}, got {value:,}")


def unbounded(cls) -> list[str]:
    """The numeric fields of `cls` (int, float) declared without a finite range: an interval
    with finite ends, "LO..HI", or `at_most`. Every number a user gives must have one, or it
    reaches Python's limits (an OverflowError, a million threads) instead of a clear error."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if hints[f.name] not in (int, float):
            continue
        check, m = f.metadata.get("check", ""), _INTERVAL.match(f.metadata.get("check", ""))
        finite = (re.fullmatch(r"-?\d+\.\.\d+", check) or f.metadata.get("at_most")
                  or m and math.isfinite(float(m[2])) and math.isfinite(float(m[3])))
        if not finite:
            out.append(f.name)
    return out


def keys_with(cls, *roles: str) -> tuple[str, ...]:
    """The fields of `cls` (in declaration order) that declare any of `roles`."""
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise KeyError(f"no role {unknown[0]!r}")
    return tuple(f.name for f in dataclasses.fields(cls)
                 if f.metadata.get("roles", frozenset()) & set(roles))


def env_vars(cls) -> dict[str, str]:
    """Environment variable -> field, for the fields that declare one."""
    return {f.metadata["env"]: f.name for f in dataclasses.fields(cls) if f.metadata.get("env")}


def undeclared(cls) -> list[str]:
    """The fields of `cls` declared without opt() or without a role."""
    return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("roles")]


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
