"""Where a bench script writes its results: a new file, or one this script wrote before (its
"written_by" names the script, mini_grpo.outputs.write_json); any other file, a user's or an
older result without the mark, is refused before the measurement starts, naming it.

    save = claim(a.json, __file__)   # first, before any work (a no-op for an empty path)
    ...
    save(result, indent=2)           # the result, marked; checked again as it is written
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # mini_grpo from the checkout

from mini_grpo.fields import ConfigError  # noqa: E402
from mini_grpo.outputs import check_file, write_json, written_by  # noqa: E402


def claim(path: str | Path | None, script: str) -> Callable[..., None]:
    """Refuses (SystemExit, one line) a `path` this `script` did not write; returns the function
    that writes a result dict there (json.dumps' options as keywords)."""
    writer = f"bench/{Path(script).name}"
    if path:
        try:
            check_file(path, written_by(writer))
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None

    def save(result: dict, **dump) -> None:
        if path:
            try:
                write_json(path, result, writer, **dump)
            except ConfigError as e:  # a file put there while the script ran
                raise SystemExit(f"error: {e}") from None

    return save
