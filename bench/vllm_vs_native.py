"""The two rollout engines side by side on one GRPO step's generation, in one process.

    python bench/vllm_vs_native.py [--model_dir /tmp/smollm2_135m_shape] [--reps 5] \
        [--out bench/vllm_vs_native_<cpu>.json]

Needs vLLM (`make setup VLLM=1`). The model is SmolLM2-135M's shape with random weights
(mini_grpo/benchmarks/shapes.py builds it locally the first time). The run is set up as
training sets it up (`run.setup` with `rollout_engine: vllm`, fp32 everywhere, 2 threads on a
CPU), and the work is what a step samples: 4 chess prompts through the chat template x 8
completions, up to 96 new tokens, temperature 1. Each rep times, alternating so that machine
noise hits both: the vLLM engine's `sync` (every weight sent from memory) and its `generate`,
and the native engine's `generate`. Reported: medians of seconds and of generated tokens per
second (each engine's own completion lengths: random weights rarely stop early), the engine's
start-up, and the log-prob gap between vLLM's samples and the policy's own pass (the
correctness check riding along)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from mini_grpo.config import load_config  # noqa: E402
from mini_grpo.dtype_probe import cpu_name  # noqa: E402
from mini_grpo.engines import Sampling  # noqa: E402
from mini_grpo.engines.native import NativeEngine  # noqa: E402
from mini_grpo.logprobs import completion_logprobs  # noqa: E402

PROMPTS, G, NEW = 4, 8, 96


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", default="/tmp/smollm2_135m_shape")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        from mini_grpo.benchmarks.shapes import build
        build("smollm2-135m", model_dir)
    from mini_grpo.run import setup

    out_dir = tempfile.mkdtemp(prefix="vllm_vs_native_")
    cfg = load_config("default", {
        "init_from": str(model_dir), "mode": "grpo", "rollout_engine": "vllm",
        "out_dir": out_dir, "use_amp": "false", "generation_amp": "off", "block_size": "512",
        "max_new_tokens": str(NEW), "prompts_per_step": str(PROMPTS),
        "group_size": str(G), "num_eval": "8", "reward_executor": "serial"}, env={})
    t0 = time.perf_counter()
    with setup(cfg, log=False) as run:
        start = time.perf_counter() - t0  # the whole set-up, the vLLM engine's start included
        engine, native = run.engine, NativeEngine(run.model, run.tok)
        prompts = [ex.model_input for ex in run.task.train[:PROMPTS] for _ in range(G)]
        s = Sampling(NEW, temperature=1.0)
        rows = {"vllm_sync_s": [], "vllm_s": [], "native_s": [], "vllm_tok_s": [],
                "native_tok_s": []}
        gen = torch.Generator().manual_seed(0)
        engine.sync(run.model)
        engine.generate(prompts, s, gen)  # warm-up, both
        native.generate(prompts, s, gen)
        for rep in range(args.reps):
            t = time.perf_counter()
            engine.sync(run.model)
            rows["vllm_sync_s"].append(time.perf_counter() - t)
            for name, eng in (("vllm", engine), ("native", native)):
                t = time.perf_counter()
                r = eng.generate(prompts, s, gen)
                sec = time.perf_counter() - t
                rows[f"{name}_s"].append(sec)
                rows[f"{name}_tok_s"].append(r.completion_mask.sum().item() / sec)
                if name == "vllm" and rep == 0:
                    lp = completion_logprobs(run.model, r.prompt_ids, r.prompt_mask,
                                             r.completion_ids, r.completion_mask, 1.0)
                    gap = (lp - r.logprobs).abs().max().item()
            print(f"rep {rep + 1}/{args.reps}: vllm {rows['vllm_s'][-1]:.2f} s, native "
                  f"{rows['native_s'][-1]:.2f} s, sync {rows['vllm_sync_s'][-1]:.3f} s",
                  file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "work": f"{PROMPTS} prompts x {G}, up to {NEW} new tokens, T=1, fp32",
              "setup_s_with_vllm_start": round(start, 1), "reps": args.reps,
              "medians": {k: round(v, 4) for k, v in med.items()},
              "vllm_over_native_tok_s": round(med["vllm_tok_s"] / med["native_tok_s"], 3),
              "max_logprob_gap_vllm_vs_policy": gap, "runs": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
