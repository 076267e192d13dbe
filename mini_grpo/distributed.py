"""The only module that calls torch.distributed.

`init()` reads torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE); without it the process
runs alone and every collective here is a no-op, so the trainer has one code path.
Backend: NCCL on CUDA, gloo on CPU. Collectives time out instead of hanging forever.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def print0(self, message: str) -> None:
        """`message` on rank 0's stdout, flushed; nothing on the other ranks."""
        if self.is_main:
            print(message, flush=True)


_INITS = [0]  # process groups this process has created
# a gloo group of the same ranks whose barrier waits for rank 0's work alone (wait_for_main),
# with a timeout of its own: the longest dist_timeout the config accepts
_SOLO: list = [None]
SOLO_TIMEOUT = datetime.timedelta(days=7)


def init(timeout_s: float = 600.0, use_cuda: bool | None = None) -> DistInfo:
    if "RANK" not in os.environ:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)),
                    int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if dist.is_initialized():  # a second init in the same process (e.g. benchmark sections)
        return info
    use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Under torchrun the agent's store outlives a restart, and gloo would read the dead
        # attempt's addresses from it (seen: "connectFullMesh failed ... Connection refused"),
        # so each attempt gets keys of its own.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              info.world_size, is_master=not agent and info.rank == 0,
                              timeout=timeout)
        # ... and so does each init of one process (benchmark.py builds several runs, each
        # torn down by cleanup): every rank inits as often, so the counts agree
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        _INITS[0] += 1
        dist.init_process_group(backend, store=dist.PrefixStore(
            f"mini_grpo/{attempt}/{_INITS[0]}", store), rank=info.rank,
            world_size=info.world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    if info.world_size > 1:
        _SOLO[0] = dist.new_group(backend="gloo", timeout=SOLO_TIMEOUT)
    return info


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; returns t."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def reduce_named(sums: dict, maxes: dict | None = None) -> dict:
    """{name: sum over ranks} and {name: max over ranks} from ONE collective (an all-gather of
    every value, flattened into one vector), read back with one host sync. Values are numbers
    or tensors; a tensor with dimensions comes back as a list."""
    maxes = maxes or {}
    values = [*sums.values(), *maxes.values()]
    dev = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    parts = [torch.as_tensor(v, device=dev).detach().double().reshape(-1) for v in values]
    vec = torch.cat(parts)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() != "nccl":
            vec = vec.cpu()
        out = [torch.empty_like(vec) for _ in range(dist.get_world_size())]
        dist.all_gather(out, vec)
        every = torch.stack(out)
        n = sum(p.numel() for p in parts[:len(sums)])
        vec = torch.cat([every[:, :n].sum(0), every[:, n:].amax(0)])
    flat, i, result = vec.tolist(), 0, {}
    for name, v, part in zip([*sums, *maxes], values, parts):
        k = part.numel()
        vector = isinstance(v, torch.Tensor) and v.dim() > 0
        result[name] = flat[i:i + k] if vector else flat[i]
        i += k
    return result


class CommTimer:
    """Seconds spent in collectives, from each one's launch to its completion (overlapping ones
    overlap in the sum too), in two parts: before and after `mark()`. On a CPU the host's
    clock; on CUDA events on the stream the collective runs on, summed by `pop`, which waits
    for them (at the end of a step, where the metrics wait anyway). As a DDP communication
    hook it all-reduces gradient buckets as DDP does by default; set as FSDP's custom
    collectives (fsdp.shard(..., timer=)) it times FSDP's all-gathers and reduce-scatters,
    issued synchronously on FSDP's own streams on CUDA (HSDP's all-reduce across replicas is
    not counted)."""

    def __init__(self):
        self.seconds = [0.0, 0.0]  # before the mark, after it
        self.phase = 0
        self._events: list = []  # (start, end, phase) on CUDA

    def start(self, device: torch.device):
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event, self.phase
        return time.perf_counter(), self.phase

    def stop(self, token) -> None:
        begun, phase = token
        if isinstance(begun, float):
            self.seconds[phase] += time.perf_counter() - begun
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((begun, end, phase))
        if len(self._events) >= 4096:  # a long stage without pops (SFT): bounded memory
            self._fold()

    def _fold(self) -> None:
        for begun, end, phase in self._events:
            end.synchronize()
            self.seconds[phase] += begun.elapsed_time(end) / 1e3
        self._events.clear()

    def mark(self) -> None:
        """What follows counts as the second part (no sync)."""
        self.phase = 1

    def pop(self) -> tuple[float, float]:
        """(seconds before the mark, seconds after it) since the last pop; then starts over."""
        self._fold()
        out, self.seconds, self.phase = tuple(self.seconds), [0.0, 0.0], 0
        return out

    def hook(self, _state, bucket):
        buf = bucket.buffer().div_(dist.get_world_size())
        token = self.start(buf.device)
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f):  # on CUDA, runs on a stream that waits for the all-reduce
            self.stop(token)
            return f.value()[0]

        return fut.then(done)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP's buffers for the collectives this timer issues."""
        return torch.empty(*size, dtype=dtype, device=device)

    def timed(self, device: torch.device, call):
        """Runs `call()` (a collective, maybe async) and times it to its completion."""
        token = self.start(device)
        work = call()
        if work is None or device.type == "cuda":  # CUDA: the end event follows on the stream
            self.stop(token)
        else:
            def done(f):
                self.stop(token)
                return f.value()

            work.get_future().then(done)
        return work


