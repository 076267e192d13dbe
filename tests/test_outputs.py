"""Directories and files written whole (outputs.py: export, import-gguf, a run's hf/ and
adapter/, checkpoints, tokenizer files) never replace a user's files, and a failed write leaves
nothing half-written: the cases an adversarial pass found destroying run directories, each
refused with one line naming it."""

import errno
import os
import re

import pytest
from conftest import ROOT, tiny_lm_dir
from test_gguf import cli

from mini_grpo.fields import ConfigError
from mini_grpo.outputs import MARKER, OutputWriteError, replace_dir

OWNED = re.compile(r"\.mini-grpo-export|model\.bin")


def write_model(tmp):
    (tmp / "model.bin").write_text("new")



def test_files_a_library_writes_private_get_the_mode_the_umask_gives(tmp_path):
    """safetensors writes 0600: an exported model directory is readable as the user's other
    files are (0644 under umask 022, 0600 under 077)."""
    import torch
    from safetensors.torch import save_file

    def fill(tmp):
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "sub").mkdir()
        (tmp / "sub" / "tokenizer.json").write_text("{}")

    for umask in (0o022, 0o077):
        old = os.umask(umask)
        try:
            out = replace_dir(tmp_path / f"out{umask:o}", OWNED, fill)
        finally:
            os.umask(old)
        modes = {p.name: p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
        assert modes == dict.fromkeys(["model.safetensors", "tokenizer.json", MARKER],
                                      0o666 & ~umask), modes

def run_dir(path):
    """What a training run leaves: the files export must never take."""
    (path / "checkpoints").mkdir(parents=True)
    (path / "checkpoints" / "step_0000004.pt").write_text("weights")
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    (path / "config.yaml").write_text("lr: 1\n")
    return sorted(p.name for p in path.rglob("*"))


def test_new_empty_and_earlier_directories_are_written(tmp_path):
    out = replace_dir(tmp_path / "a" / "b" / "new", OWNED, write_model)  # parents made
    assert (out / "model.bin").read_text() == "new" and (out / MARKER).is_file()
    (out / "model.bin").write_text("old")
    replace_dir(out, OWNED, write_model)  # an earlier one of ours: replaced
    assert (out / "model.bin").read_text() == "new"
    (tmp_path / "empty").mkdir()
    assert (replace_dir(tmp_path / "empty", OWNED, write_model) / "model.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "empty"]  # no temporaries


def test_a_users_files_are_never_replaced(tmp_path, monkeypatch):
    mine = tmp_path / "run"
    before = run_dir(mine)
    for output in (mine, f"{mine}/checkpoints/..", tmp_path / "run" / "metrics.jsonl"):
        with pytest.raises(ConfigError, match="not overwritten"):
            replace_dir(output, OWNED, write_model)
    assert sorted(p.name for p in mine.rglob("*")) == before
    ours = replace_dir(tmp_path / "ours", OWNED, write_model)
    (ours / "notes.txt").write_text("mine now")  # a marked directory holding a user's file
    with pytest.raises(ConfigError, match="notes.txt"):
        replace_dir(ours, OWNED, write_model)
    assert (ours / "notes.txt").read_text() == "mine now"
    monkeypatch.chdir(ours.parent)
    with pytest.raises(ConfigError, match="current directory"):
        replace_dir(".", OWNED, write_model)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        replace_dir(tmp_path / "file" / "out", OWNED, write_model)


def test_a_marked_directory_is_matched_at_every_depth_and_symlinks_are_followed_once(
        tmp_path, monkeypatch):
    ours = replace_dir(tmp_path / "ours", OWNED, write_model)
    (ours / "model.bin").unlink()  # a user's folder under a name the writer writes
    (ours / "model.bin").mkdir()
    (ours / "model.bin" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds files mini-grpo did not write \(model.bin\)"):
        replace_dir(ours, OWNED, write_model)
    assert (ours / "model.bin" / "notes.txt").read_text() == "mine"
    # a link under a written name points elsewhere: a user's too
    other = replace_dir(tmp_path / "other", OWNED, write_model)
    (other / "model.bin").unlink()
    os.symlink(tmp_path / "ours" / "model.bin" / "notes.txt", other / "model.bin")
    with pytest.raises(ConfigError, match="model.bin"):
        replace_dir(other, OWNED, write_model)
    # a symlink as the output: its target is written, the link stays, nothing stray is left
    target = replace_dir(tmp_path / "target", OWNED, write_model)
    os.symlink(target, tmp_path / "link")
    (target / "model.bin").write_text("old")
    assert replace_dir(tmp_path / "link", OWNED, write_model) == target
    assert (tmp_path / "link").is_symlink() and (target / "model.bin").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["link", "other", "ours", "target"]
    # through a symlinked parent to the current directory: refused, not moved away
    here = replace_dir(tmp_path / "here", OWNED, write_model)
    monkeypatch.chdir(here)
    os.symlink(tmp_path, here / "up")
    with pytest.raises(ConfigError, match="current directory"):
        replace_dir("up/here", OWNED, write_model)
    assert (here / "model.bin").read_text() == "new"


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("Error while serializing: IoError(Os { code: 28, "
                                                "kind: StorageFull, message: \"No space left on "
                                                "device\" })")])
def test_a_failed_write_leaves_the_old_directory_and_no_temporary(tmp_path, error):
    out = replace_dir(tmp_path / "out", OWNED, write_model)

    def full(tmp):
        (tmp / "model.bin").write_text("half")
        raise error

    with pytest.raises(OutputWriteError, match=r"cannot write .*out: disk full"):
        replace_dir(out, OWNED, full)
    assert (out / "model.bin").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["out"]
    with pytest.raises(ZeroDivisionError):  # a bug is not a write error: it propagates
        replace_dir(out, OWNED, lambda tmp: 1 / 0)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_export_refuses_a_run_directory_and_writes_a_new_one(tmp_path):
    lm = tiny_lm_dir(tmp_path / "lm", "llama")
    run = tmp_path / "runs" / "x"
    before = run_dir(run)
    for extra in ([], ["--adapter"]):
        r = cli("export", "--checkpoint", lm, "--output", run, *extra)
        assert r.returncode == 2 and "not overwritten" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and sorted(p.name for p in run.rglob("*")) == before
    r = cli("export", "--checkpoint", lm, "--output", f"{run}/checkpoints/..")
    assert r.returncode == 2 and "checkpoints" in r.stderr and "Traceback" not in r.stderr
    r = cli("export", "--checkpoint", lm, "--output", ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    out = tmp_path / "exports" / "x"  # a missing parent is made
    r = cli("export", "--checkpoint", lm, "--output", out)
    assert r.returncode == 0 and (out / "model.safetensors").is_file(), r.stderr
    assert cli("export", "--checkpoint", lm, "--output", out).returncode == 0  # ours: replaced
    assert sorted(p.name for p in run.rglob("*")) == before


def test_write_file_replaces_only_its_own_files_and_never_leaves_half(tmp_path, monkeypatch):
    from pathlib import Path

    from mini_grpo.outputs import write_file

    ours = lambda p: p.read_text().startswith("ours")  # noqa: E731
    out = write_file(tmp_path / "d" / "x.json", "ours 1", owned=ours)
    write_file(out, "ours 2", owned=ours)
    assert out.read_text() == "ours 2"
    (tmp_path / "notes.txt").write_text("my notes")
    with pytest.raises(ConfigError, match="notes.txt: exists and was not written"):
        write_file(tmp_path / "notes.txt", "ours", owned=ours)
    with pytest.raises(ConfigError, match="is not a directory"):
        write_file(tmp_path / "notes.txt" / "x", "ours", owned=ours)

    def full(self, text):
        Path(self).open("w").write(text[:2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OutputWriteError, match="x.json: disk full"):
        write_file(out, "ours 3")
    monkeypatch.undo()
    assert out.read_text() == "ours 2" and sorted(os.listdir(out.parent)) == ["x.json"]


def test_evaluate_json_never_replaces_a_users_file(tmp_path, capsys):
    from mini_grpo.cli import evaluate_main

    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    # refused before the checkpoint is even read (it does not exist: that would be the error)
    assert evaluate_main(["--checkpoint", str(tmp_path / "none.pt"), "--json", str(notes)]) == 2
    assert "notes.json: exists and was not written" in capsys.readouterr().err
    assert notes.read_text() == '{"mine": 1}'


def test_write_json_replaces_only_what_its_writer_marked(tmp_path):
    import json

    from mini_grpo.outputs import write_json, written_by

    out = write_json(tmp_path / "r.json", {"a": 1}, "bench/x.py")
    assert json.loads(out.read_text()) == {"written_by": "bench/x.py", "a": 1}
    assert written_by("bench/x.py")(out) and not written_by("bench/y.py")(out)
    write_json(out, {"a": 2}, "bench/x.py")  # its own: replaced
    assert json.loads(out.read_text())["a"] == 2
    with pytest.raises(ConfigError, match="r.json: exists and was not written"):
        write_json(out, {"a": 3}, "bench/y.py")  # another writer's
    for name, text in [("plain.json", '{"a": 1}'), ("list.json", '["bench/x.py"]'),
                       ("notes.txt", "written_by bench/x.py"), ("empty.json", "")]:
        (tmp_path / name).write_text(text)  # a user's, however it looks
        with pytest.raises(ConfigError, match=f"{name}: exists and was not written"):
            write_json(tmp_path / name, {"a": 1}, "bench/x.py")
        assert (tmp_path / name).read_text() == text
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(ConfigError, match="dir.json: exists and was not written"):
        write_json(tmp_path / "dir.json", {"a": 1}, "bench/x.py")
    assert json.loads(out.read_text())["a"] == 2


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   OSError("6144 requested and 3520 written"),
                                   OSError(errno.EIO, "Input/output error")])
def test_write_atomic_leaves_the_old_file_and_no_temporary_when_the_fill_fails(tmp_path,
                                                                               error):
    from mini_grpo.outputs import write_atomic

    out = write_atomic(tmp_path / "x.bin", lambda tmp: tmp.write_bytes(b"old"))

    def full(tmp):
        tmp.write_bytes(b"ha")  # part written, then the disk fails
        raise error

    with pytest.raises(OutputWriteError) as e:
        write_atomic(out, full, durable=True)
    why = "Input/output error" if error.errno == errno.EIO else "disk full"
    assert str(e.value) == f"cannot write {out}: {why}"
    assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["x.bin"]
    for bug in (ZeroDivisionError, KeyboardInterrupt):  # not a write error: as it is
        def fill(tmp, bug=bug):
            tmp.write_bytes(b"ha")
            raise bug

        with pytest.raises(bug):
            write_atomic(out, fill)
        assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["x.bin"]


def test_write_atomic_fsyncs_a_durable_file_before_its_rename(tmp_path, monkeypatch):
    from mini_grpo.outputs import write_atomic

    def fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    (tmp_path / "x.bin").write_bytes(b"old")
    write_atomic(tmp_path / "x.bin", lambda tmp: tmp.write_bytes(b"new"))  # no fsync asked
    monkeypatch.setattr(os, "fsync", fsync)
    write_atomic(tmp_path / "x.bin", lambda tmp: tmp.write_bytes(b"newer"))
    with pytest.raises(OutputWriteError, match=r"x\.bin: Input/output error$"):
        write_atomic(tmp_path / "x.bin", lambda tmp: tmp.write_bytes(b"lost"), durable=True)
    assert (tmp_path / "x.bin").read_bytes() == b"newer" and os.listdir(tmp_path) == ["x.bin"]


def test_swap_dir_puts_the_old_directory_back_when_the_rename_fails(tmp_path, monkeypatch):
    """Where two names cannot be exchanged in one step (the old directory renamed aside,
    then the new one in)."""
    from mini_grpo import outputs
    from mini_grpo.outputs import swap_dir

    out, new = tmp_path / "out", tmp_path / ".out.tmp"
    for d, text in ((out, "old"), (new, "new")):
        d.mkdir()
        (d / "f").write_text(text)
    real = os.replace

    def replace(src, dst):
        if src == new:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        swap_dir(new, out)
    assert (out / "f").read_text() == "old" and sorted(os.listdir(tmp_path)) == [".out.tmp",
                                                                                "out"]
    monkeypatch.undo()
    swap_dir(new, out, durable=True)
    assert (out / "f").read_text() == "new" and os.listdir(tmp_path) == ["out"]


def test_a_directory_the_user_made_private_stays_private(tmp_path, monkeypatch):
    """An empty directory, or an earlier export in one, keeps its mode: the new directory
    that takes its place is not the umask's 0755 (private weights made world-readable)."""
    from mini_grpo import outputs

    priv = tmp_path / "priv"
    priv.mkdir(mode=0o700)
    for exchange in (True, False):  # renameat2, and the two renames where it is missing
        if not exchange:
            monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
        assert replace_dir(priv, OWNED, write_model) == priv
        assert priv.stat().st_mode & 0o777 == 0o700 and (priv / "model.bin").is_file()
    assert os.listdir(tmp_path) == ["priv"]


# a replace_dir killed (SIGKILL: nothing runs after it) between the steps of its swap
KILLED_SWAP = """
import os, re, shutil, signal, sys
from mini_grpo import outputs

real = os.replace

def replace(src, dst):
    real(src, dst)
    if ".old" in str(dst):  # the old directory moved aside, the new one not yet in
        os.kill(os.getpid(), signal.SIGKILL)

def rmtree(path, *args, **kwargs):
    if os.path.isdir(path):  # the new directory in place, the old one not yet removed
        os.kill(os.getpid(), signal.SIGKILL)

os.replace, shutil.rmtree = replace, rmtree
if sys.argv[2] == "renames":
    outputs._exchange = lambda a, b: False
outputs.replace_dir("out", re.compile(r"\\.mini-grpo-export|model\\.bin"),
                    lambda tmp: (tmp / "model.bin").write_text("new"))
"""


@pytest.mark.parametrize("swap", ["exchange", "renames"])
def test_a_kill_during_a_swap_loses_no_directory(tmp_path, swap):
    """Killed between the steps that put a new directory in the old one's place: `out` is
    the old or the new directory, whole; or, where the system cannot exchange two names in
    one step, the old one is put back by the next writer (`.out.old<pid>` was all that was
    left of it, and checkpoint.clean_stale_temps removed it)."""
    import subprocess
    import sys

    from conftest import clean_env

    from mini_grpo.outputs import clean_temps

    out = replace_dir(tmp_path / "out", OWNED, write_model)
    (out / "model.bin").write_text("old")
    r = subprocess.run([sys.executable, "-c", KILLED_SWAP, str(out), swap], cwd=tmp_path,
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    left = sorted(os.listdir(tmp_path))
    pid = left[0].rpartition("tmp")[2] if swap == "exchange" else left[0].rpartition("old")[2]
    if swap == "exchange":  # one step: the new directory, whole
        assert left == [f".out.tmp{pid}", "out"] and (out / "model.bin").read_text() == "new"
    else:  # two: the old one aside, no `out`, until the next writer puts it back
        assert left == [f".out.old{pid}", f".out.tmp{pid}"]
        assert sorted(p.name for p in clean_temps(out)) == left
        assert os.listdir(tmp_path) == ["out"] and (out / "model.bin").read_text() == "old"
    replace_dir(out, OWNED, write_model)  # and what the kill left beside it is gone
    assert os.listdir(tmp_path) == ["out"] and (out / "model.bin").read_text() == "new"


def test_a_symlink_as_an_output_file_is_refused_and_stays_a_link(tmp_path, capsys):
    """`export --output link.gguf`, `evaluate --json link.json`: the rename that writes a
    file whole would turn the user's link into a plain file; a link is refused, naming it,
    whether it points to one of our files or nowhere. (A directory output is resolved
    instead: its target is written, the link stays.)"""
    from mini_grpo.cli import _check_gguf_output, evaluate_main
    from mini_grpo.outputs import check_file, write_json, written_by

    ours = write_json(tmp_path / "ours.json", {"a": 1}, "mini-grpo evaluate")
    os.symlink(ours, tmp_path / "link.json")
    os.symlink(tmp_path / "nowhere.json", tmp_path / "dangling.json")
    for link in ("link.json", "dangling.json"):
        with pytest.raises(ConfigError, match=f"{link}: is a symbolic link; not replaced"):
            write_json(tmp_path / link, {"a": 2}, "mini-grpo evaluate")
        with pytest.raises(ConfigError, match=f"{link}: is a symbolic link"):
            check_file(tmp_path / link, written_by("mini-grpo evaluate"))
        assert evaluate_main(["--checkpoint", str(tmp_path / "none.pt"),
                              "--json", str(tmp_path / link)]) == 2
        assert f"{link}: is a symbolic link" in capsys.readouterr().err
    os.symlink(tmp_path / "target.gguf", tmp_path / "link.gguf")  # dangling: exists() is False
    with pytest.raises(ConfigError, match="link.gguf: is a symbolic link"):
        _check_gguf_output(str(tmp_path / "link.gguf"))
    assert all((tmp_path / n).is_symlink() for n in ("link.json", "dangling.json", "link.gguf"))
    assert sorted(os.listdir(tmp_path)) == ["dangling.json", "link.gguf", "link.json",
                                            "ours.json"]


def test_temporaries_of_killed_writers_are_removed_before_writing(tmp_path):
    """What a killed export left (`.out.gguf.tmp<pid>`, `.hf.tmp<pid>`: hundreds of MB) is
    removed by the next write of that output: our names alone, of dead writers alone."""
    from mini_grpo.outputs import write_atomic

    dead = 2**22 + 12345  # above the kernel's pid_max: never a live process
    stale = [f".out.gguf.tmp{dead}", f".hf.tmp{dead}", f".hf.old{dead}"]
    keep = [f".out.gguf.tmp{os.getppid()}",  # a live writer's
            ".out.gguf.tmpx", f"out.gguf.tmp{dead}", f".other.gguf.tmp{dead}",
            f".out.gguf.tmp{dead}.bak", "notes.txt"]
    replace_dir(tmp_path / "hf", OWNED, write_model)
    for name in stale + keep:
        if ".hf." in name:
            (tmp_path / name).mkdir()
            (tmp_path / name / "model.bin").write_text("half")
        else:
            (tmp_path / name).write_text("half")
    write_atomic(tmp_path / "out.gguf", lambda tmp: tmp.write_text("gguf"))
    replace_dir(tmp_path / "hf", OWNED, write_model)
    assert sorted(os.listdir(tmp_path)) == sorted(["hf", "out.gguf", *keep])


# `mini-grpo export`, its write under way, then SIGTERM (a scheduler's, kill's)
TERMINATED = """
import re, sys, time
from mini_grpo import cli, outputs

def fill(tmp):
    (tmp / "model.bin" if tmp.is_dir() else tmp).write_text("half")
    print("writing", flush=True)
    time.sleep(60)

def export(argv):
    if argv[0] == "file":
        return cli._guarded(lambda: outputs.write_atomic("out.gguf", fill))
    return cli._guarded(lambda: outputs.replace_dir("hf", re.compile("model.bin"), fill))

cli.COMMANDS["export"] = export
sys.exit(cli.main(["export", sys.argv[1]]))
"""


@pytest.mark.parametrize("what", ["file", "dir"])
def test_a_terminated_export_leaves_no_temporary(tmp_path, what):
    import signal
    import subprocess
    import sys

    from conftest import clean_env

    p = subprocess.Popen([sys.executable, "-c", TERMINATED, what], cwd=tmp_path,
                         env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline() == "writing\n"
        assert os.listdir(tmp_path)  # the temporary, half written
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    assert os.listdir(tmp_path) == []


def test_a_file_written_in_place_is_refused_under_a_hard_link(tmp_path):
    """`cp -al` of a run, a user's `ln`: a file a run writes in place (metrics.jsonl, RFT's
    shards, the run's lock) that is one name of a file with others is refused at setup with
    one line naming it, before any work; the other name's contents stay as they were (the
    run appended rows to them). A file replaced whole breaks the link: no refusal there."""
    from conftest import tiny

    from mini_grpo.outputs import RUN_MARKER, LineFile, claim_run_dir, write_atomic
    from mini_grpo.run import setup

    notes = tmp_path / "notes.txt"
    notes.write_text("the user's notes\nno line end")
    for planted in ("metrics.jsonl", "rft/data.jsonl.rank0", "rft/data.jsonl.rank0.done"):
        run = tmp_path / planted.replace("/", "_")
        (run / "rft").mkdir(parents=True)
        (run / RUN_MARKER).write_text("")
        os.link(notes, run / planted)
        with pytest.raises(ConfigError, match=f"{re.escape(str(run / planted))}: is a hard "
                                              f"link .one file under \\d+ names") as e:
            setup(tiny(run))
        assert "\n" not in str(e.value)
        with pytest.raises(ConfigError, match="is a hard link"):
            LineFile(run / planted)
    run = tmp_path / "marked"
    run.mkdir()
    os.link(notes, run / RUN_MARKER)  # the claim rewrites its holder line in place
    with pytest.raises(ConfigError, match=f"{RUN_MARKER}: is a hard link"):
        claim_run_dir(run)
    os.symlink(notes, tmp_path / "link.jsonl")
    with pytest.raises(ConfigError, match="link.jsonl: is a symbolic link; not written"):
        LineFile(tmp_path / "link.jsonl")
    # a killed writer of this same pid (a container's pids repeat) left a link at the
    # temporary name write_atomic fills: it is removed, never written through
    os.link(notes, tmp_path / f".eval.json.tmp{os.getpid()}")
    write_atomic(tmp_path / "eval.json", lambda tmp: tmp.write_text("{}"))
    assert notes.read_text() == "the user's notes\nno line end" and notes.stat().st_nlink == 5
