"""Requests to `mini-grpo vllm-serve` are untrusted input (engines/server.py): its own HTTP
handler and endpoints over a stand-in Server of the test policy (no vLLM, no engine), and the
trainer's client (engines/client.py) pushing weights into it through a real gloo pair group.
A request that is bad, slow, unauthenticated or out of turn is one line and the server goes
on; nothing is allocated for a weight the served model does not have."""

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import HTTPServer

import pytest
import torch
from test_vllm_replies import engine, policy  # noqa: F401 (fixtures)

import mini_grpo.engines.server as S
from mini_grpo.cli import vllm_serve_main
from mini_grpo.engines.protocol import TOKEN_ENV
from mini_grpo.engines.vllm import engine_config
from mini_grpo.fields import ConfigError
from mini_grpo.models.hf import hf_tensors

TOKEN = "s3cret-t0ken"


class Group:
    """A live pair group that counts what it receives."""

    def __init__(self):
        self.closed, self.received = False, 0

    def close(self):
        self.closed = True

    def broadcast(self, t, src):
        self.received += 1
        return t


def stand_in(model, group=None):
    """A Server of `model` in float32 on the CPU with its real endpoints, but no engine."""
    server = object.__new__(S.Server)
    server.device, server.dtype, server.max_len, server.tp, server.llm = \
        torch.device("cpu"), torch.float32, 4096, 1, None
    server.config = engine_config(model, torch.float32)
    server.weights = S.served_weights(model, torch.float32)
    server.group, server.joining = group, None
    return server


@contextlib.contextmanager
def listening(server, token=""):
    """vllm-serve's handler over `server` on a free loopback port -> the port."""
    httpd = HTTPServer(("127.0.0.1", 0), S.handler(server, threading.Lock(), token))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_port
    finally:
        stop = threading.Thread(target=httpd.shutdown, daemon=True)  # a request it still
        stop.start()  # serves must not hang the suite
        stop.join(5)
        httpd.server_close()


@pytest.fixture
def served(policy, monkeypatch):  # noqa: F811
    """(port, server): a server holding a live weight group, whose /generate fails as an
    engine might; bodies up to 1000 bytes, READ_TIMEOUT_S 0.5 s."""
    server = stand_in(policy[0], Group())

    def generate(body):
        raise TypeError("an engine's own failure\nwith a second line")
    server.generate = generate
    monkeypatch.setattr(S, "MAX_BODY", 1000)
    monkeypatch.setattr(S, "READ_TIMEOUT_S", 0.5)
    with listening(server) as port:
        yield port, server


def _post(port, path, body: bytes, length=None, headers=()):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("POST", path)
    conn.putheader("Content-Length", str(len(body) if length is None else length))
    for k, v in headers:
        conn.putheader(k, v)
    conn.endheaders()
    try:
        conn.send(body)
    except OSError:  # answered and closed before the body was sent: the answer stands
        pass
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def _health(port) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("args, needle", [
    (["--port", "99999"], "--port: must be in 0..65535, got 99999"),
    (["--host", "256.1.1.1"], "--host/--port 256.1.1.1:8000: cannot listen there"),
])
def test_vllm_serve_checks_where_it_listens_before_building_an_engine(tmp_path, args, needle):
    # the model directory does not exist: the address is refused first, in a moment
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        S.serve(["--model", str(tmp_path / "none"), *args])


def test_vllm_serve_answers_bad_requests_and_failures_in_one_line_and_goes_on(served):
    port, server = served
    # a negative length was past the bound, and the whole body was read up to the close
    assert _post(port, "/generate", b"x" * 2000, length=-1) == \
        (400, {"error": "Content-Length -1: must be 0..1000"})
    # a bad device was a TypeError (no answer, the connection dropped), and it came after
    # the live weight group had been closed
    for device in ([1], "bogus"):
        status, out = _post(port, "/init_weights", json.dumps(
            {"host": "127.0.0.1", "port": 1, "device": device}).encode())
        assert status == 400 and out["error"].startswith("init_weights: device must be")
    assert not server.group.closed
    # an endpoint's own failure: 500 and one line, and the server answers the next request
    assert _post(port, "/generate", b"{}") == \
        (500, {"error": "TypeError: an engine's own failure"})
    assert _post(port, "/close_weights", b"") == (200, {})


