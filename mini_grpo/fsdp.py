"""FSDP2 (torch.distributed.fsdp.fully_shard), the second parallelism beside DDP: each rank
keeps 1/N of the parameters, gradients and AdamW state. With distributed.py, the only module
that imports torch.distributed; the loop asks for what it needs through these helpers, which
are no-ops on a model that is not sharded (one process, or DDP):

    shard(model, ...)          fully_shard on each block, then on the root (in place)
    frozen_copy(model, ...)    the reference: a sharded copy made from the shards alone
    full_params(model)         every rank all-gathers the weights once, then runs forward
                               passes of its own (sampling, evaluation) with no collective
    write_shards / read_shards DCP's shards of the weights and optimizer state, resharded on
                               load onto any number of ranks (checkpoint.py names the
                               directories and owns both checkpoint forms), read through
                               dcp_index.py (the untrusted index by an allowlist)
    load_optimizer_state       a one-file (one process, DDP) optimizer state into shards
    model_state / load_model_state
                               full (unsharded) state dicts: the export, the offloaded reference
    load_from_rank0            rank 0's full weights into every rank's shards (start-up)
    clip_grad_norm, local_params, memory_report
    pad_passes                 how many extra passes this rank runs to keep up

FSDP's collectives are timed by distributed.CommTimer. Every FSDP forward and backward
all-gathers and reduce-scatters with the other ranks, so ranks must run the same number of
passes (the trainer pads the rank with fewer micro-batches to the busiest rank's count).
Sampling does not: `full_params` unshards once per rollout, not once per decoded token.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from . import distributed as D
from .dcp_index import refusal, safe_planner, safe_reader
from .optim import check_state


def is_sharded(model) -> bool:
    """Whether `model` is sharded; run.net under compile_model is the compile wrapper
    (precision.compile_with_fallback), whose forward runs the sharded model it wraps, and
    whose passes are as much collectives as that model's."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(model, "wrapped", model), FSDPModule)


# the collectives FSDP issues by default (under their former names in older torch)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _TimedAllGather:
    def __init__(self, timer: D.CommTimer):
        self.timer, self.allocate = timer, timer.allocate

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return self.timer.timed(output_tensor.device, lambda: _all_gather(
            output_tensor, input_tensor, group=group, async_op=async_op))


class _TimedReduceScatter:
    def __init__(self, timer: D.CommTimer):
        self.timer, self.allocate = timer, timer.allocate

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return self.timer.timed(output_tensor.device, lambda: _reduce_scatter(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op))


def shard(model: torch.nn.Module, device: torch.device, param_dtype: torch.dtype | None = None,
          cpu_offload: bool = False, shard_size: int = 0,
          timer: D.CommTimer | None = None) -> torch.nn.Module:
    """`model` sharded over every rank (in place), or with `shard_size` over groups of that
    many ranks and replicated across the groups (HSDP: a 2-D mesh). `param_dtype` bf16:
    parameters gathered in bf16, gradients reduced in fp32 (MixedPrecisionPolicy);
    `cpu_offload`: the shards, their gradients and the optimizer step live in CPU memory
    (CPUOffloadPolicy). `timer`: FSDP's collectives are timed by it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    world = dist.get_world_size()
    shard_size = shard_size or world  # it divides world: limits.check_world says so first
    mesh = init_device_mesh(device.type, (world,)) if shard_size == world else \
        init_device_mesh(device.type, (world // shard_size, shard_size),
                         mesh_dim_names=("replicate", "shard"))
    kw = {"mesh": mesh, "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                               reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)  # the rest: embeddings, final norm, LM head
    if timer is not None:
        for m in [*model.blocks, model]:
            m.set_custom_all_gather(_TimedAllGather(timer))
            m.set_custom_reduce_scatter(_TimedReduceScatter(timer))
    return model


def frozen_copy(model: torch.nn.Module, copy: torch.nn.Module, device: torch.device,
                **shard_kw) -> torch.nn.Module:
    """A frozen copy of a sharded `model` into `copy` (the same architecture, built on the
    meta device), sharded the same way (`shard_kw` as given to `shard` for it), from each
    rank's own shards: every local shard is copied. No rank ever holds the full weights."""
    copy.attn_impl = model.attn_impl
    copy.requires_grad_(False)
    shard(copy, device, **shard_kw)
    copy.to_empty(device="cpu" if shard_kw.get("cpu_offload") else device)
    with torch.no_grad():
        for (name, mine), (other, theirs) in zip(copy.named_parameters(),
                                                 model.named_parameters(), strict=True):
            assert name == other, (name, other)
            mine.to_local().copy_(theirs.to_local())
    return copy


@contextmanager
def full_params(model: torch.nn.Module):
    """Inside, every FSDP module of `model` holds its full weights (one all-gather each, on
    every rank: a collective) and keeps them across forward passes, so a rank may run any
    number of forwards alone; on exit the gathered copies are freed. Re-entrant: inside
    another it gathers and frees nothing (rank 0, alone in an outer one, samples through an
    engine that opens its own)."""
    if not is_sharded(model) or getattr(model, "_full_params", False):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    for m in [*blocks, model]:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    model._full_params = True
    try:
        yield
    finally:
        model._full_params = False
        for m in [*blocks, model]:
            m.reshard()
        for m in blocks:  # the root keeps its own default (not resharded after forward)
            m.set_reshard_after_forward(True, recurse=False)


