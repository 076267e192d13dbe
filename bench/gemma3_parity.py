"""The real Gemma 3 270M in (`make model MODEL=gemma3-270m`): our model and tokenizer from
the GGUF file against transformers' own GGUF loader on the same file (`gguf_file=`).

    python bench/gemma3_parity.py [--json bench/gemma3_parity_<cpu>.json] [--new 64]

In fp32 on both sides, three plain-text prompts (a base model: `<bos>` and the text):
- the token ids of each prompt (ours with the file's add_bos_token, theirs with their BOS);
- the logits of each prompt's positions: max absolute difference (issue 72: within 1e-3);
- greedy decoding of `--new` tokens, one prompt at a time on both sides: ours (the native
  engine, KV cache) against transformers' generate: equal ids;
- wall time of each side's greedy decoding, measured one after the other in this process
  (nothing else heavy may run beside it for the times to mean anything), and the peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from outfile import claim  # noqa: E402

from mini_grpo.dtype_probe import cpu_name  # noqa: E402

GGUF = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
PROMPTS = ["The capital of France is", "Question: What is 17 + 25?\nAnswer:",
           "def fibonacci(n):\n    "]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--new", type=int, default=64)
    a = ap.parse_args(argv)
    save = claim(a.json, __file__)  # refuses a file this script did not write, before work
    import transformers

    from mini_grpo.engines.native import generate
    from mini_grpo.models.gguf import load_gguf

    torch.manual_seed(0)
    t0 = time.perf_counter()
    ours, tok = load_gguf(GGUF)
    ours.eval()
    load_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32).eval()
    their_tok = transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    load_theirs = time.perf_counter() - t0
    rows = []
    ids_all = []
    for p in PROMPTS:
        ids = tok.encode(p, bos=True)
        want_ids = [their_tok.bos_token_id, *their_tok(p, add_special_tokens=False)["input_ids"]]
        with torch.no_grad():
            x = torch.tensor([ids])
            diff = (ours(x) - theirs(x).logits).abs().max().item()
        rows.append({"prompt": p, "ids_equal": ids == want_ids, "n_ids": len(ids),
                     "logits_max_abs_diff": diff})
        ids_all.append(ids)
    t0 = time.perf_counter()
    mine = [generate(ours, [ids], a.new, eos_id=-1, pad_id=tok.pad_id, greedy=True)
            .completion_ids[0].tolist() for ids in ids_all]
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gens = []
    with torch.no_grad():
        for ids in ids_all:
            out = theirs.generate(torch.tensor([ids]), max_new_tokens=a.new, do_sample=False,
                                  eos_token_id=None, pad_token_id=tok.pad_id)
            gens.append(out[0, len(ids):].tolist())
    theirs_s = time.perf_counter() - t0
    for row, m, g in zip(rows, mine, gens):
        first = next((k for k, (x, y) in enumerate(zip(m, g)) if x != y), None)
        row.update(greedy_equal=m == g, first_difference=first,
                   ours_text=tok.decode(m), theirs_text=their_tok.decode(g))
    result = {"written_by": "bench/gemma3_parity.py", "cpu": cpu_name(), "file": GGUF.name,
              "threads": torch.get_num_threads(), "new_tokens": a.new, "prompts": rows,
              "load_s": {"ours": round(load_ours, 1), "transformers": round(load_theirs, 1)},
              "greedy_s": {"ours": round(ours_s, 2), "transformers": round(theirs_s, 2),
                           "ratio": round(ours_s / theirs_s, 3)},
              "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                    / 2**20, 2)}
    print(json.dumps(result, indent=1))
    save(result, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
