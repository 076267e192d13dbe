"""`vllm_mode: server`: rollouts from a `mini-grpo vllm-serve` process (engines/server.py).

Every rank sends its own prompts (HTTP, JSON) and gets token ids and log-probs back. Weights
go once per change, never through disk: rank 0 opens a pair group with the server
(distributed.PairGroup: gloo, or NCCL when both ends are on GPUs) and broadcasts each weight
in Hugging Face names and the server's dtype, announced by a POST /update_weights it sends
from a thread while it broadcasts. Under fsdp every rank gathers each weight as it is sent
(a collective); under ddp only rank 0 reads its replica. The other ranks wait at a barrier,
so no rank samples from the old weights.

Every request carries vllm-serve's shared secret, $MINI_GRPO_VLLM_TOKEN, where it is set
(protocol.server_token): read once, here, never written to config.yaml or a checkpoint, as a
config field would be.

The server's model is compared with the policy at start (the architecture its config.json
gives: sizes, rope, norms; and max_model_len against block_size); an
unreachable server is a ConfigError then, and one that fails or dies mid-run an EngineError
(exit 1, one line naming the URL): the last checkpoint is intact and the run resumes.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import torch

from .. import distributed as D
from .. import fsdp
from ..checkpoint import CheckpointError
from ..fields import ConfigError
from ..jsonio import check_tree
from ..lora import merged
from ..models.hf import hf_tensors
from ..models.hf_config import hf_spec
from .base import EngineError, Rollout, WeightsSeen
from .protocol import (
    check_servable,
    engine_config,
    row_seeds,
    sampling_options,
    server_token,
    to_rollout,
    turns_rollout,
)
from .turns import ToolSetup

# what a rollout does not depend on: the longest sequence (max_model_len is checked on its
# own), dropout, and a tied head (the engine's is untied: protocol.engine_config)
_NOT_COMPARED = ("block_size", "dropout", "tie_word_embeddings")


def architecture(config: dict) -> dict:
    """What must agree between the policy and the server's model, from a config.json: our
    model spec (hf_spec: sizes, rope, norms, biases, activation), less _NOT_COMPARED.
    A server's config is untrusted: CheckpointError (or KeyError, TypeError) if bad."""
    spec = hf_spec(config)
    return {"family": spec["family"],
            **{k: v for k, v in spec["config"].items() if k not in _NOT_COMPARED}}


