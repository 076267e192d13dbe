"""Checkpoints, the one module that writes and reads them: atomic, durable save in one file or
as DCP shards; newest-valid resume; retention. Loaded weights_only=True.

`save(model, opt, meta, ...)` writes the form the model's parallelism needs and
`load_weights(checkpoint, model, opt)` reads either form into a model however it is
parallelised now (state.TrainState calls both; fsdp.py holds the state-dict primitives).

A one-file checkpoint is one `step_NNNNNNN.pt` file holding plain tensors and Python values:
model and optimizer state, step, guard, RNG states, the resolved config, the tokenizer, and
the format marker (FORMAT, VERSION) without which no file counts as a checkpoint: retention
neither counts nor removes it, resume and every command refuse it. It is written through
outputs.write_atomic: to `.step_NNNNNNN.pt.tmp<pid>`, fsynced, renamed over the final name, and
the directory is fsynced so the rename survives a power cut; a kill mid-write therefore never
leaves a broken newest checkpoint, and a file that still fails to load is skipped with a warning.
A failed write (disk full, I/O error) removes its temp file, leaves older checkpoints alone and
raises CheckpointWriteError with one line; temps left by killed writers are removed by
clean_stale_temps (the trainer calls it at start) and by every save into that directory.

Under fsdp a checkpoint is a directory `step_NNNNNNN.dcp` instead (`save`): every rank
writes its shards with torch.distributed.checkpoint into `.step_NNNNNNN.dcp.tmp`,
rank 0 adds `meta.pt` (everything but the weights and optimizer state) and renames it into
place (outputs.swap_dir). `load_checkpoint` returns its meta with "sharded": the directory's
path; one without DCP's `.metadata` or `meta.pt` (cut short) is skipped like a corrupt file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from . import dcp_index, fsdp
from . import distributed as D
from .outputs import alive, swap_dir, write_atomic, write_reason

_NAME = re.compile(r"^step_(\d+)\.(pt|dcp)$")
# in every checkpoint (a one-file one's state, a sharded one's meta.pt): a file is ours only if
# it says so. Retention counts and removes, and resume reads, only files that carry it.
FORMAT = "mini-grpo checkpoint"
VERSION = 1
_TEMP = re.compile(r"^\.step_\d+\.pt\.tmp(\d+)$")  # write_atomic's temporary file
# all ranks write .tmp: no pid to check; .old<pid>: swap_dir's old one, left by a kill
_TEMP_DIR = re.compile(r"^\.(step_\d+\.dcp)\.(tmp|old(\d+))$")


class CheckpointError(ValueError):
    """A checkpoint the user named cannot be used (exit code 2)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, I/O error); older ones are untouched."""


def save(model: torch.nn.Module, opt: torch.optim.Optimizer | None, meta: dict,
         directory: str | Path, step: int, keep: int = 0) -> Path | None:
    """`model`'s weights (and `opt`'s state) with `meta` as checkpoint `step` in `directory`,
    keeping the newest `keep`: as DCP shards when the model is sharded (every rank writes its
    own: a collective, every rank calls it), else one file written by rank 0. Returns the
    path (None on the ranks that wrote nothing)."""
    if fsdp.is_sharded(model):
        return _save_sharded(model, opt, meta, Path(directory), step, keep)
    if not D.is_main():
        return None
    kept = weights_kept(model)
    state = {**meta, "model": {k: v for k, v in model.state_dict().items() if kept(k)}}
    if opt is not None:
        state["optimizer"] = opt.state_dict()
    return save_checkpoint(state, directory, step, keep=keep)


def _save_sharded(model, opt, meta: dict, directory: Path, step: int, keep: int) -> Path:
    final = directory / f"step_{step:07d}.dcp"
    tmp = directory / f".{final.name}.tmp"
    if D.is_main():
        directory.mkdir(parents=True, exist_ok=True)
        clean_stale_temps(directory)
    D.barrier()
    try:
        fsdp.write_shards(model, opt, tmp, keep=weights_kept(model))
        if D.is_main():
            torch.save({**meta, "format": FORMAT, "version": VERSION}, tmp / "meta.pt")
            swap_dir(tmp, final, durable=True)  # over the same step saved before
    except Exception as e:  # disk full on any rank: no half directory left, older ones kept
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"cannot write checkpoint {final}: {write_reason(e)}") \
            from e
    if D.is_main():
        prune(directory, keep, final)
    D.wait_for_main()  # rank 0's rename, fsync and prune, alone
    return final


_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".distcp", ".metadata")


def base_fingerprint(path: str | Path) -> str:
    """A short digest of a model's weights as files: of `path` (one of our checkpoints) or of
    the weight files and config.json of a directory, their sizes and 16 slices of 4 KiB
    spread through each, headers included. Another model, or the same one trained further,
    gets another digest, without reading gigabytes. A LoRA checkpoint records its base's
    (`check_base`): it holds its adapters alone, and they mean nothing on another base."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file() and (
        f.name == "config.json" or f.suffix in _WEIGHT_FILES)) if p.is_dir() else [p]
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name if p.is_dir() else ''}:{size};".encode())
        with open(f, "rb") as fh:
            for i in range(16):
                fh.seek(size * i // 16)
                digest.update(fh.read(4096))
    return digest.hexdigest()[:16]


def check_base(state: dict, have: str, init_from: str, source: str) -> None:
    """A LoRA checkpoint's adapters go onto the base they were trained on: `have`, the
    fingerprint of the base read from `init_from`, must be the one `state` recorded
    (checkpoints written before bases were recorded are taken on trust)."""
    want = state.get("base")
    if want is not None and not isinstance(want, str):
        raise CheckpointError(f"{source}: its base record must be a string, got "
                              f"{type(want).__name__}")
    if want is not None and have != want:
        raise CheckpointError(f"{source}: its adapters were trained on another base than "
                              f"what init_from {init_from} holds now (its weight files "
                              f"differ); point init_from at that base")


def load_weights(checkpoint: dict, model: torch.nn.Module,
                 opt: torch.optim.Optimizer | None = None, source: str = "checkpoint") -> None:
    """A loaded checkpoint's weights (and, given `opt`, its optimizer state) into `model`,
    whichever form it was saved in and however `model` is parallelised now."""
    where = checkpoint.get("sharded") or source
    try:
        lora = _adapted(model)
        if lora:  # the adapters alone: every one of them, nothing else
            saved = set(dcp_index.sharded_shapes(where) if checkpoint.get("sharded") else
                        checkpoint["model"])
            want = {k for k in model.state_dict() if ".lora_" in k}
            if saved != want:
                odd = sorted(saved - want) or sorted(want - saved)
                raise ValueError(f"{'unexpected' if saved - want else 'missing'} weight "
                                 f"{odd[0]} (this run trains LoRA adapters of rank "
                                 f"{lora[0]} on {', '.join(lora[1])})")
        keep = (lambda k: ".lora_" in k) if lora else None
        if checkpoint.get("sharded"):
            fsdp.read_shards(checkpoint["sharded"], model, opt, keep=keep)
            return
        # under fsdp each rank keeps its shards
        fsdp.load_model_state(model, checkpoint["model"], strict=keep is None)
        if opt is not None:
            fsdp.load_optimizer_state(model, opt, checkpoint["optimizer"])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None


def weights_kept(model: torch.nn.Module):
    """Which weights a checkpoint keeps, as a test on the name: all of them, or with LoRA
    the adapters alone (the frozen base is init_from's, read from there)."""
    return (lambda k: ".lora_" in k) if _adapted(model) else (lambda k: True)


def _adapted(model: torch.nn.Module) -> tuple[int, list[str]] | None:
    """(rank, adapted layers' short names) of a model with LoRA adapters (lora.py's
    `lora_A` / `lora_B` submodules), read off its weights; None without any."""
    a = {k.rpartition(".lora_A.")[0]: v for k, v in model.state_dict().items()
         if ".lora_A." in k}
    if not a:
        return None
    return next(iter(a.values())).shape[0], list(dict.fromkeys(
        k.rpartition(".")[2] for k in a))


def save_checkpoint(state: dict[str, Any], directory: str | Path, step: int,
                    keep: int = 0) -> Path:
    """Writes state atomically as directory/step_<step>.pt; keeps the newest `keep` (0 = all)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(directory)  # before writing: a full disk may need the room
    path = directory / f"step_{step:07d}.pt"
    state = {**state, "format": FORMAT, "version": VERSION}

    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(state, f)

    try:
        write_atomic(path, fill, durable=True)
    except Exception as e:  # torch.save's own errors too; KeyboardInterrupt goes on as it is
        raise CheckpointWriteError(f"cannot write checkpoint {path}: {write_reason(e)}") from e
    prune(directory, keep, path)
    return path


def prune(directory: Path, keep: int, written: Path) -> None:
    """After `written`: removes the same step saved in the other form (one file or fsdp's
    shards: a run that changed its parallelism), then all but the newest `keep` checkpoints
    that load (0: keeps all), up to `written`'s step. Only loadable ones count and go: one
    that does not load is left as it is (the run overwrites it when it gets to that step),
    and so is any of a later step (a resume skipped it: this run's steps have not got there)."""
    other = written.with_suffix(".pt" if written.suffix == ".dcp" else ".dcp")
    if loadable(other):  # a checkpoint, never a file or folder of the user's that is named so
        _remove(other)
    if keep <= 0:
        return
    upto = int(_NAME.match(written.name).group(1))
    good = [p for p in list_checkpoints(directory)
            if int(_NAME.match(p.name).group(1)) <= upto and (p == written or loadable(p))]
    for old in good[:-keep]:
        _remove(old)


def _remove(path: Path) -> None:
    """A checkpoint: one file, or a directory of shards."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def discard_checkpoints(directory: Path) -> None:
    """Removes every checkpoint of `directory` that is ours (carries the format marker and
    loads): a run that starts afresh must not later resume from the run before it."""
    for p in list_checkpoints(directory):
        if loadable(p):
            _remove(p)


def loadable(path: Path) -> bool:
    """Whether checkpoint `path` loads (its tensors mapped, not read)."""
    try:
        load_checkpoint(path, mmap=True)
    except CheckpointError:
        return False
    return True


def has_checkpoint(directory: str | Path) -> bool:
    """Whether `directory` holds a checkpoint that loads (one named so is not enough: the
    guard's restore rung, offered on that, found none and ended in a traceback)."""
    return any(loadable(p) for p in list_checkpoints(directory))


def clean_stale_temps(directory: str | Path) -> list[Path]:
    """Removes `.step_*.pt.tmp<pid>` files whose writer is gone (or is this process, which
    writes one checkpoint at a time) and fsdp's `.step_*.dcp.tmp` / `.old<pid>` directories;
    returns them. An `.old<pid>` of a writer gone whose checkpoint is missing (a kill between
    swap_dir's two renames) is put back under its name instead: that step's checkpoint,
    whole. pids are
    this host's, so only one job, on one host, should write into a directory."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for p in sorted(directory.iterdir()):
        if m := _TEMP_DIR.match(p.name):
            pid = m.group(3)  # none in .tmp: every rank writes into it
            if pid and int(pid) != os.getpid() and alive(int(pid)):
                continue  # another process's swap, under way
            final = directory / m.group(1)
            if m.group(3) and not final.exists():
                os.replace(p, final)
            else:
                shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            continue
        m = _TEMP.match(p.name)
        if m and (int(m.group(1)) == os.getpid() or not alive(int(m.group(1)))):
            with contextlib.suppress(FileNotFoundError):  # another cleaner got there first
                p.unlink()
                removed.append(p)
    return removed


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files in step order, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: str | Path, map_location="cpu", mmap: bool = False) -> dict[str, Any]:
    """Loads one checkpoint; a missing or unreadable file is a CheckpointError naming it.
    `mmap`: the tensors mapped, not read (checks that it loads, at little cost)."""
    path = Path(path)
    with warnings.catch_warnings():
        # a plain (non-zip) pickle of protocol > 2 makes torch warn before it refuses it, or
        # before our one-line error does: the line is ours alone
        warnings.filterwarnings("ignore", r"Detected pickle protocol \d+ in the checkpoint",
                                UserWarning)
        if path.is_dir() and path.suffix == ".dcp":
            return _sharded_meta(path)
        if not path.is_file():
            raise CheckpointError(f"checkpoint not found: {path}")
        try:
            state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except Exception as e:  # truncated zip, wrong format, non-allowlisted pickle ...
            raise CheckpointError(f"{path}: cannot load checkpoint ({_reason_to_refuse(e)})") \
                from None
    _check_format(state, path)
    if "model" not in state:
        raise CheckpointError(f"{path}: not a mini-grpo checkpoint (no 'model' entry)")
    return state


def _check_format(state, path: Path) -> None:
    """A checkpoint is ours only if it carries FORMAT, at a version this code reads."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a mini-grpo checkpoint (no format marker: written "
                              f"by another program, or by mini-grpo before checkpoints carried "
                              f"one)")
    version = state.get("version")
    if type(version) is not int or not 1 <= version <= VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version!r}; this mini-grpo "
                              f"reads version {VERSION} (a newer one wrote it? upgrade)")


