"""A vLLM server's replies are untrusted input (engines/client.py): a stand-in HTTP server on
loopback answers /health and /generate wrongly, and each answer is one line naming the URL and
what is wrong, never a traceback, a hang past `vllm_server_timeout`, or a rollout trained on.
No vLLM needed: the client alone is under test."""

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import tiny, tiny_lm_dir

from mini_grpo.engines.base import EngineError, Sampling
from mini_grpo.engines.client import ServerEngine
from mini_grpo.engines.vllm import engine_config
from mini_grpo.fields import ConfigError
from mini_grpo.models.hf import load_hf_model
from mini_grpo.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    lm = tiny_lm_dir(tmp_path_factory.mktemp("lm"), "qwen2")
    return load_hf_model(lm), HFTokenizer.from_dir(lm)


@pytest.fixture
def server():
    """(url, replies): set replies[path] to the bytes to answer, or to a function of the
    handler that writes its own answer."""
    replies: dict = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def answer(self):
            self.body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            reply = replies[self.path]
            if callable(reply):
                return reply(self)
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        do_GET = do_POST = answer

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{http.server_port}", replies
    http.shutdown()
    http.server_close()


def engine(policy, url, timeout=30):
    model, tok = policy
    cfg = tiny(None, vllm_server_url=url, vllm_server_timeout=timeout)
    return ServerEngine(cfg, model, tok, torch.device("cpu"), rank=0)


def health(policy, **change):
    good = {"config": engine_config(policy[0], torch.float32), "dtype": "float32",
            "device": "cpu", "max_model_len": 4096}
    return json.dumps({**good, **change}).encode()


def other_config(policy, **change):
    return {**engine_config(policy[0], torch.float32), **change}