MAX_REPLY_BYTES = 1 << 28  # a rollout of thousands of rows is a few MB of JSON
DTYPES = ("float32", "bfloat16", "float16")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is refused as any other error status: urllib would read its body whole
    before following it, past MAX_REPLY_BYTES and the deadline."""

    def redirect_request(self, *args):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class ServerEngine:
    name = "vllm"
    alone = True  # every rank sends its own requests

    def __init__(self, cfg, model, tok, device: torch.device, rank: int,
                 tools: ToolSetup | None = None):
        """`tools`: multi-turn rollouts (turns.py), in rounds of requests (the tool loop runs
        here, on the trainer's rank: protocol.complete_turns)."""
        check_servable(tok)
        self.tools = tools
        self.url, self.timeout = cfg.vllm_server_url.rstrip("/"), cfg.vllm_server_timeout
        token = server_token()
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {token}"} if token else {})}
        self.tok, self.device, self.rank = tok, device, rank
        self.group, self.weights = None, WeightsSeen()
        try:
            info = self._call("GET", "/health")
        except EngineError as e:
            raise ConfigError(f"vllm_server_url: {e} (start one with `mini-grpo vllm-serve "
                              f"--model DIR`)") from None
        bad = lambda why: ConfigError(f"vllm_server_url: the server at {self.url} answered "
                                      f"/health with {why}: not a mini-grpo vllm-serve")
        if not isinstance(info.get("config"), dict):
            raise bad("no model config")
        if info.get("dtype") not in DTYPES:
            raise bad(f"dtype {repr(info.get('dtype'))[:40]}, not one of {', '.join(DTYPES)}")
        if info.get("device") not in ("cpu", "cuda"):
            raise bad(f"device {repr(info.get('device'))[:40]}")
        ours = architecture(engine_config(model, torch.float32))
        try:
            theirs = architecture(info["config"])
        except (CheckpointError, KeyError, TypeError, ValueError) as e:
            raise bad(f"a model config it cannot be ({_gist(e)[:200]})") from None
        for key in ours:  # sizes, and what the same sizes can compute otherwise (rope, eps)
            if not _same(ours[key], theirs.get(key)):
                raise ConfigError(f"vllm_server_url: the server at {self.url} serves another "
                                  f"model ({key} {str(theirs.get(key))[:60]}, the policy's "
                                  f"{ours[key]})")
        longest = info.get("max_model_len")
        if type(longest) is not int or longest < cfg.block_size:
            raise ConfigError(f"vllm_server_url: the server at {self.url} holds sequences of "
                              f"{str(longest)[:40]} tokens (max_model_len), fewer than the "
                              f"run's block_size ({cfg.block_size}): start it with "
                              f"--max_model_len {cfg.block_size}, or lower block_size")
        self.dtype = getattr(torch, info["dtype"])
        self.nccl = info["device"] == "cuda" and device.type == "cuda"
        self.vocab = model.cfg.vocab_size

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        """The server's JSON object for one request, within `vllm_server_timeout` for the
        whole of it (a server that trickles its reply byte by byte included); a reply that
        is no JSON object, too large or too deep is an EngineError naming the URL."""
        result: dict = {}

        def request():
            try:
                result["out"] = self._request(method, path, body)
            except BaseException as e:  # handed to the caller's thread
                result["error"] = e
        thread = threading.Thread(target=request, daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():  # the thread gives up at its deadline, or with the socket
            raise EngineError(f"no answer from the vLLM server at {self.url} ({path}) within "
                              f"vllm_server_timeout ({self.timeout:g} s)")
        if "error" in result:
            raise result["error"]
        return result["out"]

    def _request(self, method: str, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers=self.headers)
        deadline = time.monotonic() + self.timeout
        try:
            with _OPENER.open(req, timeout=self.timeout) as resp:
                return self._parse(self._read(resp, path, deadline), path)
        except urllib.error.HTTPError as e:
            try:
                reason = json.loads(self._read(e, path, deadline)).get("error", e.reason)
            except (ValueError, AttributeError, http.client.HTTPException, OSError):
                reason = e.reason
            finally:
                e.close()  # its socket now, not when the error is collected
            raise EngineError(f"the vLLM server at {self.url} refused {path}: {reason}") \
                from None
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            raise EngineError(f"no answer from the vLLM server at {self.url} ({path}): "
                              f"{reason}") from None

    def _read(self, resp, path: str, deadline: float) -> bytearray:
        """A reply's body, an error's too, in bounded chunks up to MAX_REPLY_BYTES and
        `deadline`, whether or not it states a Content-Length (chunked, or up to the close)."""
        raw = bytearray()  # not a list of chunks: a server's one-byte chunks cost one byte
        while chunk := resp.read1(1 << 16):
            raw += chunk
            if len(raw) > MAX_REPLY_BYTES or time.monotonic() > deadline:
                raise EngineError(f"the vLLM server at {self.url} sent a reply to {path} " +
                                  (f"over {MAX_REPLY_BYTES >> 20} MiB"
                                   if len(raw) > MAX_REPLY_BYTES else "too slowly"))
        return raw

    def _parse(self, raw: bytes, path: str) -> dict:
        try:
            out = json.loads(raw)
            check_tree(out, path, max_depth=16)
        except (ValueError, RecursionError, ConfigError) as e:
            why = "is nested too deeply" if isinstance(e, (RecursionError, ConfigError)) \
                else "is not JSON"
            raise EngineError(f"the vLLM server at {self.url} sent a reply to {path} that "
                              f"{why}") from None
        if not isinstance(out, dict):
            raise EngineError(f"the vLLM server at {self.url} sent a reply to {path} that is "
                              f"not a JSON object")
        return out

    def generate(self, prompts: list, sampling, generator=None, autocast=None) -> Rollout:
        options = sampling_options(sampling, self.tok.eos_ids)
        if self.tools is not None:
            return turns_rollout(lambda prefixes, budgets, seeds: self._generate(
                prefixes, options, seeds, budgets), self.tools, self.tok, prompts, sampling,
                generator, self.device)
        enc = [self.tok.encode_prompt(p) for p in prompts]
        toks, lps = self._generate(enc, options, row_seeds(len(enc), generator))
        return to_rollout(self.tok, enc, toks, lps, self.device, sampling)

    def _generate(self, prompts: list[list[int]], options: dict, seeds: list[int],
                  budgets: list[int] | None = None) -> tuple[list, list]:
        """One /generate request -> (token ids, log-probs) per row, checked; `budgets`: each
        row's max_tokens in place of options' (a multi-turn round's)."""
        body = {"prompts": prompts, "options": options, "seeds": seeds}
        if budgets is not None:
            body["max_tokens"] = budgets
        out = self._call("POST", "/generate", body)
        try:
            check_rollout(out, len(prompts), self.vocab, options["max_tokens"], budgets,
                          set(self.tok.eos_ids))
        except (KeyError, TypeError, ValueError) as e:
            raise EngineError(f"the vLLM server at {self.url} sent a bad rollout: {e}") \
                from None
        return out["token_ids"], out["logprobs"]

    def sync(self, model) -> None:
        if not self.weights.changed_anywhere(model, self.device):
            return
        if self.rank == 0:
            self._push(model)
        elif fsdp.is_sharded(model):  # the gathers are collectives: every rank takes part
            for _ in fsdp.full_tensors(model):
                pass
        D.barrier()  # no rank samples before the server has the new weights
        self.weights.mark(model)

    def _push(self, model) -> None:
        if self.group is None:
            host = _reachable_address(self.url)
            listener = socket.create_server((host, 0))  # there alone, not every interface
            port = listener.getsockname()[1]
            device = self.device if self.nccl else torch.device("cpu")
            try:  # a group a trainer before this one left (a run resumed) is closed first
                self._call("POST", "/close_weights", {})
                self._call("POST", "/init_weights", {"host": host, "port": port,
                                                     "device": device.type})
                self.group = D.PairGroup(host, port, 0, 2, device, self.timeout, listener)
            except EngineError:
                raise
            except (RuntimeError, OSError) as e:  # the server never joined (DistStoreError)
                raise EngineError(f"the vLLM server at {self.url} did not join the weight "
                                  f"transfer at {host}:{port}: {_gist(e)}") from None
            finally:
                listener.close()  # detached by the group, or never used
        device = self.group.device
        shapes = ((n, torch.empty(t.shape, dtype=t.dtype, device="meta"))
                  for n, t in model.state_dict().items())
        specs = [[name, list(t.shape), str(self.dtype).removeprefix("torch.")]
                 for name, t in hf_tensors(model, merged(model, shapes), self.dtype,
                                           head=True)]
        reply: dict = {}

        def announce():
            try:
                reply["out"] = self._call("POST", "/update_weights", {"tensors": specs})
            except EngineError as e:
                reply["error"] = e
        thread = threading.Thread(target=announce, daemon=True)
        thread.start()
        try:
            for _, t in hf_tensors(model, merged(model, fsdp.full_tensors(model)),
                                   self.dtype, head=True):
                self.group.broadcast(t.to(device).contiguous(), src=0)
        except RuntimeError as e:  # the server died mid-transfer
            raise EngineError(f"weights to the vLLM server at {self.url} failed: "
                              f"{_gist(e)}") from None
        thread.join(self.timeout)
        if "error" in reply:
            raise reply["error"]
        if "out" not in reply:
            raise EngineError(f"the vLLM server at {self.url} did not confirm the weights in "
                              f"{self.timeout:g} s")

    def close(self) -> None:
        if self.group is not None:
            try:
                self._call("POST", "/close_weights", {})
            except EngineError:
                pass  # the run is ending; a server that is gone has nothing to close
            self.group.close()
            self.group = None


def check_rollout(out: dict, rows: int, vocab: int, max_new_tokens: int,
                  budgets: list[int] | None = None, eos_ids=()) -> None:
    """A server's /generate reply, as untrusted as a file: one row per prompt, each of 1 to
    max_new_tokens (or the row's budget) token ids in the vocabulary (ints, not bools or
    floats), an EOS (`eos_ids`) as its last at most, and as many finite log-probs <= 0;
    ValueError naming the field and row otherwise."""
    toks, lps = out.get("token_ids"), out.get("logprobs")
    for name, v in (("token_ids", toks), ("logprobs", lps)):
        if not isinstance(v, list) or len(v) != rows:
            got = f"{len(v)} rows" if isinstance(v, list) else type(v).__name__
            raise ValueError(f"{name}: {rows} rows asked, got {got}")
    for i, (t, lp) in enumerate(zip(toks, lps)):
        most = budgets[i] if budgets is not None else max_new_tokens
        if not (isinstance(t, list) and isinstance(lp, list)) or not 0 < len(t) <= most \
                or len(lp) != len(t):
            raise ValueError(f"row {i}: token_ids and logprobs must be lists of 1 to "
                             f"{most} items, one log-prob per token")
        if not all(type(x) is int and 0 <= x < vocab for x in t):
            raise ValueError(f"row {i}: token_ids must be integers in 0..{vocab - 1}")
        if any(x in eos_ids for x in t[:-1]):  # a row stops at its EOS: tokens after one
            raise ValueError(f"row {i}: tokens after an EOS")  # would be trained on
        if not all(type(x) in (int, float) and math.isfinite(x) and x <= 1e-3 for x in lp):
            raise ValueError(f"row {i}: logprobs must be finite numbers <= 0")


def _same(a, b) -> bool:
    """Equal, floats to float32's precision (a GGUF file's metadata holds float32: its
    rms_norm_eps 1e-6 reads 9.99999997e-07); a dict's values alike."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if float in (type(a), type(b)) and {type(a), type(b)} <= {int, float}:
        return math.isclose(a, b, rel_tol=1e-6)
    return type(a) is type(b) and a == b


def _gist(e: BaseException) -> str:
    """gloo's message without its source location and advice: "Read error [host]:port:
    Connection reset by peer"."""
    line = (str(e).splitlines() or [type(e).__name__])[0]
    return re.sub(r"^\[[^\]]*\] ", "", line).split(". ")[0]


def _reachable_address(url: str) -> str:
    """This machine's address on the route to the server (loopback for a local one)."""
    host = urllib.parse.urlparse(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
        return s.getsockname()[0]