def release(model: torch.nn.Module) -> None:
    """Frees the weights a sharded model's root still holds gathered after a forward pass
    that no backward follows (the blocks free theirs after their own forward)."""
    if is_sharded(model):
        model.reshard()


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def model_state(model: torch.nn.Module, everywhere: bool = False) -> dict:
    """The full state dict (a collective when sharded): on CPU and on rank 0 only, unless
    `everywhere` (then on every rank, on the model's device)."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=not everywhere))


def full_tensors(model: torch.nn.Module):
    """(name, full tensor) of each entry of model.state_dict(), one at a time: under fsdp each
    is all-gathered as it is read (a collective: every rank must read them all, in order), so
    a rank never holds more than one full tensor besides its shards."""
    for name, t in model.state_dict().items():
        yield name, t.full_tensor() if hasattr(t, "full_tensor") else t


def load_model_state(model: torch.nn.Module, state: dict, strict: bool = True) -> None:
    """Loads a full state dict that every rank holds (each keeps its shard); `strict=False`:
    some of the weights (LoRA's adapters), the rest left as they are."""
    if not is_sharded(model):
        model.load_state_dict(state, strict=strict)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(strict=strict))


def load_from_rank0(model: torch.nn.Module, state: dict, device: torch.device,
                    cpu_offload: bool = False) -> None:
    """Rank 0's full state dict (`state`; the others pass {}) into every rank's shards of
    `model`, tensor by tensor (a collective). Shards still on the meta device get memory on
    `device` (CPU under `cpu_offload`) first."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device="cpu" if cpu_offload else device)
    set_model_state_dict(model, state, options=_options(broadcast_from_rank0=True))


def load_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Loads an optimizer state as `opt.state_dict()` writes it for a model that is not sharded
    (keyed by parameter index: a one-process or DDP checkpoint) into `opt`, however `model` is
    sharded now: under fsdp by parameter name, every rank keeping its shards of the moments.
    Every rank holds `state`, checked before any of it is loaded (optim.check_state)."""
    check_state(opt, state)
    if not is_sharded(model):
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    saved, now = state["param_groups"], opt.param_groups
    name = {i: names[id(p)] for g, h in zip(saved, now) for i, p in zip(g["params"], h["params"])}
    full = {"state": {name[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in saved]}
    set_optimizer_state_dict(model, opt, full, options=_options())


def pad_passes(model: torch.nn.Module, passes: int, device: torch.device) -> int:
    """Under fsdp every forward and backward is a collective, so each rank runs as many
    passes as the busiest one: the extra passes (carrying no loss) this rank runs; 0 when
    `model` is not sharded."""
    if not is_sharded(model):
        return 0
    return int(D.all_reduce_max(torch.tensor([passes], device=device)).item()) - passes


def local_params(params) -> list[torch.Tensor]:
    """Each parameter's local part: this rank's shard of a sharded one."""
    return [p.to_local() if hasattr(p, "to_local") else p for p in params]


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_, returning the total norm as a plain tensor (a DTensor when sharded)."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def memory_report(model: torch.nn.Module) -> dict[str, float]:
    """Bytes this rank holds for the trained parameters, their gradients (same dtype and
    size) and AdamW's two fp32 moments, and for the frozen ones (LoRA's base): from the
    local shards, so a fraction under fsdp."""
    local = local_params(p for p in model.parameters() if p.requires_grad)
    frozen = local_params(p for p in model.parameters() if not p.requires_grad)
    params = sum(t.numel() * t.element_size() for t in local)
    return {"params": params, "grads": params, "optimizer": sum(8 * t.numel() for t in local),
            "frozen": sum(t.numel() * t.element_size() for t in frozen)}


def _sharded_state(model: torch.nn.Module, opt: torch.optim.Optimizer | None,
                   keep=None) -> dict:
    """This rank's shards of the weights (those whose name `keep` accepts, default all) and
    of `opt`'s state, as DCP reads and writes them."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state = {"model": {k: v for k, v in get_model_state_dict(model).items()
                       if keep is None or keep(k)}}
    if opt is not None:
        state["optim"] = get_optimizer_state_dict(model, opt)
    return state


def write_shards(model: torch.nn.Module, opt: torch.optim.Optimizer | None, path,
                 keep=None) -> None:
    """Every rank writes its shards of the weights (those `keep` accepts, default all; and of
    `opt`'s state) into directory `path` with torch.distributed.checkpoint (a collective;
    checkpoint.py names, completes and renames the directory)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(model, opt, keep), checkpoint_id=str(path))


def read_shards(path, model: torch.nn.Module, opt: torch.optim.Optimizer | None = None,
                keep=None):
    """Loads the shards in directory `path` into `model` (the weights `keep` accepts, default
    all; and `opt`), however it is parallelised now and over however many ranks: DCP reads
    each rank's part (resharding)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _sharded_state(model, opt, keep)
    names = [list(g["params"]) for g in state["optim"]["param_groups"]] if opt else None
    try:
        dcp.load(state, checkpoint_id=str(path), storage_reader=safe_reader(path),
                 planner=safe_planner())
    except dcp.api.CheckpointException as e:  # {rank: (error, trace)}: the first, one line
        why = [refusal(exc) for exc, _ in e.failures.values()]
        raise ValueError(why[0] if why else "DCP cannot load it") from None
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=keep is None))
    if opt is not None:  # its tensors are ours, filled; its groups are the file's
        groups = state["optim"]["param_groups"]
        if not isinstance(groups, list) or [g.get("params") if isinstance(g, dict) else g
                                            for g in groups] != names:
            raise ValueError("optimizer.param_groups: other parameters than this model's")
        check_state(opt, state["optim"])
        set_optimizer_state_dict(model, opt, state["optim"])