def wrap_ddp(model: torch.nn.Module, device: torch.device):
    """(DDP-wrapped model, CommTimer) under torchrun; (model, None) in a single process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return model, None
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    comm = CommTimer()
    net.register_comm_hook(None, comm.hook)
    return net, comm


def all_gather_object(obj, group=None) -> list:
    """[obj of rank 0, obj of rank 1, ...] (of `group`'s ranks, else all); [obj] when alone."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def group_rank(group) -> int:
    return dist.get_rank(group)


def consecutive_groups(size: int):
    """This rank's group of `size` consecutive ranks (0..size-1, size..2 size-1, ...), e.g.
    the ranks that share one tensor-parallel engine; every rank must call it. None: alone."""
    if size <= 1 or not dist.is_initialized():
        return None
    group, _ = dist.new_subgroups(group_size=size)
    return group


def is_main() -> bool:
    """Rank 0, or the only process."""
    return not dist.is_initialized() or dist.get_rank() == 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class PeerLost(RuntimeError):
    """Rank 0 ended while this rank waited for it: one line and exit 1 (cli._guarded);
    torchrun names the rank that failed first."""


def wait_for_main() -> None:
    """Every rank waits here until rank 0 has finished what it does alone (an evaluation, the
    export), however long that takes: dist_timeout bounds the collectives of ranks that work
    together, and a final evaluation longer than it ended a finished run. A barrier of a gloo
    group of its own, whose timeout is SOLO_TIMEOUT; a rank 0 that dies ends it at once (its
    connections close). A no-op in one process."""
    if _SOLO[0] is None or not dist.is_initialized():
        return
    try:
        dist.barrier(group=_SOLO[0])
    except RuntimeError as e:
        raise PeerLost(f"rank 0 ended while rank {dist.get_rank()} waited for it: "
                       f"{str(e).splitlines()[0][:200]}") from None


def cleanup(wait: bool = True) -> None:
    """Waits for every rank (`wait`), then tears the process group down. A rank that fails
    must not wait: the others may be stuck in a collective it will never join, and torchrun
    stops them once this process exits."""
    if dist.is_initialized():
        if wait and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()  # every group, the solo one too
    _SOLO[0] = None


class PairGroup:
    """A process group of its own, outside the default one: a trainer rank and an engine
    server that push weights to each other (engines/server.py), on loopback or across nodes.
    Rank 0 hosts the rendezvous store at host:port, on `listener` (a socket bound to host
    and listening) where given: TCPStore alone binds every interface, and the store lives as
    long as the group. gloo on a CPU, NCCL between GPUs."""

    def __init__(self, host: str, port: int, rank: int, world_size: int,
                 device: torch.device, timeout_s: float = 600.0, listener=None):
        timeout = datetime.timedelta(seconds=timeout_s)
        fd = {} if listener is None else {"master_listen_fd": listener.detach()}  # the
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0,  # store's
                                   timeout=timeout, **fd)  # now: it closes it
        if device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        self.rank, self.device = rank, device

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`t` from rank `src` into every rank's `t`, in place; returns t."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([t], opts).wait()
        return t

    def close(self) -> None:
        self.pg = self.store = None
