"""What a pass's shape costs: the LM job's policy pass (forward and backward of SmolLM2-135M's
shape, random weights, bf16 autocast, manual attention) timed per 384 token positions when
every pass has the same number of positions, a number no pass had before, or one of two:

    .venv/bin/python bench/pass_shapes.py --json bench/pass_shapes_<cpu>.json

oneDNN builds a primitive for each new matmul shape (on an AMX CPU a JIT-compiled kernel) and
keeps the last 16 (precision.ONEDNN_CACHES, which the job sets). GRPO's passes change length
every micro-batch, so if a new shape costs much, padding passes to a few lengths would pay.
Each mode runs in rounds, interleaved with the others; the figure is the median over rounds
of each round's median. One process, nothing else running.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mini_grpo.dtype_probe import cpu_name  # noqa: E402
from mini_grpo.models.llama import Llama, LlamaConfig  # noqa: E402
from mini_grpo.precision import bound_onednn_caches  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from outfile import claim  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=6, help="passes per mode and round")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    save = claim(a.json, __file__)
    bound_onednn_caches()  # before oneDNN's first use, as the job does
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=49152, block_size=2048, n_layer=30, n_head=9,
                              n_kv_head=3, n_embd=576, head_dim=64, n_inner=1536,
                              tie_word_embeddings=True))
    model.attn_impl = "manual"

    def one(T: int) -> float:  # seconds per 384 positions
        idx = torch.randint(1, 49152, (1, T))
        t0 = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16):
            h = model(idx, hidden=True)
        h.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) * 384 / T

    fresh = random.Random(0).sample(range(300, 384), a.rounds * a.passes)
    length = {"same": lambda i: 384, "new": lambda i: fresh.pop(),
              "two": lambda i: (320, 384)[i % 2]}
    one(384), one(383)  # warm-up
    rounds = {k: [] for k in length}
    for _ in range(a.rounds):
        for mode, T in length.items():
            rounds[mode].append(statistics.median(one(T(i)) for i in range(a.passes)))
    out = {mode: {"rounds_s": [round(x, 3) for x in v], "median_s": round(statistics.median(v), 3)}
           for mode, v in rounds.items()}
    for mode, r in out.items():
        print(f"{mode}: {r['median_s']} s per 384 positions (rounds {r['rounds_s']})")
    save({"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
          "onednn_primitives": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
          "results": out}, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
