"""How a config's values are gathered: configs/ names, and the layers (a checkpoint's stored
config, YAML, environment, command line) whose later values win, task_args kept per key with
the task each layer was for. config.load_config runs them and builds the GRPOConfig."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .fields import ConfigError, coerce

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# options that moved into chess_fen's task_args; checkpoints saved before carry them on top
LEGACY_TASK_ARGS = ("num_train", "min_plies", "max_plies", "move_format", "pgn_path")


def unknown_key(key: str, where: str, fields: Iterable[str]) -> ConfigError:
    if key in LEGACY_TASK_ARGS:
        return ConfigError(f"{where}{key}: moved into the task's arguments: write "
                           f"task_args: {{{key}: ...}} in YAML, or --task_args.{key}=...")
    close = difflib.get_close_matches(key, list(fields), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"{where}{key}: unknown key{hint}")  # as task_args' keys say it


def resolve_config_path(name: str) -> Path:
    """A path as given, else a bare name looked up in configs/ (with or without .yaml)."""
    p = Path(name)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if cand.is_file():
            return cand
    available = ", ".join(sorted(q.stem for q in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config file not found: {name} (names in configs/: {available})")


class Layers:
    """Config values gathered layer by layer (later layers win); the legacy switch
    `parallel_rewards` maps onto reward_executor (false: serial; true: a pool, process unless
    one is chosen).

    task_args are kept per key with where they were set and the task in effect once their
    layer is read (`end_layer`): `task_args.KEY` sets one key, a `task_args` mapping the keys
    it names, or, when `replace` (the command line), replaces all that came before."""

    def __init__(self, fields: dict[str, dataclasses.Field], types: dict[str, Any]):
        self.fields, self.types = fields, types  # GRPOConfig's, by name
        self.values: dict[str, Any] = {}
        self.where: dict[str, str] = {}  # key: the file and line or layer that set it last
        self.args: dict[str, tuple[Any, str, str, str]] = {}  # key: value, where, layer, task
        self.pending: dict[str, tuple[Any, str]] = {}  # this layer's: key: value, where

    def set(self, key: str, value: Any, where: str, replace: bool = False) -> None:
        if key.startswith("task_args."):
            self.pending[key.partition(".")[2]] = (value, where)
            return
        if key == "task_args":
            value = coerce(key, value, dict, where)
            if replace:
                self.args, self.pending = {}, {}
            self.pending.update({str(k): (v, where) for k, v in value.items()})
            return
        if key == "parallel_rewards":
            on = coerce(key, value, bool, where)
            current = self.values.get("reward_executor", self.fields["reward_executor"].default)
            self.values["reward_executor"] = ("process" if current == "serial" else current) \
                if on else "serial"
            self.where["reward_executor"] = where
            return
        if key not in self.fields:
            raise unknown_key(key, where, self.fields)
        self.values[key] = coerce(key, value, self.types[key], where)
        self.where[key] = where

    def end_layer(self, layer: str) -> None:
        task = self.values.get("task", self.fields["task"].default)
        self.args.update({k: (v, where, layer, task) for k, (v, where) in self.pending.items()})
        self.pending = {}

    def task_args(self) -> tuple[dict[str, Any], dict[str, str], list[str]]:
        """(task_args, where each was set, notes): those of layers whose task is the final
        one; one note per layer whose task_args were for another task."""
        final = self.values.get("task", self.fields["task"].default)
        args, where, dropped = {}, {}, {}
        for key, (value, at, layer, task) in self.args.items():
            if task == final:
                args[key], where[key] = value, at
            else:
                dropped.setdefault(layer, task)
        notes = [f"task_args from {layer} were for {task}, not applied to {final}"
                 for layer, task in dropped.items()]
        return args, where, notes