@pytest.mark.parametrize("reply, needle", [
    (b"[1, 2]", "not a JSON object"),
    (b"{not json", "not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ({"config": None}, "answered /health with no model config"),
    ({"dtype": None}, "dtype None, not one of float32"),
    ({"dtype": "__class__"}, "dtype '__class__', not one of"),
    ({"device": ["cuda"]}, "device"),
    # the same sizes computing another model: only the sizes had been compared
    (lambda p: {"config": other_config(p, rope_theta=1.0)}, "another model (rope_theta 1.0"),
    (lambda p: {"config": other_config(p, rms_norm_eps=0.5)}, "(rms_norm_eps 0.5"),
    (lambda p: {"config": other_config(p, rope_parameters={"rope_type": "linear",
                                                           "factor": 8})},
     "(rope_scaling {'rope_type': 'linear', 'factor': 8.0}"),
    (lambda p: {"config": other_config(p, model_type="bert")}, "a model config it cannot be"),
    ({"max_model_len": 4}, "holds sequences of 4 tokens (max_model_len), fewer than"),
    ({"max_model_len": None}, "holds sequences of None tokens"),
])
def test_bad_health_replies_are_refused_at_start(policy, server, reply, needle):
    url, replies = server
    reply = reply(policy) if callable(reply) else reply
    replies["/health"] = health(policy, **reply) if isinstance(reply, dict) else reply
    with pytest.raises((ConfigError, EngineError)) as e:
        engine(policy, url)
    assert needle in str(e.value) and url in str(e.value) and "\n" not in str(e.value)


PROMPTS = ["e2e4 e7e5", "d2d4"]


@pytest.mark.parametrize("reply, needle", [
    ({"token_ids": [[5]], "logprobs": [[-1.0]]}, "token_ids: 2 rows asked, got 1"),
    ({"token_ids": [[], []], "logprobs": [[], []]}, "row 0: token_ids and logprobs must be"),
    ({"token_ids": [[99999], [5]], "logprobs": [[-1.0], [-1.0]]}, "row 0: token_ids must be"),
    ({"token_ids": [[5], [-5]], "logprobs": [[-1.0], [-1.0]]}, "row 1: token_ids must be"),
    ({"token_ids": [[True], [5]], "logprobs": [[-1.0], [-1.0]]}, "row 0: token_ids must be"),
    ({"token_ids": [[5.0], [5]], "logprobs": [[-1.0], [-1.0]]}, "row 0: token_ids must be"),
    ({"token_ids": [[5], [5]], "logprobs": [[float("nan")], [-1.0]]}, "row 0: logprobs must"),
    ({"token_ids": [[5], [5]], "logprobs": [[-1.0], [0.5]]}, "row 1: logprobs must be"),
    ({"token_ids": [[5, 6], [5]], "logprobs": [[-1.0], [-1.0]]}, "one log-prob per token"),
    ({"token_ids": [[5] * 9, [5]], "logprobs": [[-1.0] * 9, [-1.0]]}, "lists of 1 to 8"),
    ({"token_ids": "x", "logprobs": []}, "token_ids: 2 rows asked, got str"),
    (lambda eos: {"token_ids": [[5, eos, 6], [5]], "logprobs": [[-1.0] * 3, [-1.0]]},
     "row 0: tokens after an EOS"),
])
def test_bad_rollouts_are_one_line_and_never_trained_on(policy, server, reply, needle):
    url, replies = server
    replies["/health"] = health(policy)
    eng = engine(policy, url)
    reply = reply(policy[1].eos_id) if callable(reply) else reply
    replies["/generate"] = json.dumps(reply).encode()
    with pytest.raises(EngineError, match="sent a bad rollout") as e:
        eng.generate(PROMPTS, Sampling(max_new_tokens=8))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    replies["/generate"] = json.dumps({"token_ids": [[5, 6], [7]],
                                       "logprobs": [[-0.5, -1.5], [-2.0]]}).encode()
    r = eng.generate(PROMPTS, Sampling(max_new_tokens=8))  # a right one goes through
    assert r.completion_ids[0, :2].tolist() == [5, 6] and r.completion_mask.sum() == 3


def test_the_timeout_bounds_a_whole_reply_sent_byte_by_byte(policy, server):
    """A server that trickles a good reply (one byte every 0.2 s) is cut off at
    vllm_server_timeout (1 s): without the bound the call returns the reply after 8 s."""
    url, replies = server
    replies["/health"] = health(policy)
    eng = engine(policy, url, timeout=1)
    body = json.dumps({"token_ids": [[5], [5]], "logprobs": [[-1.0], [-1.0]]}).encode()

    def trickle(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        for i in range(len(body)):
            try:
                handler.wfile.write(body[i:i + 1])
                handler.wfile.flush()
            except OSError:
                return
            time.sleep(8 / len(body))

    replies["/generate"] = trickle
    with pytest.raises(EngineError, match=r"within vllm_server_timeout \(1 s\)") as e:
        eng.generate(PROMPTS, Sampling(max_new_tokens=8))
    assert url in str(e.value)


def test_a_multi_turn_round_s_reply_is_held_to_each_row_s_own_budget(policy, server):
    """With tools the client asks a round's rows for the tokens each has left (max_tokens);
    a reply past a row's own budget is refused like any bad rollout."""
    from mini_grpo.engines.turns import ToolSetup
    from mini_grpo.envs import Step

    class Nudge:
        def reset(self, prompt):
            return None

        def step(self, reply):
            return Step([{"role": "user", "content": "go on"}], done=False)

    url, replies = server
    replies["/health"] = health(policy)
    model, tok = policy
    eng = ServerEngine(tiny(None, vllm_server_url=url), model, tok, torch.device("cpu"), 0,
                       ToolSetup(Nudge, max_rounds=2, timeout=5))
    asked = []

    def generate(handler, extra=0):
        body = json.loads(handler.body)
        asked.append(body["max_tokens"])
        eos = tok.eos_id  # each row ends its turn at once, or overruns its budget
        toks = [[5] * (m + extra) if extra else [eos] for m in body["max_tokens"]]
        data = json.dumps({"token_ids": toks,
                           "logprobs": [[-1.0] * len(t) for t in toks]}).encode()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    replies["/generate"] = generate
    r = eng.generate(PROMPTS, Sampling(max_new_tokens=64))
    # rounds of one EOS each, the answers between them; the cap of 2 ends the rows
    assert asked[0] == [64, 64] and asked[1][0] < 64 and len(asked) == 3
    assert r.turn_counts[:, 2].tolist() == [2, 2] and r.finished.all()
    assert r.model_mask.sum(1).tolist() == [3, 3]  # the three EOS tokens alone
    replies["/generate"] = lambda handler: generate(handler, extra=1)
    with pytest.raises(EngineError, match="row 0: token_ids and logprobs must be lists of 1 "
                                          "to 64 items"):
        eng.generate(PROMPTS, Sampling(max_new_tokens=64))


def test_tools_on_a_tensor_parallel_colocated_engine_are_refused_by_name():
    from mini_grpo.engines import check_engine

    cfg = tiny(None, tools='["calculator"]', rollout_engine="vllm",
               vllm_tensor_parallel_size=2, init_from="some/model")
    with pytest.raises(ConfigError, match="tools: multi-turn rollouts take one engine per "
                                          "rank \\(vllm_tensor_parallel_size: 1\\)"):
        check_engine(cfg, torch.device("cpu"))


def test_a_server_that_never_joins_the_weight_transfer_is_one_line(policy, server):
    """It accepted /init_weights and never joined: torch's DistStoreError had escaped as a
    traceback."""
    url, replies = server
    replies["/health"] = health(policy)
    replies["/close_weights"] = replies["/init_weights"] = b"{}"
    eng = engine(policy, url, timeout=2)
    with pytest.raises(EngineError, match="did not join the weight transfer at 127.0.0.1:"):
        eng.sync(policy[0])


def _listening(port: int) -> list[str]:
    """The addresses a TCP port of this machine listens on (hex, as /proc/net gives them)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    out.append(local.rsplit(":", 1)[0])
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net")
def test_the_weight_transfer_listens_on_the_address_it_gives_alone():
    """The trainer's rendezvous for the weight push listened on every interface for the
    whole run (TCPStore binds them all), though it gives the server one address."""
    import socket

    from mini_grpo import distributed as D

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    joined = []
    server = threading.Thread(target=lambda: joined.append(
        D.PairGroup("127.0.0.1", port, 1, 2, torch.device("cpu"), 30)), daemon=True)
    server.start()
    group = D.PairGroup("127.0.0.1", port, 0, 2, torch.device("cpu"), 30, listener)
    server.join(30)
    assert joined and _listening(port) == ["0100007F"]  # 127.0.0.1, no other
    t = torch.arange(4.0)
    other = torch.zeros(4)
    done = threading.Thread(target=lambda: joined[0].broadcast(other, src=0))
    done.start()
    group.broadcast(t, src=0)
    done.join(30)
    assert other.tolist() == [0.0, 1.0, 2.0, 3.0]
    group.close()
    joined[0].close()


def test_a_server_of_the_policy_s_gguf_file_serves_the_same_model(policy, server, tmp_path):
    """A GGUF file's metadata holds float32 (rms_norm_eps 1e-6 reads 9.99999997e-07): its
    server's model is the policy's all the same."""
    from mini_grpo.engines.server import served_model
    from mini_grpo.models.gguf import write_gguf

    url, replies = server
    gguf = write_gguf(policy[0], policy[1], tmp_path / "lm.gguf", "f32")
    config = engine_config(served_model(str(gguf)), torch.float32)
    assert config["rms_norm_eps"] != engine_config(policy[0], torch.float32)["rms_norm_eps"]
    replies["/health"] = health(policy, config=config)
    engine(policy, url)  # accepted
