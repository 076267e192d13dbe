"""`distributed_train.py --help` / `mini-grpo train --help` and docs/guide.md's table of environment
variables, both generated from GRPOConfig's declarations: each field's type, default, range,
roles and variable (options.opt), with the comment above and beside it as its help, grouped by
the dataclass's `# ---- section ----` lines, so neither can drift from the fields. A field
without a comment has no help: `missing_help` finds it, and tests/test_config.py fails on it.

    python -m mini_grpo.config_help --env-table    # docs/guide.md's table, as tests compare it
"""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
import typing

from .config import ENV_VARS, FIELDS, LEGACY_ENV, TYPES, GRPOConfig
from .options import default_of

ENV_VARS_OF = {field: f"env {var}" for var, field in ENV_VARS.items() if var not in LEGACY_ENV}


def _comments(source: str = "") -> tuple[dict[str, str], dict[str, str]]:
    """(help, section) of each field declared in `source` (GRPOConfig's): the comment lines
    just above its declaration (a blank line ends their reach), then the comment beside its
    first line; the `# ---- name ----` line it comes under."""
    helps, sections, above, section = {}, {}, [], ""
    for line in (source or inspect.getsource(GRPOConfig)).splitlines():
        stripped = line.strip()
        if stripped.startswith("# ----"):
            section, above = stripped.strip("# -").strip(), []
        elif stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
        elif (m := re.match(r"^    (\w+): ", line)) and m[1] in FIELDS:
            inline = line.partition("  # ")[2] if ")  # " in line else ""
            helps[m[1]], sections[m[1]] = " ".join(x for x in [*above, inline] if x), section
            above = []
        elif not stripped or stripped.startswith("def "):
            above = []
    return helps, sections


def missing_help(source: str = "") -> list[str]:
    """The fields with no help text in `source` (GRPOConfig's), in declaration order."""
    helps = _comments(source)[0]
    return [name for name in FIELDS if not helps.get(name)]


def _kind(name: str) -> str:
    tp = TYPES[name]
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(typing.get_args(tp))
    return re.sub(r"typing\.|<class '(\w+)'>", r"\1", str(tp)).replace("NoneType", "None")


def _default(name: str) -> str:
    value = default_of(FIELDS[name])
    return "null" if value is None else str(value).lower() if isinstance(value, bool) \
        else repr(value) if value == "" else str(value)


def _range(name: str) -> str:
    meta = FIELDS[name].metadata
    parts = [meta["check"]] if meta["check"] else []
    if meta["at_most"]:
        parts.append(f"<= {meta['at_most']:,}")
    return " and ".join(parts)


def help_text() -> str:
    """Every option, grouped by the sections of GRPOConfig, with its type, default, range,
    environment variable and help."""
    helps, sections = _comments()
    out = ["usage: python distributed_train.py --config NAME_OR_PATH [--key=value ...]",
           "       mini-grpo train --config NAME_OR_PATH [--key=value ...] [--print-config]",
           "",
           *textwrap.wrap("--config names a file in configs/ (default, tiny, smollm2_numeric, "
                          "...) or a path; any option below overrides it as --key=value (lists "
                          "and dicts as YAML), and environment variables set those that name "
                          "one (lower precedence than the command line). Legacy: "
                          + ", ".join(LEGACY_ENV) + " (false = reward_executor serial).", 100)]
    section = None
    for name in FIELDS:
        if sections[name] != section:
            section = sections[name]
            out += ["", section + ":"]
        extra = [x for x in (_range(name), ENV_VARS_OF.get(name, "")) if x]
        out.append(f"  --{name} ({_kind(name)}, default {_default(name)}"
                   + "".join(f"; {x}" for x in extra) + ")")
        out += textwrap.wrap(helps[name], 96, initial_indent="      ",
                             subsequent_indent="      ")
    return "\n".join(out) + "\n"


def env_table() -> str:
    """docs/guide.md's table of environment variables (markdown), in declaration order."""
    rows = ["| environment variable | config field | values | default |",
            "| --- | --- | --- | --- |"]
    for var, name in ENV_VARS.items():
        if var in LEGACY_ENV:
            rows.append(f"| `{var}` | `reward_executor` | false = serial; true = a pool "
                        f"(process unless thread is set) | |")
            continue
        tp = TYPES[name]
        values = "true/false (also 1/0, yes/no, on/off)" if tp is bool else \
            ", ".join(typing.get_args(tp)) if typing.get_origin(tp) is typing.Literal else \
            " ".join(x for x in (_kind(name), _range(name)) if x)
        rows.append(f"| `{var}` | `{name}` | {values} | `{_default(name)}` |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(env_table() if sys.argv[1:] == ["--env-table"] else help_text(), end="")
