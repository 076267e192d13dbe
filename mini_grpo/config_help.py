"""`distributed_train.py --help` / `mini-grpo train --help`: every option of GRPOConfig, read
from its declaration (the field, its default and the comment beside or above it), grouped by
the dataclass's `# ---- section ----` lines, so the help cannot drift from the fields."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap

from .config import ENV_VARS, GRPOConfig

FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)}


def help_text() -> str:
    """Every option, grouped by the sections of GRPOConfig, with its type, default and help
    (the comments beside and above its field: written once, where the field is)."""
    field_re = re.compile(r"^    (\w+): (.+?) = (.+?)(?:\s+#\s*(.*))?$")
    out = ["usage: python distributed_train.py --config NAME_OR_PATH [--key=value ...]",
           "       mini-grpo train --config NAME_OR_PATH [--key=value ...] [--print-config]",
           "",
           *textwrap.wrap("--config names a file in configs/ (default, tiny, smollm2_numeric, "
                          "...) or a path; any option below overrides it as --key=value (lists "
                          "and dicts as YAML). Environment switches: " + ", ".join(
                              f"{k} ({v})" for k, v in ENV_VARS.items()) + ".", 100)]
    above: list[str] = []
    for line in inspect.getsource(GRPOConfig).splitlines():
        stripped = line.strip()
        if stripped.startswith("# ----"):
            out += ["", stripped.strip("# -").strip() + ":"]
            above = []
        elif stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
        elif (m := field_re.match(line)) and m.group(1) in FIELDS:
            name, kind, default, inline = m.groups()
            default = default.replace("dataclasses.field(default_factory=dict)", "{}")
            text = inline or " ".join(above)
            out.append(f"  --{name} ({kind}, default {default})")
            out += textwrap.wrap(text, 96, initial_indent="      ",
                                 subsequent_indent="      ") if text else []
            above = []
        elif not stripped or stripped.startswith(("def ", '"""', "@")):
            above = []
            if stripped.startswith("def "):
                break
    return "\n".join(out) + "\n"
