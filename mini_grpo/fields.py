"""Typed values from YAML, environment and command-line text: the one set of rules the
config's fields and every task's `task_args` are checked with; a YAML file read as a mapping
with each key's line, and `--key=value` arguments split. Bad input is a ConfigError
whose message names the key (and, through `where`, the file, line or variable).

A leaf: it imports nothing of mini_grpo, so every module may take ConfigError from here.
"""

from __future__ import annotations

import argparse
import math
import reprlib
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

# lists and mappings nested deeper than this in one value are refused: a config has no use for
# them, and code that walks values recursively (repr, asdict, YAML's own) would overflow
MAX_DEPTH = 100
# a YAML text is bounded before it is parsed (PyYAML takes some 40 us and 2 KB a node): a config
# file's bytes, and the nodes of any YAML text (values, lists, mappings; an alias counted as
# what it stands for). Ours have some 50 nodes in 2 KB
MAX_YAML_BYTES = 1 << 20
MAX_YAML_NODES = 10_000


class ConfigError(ValueError):
    """Bad configuration input: the message is one line naming the culprit."""


class ArgParser(argparse.ArgumentParser):
    """argparse for the subcommands' flags: a bad one is one line and exit 2 like any other
    bad input (`error: --n: invalid int value: 'abc'`); the usage block stays behind --help."""

    def error(self, message):
        print(f"error: {message.removeprefix('argument ')}", file=sys.stderr)
        sys.exit(2)


_SHORT = reprlib.Repr()  # show()'s limits
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlong = 40
_SHORT.maxlevel = 3


def show(value: Any) -> str:
    """repr() cut to a line's worth, on one line (a tensor's has breaks), and bounded in time
    for huge or shared structures."""
    try:
        return " ".join(line.strip() for line in _SHORT.repr(value).splitlines())
    except ValueError:  # an int over Python's int-string limit
        return f"<{type(value).__name__} too large to show>"


def _depth(value: Any) -> float:
    """Levels of list/dict nesting (a scalar 0, [1] 1, [[1]] 2); inf for a value that contains
    itself. Iterative, and each shared part (a YAML alias) is walked once."""
    memo: dict[int, float] = {}
    open_: set[int] = set()  # on the current path: met again, the value contains itself
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        v, done = stack.pop()
        if not isinstance(v, (list, dict)):
            continue
        kids = [k for k in (v.values() if isinstance(v, dict) else v)
                if isinstance(k, (list, dict))]
        if done:
            open_.discard(id(v))
            memo[id(v)] = 1 + max((memo[id(k)] for k in kids), default=0)
        elif id(v) in open_:
            return math.inf
        elif id(v) not in memo:
            open_.add(id(v))
            stack.append((v, True))
            stack.extend((k, False) for k in kids)
    return memo.get(id(value), 0)


def _check_depth(key: str, value: Any, where: str = "") -> None:
    d = _depth(value)
    if d > MAX_DEPTH:
        what = "contains itself" if d == math.inf else f"nested deeper than {MAX_DEPTH} levels"
        raise ConfigError(f"{where}{key}: {what}")


