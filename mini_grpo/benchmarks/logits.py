"""Peak memory of the log-prob pass (forward + backward of the LM head and log-softmax) with
the chunked LM head (chunked.token_logprobs) and without it, at a real vocabulary's size:
`python benchmark.py --only logits_memory` (Qwen2.5-0.5B's head by default: V 151936, C 896).

Each variant runs in a fresh process so one's peak cannot hide the other's: on a GPU the
peak is torch.cuda.max_memory_allocated, on a CPU the process's peak resident memory
(ru_maxrss), both minus the same figure just before the pass, with the inputs in place.
"""

from __future__ import annotations

import json
import subprocess
import sys

_PASS = """
import json, resource, sys, time, torch
from mini_grpo.chunked import LOGITS_BUDGET_BYTES, token_logprobs
V, C, N = map(int, sys.argv[1:4])
chunked, dev = sys.argv[4] == "1", sys.argv[5]
g = torch.Generator(device=dev).manual_seed(0)
h = torch.randn(N, C, device=dev, generator=g).requires_grad_()
w = torch.randn(V, C, device=dev, generator=g).mul_(0.02).requires_grad_()  # no transient copy
t = torch.randint(0, V, (N,), device=dev, generator=g)
cuda = dev == "cuda"
def peak():
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if cuda:
    torch.cuda.reset_peak_memory_stats()
base, t0 = peak(), time.perf_counter()
chunk = max(1, (LOGITS_BUDGET_BYTES // 4) // V) if chunked else N  # N: the one-shot path
token_logprobs(h, w, t, chunk_tokens=chunk).sum().backward()
print(json.dumps({"peak_MiB": (peak() - base) / 2**20, "seconds": time.perf_counter() - t0,
                  "chunk_tokens": chunk}))
"""


def logits_memory(vocab: int = 151936, width: int = 896, tokens: int = 4096,
                  device: str = "cpu") -> dict:
    """{"full": {...}, "chunked": {...}} peak MiB and seconds of one pass of `tokens` tokens."""
    out = {"vocab": vocab, "width": width, "tokens": tokens, "device": device,
           "logits_fp32_MiB": tokens * vocab * 4 / 2**20}
    for name, flag in (("full", "0"), ("chunked", "1")):
        r = subprocess.run([sys.executable, "-c", _PASS, str(vocab), str(width), str(tokens),
                            flag, device], capture_output=True, text=True, timeout=1800)
        if r.returncode:
            raise RuntimeError(f"logits_memory {name}: {r.stderr.strip().splitlines()[-1]}")
        out[name] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def format_logits_memory(r: dict) -> str:
    rows = [f"log-prob pass, V {r['vocab']}, C {r['width']}, {r['tokens']} tokens on "
            f"{r['device']} (fp32 logits alone: {r['logits_fp32_MiB']:.0f} MiB)"]
    for name in ("full", "chunked"):
        m = r[name]
        rows.append(f"  {name:8s} peak +{m['peak_MiB']:7.0f} MiB  {m['seconds']:6.2f} s"
                    f"  ({m['chunk_tokens']} tokens a chunk)")
    return "\n".join(rows)
