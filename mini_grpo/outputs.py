"""Files and directories a command writes whole: never over a user's files, never half.

    path = replace_dir("runs/x/hf", HF_FILES, lambda tmp: ...write files into tmp...)
    write_file("runs/x/eval.json", text)                       # inside a run's own directory
    write_file("out.json", text, owned=lambda p: ...)          # replaces only a file of ours
    write_json("out.json", {...}, "mini-grpo evaluate")        # the same, marked as ours
    write_atomic("x.pt", lambda tmp: torch.save(obj, tmp), durable=True)  # a library's writer

A training run writes into its out_dir only where that is new, empty, or a run directory
(RUN_MARKER), and only while it holds the directory's lock (`claim_run_dir`): never into a
user's folder, never beside another run.

A directory is written only where it is absent, empty, or one that mini-grpo wrote before (its
MARKER file) holding only names that writer writes (`owned`). Anything else is refused with a
ConfigError naming the path and a file in it (exit 2), before any work: a run directory, a
user's notes, a file where the directory should be. The new files go to a temporary sibling
that replaces the old directory by renames; a failed write (disk full, I/O error) removes the
temporary directory, leaves the old one as it was, and is an OutputWriteError of one line (exit
1). A file is written the same way (write_atomic: checkpoints, GGUF exports, the dtype probe's
cache, tokenizer files, eval.json): into a temporary sibling, renamed over it once whole;
`durable` fsyncs it and its directory, so that the rename survives a power cut. A file written
in place instead (LineFile's appends, a lock's holder line) is opened by open_in_place, which
refuses a link there: a symbolic one, or a hard one (a file with another name, `cp -al`), whose
other names would see the writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import re
import shutil
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from .fields import ConfigError

MARKER = ".mini-grpo-export"  # in every directory written here: one it may replace next time
RUN_MARKER = ".mini-grpo-run"  # in every run's out_dir: the run's claim, and the file it locks


class OutputWriteError(RuntimeError):
    """A file or directory could not be written (disk full, I/O error); nothing was replaced."""


_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")


def write_reason(e: BaseException) -> str:
    """One line for a failed write: "disk full" wherever ENOSPC is in the chain (torch.save
    hides it in the context of a RuntimeError, safetensors in the text of its own error, and
    numpy's tofile says only "6144 requested and 3520 written": the disk filled under it)."""
    seen, cause = set(), e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return "disk full"
        if "No space left on device" in str(cause) or _SHORT_WRITE.fullmatch(str(cause)):
            return "disk full"
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        cause = cause.__cause__ or cause.__context__
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def check_parent(output: str | Path, what: str = "output") -> None:
    """ConfigError unless `output` is no symbolic link and its nearest existing ancestor is a
    directory (a missing parent is made later, as mkdir -p does; a file in the way cannot
    be). A link is refused, dangling or not: the rename that writes a file whole would put a
    plain file in the place of the link the user made."""
    if os.path.islink(output):
        raise ConfigError(f"{what} {output}: is a symbolic link; not replaced (name the file "
                          f"it points to, or another name)")
    above = next(p for p in Path(output).absolute().parents if p.exists())
    if not above.is_dir():
        raise ConfigError(f"{what} {output}: {above} is not a directory")


def _check_dir(output: str | Path, what: str) -> Path:
    """The absolute path of directory `output` with every symlink resolved (a symlink as the
    output is followed: its target is written; `a/b/..` is `a`), refused where it is a file,
    the current directory or one holding it, or below a file."""
    out = Path(os.path.realpath(output))  # a symlink, as output or above it, followed once
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{what} {output}: exists and is not a directory; not overwritten")
    here = Path(os.path.realpath(os.getcwd()))
    if out == here or here.is_relative_to(out):
        raise ConfigError(f"{what} {output}: is the current directory or holds it; not "
                          f"overwritten (choose a new directory)")
    check_parent(out, what)
    return out


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def check_replaceable(output: str | Path, owned: re.Pattern) -> Path:
    """The absolute, normalised path of a directory that may be (re)written: absent, empty, or
    marked and holding only `owned` names; ConfigError naming it otherwise. `a/b/..` is `a`."""
    out = _check_dir(output, "output")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    # a writer writes plain files at the top level alone: a folder or a link under one of
    # their names is a user's, and so is everything in it
    foreign = [n for n in names if not (owned.fullmatch(n) and (out / n).is_file()
                                        and not (out / n).is_symlink())] \
        if MARKER in names else names
    if foreign:
        raise ConfigError(f"output {output}: exists and holds files mini-grpo did not write "
                          f"({_listed(foreign)}); not overwritten (choose a new directory)")
    return out


def claim_run_dir(out_dir: str | Path) -> int:
    """Takes `out_dir` for a training run: new (made), empty, or marked by a run before
    (RUN_MARKER; a resumed run is the same owner); anything else is a ConfigError naming up
    to 3 of its files. Returns the descriptor of the marker, locked (flock) so that a second
    run is refused while this process lives; the kernel drops the lock when it dies, however.
    Keep it open for the run's life, then `os.close` it. Rank 0 alone claims: on several
    nodes out_dir must be on one shared file system whose locks span them (NFSv4, Lustre with
    flock)."""
    out = _check_dir(out_dir, "out_dir")
    names = sorted(os.listdir(out)) if out.is_dir() else []
    if names and RUN_MARKER not in names:
        hint = (f"; if an earlier mini-grpo wrote it, `touch {Path(out_dir) / RUN_MARKER}` to "
                f"claim it" if {"config.yaml", "metrics.jsonl"} <= set(names) else "")
        raise ConfigError(f"out_dir {out_dir}: holds files no mini-grpo run wrote "
                          f"({_listed(names)}); not written into (choose a new or empty "
                          f"directory{hint})")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = open_in_place(out / RUN_MARKER)
    except OSError as e:
        raise ConfigError(f"out_dir: cannot write to {out_dir} ({e.strerror or e})") from None
    try:
        import fcntl  # POSIX; elsewhere a run's directory is not locked

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:
        pass
    except OSError:  # EWOULDBLOCK: another live process holds it
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError(f"out_dir {out_dir}: another run is writing into it ({holder}); "
                          f"wait for it to end, or choose another out_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"mini-grpo run, pid {os.getpid()} on {socket.gethostname()}\n".encode())
    return fd


def check_in_place(path: str | Path) -> None:
    """ConfigError naming `path` unless it is absent or a plain file of one name: a file
    written in place (appended to, a lock rewritten) that is a symbolic link, or a hard link
    (st_nlink > 1: `cp -al` of a run directory, a user's `ln`), would change under its other
    names too. A file replaced whole (write_atomic) needs no such check: the rename breaks
    the link, and the other names keep the old contents."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"{path}: is a symbolic link; not written through it (move it away)")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: is not a plain file; not written (move it away)")
    if st.st_nlink > 1:
        raise ConfigError(f"{path}: is a hard link (one file under {st.st_nlink} names), which "
                          f"writing it in place would change under its other names too; not "
                          f"written (give it a copy of its own, or move it away)")


def open_in_place(path: str | Path, append: bool = False) -> int:
    """A read-write descriptor of `path`, made where absent, for writing it in place (the
    appends of LineFile, a lock's holder line): refused as check_in_place says before a byte
    is written, its checks made on the file opened (no link followed), not on a name that
    may change between a check and the open."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | (os.O_APPEND if append else 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            check_in_place(path)
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            check_in_place(path)
            raise ConfigError(f"{path}: changed while it was opened; not written")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_file(output: str | Path, owned: Callable[[Path], bool]) -> Path:
    """A file that may be (re)written: absent, or one `owned` says this command wrote;
    ConfigError naming it otherwise."""
    out = Path(output)
    check_parent(out)  # first: a link is refused as a link, whatever it points to
    if out.exists() and not (out.is_file() and owned(out)):
        raise ConfigError(f"output {output}: exists and was not written by this command; not "
                          f"overwritten (choose another name)")
    return out


def write_file(output: str | Path, text: str,
               owned: Callable[[Path], bool] | None = None) -> Path:
    """`text` into `output` (write_atomic). `owned`: where given, an existing file is replaced
    only if it says yes (check_file); without it the caller owns the path (a file in a run's
    own directory)."""
    if owned is not None:
        check_file(output, owned)
    return write_atomic(output, lambda tmp: tmp.write_text(text))


def written_by(writer: str) -> Callable[[Path], bool]:
    """An `owned` test for JSON results (check_file, write_file): a JSON object whose
    "written_by" is `writer`, the mark write_json puts in every file it writes."""

    def owned(path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read(1 << 24))  # a larger file is no result of ours
        except (OSError, ValueError, RecursionError):
            return False
        return isinstance(data, dict) and data.get("written_by") == writer

    return owned


def write_json(output: str | Path, data: dict, writer: str, **dump) -> Path:
    """`data` as JSON into `output` (json.dumps' `dump` options), marked as `writer`'s: an
    existing file is replaced only where `writer` wrote it (ConfigError naming it else)."""
    text = json.dumps({"written_by": writer, **data}, **dump) + "\n"
    return write_file(output, text, owned=written_by(writer))


def write_atomic(output: str | Path, fill: Callable[[Path], None],
                 durable: bool = False) -> Path:
    """Has `fill` write the file at the path it is given (a temporary sibling of `output`,
    closed when fill returns) and renames that over `output`: a kill leaves the old file
    whole. `durable`: the file, then its directory, fsynced (checkpoints). The caller owns
    `output`. A failed write removes the temporary file; an I/O error (disk full) is an
    OutputWriteError of one line, anything else (a bug) goes on as it is. Temporaries of
    `output` that killed writers left are removed first (clean_temps)."""
    out = Path(output)
    tmp = _temp(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_temps(out)
        # what is at our own temporary name is no write of ours under way but a killed
        # writer's of the same pid (a container's pids repeat), maybe a link (`cp -al`):
        # fill would write through it
        _remove(tmp)
        fill(tmp)
        if durable:
            _fsync(tmp)
        os.replace(tmp, out)
        if durable:
            _fsync_dir(out.parent)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        _raise_write_error(output, e)
        raise
    return out


def replace_dir(output: str | Path, owned: re.Pattern, fill: Callable[[Path], None]) -> Path:
    """Checks `output` (check_replaceable), has `fill` write into a temporary sibling, marks
    it and swaps it in (swap_dir). What killed writers of `output` left is cleaned up first
    (clean_temps): an old directory a kill left aside is back, and checked."""
    clean_temps(Path(os.path.realpath(output)))
    out = check_replaceable(output, owned)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp(out)
    _remove(tmp)
    try:
        tmp.mkdir()
        fill(tmp)
        (tmp / MARKER).write_text("written by mini-grpo: it may replace this directory\n")
        _as_umask_gives(tmp, (tmp / MARKER).stat().st_mode & 0o777)
        swap_dir(tmp, out)
    except BaseException as e:  # no temporary directory left, then why
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_write_error(output, e)
        raise
    return out


def swap_dir(tmp: Path, out: Path, durable: bool = False) -> None:
    """Directory `tmp`, complete, takes `out`'s place; `durable`: the parent fsynced after.
    An old `out` gives the new one its mode (and owner and group, where permitted): a
    directory the user made private stays private. Where the system can (renameat2 on
    Linux) the two names are exchanged in one step, then the old directory, now under
    `tmp`'s name, is removed: a kill leaves the old or the new one at `out`, whole.
    Elsewhere the old `out` is renamed aside to `.<name>.old<pid>` first and put back if the
    second rename fails; one a kill left there between the two renames, the next writer of
    `out` puts back (clean_temps, checkpoint.clean_stale_temps)."""
    if not out.exists():
        old = None
        os.replace(tmp, out)
    else:
        _keep_mode(out, tmp)
        if _exchange(tmp, out):
            old = tmp  # the old directory, now under the temporary name
        else:
            old = out.with_name(f".{out.name}.old{os.getpid()}")
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except BaseException:
                if old.exists() and not out.exists():
                    os.replace(old, out)
                raise
    if durable:
        _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _keep_mode(old: Path, new: Path) -> None:
    """Directory `new` gets `old`'s owner and group where this user may give them (the
    group, when a member of it), then its mode (chown clears setgid, so it goes first)."""
    st = old.stat()
    with contextlib.suppress(OSError):
        os.chown(new, st.st_uid, st.st_gid)
    os.chmod(new, stat.S_IMODE(st.st_mode))


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


@functools.cache
def _renameat2():
    """The C library's renameat2 (glibc 2.28+, Linux 3.15+), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swaps the names of existing `a` and `b` atomically; False where the system or the file
    system cannot (the caller renames twice instead)."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a file system without it
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def clean_temps(out: Path) -> list[Path]:
    """Removes what killed writers of `out` left beside it: `.<name>.tmp<pid>` (a file or
    directory half written; after an exchange, the old one) and `.<name>.old<pid>` (swap_dir's
    old directory), of pids no longer alive on this host. A kill between swap_dir's two
    renames leaves `out` missing: its `.old<pid>` (the newest, if several) is put back there
    instead. Names of this pattern alone, of dead writers alone: a live writer's are its own.
    Returns what it removed or put back."""
    ours = re.compile(re.escape(f".{out.name}.") + r"(tmp|old)(\d+)")
    try:
        found = [(m.group(1), p) for p in out.parent.iterdir()
                 if (m := ours.fullmatch(p.name)) and not alive(int(m.group(2)))]
    except OSError:  # no parent yet: nothing left there
        return []
    olds = [p for kind, p in found if kind == "old"]
    back = None
    if olds and not os.path.lexists(out):
        back = max(olds, key=lambda p: p.lstat().st_mtime)
        os.replace(back, out)
    for _, p in found:
        if p != back:
            _remove(p)
    return [p for _, p in found]


def _remove(path: Path) -> None:
    """A file, link or directory tree, gone (a link's target kept)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def alive(pid: int) -> bool:
    """Whether process `pid` may still be writing; when unsure, yes (this process too)."""
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # EPERM: another user's process; a pid out of range
        pass
    return True


def _temp(out: Path) -> Path:
    """The temporary sibling a file or directory is written to (checkpoint.clean_stale_temps
    knows this name)."""
    return out.with_name(f".{out.name}.tmp{os.getpid()}")


def _raise_write_error(output: str | Path, e: BaseException) -> None:
    """An I/O error (disk full, however a library words it) as an OutputWriteError of one line
    naming `output`; anything else (a bug, Ctrl-C) is left to go on."""
    if isinstance(e, (OSError, OutputWriteError)) or write_reason(e) == "disk full":
        raise OutputWriteError(f"cannot write {output}: {write_reason(e)}") from e


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDWR)  # O_RDWR: Windows' _commit refuses a read-only descriptor
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    """Makes a rename inside `directory` durable; skipped where a directory cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: this file system cannot sync directories
            raise
    finally:
        os.close(fd)


def _as_umask_gives(directory: Path, mode: int) -> None:
    """Every file under `directory` gets `mode` (a plain file's, as the user's umask gives):
    safetensors writes its files readable by their owner alone (0600), which a model directory
    meant for sharing must not be."""
    for f in directory.rglob("*"):
        if f.is_file() and not f.is_symlink() and f.stat().st_mode & 0o777 != mode:
            f.chmod(mode)


class LineFile:
    """A file appended in whole lines (metrics.jsonl, RFT shards): a partial last line (a
    kill mid-write) is cut at open; a write that fails (disk full) cuts the file back to its
    last whole line and is an OutputWriteError of one line. A link at `path` (symbolic, or
    hard: another name of the file) is refused before anything is cut or written
    (open_in_place)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd = open_in_place(self.path, append=True)
        self.size = whole_lines(self.fd)
        self.f = os.fdopen(self.fd, "ab", buffering=0)  # closed by close()

    def append(self, text: str) -> None:
        data = text.encode()
        try:
            done = 0
            while done < len(data):
                done += self.f.write(data[done:])
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.size)
            raise OutputWriteError(f"cannot write {self.path}: {write_reason(e)}") from e
        self.size += len(data)

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def whole_lines(fd: int) -> int:
    """The size of open file `fd` up to its last whole line, a partial one (a kill mid-write)
    cut."""
    size = os.fstat(fd).st_size
    start = max(0, size - (1 << 20))  # a line is far shorter than the tail read
    tail = os.pread(fd, size - start, start)
    if b"\n" not in tail and start > 0:
        return size  # no line end in the last MiB: not ours to cut
    end = start + tail.rfind(b"\n") + 1
    if end != size:
        os.ftruncate(fd, end)
    return end