def test_a_peer_that_stalls_mid_request_does_not_hold_vllm_serve(served):
    """One request at a time: a peer that sent its headers and part of its body held the
    server for every rank until it closed. Now its connection drops after READ_TIMEOUT_S."""
    port, _ = served
    stalled = socket.create_connection(("127.0.0.1", port))
    stalled.sendall(b"POST /generate HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
    try:
        assert _health(port)["max_model_len"] == 4096
    finally:
        stalled.close()


def test_a_peer_that_trickles_its_request_is_dropped_at_one_deadline_for_all_of_it(served):
    """A byte every 0.1 s, each read well within READ_TIMEOUT_S (0.5 s): the socket's
    timeout, per read, held the server for the whole 8 s the request took; one deadline for
    its headers and body together drops it after 0.5 s."""
    port, _ = served
    request = b"POST /generate HTTP/1.1\r\nContent-Length: 30\r\n\r\n" + b"[" * 30
    stop = threading.Event()

    def trickle():
        with socket.create_connection(("127.0.0.1", port)) as s:
            for i in range(len(request)):
                if stop.is_set():
                    return
                try:
                    s.sendall(request[i:i + 1])
                except OSError:  # dropped
                    return
                sent.append(i)
                time.sleep(0.1)
    sent = []
    peer = threading.Thread(target=trickle, daemon=True)
    peer.start()
    time.sleep(0.2)  # the server has taken the trickling connection
    assert _health(port)["max_model_len"] == 4096
    served_after = len(sent)  # counted, not timed: bytes the peer had sent by then
    stop.set()
    peer.join(5)
    # held for the whole request, the server answers after all of it; dropped at the
    # deadline, after a few bytes
    assert served_after < len(request) // 2, (served_after, len(request))


def test_init_weights_is_refused_while_a_weight_group_is_live(served):
    """A POST /init_weights aimed at a dead port closed the trainer's live group, and the
    next /update_weights waited on a join that never came, holding the server."""
    port, server = served
    live = server.group
    with socket.socket() as s:  # a port no one listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    status, out = _post(port, "/init_weights", json.dumps(
        {"host": "127.0.0.1", "port": dead}).encode())
    assert status == 400 and out["error"] == \
        "init_weights: a weight group is live (POST /close_weights first)"
    assert server.group is live and not live.closed and server.joining is None
    assert _health(port)["max_model_len"] == 4096


def test_update_weights_takes_only_the_served_models_own_weights_before_allocating(served):
    """Names, shapes and dtypes were checked by type alone: up to 2^36 elements a tensor,
    any name, were allocated before a byte came."""
    port, server = served
    name, (shape, dtype) = next(iter(server.weights.items()))
    for spec, needle in [
        (["evil", [4], "float32"], "['evil', [4], 'float32']: not a weight of the served model"),
        ([[name], shape, dtype], "not a weight of the served model"),
        ([name, [2**18, 2**18], dtype], f"{name}: shape and dtype [[262144, 262144], "),
        ([name, shape, "float16"], f"{name}: shape and dtype [{shape}, 'float16'], the "
                                   f"served model's [{shape}, 'float32']"),
        ([name, shape], "not a weight of the served model"),
    ]:
        status, out = _post(port, "/update_weights", json.dumps({"tensors": [spec]}).encode())
        assert status == 400 and needle in out["error"], out
    status, out = _post(port, "/update_weights", json.dumps(
        {"tensors": [[name, shape, dtype]] * 2}).encode())
    assert (status, out) == (400, {"error": "update_weights: a weight is sent twice"})
    assert server.group.received == 0  # nothing received, so nothing allocated for it


def test_vllm_serve_with_a_token_answers_only_requests_that_carry_it(policy, monkeypatch):  # noqa: F811
    with listening(stand_in(policy[0]), token=TOKEN) as port:
        url = f"http://127.0.0.1:{port}/health"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Bearer {TOKEN}x"}):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
            body = e.value.read().decode()
            assert e.value.code == 401 and "no valid token" in body and TOKEN not in body
        # refused before its body is read: an unknown peer cannot make it read 1 GiB
        assert _post(port, "/generate", b"", length=1 << 30)[0] == 401
        with urllib.request.urlopen(urllib.request.Request(
                url, headers={"Authorization": f"Bearer {TOKEN}"}), timeout=10) as r:
            assert json.loads(r.read())["max_model_len"] == 4096
        # the trainer's client without the token: one line at start, naming the variable
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        with pytest.raises(ConfigError, match=f"refused /health: no valid token .*{TOKEN_ENV}"):
            engine(policy, f"http://127.0.0.1:{port}")


def test_vllm_serve_beyond_loopback_needs_a_token(tmp_path, monkeypatch, capsys):
    # refused in one line (exit 2) before the model is read: the directory does not exist
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    argv = ["--model", str(tmp_path / "none"), "--host", "0.0.0.0", "--port", "0"]
    assert vllm_serve_main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --host 0.0.0.0: serving beyond this machine needs a token: set {TOKEN_ENV} "
        f"(or --token), the trainer's too"]
    # with one (the environment's, or --token's) it goes on, to the model; never shown
    for env, flag in ((TOKEN, []), ("", ["--token", TOKEN])):
        monkeypatch.setenv(TOKEN_ENV, env)
        assert vllm_serve_main([*argv, *flag]) == 2
        err = capsys.readouterr().err
        assert "none: not found" in err and TOKEN not in err
    monkeypatch.setenv(TOKEN_ENV, "not ascii é")
    assert vllm_serve_main(argv) == 2
    err = capsys.readouterr().err
    assert "must be printable ASCII" in err and "é" not in err


def test_the_trainer_pushes_its_weights_and_a_resumed_trainer_takes_over(policy, monkeypatch):  # noqa: F811
    """The client's order (close, init, update) through the real endpoints and a gloo pair
    group, with a token: a second trainer (a run resumed against the same server) closes the
    group the first left before it opens its own. Each push brings the policy's weights."""
    model, _ = policy
    pushed = []
    monkeypatch.setattr(S, "reload", lambda llm, weights: pushed.append(
        {n: t.clone() for n, t in weights}))
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    server = stand_in(model)
    with listening(server, token=TOKEN) as port:
        first = engine(policy, f"http://127.0.0.1:{port}")
        first.sync(model)
        second = engine(policy, f"http://127.0.0.1:{port}")
        second.sync(model)
        second.close()
        first.group.close()
    assert server.group is None and len(pushed) == 2
    want = dict(hf_tensors(model, model.state_dict().items(), torch.float32, head=True))
    for got in pushed:
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)
