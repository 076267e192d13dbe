"""Bounds an adversarial pass found missing (issue 37): a vLLM server's reply without a
Content-Length (chunked, or up to the close; an error's or a redirect's too) is read within
`vllm_server_timeout` and MAX_REPLY_BYTES; a GGUF file's metadata is one memory budget in all
and its tensors may not overlap; a GGUF export that fills the disk says so and leaves nothing.
Each is one line naming the URL, key, tensor or path."""

import errno
import os
import threading
import time

import pytest
from test_gguf import exported
from test_vllm_replies import engine, health, policy, server  # noqa: F401 (fixtures)

from mini_grpo.checkpoint import CheckpointError
from mini_grpo.engines import client
from mini_grpo.engines.base import EngineError, Sampling
from mini_grpo.models.gguf import read_gguf
from mini_grpo.outputs import OutputWriteError

PROMPTS = ["e2e4 e7e5", "d2d4"]


def streamer(status: int, chunked: bool, pieces: int, piece: bytes, pause: float = 0.0):
    """(handler function, stats): a reply of `status` without Content-Length, `pieces` times
    `piece`; stats["sent"] counts the bytes written before the client hung up, stats["done"]
    is set when the handler returns."""
    stats = {"sent": 0, "done": threading.Event()}

    def answer(handler):
        handler.send_response(status)
        if status == 302:
            handler.send_header("Location", "/generate")
        if chunked:
            handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        frame = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
        try:
            for _ in range(pieces):
                handler.wfile.write(frame)
                handler.wfile.flush()
                stats["sent"] += len(piece)
                time.sleep(pause)
        except OSError:
            pass  # the client hung up
        finally:
            stats["done"].set()

    return answer, stats


@pytest.mark.parametrize("status", [200, 500])
@pytest.mark.parametrize("chunked", [False, True])
def test_an_endless_reply_without_length_ends_at_the_timeout(policy, server, status,  # noqa: F811
                                                             chunked):
    """A byte every 50 ms for up to 10 s: the call ends after vllm_server_timeout (1 s)."""
    url, replies = server
    replies["/health"] = health(policy)
    eng = engine(policy, url, timeout=1)
    replies["/generate"], stats = streamer(status, chunked, 200, b" ", pause=0.05)
    with pytest.raises(EngineError) as e:
        eng.generate(PROMPTS, Sampling(max_new_tokens=8))
    # counted, not timed: the client hung up long before the server's 200 bytes were out
    assert stats["done"].wait(15) and stats["sent"] < 100, stats["sent"]
    why = str(e.value)
    assert url in why and "\n" not in why, why
    assert "within vllm_server_timeout (1 s)" in why or "too slowly" in why, why


@pytest.mark.parametrize("status", [200, 500, 302])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_reply_past_the_limit_is_refused_unread(policy, server, monkeypatch,  # noqa: F811
                                                  status, chunked):
    """64 MiB sent as fast as it goes, the limit made 1 MiB: refused once past it, the rest
    never read (an error's body and a redirect's were read whole by urllib)."""
    url, replies = server
    replies["/health"] = health(policy)
    eng = engine(policy, url)
    monkeypatch.setattr(client, "MAX_REPLY_BYTES", 1 << 20)
    replies["/generate"], stats = streamer(status, chunked, 1024, b" " * (1 << 16))
    with pytest.raises(EngineError, match="sent a reply to /generate over 1 MiB") as e:
        eng.generate(PROMPTS, Sampling(max_new_tokens=8))
    assert url in str(e.value) and "\n" not in str(e.value)
    assert stats["done"].wait(10)
    assert stats["sent"] < 32 << 20, stats["sent"]  # what loopback's buffers hold, at most


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return exported(tmp_path_factory.mktemp("gguf"), "llama")[1]


def with_arrays(raw: bytes, count: int, items: int) -> bytes:
    """`raw` (a GGUF file) with `count` more metadata keys junk.0, junk.1, ..., each an array
    of `items` u8 values, ahead of its own (the header's key count raised to match). Each
    key takes 30 + items bytes: a multiple of the alignment (32) keeps the tensors in place."""
    kv = b""
    for i in range(count):
        key = f"junk.{i}".encode()
        kv += len(key).to_bytes(8, "little") + key + (9).to_bytes(4, "little") + \
            (0).to_bytes(4, "little") + items.to_bytes(8, "little") + bytes(items)
    n_kv = int.from_bytes(raw[16:24], "little")
    return raw[:16] + (n_kv + count).to_bytes(8, "little") + kv + raw[24:]


def test_the_metadata_is_one_memory_budget_in_all(tmp_path, gguf_file):
    """Two arrays of 1M u8 (1 MB each in the file, charged 40 MB each: a list of 1M ints)
    exceed the 64 MiB together, each within MAX_ARRAY; one alone is read."""
    raw = gguf_file.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(with_arrays(raw, 1, 1_000_002))
    assert len(read_gguf(bad).meta["junk.0"]) == 1_000_002
    bad.write_bytes(with_arrays(raw, 2, 1_000_002))
    with pytest.raises(CheckpointError) as e:
        read_gguf(bad)
    why = str(e.value)
    assert "junk.1: the keys, strings and arrays take over 64 MiB" in why, why
    assert "\n" not in why


def test_overlapping_tensors_are_refused(tmp_path, gguf_file):
    """Every tensor's data offset set to 0: each within the file, all on the same bytes."""
    f = read_gguf(gguf_file)
    raw = bytearray(gguf_file.read_bytes())
    for name, t in f.tensors.items():
        at = raw.index(len(name).to_bytes(8, "little") + name.encode()) + 8 + len(name)
        at += 4 + 8 * len(t.shape) + 4  # past n_dims, the dims and the type: the offset
        raw[at:at + 8] = bytes(8)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(raw)
    with pytest.raises(CheckpointError) as e:
        read_gguf(bad)
    why = str(e.value)
    # all at one offset: the two smallest come first
    (_, first), (_, second) = sorted((t.nbytes, name) for name, t in f.tensors.items())[:2]
    assert f"tensors {first} and {second} overlap" in why and "\n" not in why, why


@pytest.mark.parametrize("error", [OSError("6144 requested and 3520 written"),
                                   OSError(errno.ENOSPC, "No space left on device")])
def test_a_gguf_export_on_a_full_disk_says_so_and_leaves_nothing(tmp_path, monkeypatch,
                                                                 error):
    """numpy's tofile reports a short write without its errno (the first error); the old
    export stays whole and no temporary file is left."""
    import gguf

    _, out = exported(tmp_path, "llama")
    before = out.read_bytes()

    def full(self, **kw):
        self.fout[0].write(b"\0" * 100)  # part written, then the disk is full
        raise error

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full)
    with pytest.raises(OutputWriteError) as e:
        exported(tmp_path, "llama")
    assert str(e.value) == f"cannot write {out}: disk full"
    assert out.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == sorted(["llama", out.name])
