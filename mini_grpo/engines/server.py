"""`mini-grpo vllm-serve`: a vLLM engine in a process of its own, on other GPUs or another
node, that trainer ranks send prompts to and push weights into (`vllm_mode: server`,
engines/client.py).

    mini-grpo vllm-serve --model DIR|FILE.gguf [--host 127.0.0.1] [--port 8000]
                         [--dtype auto] [--max_model_len N] [--gpu_memory_utilization 0.9]
                         [--kv_cache_gib 0] [--tensor_parallel_size 1] [--token SECRET]

DIR gives the model's config.json only (a GGUF file, its metadata): the engine starts with
dummy weights and serves the trainer's, which the trainer pushes before its first rollout and
after every update. HTTP with JSON bodies (the standard library's server, one request at a
time: the engine is not thread-safe, and the requests of several ranks queue):

    GET  /health          {"config": the engine's config.json, "dtype", "device", "max_model_len"}
    POST /generate        {"prompts": [[ids]], "options": SamplingParams keywords, "seeds": [..],
                           "max_tokens": [..] (optional: each row's, in place of options')}
                          -> {"token_ids": [[..]], "logprobs": [[..]]}
    POST /init_weights    {"host", "port"}: join the trainer's pair group (distributed.PairGroup,
                          rank 1 of 2: gloo, or NCCL when both ends are on GPUs); returns at
                          once, the join completes when the trainer joins. Refused while a
                          group is live: the trainer's client closes it first
    POST /update_weights  {"tensors": [[name, shape, dtype], ..]}: each received by broadcast
                          from the trainer, in that order, into reload_weights -> {"seconds"};
                          every name, shape and dtype the served model's own
    POST /close_weights   leaves the pair group

With a token (--token, or $MINI_GRPO_VLLM_TOKEN; required unless --host is a loopback
address) every request carries `Authorization: Bearer TOKEN`, or is answered 401. A bad
request is answered 400 with {"error": one line}, an endpoint's failure 500; the server goes
on. A request whose bytes (headers and body) have not all come within READ_TIMEOUT_S is
dropped.
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import json
import os
import shutil
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import torch

from .. import distributed as D
from ..checkpoint import CheckpointError
from ..fields import ArgParser, ConfigError
from ..jsonio import check_tree
from ..models.hf import hf_tensors
from ..models.hf_config import hf_spec, read_config
from .protocol import TOKEN_ENV, complete, engine_config, server_token
from .vllm import _summary, build_llm, engine_dtype, import_vllm, reload, shutdown

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_BODY = 1 << 30  # a generate request of 1 GiB of JSON is more than any step sends
# a request's bytes arrive within this, all of them, or its connection is dropped: the server
# answers one request at a time, so a peer that stalls or trickles would hold it for every rank
READ_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 60.0  # /update_weights waits this long for the pair group /init_weights began


class BadRequest(ValueError):
    pass


class Server:
    def __init__(self, args):
        model = served_model(args.model)  # a bad one is refused before vLLM's import
        vllm = import_vllm()
        self.SamplingParams = vllm.SamplingParams
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = engine_dtype(args.dtype, self.device)
        self.config = engine_config(model, self.dtype)
        self.weights = served_weights(model, self.dtype)
        self.dir = Path(tempfile.mkdtemp(prefix="mini_grpo_vllm_serve_"))
        (self.dir / "config.json").write_text(json.dumps(self.config))
        self.max_len = args.max_model_len or model.cfg.block_size
        if self.device.type == "cpu" and args.tensor_parallel_size > 1:
            _bind_cpu_workers(args.tensor_parallel_size)
        kv = int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else \
            (1 << 30 if self.device.type == "cpu" else 0)
        try:
            self.llm = build_llm(vllm, self.dir, self.dtype, self.device, args.seed,
                                 self.max_len, kv_bytes=kv,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 tensor_parallel_size=args.tensor_parallel_size)
        except Exception as e:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise ConfigError(f"vllm-serve: vLLM cannot serve {args.model}: "
                              f"{_summary(e)}") from None
        self.group, self.joining = None, None
        self.tp = args.tensor_parallel_size

    # ---- the endpoints
    def health(self, _body) -> dict:
        return {"config": self.config, "dtype": str(self.dtype).removeprefix("torch."),
                "device": self.device.type, "max_model_len": self.max_len}

    def generate(self, body) -> dict:
        prompts, options, seeds = body.get("prompts"), body.get("options"), body.get("seeds")
        if not (isinstance(prompts, list) and prompts and all(
                isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompts)):
            raise BadRequest("prompts: must be a non-empty list of non-empty token id lists")
        if not isinstance(options, dict) or not isinstance(seeds, list) or \
                len(seeds) != len(prompts) or not all(type(s) is int for s in seeds):
            raise BadRequest("options must be a mapping and seeds one integer per prompt")
        budgets = body.get("max_tokens")
        if budgets is not None and not (isinstance(budgets, list) and len(budgets) == len(
                prompts) and all(type(m) is int and m > 0 for m in budgets)):
            raise BadRequest("max_tokens: one positive integer per prompt")
        try:
            toks, lps = complete(self.llm, self.SamplingParams, prompts, options, seeds,
                                 budgets)
        except (TypeError, ValueError) as e:  # options vLLM refuses, a prompt too long
            raise BadRequest(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        return {"token_ids": toks, "logprobs": lps}

    def init_weights(self, body) -> dict:
        host, port = body.get("host"), body.get("port")
        if not isinstance(host, str) or type(port) is not int or not 0 < port < 65536:
            raise BadRequest("init_weights: needs host (a string) and port (1..65535)")
        if body.get("device", "cpu") not in ("cpu", "cuda"):
            raise BadRequest("init_weights: device must be \"cpu\" or \"cuda\"")
        if self.group is not None or self.joining is not None:  # a request must not end it
            raise BadRequest("init_weights: a weight group is live (POST /close_weights first)")
        device = self.device if body.get("device") == "cuda" == self.device.type else \
            torch.device("cpu")
        joined: dict = {}  # the thread's group, for update_weights: a dropped join stays out
        thread = threading.Thread(target=lambda: joined.update(
            group=D.PairGroup(host, port, 1, 2, device)), daemon=True)
        thread.start()
        self.joining = thread, joined
        return {}

    def update_weights(self, body) -> dict:
        specs = body.get("tensors")
        if not isinstance(specs, list) or not specs:
            raise BadRequest("update_weights: tensors must be a non-empty list")
        names = []  # each checked against the served model before anything is allocated
        for spec in specs:
            name = spec[0] if isinstance(spec, list) and len(spec) == 3 and \
                isinstance(spec[0], str) else None
            if name not in self.weights:
                raise BadRequest(f"update_weights: {str(spec)[:200]}: not a weight of the "
                                 f"served model")
            if spec[1:] != self.weights[name]:
                raise BadRequest(f"update_weights: {name}: shape and dtype "
                                 f"{str(spec[1:])[:200]}, the served model's "
                                 f"{self.weights[name]}")
            names.append(name)
        if len(set(names)) < len(names):
            raise BadRequest("update_weights: a weight is sent twice")
        if self.joining is not None:
            thread, joined = self.joining
            thread.join(JOIN_TIMEOUT_S)
            if thread.is_alive():
                raise BadRequest(f"update_weights: the trainer has not joined the pair group "
                                 f"in {JOIN_TIMEOUT_S:g} s")
            self.group, self.joining = joined.get("group"), None
        if self.group is None:
            raise BadRequest("update_weights: no pair group (POST /init_weights first)")
        t0 = time.perf_counter()
        device = self.group.device

        def received():
            for name in names:
                shape, dtype = self.weights[name]
                t = torch.empty(shape, dtype=DTYPES[dtype], device=device)
                yield name, self.group.broadcast(t, src=0).to(self.dtype)
        # one process: each weight loaded as it arrives; tensor parallel: the engine's workers
        # are processes of their own, so the weights go to them together
        reload(self.llm, received() if self.tp == 1 else list(received()))
        return {"seconds": time.perf_counter() - t0}

    def close_weights(self, _body) -> dict:
        if self.group is not None:  # a join still under way is dropped, its group unused
            self.group.close()
        self.group, self.joining = None, None
        return {}

    def close(self) -> None:
        self.close_weights(None)
        shutdown(self.llm)
        shutil.rmtree(self.dir, ignore_errors=True)


def _bind_cpu_workers(tp: int) -> None:
    """vLLM's CPU workers bind their threads one NUMA node each, and refuse more workers than
    nodes: unless VLLM_CPU_OMP_THREADS_BIND says otherwise, split this process's cores into
    `tp` contiguous sets instead ("0-7|8-15")."""
    cores = sorted(os.sched_getaffinity(0))
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or len(cores) < tp:
        return
    n = len(cores) // tp
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(map(str, cores[i * n:(i + 1) * n])) for i in range(tp))


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    check_tree(body, "request")
    return body


def _line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def served_weights(model, dtype: torch.dtype) -> dict:
    """{Hugging Face name: [shape, dtype]} of each weight the trainer sends (client._push):
    the served model's own, in the engine's dtype, the LM head too."""
    name = str(dtype).removeprefix("torch.")
    return {n: [list(t.shape), name] for n, t in
            hf_tensors(model, model.state_dict().items(), dtype, head=True)}


class _Deadline(io.RawIOBase):
    """A connection's bytes, all of them by one deadline: a socket's timeout bounds each
    read alone, and a peer that sends a byte every second never meets it."""

    def __init__(self, sock, seconds: float):
        self.sock, self.end = sock, time.monotonic() + seconds

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not come in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(b)


def served_model(path: str):
    """Our model for the config of `path` (a Hugging Face directory, or a GGUF file: its
    metadata and tensor directory, never its weights) on the meta device, checked as
    init_from's is: its shapes and names, no memory."""
    from ..models import build
    from ..models.gguf import load_gguf

    if not Path(path).exists():
        raise CheckpointError(f"--model {path}: not found (a model directory or a GGUF file)")
    if Path(path).is_file():
        return load_gguf(path, weights=False)[0]
    config = read_config(path)
    with torch.device("meta"):
        model = build(hf_spec(config))
    model.hf_config = config
    return model


