"""The reward plugin API: one registry, one way to look a name up, and the call shapes a
plugin may have (inspected once, when its name is resolved).

The native shape is a batched function

    fn(prompts: list[str], completions: list[str], targets: list[str], metas: list[dict])
        -> list[float]   # one reward per row, same order

Also accepted, as users bring them (`adapt`):

    fn(prompts, completions, targets, **columns)    # each metadata column, a list, by keyword
    fn(prompts, completions, **kwargs)              # TRL's shapes: everything by keyword:
    fn(completions, **kwargs)                       #   prompts, completions, target, columns

Any of them may be `async def`: the scorer runs the async plugins of a batch concurrently in
one event loop. `per_sample` turns a one-row function (sync or async) into the batched form.
Plugins see plain Python values only (the rows' strings and their task metadata), never
trainer internals. A config names a plugin by its registered name, by
`package.module:callable`, or by the name an installed package declares in the
`mini_grpo.rewards` entry-point group.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Mapping

from mini_grpo.fields import ConfigError, check_named

RewardFn = Callable[[list[str], list[str], list[str], list[dict]], list[float]]

ENTRY_POINT_GROUP = "mini_grpo.rewards"
REWARDS: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: `@register("my_reward")` makes the function available to configs by name."""
    def deco(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn
    return deco


# rows of async `per_sample` plugins in flight at once (reward_concurrency), set by the scorer
ROW_SLOTS: contextvars.ContextVar[asyncio.Semaphore | None] = contextvars.ContextVar(
    "reward_row_slots", default=None)


def per_sample(fn: Callable[[str, str, str, dict], float]) -> RewardFn:
    """Adapter: fn(prompt, completion, target, meta) -> float becomes a batched RewardFn; an
    `async def` fn becomes an async batched one whose rows run concurrently, at most
    `reward_concurrency` at a time."""
    # functools.wraps keeps the module and qualified name, so a decorated module-level function
    # still pickles by reference into worker processes.
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def gathered(prompts, completions, targets, metas):
            slots = ROW_SLOTS.get()

            async def one(row):
                if slots is None:
                    return await fn(*row)
                async with slots:
                    return await fn(*row)
            return await asyncio.gather(*map(one, zip(prompts, completions, targets, metas)))
        return gathered

    @functools.wraps(fn)
    def batched(prompts, completions, targets, metas):
        return [fn(p, c, t, m) for p, c, t, m in zip(prompts, completions, targets, metas)]
    return batched


RESERVED = ("prompts", "completions", "target", "targets", "metas")


def columns(metas: list[dict]) -> dict[str, list]:
    """The rows' metadata as keyword columns: one list per key any row has (None where a row
    lacks it); keys that would shadow the call's own arguments are left out."""
    keys = dict.fromkeys(k for m in metas for k in m if k not in RESERVED)
    return {k: [m.get(k) for m in metas] for k in keys}


class Adapted:
    """A plugin of another accepted shape, called in the native one. A module-level class, so
    it pickles (by reference to the user's function) into worker processes."""

    def __init__(self, fn, shape: str):
        self.fn, self.shape = fn, shape  # shape: "targets" | "keywords"
        self.is_async = inspect.iscoroutinefunction(fn)
        # named parameters only columns can fill: read once, checked at each call
        self.needs = [k for k, p in inspect.signature(fn).parameters.items()
                      if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                             p.KEYWORD_ONLY)
                      and k not in ("prompts", "completions", "target")]
        functools.update_wrapper(self, fn)

    def __call__(self, prompts, completions, targets, metas):
        cols = columns(metas)
        if self.shape == "targets":
            return self.fn(prompts, completions, targets, **cols)
        missing = [k for k in self.needs if k not in cols]
        if missing:
            raise TypeError(f"needs the column {missing[0]!r}, which the rows' metadata lacks "
                            f"(columns: {', '.join(cols) or 'none'})")
        return self.fn(prompts=prompts, completions=completions, target=targets, **cols)

    def __reduce__(self):
        return Adapted, (self.fn, self.shape)


def is_async(fn) -> bool:
    return getattr(fn, "is_async", False) or inspect.iscoroutinefunction(fn)


SHAPES = ("fn(prompts, completions, targets, metas), fn(prompts, completions, targets, "
          "**columns), fn(prompts, completions, **kwargs) or fn(completions, **kwargs) "
          "(sync or async); wrap a one-row function with mini_grpo.rewards.per_sample")


def adapt(name: str, fn) -> RewardFn:
    """`fn` called in the native shape, whichever accepted shape it has; ConfigError naming
    the plugin and the accepted shapes when it fits none."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: benefit of the doubt
        return fn
    params = list(sig.parameters.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    first = params[0].name if params else ""
    if first != "completions" and _binds(sig, [], [], [], []):
        return fn
    if var_kw and first != "completions" and _binds(sig, [], [], []):
        return Adapted(fn, "targets")
    if var_kw and "completions" in sig.parameters:  # other named parameters: columns
        return Adapted(fn, "keywords")
    raise ConfigError(f"reward {name!r}: its signature {sig} fits none of the accepted "
                      f"shapes: {SHAPES}")


def _binds(sig: inspect.Signature, *args, **kwargs) -> bool:
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_rewards() -> list[str]:
    """Registered names plus those of installed entry points, sorted."""
    return sorted(set(REWARDS) | set(_entry_points()))


def import_callable(name: str, what: str = "reward"):
    """The object `package.module:attr` names (a reward plugin, a tool); a ConfigError naming
    `what` and `name` where the module cannot be imported or has no such attribute."""
    module_name, _, attr = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # a user's file may fail in any way; report it as bad input
        raise ConfigError(f"{what} {name!r}: cannot import module {module_name!r} "
                          f"({type(e).__name__}: {e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {name!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_named(key: str, name: str, registry: Mapping[str, Callable], kind: str) -> Callable:
    """The function a field names (policy_loss, advantage_estimator): registered under
    `name`, or the `package.module:function` it names, imported now."""
    check_named(key, name, registry, kind)
    if name in registry:
        return registry[name]
    fn = import_callable(name, key)
    if not callable(fn):
        raise ConfigError(f"{key} {name!r}: a {type(fn).__name__}, not a function")
    return fn


def resolve_reward(name: str) -> RewardFn:
    """The plugin for a config name: registered name, `package.module:callable`, entry point."""
    if name in REWARDS:
        return adapt(name, REWARDS[name])
    if ":" in name:
        fn = import_callable(name)
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
    return adapt(name, fn)
