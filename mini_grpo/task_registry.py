"""The task registry: a task's name, its options and its builder, filled by the task modules.

A task module registers itself with a decorator on its builder:

    @register("countdown", Args)            # Args: a dataclass, the config's task_args
    def build(cfg, args) -> TaskData: ...   # an optional Args.check() raises ConfigError

The config checks `task_args` here (`resolve_task_args`) without importing any task; the
built-in tasks (mini_grpo/tasks/) register themselves the first time a name is looked up, the
way reward plugins load from entry points: by name, from the registry, at run time.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .fields import ConfigError, coerce

BUILT_IN = "mini_grpo.tasks"  # the package whose import registers the shipped tasks

# the most rows a task may generate (task_args.num_train, the config's num_eval): a typo's
# extra zeros fail at once instead of generating for hours
MAX_GENERATED = 10_000_000


@dataclass(frozen=True)
class Task:
    name: str
    Args: type  # dataclass of the task's options
    build: Callable  # build(cfg, args: Args) -> TaskData


TASKS: dict[str, Task] = {}


def register(name: str, args: type) -> Callable[[Callable], Callable]:
    """Decorator on a task's `build(cfg, args)`: makes the task available to configs."""
    def deco(build: Callable) -> Callable:
        TASKS[name] = Task(name, args, build)
        return build
    return deco


def get_task(name: str) -> Task:
    if name not in TASKS:
        importlib.import_module(BUILT_IN)  # the shipped tasks register on import
    if name not in TASKS:
        raise ConfigError(f"task: unknown task {name!r} (available: {', '.join(sorted(TASKS))})")
    return TASKS[name]


def resolve_task_args(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The task's arguments with its defaults filled in, checked against its Args fields;
    each error opens with `task_args.KEY:` (load_config puts where KEY was set in front)."""
    task = get_task(name)
    hints = typing.get_type_hints(task.Args)
    given = {}
    for key, value in args.items():
        if key not in hints:
            raise _unknown_option(task, str(key))
        given[key] = coerce(f"task_args.{key}", value, hints[key])
    resolved = task.Args(**given)
    check = getattr(resolved, "check", None)
    if check is not None:
        check()
    return dataclasses.asdict(resolved)


def _unknown_option(task: Task, key: str) -> ConfigError:
    options = [f.name for f in dataclasses.fields(task.Args)]
    if not options:
        return ConfigError(f"task_args.{key}: unknown key: task {task.name} takes no "
                           f"options")
    close = difflib.get_close_matches(key, options, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return ConfigError(f"task_args.{key}: unknown key for task {task.name} ({hint}its "
                       f"options: {', '.join(options)})")