def handler(server: Server, lock: threading.Lock, token: str = ""):
    """The HTTP handler of `server`'s endpoints, one at a time under `lock`; with `token`,
    every request must carry it."""
    expected = f"Bearer {token}".encode()
    routes = {("GET", "/health"): server.health, ("POST", "/generate"): server.generate,
              ("POST", "/init_weights"): server.init_weights,
              ("POST", "/update_weights"): server.update_weights,
              ("POST", "/close_weights"): server.close_weights}

    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # a reply's writes: a peer that stops reading is dropped

        def setup(self):
            super().setup()
            self.rfile.close()  # the socket's own reader: each read bounded alone
            self.rfile = io.BufferedReader(_Deadline(self.connection, READ_TIMEOUT_S))

        def _serve(self, method: str):
            given = str(self.headers.get("Authorization", "")).encode("latin-1")
            if token and not hmac.compare_digest(given, expected):
                return self._reply(401, {"error": f"no valid token (Authorization: Bearer, "
                                                  f"as vllm-serve's {TOKEN_ENV})"})
            fn = routes.get((method, self.path))
            if fn is None:
                return self._reply(404, {"error": f"no {method} {self.path}"})
            try:
                body = {}
                if method == "POST":
                    n = int(self.headers.get("Content-Length") or 0)
                    if not 0 <= n <= MAX_BODY:
                        raise BadRequest(f"Content-Length {n}: must be 0..{MAX_BODY}")
                    body = _json(self.rfile.read(n)) if n else {}
                self.connection.settimeout(READ_TIMEOUT_S)  # the reply's own bound
            except TimeoutError:  # the body did not come: no one is left to answer
                self.close_connection = True
                return
            except (BadRequest, ValueError) as e:
                return self._reply(400, {"error": _line(e)})
            try:
                with lock:
                    out = fn(body)
            except (BadRequest, ValueError) as e:
                return self._reply(400, {"error": _line(e)})
            except Exception as e:  # the server goes on; the caller gets one line
                print(f"[mini-grpo] vllm-serve: {self.path}: {type(e).__name__}: {_line(e)}",
                      flush=True)
                return self._reply(500, {"error": f"{type(e).__name__}: {_line(e)}"})
            self._reply(200, out)

        def _reply(self, code: int, obj: dict):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def log_message(self, *args):  # one line per request is noise at a step's pace
            pass

    return Handler