def _reason_to_refuse(e: Exception) -> str:
    """torch.load's error in one line; for what weights_only refuses, not torch's advice to
    load it with weights_only=False (which runs any code the file holds)."""
    if isinstance(e, pickle.UnpicklingError) and "weights_only" in str(e):
        return "it holds more than tensors and plain values, which are never unpickled"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _sharded_meta(path: Path) -> dict[str, Any]:
    if not (path / ".metadata").is_file() or not (path / "meta.pt").is_file():
        raise CheckpointError(f"{path}: a sharded checkpoint cut short (no .metadata or "
                              f"meta.pt)")
    if (path / "meta.pt").is_symlink():  # as its shards: a file of the folder, read there
        raise CheckpointError(f"{path}: its meta.pt is a symbolic link, not a file mini-grpo "
                              f"wrote")
    try:
        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load meta.pt ({_reason_to_refuse(e)})") \
            from None
    _check_format(meta, path)
    if "kind" not in meta:
        raise CheckpointError(f"{path}: not a mini-grpo checkpoint (meta.pt has no 'kind')")
    try:
        dcp_index.check_shards(path)
    except Exception as e:  # a deleted or cut shard; unreadable .metadata
        raise CheckpointError(f"{path}: a sharded checkpoint that cannot load "
                              f"({_reason_to_refuse(e)})") from None
    return {**meta, "sharded": str(path)}


