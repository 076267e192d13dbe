"""Typed values from YAML, environment and command-line text: the one set of rules the
config's fields and every task's `task_args` are checked with. Bad input is a ConfigError
whose message names the key (and, through `where`, the file, line or variable)."""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal

import yaml

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """Bad configuration input: the message is one line naming the culprit."""


def coerce(key: str, value: Any, tp: Any, where: str = "") -> Any:
    """`value` checked against the type `tp` (bool, int, float, str, list, dict, a Literal,
    or an Optional of one); strings (environment, command line) are parsed first."""
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
        if tp in (list, dict):
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                raise ConfigError(f"{where}{key}: cannot parse {text!r} as YAML") from None
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}{key}: must not be empty")

    bad = ConfigError(f"{where}{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad
    if tp is int:
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise bad from None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise bad from None
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad
        if not math.isfinite(value):  # NaN/Inf pass every `<= 0` check and break runs later
            raise ConfigError(f"{where}{key}: must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, str) and value.strip() in choices:
            return value.strip()
        raise ConfigError(f"{where}{key}: must be one of {', '.join(choices)}, got {value!r}")
    if tp in (list, dict):
        if isinstance(value, tp):
            return value
        raise bad
    raise TypeError(f"config field {key} has an unsupported type {tp}")


def _type_name(tp: Any) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(tp, str(tp))
