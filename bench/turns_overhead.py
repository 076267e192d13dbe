"""What the multi-turn loop costs a rollout in which no tool is called: the native engine's
generation of the LM job's shape (SmolLM2-135M-Instruct from `make model`, 16 questions x 8
rows, bf16 autocast as the job samples), single-turn against the same prompts through the
turn loop (an environment per row that ends the conversation at its first turn: the tool loop
when the model writes no call), alternating, in one process:

    .venv/bin/python bench/turns_overhead.py --reps 5 --json bench/turns_overhead_zen4.json

Both draw the same tokens (asserted: with no turn answered the rollouts are bit-identical);
it reports each variant's median seconds, their ratio, and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mini_grpo.engines.native import sample  # noqa: E402
from mini_grpo.engines.turns import ToolSetup  # noqa: E402
from mini_grpo.envs import ToolEnv  # noqa: E402
from mini_grpo.models.hf import load_hf_model  # noqa: E402
from mini_grpo.tokenizer import HFTokenizer  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from outfile import claim  # noqa: E402

QUESTIONS = [f"What is {a} * {b}? Put the final answer in <answer></answer> tags."
             for a, b in [(431, 254), (17, 23), (908, 12), (55, 66), (123, 456), (7, 89),
                          (640, 3), (29, 31), (314, 159), (265, 358), (97, 93), (12, 12),
                          (846, 264), (338, 327), (950, 288), (419, 716)]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=96)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    save = claim(args.json, __file__)
    torch.set_num_threads(2)
    tok = HFTokenizer.from_dir(args.model)
    tok.configure_chat("auto", "")
    model = load_hf_model(args.model)
    prompts = [q for q in QUESTIONS for _ in range(args.group)]
    setup = ToolSetup(lambda: ToolEnv({}), 4, 10.0)
    times: dict[str, list[float]] = {"single_turn": [], "turn_loop": []}
    tokens = {}
    for rep in range(args.reps + 1):  # the first round warms up, not counted
        for name, tools in (("single_turn", None), ("turn_loop", setup))[::1 - 2 * (rep % 2)]:
            gen = torch.Generator().manual_seed(rep)
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                r = sample(model, tok, prompts, args.max_new_tokens, temperature=0.7,
                           generator=gen, tools=tools)
            seconds = time.perf_counter() - t0
            if rep:
                times[name].append(seconds)
            tokens.setdefault(rep, {})[name] = r.completion_ids
            print(f"rep {rep} {name}: {seconds:.2f} s, {int(r.completion_mask.sum())} tokens",
                  flush=True)
        a, b = tokens[rep]["single_turn"], tokens[rep]["turn_loop"]
        assert torch.equal(a, b), "with no turn answered the rollouts must be identical"
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
           "rows": len(prompts), "max_new_tokens": args.max_new_tokens, "reps": args.reps,
           "seconds": times, "median_s": med,
           "ratio_turn_loop": med["turn_loop"] / med["single_turn"],
           "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
    print(json.dumps({k: out[k] for k in ("median_s", "ratio_turn_loop", "peak_rss_gb")}))
    save(out, indent=2)


if __name__ == "__main__":
    main()