def latest_checkpoint(directory: str | Path, map_location="cpu", mmap: bool = False,
                      step: int | None = None):
    """(path, state) of the newest checkpoint that loads (of that `step` alone, where
    given), or (None, None); warns on bad ones. `mmap`: its tensors mapped, read only where
    used."""
    for path in reversed(list_checkpoints(directory)):
        if step is not None and int(_NAME.match(path.name).group(1)) != step:
            continue
        try:
            return path, load_checkpoint(path, map_location, mmap)
        except CheckpointError as e:
            warnings.warn(f"skipping corrupt checkpoint: {e}", stacklevel=2)
    return None, None


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
        state["generator_device"] = generator.device.type
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None,
                  source: str = "checkpoint") -> list[str]:
    """Restores what `rng_state` saved; returns what could not be restored. A generator's
    state belongs to its device's kind (the CPU's is 5 KB, CUDA's 16 bytes), so a run written
    on CPU ranks and resumed on a GPU, or the other way round, keeps its generator as seeded;
    CUDA's states are restored only onto as many GPUs as wrote them. An entry that is not
    what `rng_state` writes is a CheckpointError naming it."""
    _check_rng(state, source)
    skipped, before = [], torch.get_rng_state()
    try:
        _restore(source, "torch", torch.set_rng_state, state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            if len(state["cuda"]) == torch.cuda.device_count():
                _restore(source, "cuda", torch.cuda.set_rng_state_all, state["cuda"])
            else:
                skipped.append(f"CUDA's RNG ({len(state['cuda'])} GPUs wrote it, "
                               f"{torch.cuda.device_count()} here)")
        if generator is not None and "generator" in state:
            saved = state.get("generator_device")
            if saved is None:  # written before the device was recorded: its size tells
                saved = "cpu" if state["generator"].numel() > 16 else "cuda"
            if saved == generator.device.type:
                _restore(source, "generator", generator.set_state, state["generator"])
            else:
                skipped.append(f"the sampling generator (written on {saved}, resumed on "
                               f"{generator.device.type})")
    except CheckpointError:
        torch.set_rng_state(before)  # none of it, rather than half
        raise
    return skipped


def _check_rng(state, source: str) -> None:
    def byte_tensor(v) -> bool:
        return torch.is_tensor(v) and v.dtype == torch.uint8 and v.dim() == 1
    bad = None
    if not isinstance(state, dict) or not byte_tensor(state.get("torch")):
        bad = "torch"
    elif "cuda" in state and not (isinstance(state["cuda"], list)
                                  and all(byte_tensor(v) for v in state["cuda"])):
        bad = "cuda"
    elif "generator" in state and not byte_tensor(state["generator"]):
        bad = "generator"
    elif state.get("generator_device", "cpu") not in ("cpu", "cuda", "mps", "xpu"):
        bad = "generator_device"
    if bad:
        raise CheckpointError(f"{source}: its RNG state's {bad!r} entry is not what mini-grpo "
                              f"writes (a 1-d uint8 tensor, or a list of them for 'cuda'; "
                              f"a device kind for 'generator_device')")


def _restore(source: str, name: str, fn, value) -> None:
    try:
        fn(value)
    except RuntimeError as e:  # a state of the wrong size for this torch's generator
        raise CheckpointError(f"{source}: cannot restore its RNG state's {name!r} entry "
                              f"({str(e).splitlines()[0][:200]})") from None


def check_shapes(expected: dict[str, torch.Size], state: dict, source: str) -> None:
    """Weights must name exactly the model's tensors, with the same shapes: otherwise a
    CheckpointError naming the first few differences."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{source}: model weights are not a mapping of tensors")
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    shape = lambda v: tuple(v.shape) if torch.is_tensor(v) else f"({type(v).__name__})"
    wrong = [f"{k} {shape(state[k])} (expected {tuple(s)})" for k, s in expected.items()
             if k in state and (not torch.is_tensor(state[k]) or state[k].shape != s)]
    for what, names in (("missing", missing), ("unexpected", extra), ("mismatched", wrong)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise CheckpointError(f"{source}: {what} weights: {', '.join(names[:3])}{more}")