def parse_args(argv: list[str]):
    ap = ArgParser(prog="mini-grpo vllm-serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help="a Hugging Face model directory or a GGUF file (its shapes only)")
    ap.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other nodes")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    ap.add_argument("--max_model_len", type=int, default=0,
                    help="longest prompt + completion (0: the model's)")
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.9)
    ap.add_argument("--kv_cache_gib", type=float, default=0.0,
                    help="KV cache GiB (0: from the share on a GPU, 1 GiB on a CPU)")
    ap.add_argument("--tensor_parallel_size", type=int, default=1,
                    help="devices (on a CPU: processes) the engine is split over")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token", default="",
                    help=f"the secret every request must carry (default: ${TOKEN_ENV}, "
                         f"better: a flag shows on the process list); required unless --host "
                         f"is a loopback address")
    return ap.parse_args(argv)


def serve(argv: list[str]) -> int:
    args = parse_args(argv)
    token = server_token(args.token)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: must be in 0..65535, got {args.port}")
    try:  # listen first: a port in use or a bad host fails before the engine's minutes
        http = HTTPServer((args.host, args.port), BaseHTTPRequestHandler)
    except (OSError, OverflowError, UnicodeError) as e:
        raise ConfigError(f"--host/--port {args.host}:{args.port}: cannot listen there "
                          f"({getattr(e, 'strerror', None) or e})") from None
    if not token and not ipaddress.ip_address(http.server_address[0]).is_loopback:
        http.server_close()  # anyone who reaches it could push weights: never without one
        raise ConfigError(f"--host {args.host}: serving beyond this machine needs a token: "
                          f"set {TOKEN_ENV} (or --token), the trainer's too")
    try:
        server = Server(args)
    except BaseException:
        http.server_close()
        raise
    http.RequestHandlerClass = handler(server, threading.Lock(), token)
    print(f"[mini-grpo] vllm-serve: {args.model} ({server.dtype}, {server.device.type}) on "
          f"http://{args.host}:{http.server_port}{' (token required)' if token else ''}",
          flush=True)
    try:
        http.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        http.server_close()
        server.close()
    return 0