def _parse_yaml_text(key: str, text: str, where: str = "") -> Any:
    """A command-line or environment value read as YAML, with every failure a ConfigError."""
    try:
        return _construct(_compose(text, f"{where}{key}"))
    except ConfigError:
        raise
    except yaml.YAMLError:
        raise ConfigError(f"{where}{key}: cannot parse {show(text)} as YAML") from None
    except RecursionError:
        raise ConfigError(f"{where}{key}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # a constructor's: an int over the int-string limit, a bad date
        raise ConfigError(f"{where}{key}: {unreadable(e)}") from None


_PARSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where built: it counts fast


def _compose(text: str, name: str) -> yaml.Node | None:
    """The node graph of YAML `text` (None: empty), bounded: a ConfigError naming `name` past
    MAX_YAML_NODES nodes, counted as the text is parsed and then with each alias as what it
    stands for (a few lines of nested aliases are a billion values), or nested past
    MAX_DEPTH, before any is built. YAML's own errors go on as they are."""
    try:
        _count_nodes(text, _PARSER, name)
    except yaml.YAMLError:  # libyaml's verdict: PyYAML's own parser counts, as it will read
        try:
            _count_nodes(text, yaml.SafeLoader, name)
        except yaml.YAMLError:
            pass  # malformed within the bounds: the composer says where, in its own words
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is not None and _expanded(node) > MAX_YAML_NODES:
        _too_many(name)
    return node


def _count_nodes(text: str, loader, name: str) -> None:
    """Parses YAML `text` with `loader`'s parser as far as the bounds (_compose) allow. The
    depth stops it early too: PyYAML's scanner takes time in the depth for every token (a
    list 5,000 deep took 8 s to parse). Twice MAX_DEPTH: a value less deep reaches coerce,
    whose error names its key."""
    nodes = depth = 0
    for event in yaml.parse(text, Loader=loader):
        nodes += isinstance(event, yaml.NodeEvent)
        depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(
            event, yaml.CollectionEndEvent)
        if nodes > MAX_YAML_NODES:
            _too_many(name)
        if depth > 2 * MAX_DEPTH:
            raise ConfigError(f"{name}: nested deeper than {MAX_DEPTH} levels")


def _too_many(name: str):
    raise ConfigError(f"{name}: more than {MAX_YAML_NODES} YAML nodes (values, lists and "
                      f"mappings, an alias counted as what it stands for); a config has no "
                      f"use for so many")


def _expanded(root: yaml.Node) -> int:
    """The nodes of `root` with every alias counted as the node it names (the values a walk
    of what YAML builds meets), stopping past MAX_YAML_NODES; a node that contains itself
    counts once there (_check_depth refuses it as it is checked)."""
    memo: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        kids = [] if isinstance(node, yaml.ScalarNode) else \
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) \
            else node.value
        if done:
            memo[id(node)] = min(1 + sum(memo.get(id(k), 0) for k in kids), MAX_YAML_NODES + 1)
        elif id(node) not in memo:
            memo[id(node)] = 0  # met again inside itself: counted once
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in memo)
    return memo[id(root)]


def _construct(node: yaml.Node | None) -> Any:
    """The values of a composed YAML document, built as yaml.safe_load builds them."""
    return None if node is None else yaml.SafeLoader("").construct_document(node)


def unreadable(e: ValueError) -> str:
    """A YAML or JSON constructor's ValueError, said in one line."""
    if "integer string conversion" in str(e):
        return f"an integer longer than {sys.get_int_max_str_digits()} digits"
    return f"unreadable value ({str(e).splitlines()[0] if str(e) else type(e).__name__})"


def check_named(key: str, name: str, registry: Mapping[str, Any], kind: str) -> None:
    """A field that names a function (policy_loss, advantage_estimator): a registered name,
    or `package.module:function`, which is imported only when the run needs it."""
    if name not in registry and ":" not in name:
        raise ConfigError(f"{key}: unknown {kind} {name!r} (available: {', '.join(registry)}; "
                          f"or package.module:function)")


