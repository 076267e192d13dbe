"""The reward plugin API: one callable form, one registry, one way to look a name up.

A reward plugin is a batched function

    fn(prompts: list[str], completions: list[str], targets: list[str], metas: list[dict])
        -> list[float]   # one reward per row, same order

It sees plain Python values only (the rows' strings and their task metadata), never trainer
internals. `per_sample` turns a one-row function into this form. A config names a plugin by
its registered name, by `package.module:callable`, or by the name an installed package declares
in the `mini_grpo.rewards` entry-point group.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable

from mini_grpo.config import ConfigError

RewardFn = Callable[[list[str], list[str], list[str], list[dict]], list[float]]

ENTRY_POINT_GROUP = "mini_grpo.rewards"
REWARDS: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: `@register("my_reward")` makes the function available to configs by name."""
    def deco(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn
    return deco


def per_sample(fn: Callable[[str, str, str, dict], float]) -> RewardFn:
    """Adapter: fn(prompt, completion, target, meta) -> float becomes a batched RewardFn."""
    # functools.wraps keeps the module and qualified name, so a decorated module-level function
    # still pickles by reference into worker processes.
    @functools.wraps(fn)
    def batched(prompts, completions, targets, metas):
        return [fn(p, c, t, m) for p, c, t, m in zip(prompts, completions, targets, metas)]
    return batched


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_rewards() -> list[str]:
    """Registered names plus those of installed entry points, sorted."""
    return sorted(set(REWARDS) | set(_entry_points()))


def _import_callable(name: str) -> RewardFn:
    module_name, _, attr = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # a user's file may fail in any way; report it as bad input
        raise ConfigError(f"reward {name!r}: cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"reward {name!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_reward(name: str) -> RewardFn:
    """The plugin for a config name: registered name, `package.module:callable`, entry point."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        fn = _import_callable(name)
    else:
        eps = _entry_points()
        if name not in eps:
            raise ConfigError(f"unknown reward {name!r} (available: "
                              f"{', '.join(available_rewards())}; or package.module:callable)")
        try:
            fn = eps[name].load()
        except Exception as e:
            raise ConfigError(f"reward {name!r}: cannot load entry point {eps[name].value!r} "
                              f"({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ConfigError(f"reward {name!r}: {type(fn).__name__} object is not callable")
    try:
        inspect.signature(fn).bind([], [], [], [])
    except TypeError:
        raise ConfigError(f"reward {name!r}: must accept (prompts, completions, targets, metas); "
                          f"wrap a one-row function with mini_grpo.rewards.per_sample") from None
    except ValueError:  # some builtins have no signature; they get the benefit of the doubt
        pass
    return fn
