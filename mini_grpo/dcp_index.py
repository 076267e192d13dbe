"""A sharded (DCP) checkpoint's files, read as untrusted input: DCP writes its index
(`.metadata`) as a plain pickle and reads it back with pickle.load, and reads a shard's
non-tensor items with torch.load(weights_only=False); both run whatever code a crafted file
names. Here the index is read by an allowlist of the classes DCP's own is made of, its entries
checked as DCP writes them, and non-tensor items with weights_only=True.

    safe_reader(path)          DCP's FileSystemReader, reading `.metadata` by the allowlist
    safe_planner()             DCP's DefaultLoadPlanner, byte items by torch.load(weights_only)
    check_shards(path)         every shard the index names is a plain file of the folder
                               (no link), holding every byte range named in it
    sharded_shapes(path)       {weight: shape} from the index alone

fsdp.read_shards loads through the first two; checkpoint.py and policy.py check with the last.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import pickle
import stat
from pathlib import Path

import torch


def check_shards(path) -> None:
    """Every shard the metadata of sharded checkpoint `path` names is a plain file of its
    folder, holding every byte range named in it (read_metadata checks them, as every read
    of the index does): a deleted, truncated or linked shard is a ValueError naming it (DCP
    would trace back mid-load, or read a file elsewhere)."""
    safe_reader(path).read_metadata()


def _check_files(meta, folder: Path) -> None:
    """The shards index `meta` names, in checkpoint folder `folder`: each a plain file there
    (no symbolic link, none above it inside the folder: its resolved path within the
    folder's), long enough for every byte range in it."""
    ends: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        name = str(info.relative_path)
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    inside = Path(os.path.realpath(folder))
    for name, end in sorted(ends.items()):
        shard = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts \
                or not Path(os.path.realpath(shard)).is_relative_to(inside):
            raise ValueError(f"shard {name!r} lies outside the checkpoint")
        try:
            st = os.lstat(shard)
        except FileNotFoundError:
            raise ValueError(f"shard {name} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a plain file"
            raise ValueError(f"shard {name} is {what}, not a file DCP wrote")
        if st.st_size < end:
            raise ValueError(f"shard {name} is cut short ({st.st_size} of {end} bytes)")


def refusal(e: BaseException) -> str:
    """One line for an error torch raised reading a shard: for what weights_only refuses,
    not torch's advice to load it with weights_only=False (which runs any code it holds)."""
    text = str(e).strip()
    if "weights_only" in text:
        return "a shard holds more than tensors and plain values, which are never unpickled"
    return text.splitlines()[0][:200] if text else type(e).__name__


def sharded_shapes(path) -> dict[str, torch.Size]:
    """{weight name: shape} of a sharded checkpoint's model, from its metadata alone."""
    meta = safe_reader(path).read_metadata().state_dict_metadata
    return {k.removeprefix("model."): v.size for k, v in meta.items()
            if k.startswith("model.") and hasattr(v, "size")}


# DCP writes its index (`.metadata`) as a plain pickle and reads it back with pickle.load, which
# runs whatever code a crafted file names. A checkpoint directory is untrusted input: the index
# is read here with only the classes DCP's own index is made of.
MAX_DCP_METADATA = 1 << 28  # bytes; the index of a 70B model's sharded state is a few MiB
_DCP_METADATA_CLASSES = {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                         "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                         "_MEM_FORMAT_ENCODING"}
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = (module == "torch.distributed.checkpoint.metadata"
                   and name in _DCP_METADATA_CLASSES
                   or (module, name) in {("torch.distributed.checkpoint.filesystem",
                                          "_StorageInfo"), ("torch", "Size"),
                                         ("torch.serialization", "_get_layout")}
                   or module == "pathlib" and name in _PATHS
                   or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise pickle.UnpicklingError(f".metadata names {module}.{name}, which is not part "
                                         f"of a DCP index and is never unpickled")
        return super().find_class(module, name)


def _no_link(path, flags: int) -> int:
    """os.open for open(opener=): a symbolic link as the index is refused (ELOOP)."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{Path(path).name} is a symbolic link, not the index DCP "
                             f"wrote") from None
        raise


def safe_reader(path):
    """DCP's FileSystemReader for directory `path`, reading `.metadata` by the allowlist."""
    return _safe_reader_class()(str(path))


@functools.cache
def _safe_reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs) -> Metadata:
            rank = kwargs.get("rank")
            folder = Path(str(self.path))
            path = folder / (".metadata" if rank is None else f"__{rank}.metadata")
            with open(path, "rb", opener=_no_link) as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_DCP_METADATA:
                    raise ValueError(f"{path.name} is {size} bytes, beyond the "
                                     f"{MAX_DCP_METADATA} of any DCP index")
                meta = _IndexUnpickler(f).load()
            if not isinstance(meta, Metadata):
                raise ValueError(f"{path.name} holds a {type(meta).__name__}, not DCP's index")
            coded = sorted(str(k.fqn) for k, info in (meta.storage_data or {}).items()
                           if getattr(info, "transform_descriptors", None))
            if coded:  # never written here; a decompressor could inflate bytes without bound
                raise ValueError(f"{path.name}: item {coded[0]} is stored through a transform "
                                 f"(compression), which mini-grpo never writes")
            _check_entries(meta, path.name)
            _check_files(meta, folder)
            if getattr(meta, "storage_meta", None) is None:  # as FileSystemReader does
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return SafeReader


def _dims(size, ndim: int | None = None) -> bool:
    """A torch.Size of non-negative ints (of `ndim` dimensions, where given)."""
    return isinstance(size, torch.Size) and (ndim is None or len(size) == ndim) and all(
        type(d) is int and d >= 0 for d in size)


def _check_entries(meta, name: str) -> None:
    """Every entry of DCP index `name` as DCP writes one: a tensor's size and its chunks are
    non-negative ints, the chunks within the size, and the tensor's bytes no more than the
    index stores for it (sizes read from a crafted index made torch.empty trace back, or
    overflow, where the model is compared with them)."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        TensorStorageMetadata,
    )

    stored: dict[str, int] = {}
    for index, info in (meta.storage_data or {}).items():
        length = getattr(info, "length", None)
        if type(length) is not int or length < 0:
            raise ValueError(f"{name}: the bytes of item {getattr(index, 'fqn', index)!r} are "
                             f"{length!r}, not a length")
        stored[index.fqn] = stored.get(index.fqn, 0) + length
    for key, entry in (meta.state_dict_metadata or {}).items():
        if isinstance(entry, BytesStorageMetadata) and isinstance(key, str):
            continue
        if not (isinstance(entry, TensorStorageMetadata) and isinstance(key, str)):
            raise ValueError(f"{name}: entry {str(key)[:200]} is a {type(entry).__name__}, not a "
                             f"tensor's or bytes' entry")
        size, dtype = entry.size, getattr(entry.properties, "dtype", None)
        if not _dims(size):
            shown = list(size) if isinstance(size, torch.Size) else repr(size)
            raise ValueError(f"{name}: entry {key} has size {shown}, not a tensor's "
                             f"(non-negative integers)")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}: entry {key} has dtype {dtype!r}, not a torch dtype")
        if math.prod(size) * dtype.itemsize > stored.get(key, 0):
            raise ValueError(f"{name}: entry {key} of size {tuple(size)} would take more than "
                             f"the {stored.get(key, 0)} bytes the index stores for it")
        for chunk in entry.chunks or []:
            if not (_dims(chunk.offsets, len(size)) and _dims(chunk.sizes, len(size)) and all(
                    o + n <= d for o, n, d in zip(chunk.offsets, chunk.sizes, size))):
                raise ValueError(f"{name}: entry {key} has a chunk outside its size "
                                 f"{tuple(size)}")


def safe_planner():
    """A load planner that reads a shard's byte items with weights_only=True."""
    return _safe_planner_class()()


@functools.cache
def _safe_planner_class():
    """DCP's DefaultLoadPlanner, but a shard's non-tensor items (the optimizer's param_groups
    values, any byte item) are read with torch.load(weights_only=True): torch's own reads them
    with weights_only=False, which runs whatever code a planted pickle names."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                raise ValueError(f"item {fqn} holds more than tensors and plain values, which "
                                 f"are never unpickled") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafePlanner
