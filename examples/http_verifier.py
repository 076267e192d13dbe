"""An async reward plugin that asks an HTTP verifier: the pattern for code sandboxes and LLM
judges, which answer over the network while the trainer waits.

    python distributed_train.py --config tiny --task=countdown --reward_executor=thread \
        --rewards='[{name: "examples.http_verifier:verified"}]'

The verifier here is a toy: a server this module starts on 127.0.0.1 (a free port) the first
time a row is scored, in each process that scores, and that checks countdown answers with the
built-in parser. In a real setup it is your sandbox or judge; only `VERIFIER_URL` changes.

The plugin is `async def` under `per_sample`: the scorer runs the rows of a batch concurrently
in one event loop, at most `reward_concurrency` requests in flight, and cancels a request at
`reward_timeout` (its row then counts as failed, like any plugin error). The blocking urllib
call runs in a thread (`asyncio.to_thread`) so the example needs no HTTP library; with one
(httpx, aiohttp) you would await its client instead.
"""

import asyncio
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mini_grpo.rewards import per_sample
from mini_grpo.rewards.countdown import countdown_correct

VERIFIER_URL = None  # set to your verifier's URL; None starts the toy server below
_lock = threading.Lock()


class _Verifier(BaseHTTPRequestHandler):
    """POST {"completion": ..., "meta": {...}} -> {"reward": 0.0 or 1.0}."""

    def do_POST(self):
        row = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reward = countdown_correct([""], [row["completion"]], [""], [row["meta"]])[0]
        body = json.dumps({"reward": reward}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet: one line per request would flood the console
        pass


def _url() -> str:
    global VERIFIER_URL
    with _lock:
        if VERIFIER_URL is None:
            server = ThreadingHTTPServer(("127.0.0.1", 0), _Verifier)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            VERIFIER_URL = f"http://127.0.0.1:{server.server_port}/verify"
    return VERIFIER_URL


def _post(url: str, payload: dict) -> float:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return float(json.loads(resp.read())["reward"])


@per_sample
async def verified(prompt: str, completion: str, target: str, meta: dict) -> float:
    return await asyncio.to_thread(_post, _url(), {"completion": completion, "meta": meta})
