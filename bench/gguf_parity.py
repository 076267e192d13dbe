"""The real model in: `mini-grpo sample` on SmolLM2-135M-Instruct (`make model`) against
transformers' greedy generation from the same GGUF file (`gguf_file=`, its own loader).

    python bench/gguf_parity.py [--out bench/gguf_parity_<cpu>.json]

Three chat prompts, greedy, 48 new tokens each, in fp32 on both sides (`--generation_amp=off`:
a bf16 sampler rounds otherwise, and greedy text then parts at the first near-tie). Ours runs
as a user runs it, twice: from the imported directory and from the .gguf file itself.
transformers encodes with the imported directory's tokenizer: its own GGUF tokenizer builder
does not know the `smollm` pre-tokenizer and would split digits differently from llama.cpp
(and from the model's training). Prints each prompt's three texts and writes JSON.

The way out too: `mini-grpo export --checkpoint models/smollm2-135m-instruct --output X.gguf`
in f16 and q8_0, each loaded by transformers (`gguf_file=`), its logits on the three chat
prompts against those of the directory it came from (max and mean absolute difference);
`--exports_of DIR` does that alone for another directory (the LM job's hf/, say)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from outfile import claim

from mini_grpo.dtype_probe import cpu_name

ROOT = Path(__file__).resolve().parent.parent
DIR = ROOT / "models" / "smollm2-135m-instruct"
GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["What is 17 + 25?", "Convert 3 kilometers to meters.",
           "Name three colors of the rainbow."]
NEW = 48


def ours(checkpoint: Path) -> list[str]:
    args = [sys.executable, "-m", "mini_grpo", "sample", "--checkpoint", str(checkpoint),
            "--greedy", "--json", "--max_new_tokens", str(NEW), "--generation_amp=off"]
    for p in PROMPTS:
        args += ["--prompt", p]
    r = subprocess.run(args, capture_output=True, text=True, check=True)
    return [json.loads(line)["completion"] for line in r.stdout.splitlines()]


def transformers_greedy() -> list[str]:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        gen = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        out.append(tok.decode(gen[0, ids.size(1):], skip_special_tokens=True))
    return out


def exports(model_dir: Path = DIR) -> dict:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]
           for p in PROMPTS]

    def logits(path, **kw):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, **kw).eval()
        with torch.no_grad():
            return [model(x).logits for x in ids]

    want, out = logits(model_dir), {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("f16", "q8_0"):
            file = Path(tmp) / f"smollm2-{kind}.gguf"
            subprocess.run([sys.executable, "-m", "mini_grpo", "export", "--checkpoint",
                            str(model_dir), "--output", str(file), "--gguf_type", kind],
                           check=True, capture_output=True)
            got = logits(tmp, gguf_file=file.name)
            diff = torch.cat([(a - b).abs().flatten() for a, b in zip(got, want)])
            out[kind] = {"bytes": file.stat().st_size, "max_abs_diff": diff.max().item(),
                         "mean_abs_diff": diff.mean().item()}
            print(f"export {kind}: {out[kind]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument("--exports_of", help="only the export check, of this model directory "
                                         "(a run's hf/, say)")
    args = ap.parse_args()
    save = claim(args.out, __file__)
    if args.exports_of:
        result = {"cpu": cpu_name(), "model_dir": args.exports_of,
                  "exports_vs_directory_logits": exports(Path(args.exports_of))}
        save(result, indent=2)
        return
    if not (DIR / "config.json").is_file() or not GGUF.is_file():
        sys.exit("run `make model` first")
    rows = [{"prompt": p, "transformers_gguf": t, "ours_dir": a, "ours_gguf": b,
             "equal": t == a == b}
            for p, t, a, b in zip(PROMPTS, transformers_greedy(), ours(DIR), ours(GGUF))]
    for r in rows:
        print(f"{'EQUAL' if r['equal'] else 'DIFFERENT'}: {r['prompt']!r}\n"
              f"  transformers: {r['transformers_gguf']!r}\n  ours (dir):   {r['ours_dir']!r}\n"
              f"  ours (gguf):  {r['ours_gguf']!r}")
    result = {"cpu": cpu_name(), "model": GGUF.name, "max_new_tokens": NEW, "rows": rows,
              "all_equal": all(r["equal"] for r in rows)}
    print(f"all equal: {result['all_equal']}")
    result["exports_vs_directory_logits"] = exports()
    save(result, indent=2, ensure_ascii=False)


if __name__ == "__main__":
    main()
