"""JSON files of model directories (config.json, tokenizer_config.json, generation_config.json,
model.safetensors.index.json), read as untrusted input: the one bounded reader.

    config = read_json_object(path / "config.json", max_bytes=1 << 20)   # None when absent

At most `max_bytes` are read (whatever the file claims to be), nesting is bounded (json
recurses per level: a deep file would end in a RecursionError, and a value nested a few hundred
levels deep breaks whatever walks it later: pickling it into a checkpoint, printing it), and
strings must be valid Unicode (a lone surrogate cannot be written back out). Every failure is a
ConfigError (exit 2) of one line naming the file, and the line where json knows it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .fields import ConfigError, unreadable

MAX_BYTES = 16 << 20  # a tokenizer_config.json with a long chat template is well under this
MAX_DEPTH = 64  # Hugging Face's files nest a few levels


def read_json_object(path: str | Path, max_bytes: int = MAX_BYTES) -> dict | None:
    """The JSON object in `path`, checked (`check_tree`); None when there is no such file."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) > max_bytes:
        raise ConfigError(f"{path}: larger than {max_bytes} bytes, too large for this file")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: malformed JSON ({e.msg}, column {e.colno})") \
            from None
    except RecursionError:
        raise ConfigError(f"{path}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # an integer over Python's int-string limit
        raise ConfigError(f"{path}: {unreadable(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {_json_type(data)}")
    check_tree(data, str(path))
    return data


def check_tree(value: Any, where: str, max_depth: int = MAX_DEPTH) -> None:
    """`value` (parsed JSON, or the plain values a checkpoint stores) nested at most
    `max_depth` levels and not containing itself, its strings valid Unicode; ConfigError
    naming `where` otherwise. Iterative, and a part shared by several others (a pickle's
    memo) is walked once."""
    height: dict[int, int] = {}  # levels of each container walked, by id
    open_: set[int] = set()  # on the current path: met again, the value contains itself
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        v, done = stack.pop()
        if isinstance(v, str):
            _check_text(v, where)
            continue
        if not isinstance(v, (list, tuple, dict)):
            continue
        kids = [x for kv in v.items() for x in kv] if isinstance(v, dict) else v
        if done:
            open_.discard(id(v))
            height[id(v)] = 1 + max((height.get(id(k), 0) for k in kids), default=0)
            if height[id(v)] > max_depth:
                raise ConfigError(f"{where}: nested deeper than {max_depth} levels")
        elif id(v) in open_:
            raise ConfigError(f"{where}: a value that contains itself")
        elif id(v) not in height:
            open_.add(id(v))
            stack.append((v, True))
            stack.extend((k, False) for k in kids)


def _check_text(text: str, where: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{where}: a string that is not valid Unicode (a lone "
                              f"surrogate in {text[:40]!r})") from None


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number",
            bool: "true/false", type(None): "null"}.get(type(value), type(value).__name__)