def coerce(key: str, value: Any, tp: Any, where: str = "") -> Any:
    """`value` checked against the type `tp` (bool, int, float, str, list, dict, list[T],
    dict[K, V], a Literal, or an Optional of one); strings (environment, command line) are
    parsed first."""
    _check_depth(key, value, where)
    optional = False
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0]
    from_text = isinstance(value, str) and tp is not str and typing.get_origin(tp) is not Literal

    if from_text:
        text = value.strip()
        if optional and text.lower() in ("", "none", "null"):
            return None
        if tp in (list, dict) or typing.get_origin(tp) in (list, dict):
            value = _parse_yaml_text(key, text, where)
            _check_depth(key, value, where)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}{key}: must not be empty")

    bad = lambda: ConfigError(f"{where}{key}: expected {_type_name(tp)}, got {show(value)}")
    if tp in (bool, int, float):
        return _scalar(key, value, tp, where, bad)
    # YAML reads a bare on, off, yes or no as a boolean: `generation_amp: off` was refused
    # as "got False"
    yaml_bool = " (YAML reads a bare on/off/yes/no as true/false: quote it)" \
        if isinstance(value, bool) else ""
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{bad()}{yaml_bool}")
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(choices):
            return "on" if value else "off"
        if isinstance(value, str) and value.strip() in choices:
            return value.strip()
        raise ConfigError(f"{where}{key}: must be one of {', '.join(choices)}, "
                          f"got {show(value)}{yaml_bool}")
    if tp in (list, dict):
        if isinstance(value, tp):
            return value
        raise bad()
    origin, inner = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and len(inner) == 1:  # list[str] (a task's options): each item too
        if not isinstance(value, list):
            raise bad()
        return [coerce(f"{key}[{i}]", v, inner[0], where) for i, v in enumerate(value)]
    if origin is dict and len(inner) == 2:
        if not isinstance(value, dict):
            raise bad()
        return {coerce(f"{key} key", k, inner[0], where): coerce(f"{key}.{k}", v, inner[1], where)
                for k, v in value.items()}
    raise TypeError(f"config field {key} has an unsupported type {tp}")


def _scalar(key: str, value: Any, tp: type, where: str, bad) -> Any:
    """coerce's bool, int and float: `value` (or its text) as `tp`; `bad()` the error of a
    value of another type. A float must be finite."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad()
    if tp is int:
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError as e:
                if value.strip().lstrip("+-").isdigit():  # over the int-string limit
                    raise ConfigError(f"{where}{key}: {unreadable(e)}") from None
                raise bad() from None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad()
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise bad() from None
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad()
        if not math.isfinite(value):  # NaN/Inf pass every `<= 0` check and break runs later
            raise ConfigError(f"{where}{key}: must be a finite number, got {show(value)}")
        return float(value)
    raise TypeError(tp)


def _type_name(tp: Any) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(tp, str(tp))


def read_yaml_mapping(path: Path) -> dict[str, tuple[Any, int]]:
    """Returns {key: (value, line)} from a YAML mapping, with errors that name file and line.
    Bounded before it is parsed: MAX_YAML_BYTES read at most, MAX_YAML_NODES (_compose)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from None
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_YAML_BYTES} bytes (1 MiB), the most a "
                          f"config file may be; not parsed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not valid UTF-8") from None
    try:
        node = _compose(text, str(path))
        data = _construct(node)
    except ConfigError:
        raise
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{line}: malformed YAML: {problem}") from None
    except RecursionError:  # YAML's composer recurses per level: ~500 levels overflow it
        raise ConfigError(f"{path}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:  # a constructor's: an int over the int-string limit, a bad date
        raise ConfigError(f"{path}: {unreadable(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of key: value, got {type(data).__name__}")
    lines = {}
    for k, _ in node.value:  # YAML lets a later `lr:` win over an earlier one, silently
        if k.value in lines:
            raise ConfigError(f"{path}:{k.start_mark.line + 1}: {k.value}: set twice (line "
                              f"{lines[k.value]} too)")
        lines[k.value] = k.start_mark.line + 1
    return {str(k): (v, lines.get(str(k), 0)) for k, v in data.items()}


def parse_cli(argv: list[str]) -> tuple[str | None, dict[str, str]]:
    """Splits `--config X` and `--key=value` / `--key value` arguments."""
    config, overrides, i = None, {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r} (use --key=value)")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"--{key}: missing value (use --{key}=value)")
            value, i = argv[i + 1], i + 1
        key = key.replace("-", "_")
        if key == "config":
            if not value.strip():  # `--config=` from an unset shell variable: not the defaults
                raise ConfigError("--config: empty (a name in configs/ or a YAML file)")
            config = value
        else:
            overrides[key] = value
        i += 1
    return config, overrides
