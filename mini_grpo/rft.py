"""Rejection-sampling fine-tuning (RFT) data: oversample completions, keep the ones that score.

    mini-grpo rft-generate --checkpoint runs/default/sft/step_0001200.pt --output rft.jsonl \
        [--rft_oversample=16] [--rft_prompts_per_batch=64] [--rft_min_reward=0.9] [--rft_keep=best]
    torchrun --standalone --nproc_per_node=2 -m mini_grpo rft-generate ...   # sharded
    python distributed_train.py --config default --mode=rft   # SFT -> generate -> SFT -> eval

For every distinct prompt of the split, `rft_oversample` completions are sampled in batched,
KV-cached passes of `rft_prompts_per_batch` prompts, scored with the run's rewards, and the best
one is kept when it reaches `rft_min_reward` (`rft_keep: all` keeps every distinct one that
does). Rows are `{prompt, target, completion, reward, rewards: {plugin: value}}`: the JSONL
task loader reads them (completion, reward and rewards become metadata) and SFT trains on
`completion`.

Each rank appends whole lines to its own shard (`<output>.rank<R>`, flushed per batch) and
lists the prompts it has finished in `<output>.rank<R>.done`, so a re-run skips them; rank 0
then merges everything into `<output>` in prompt order (written to a temporary file and renamed)
and saves `<output>.summary.json`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from . import distributed as D
from .data import shard
from .rollout import sample, scored_metas


def first_prompts(examples: list, n: int) -> list:
    """The examples of the first `n` distinct prompts (in split order); all when n is 0."""
    prompts = list(dict.fromkeys(ex.prompt for ex in examples))
    keep = set(prompts[:n] if n else prompts)
    return [ex for ex in examples if ex.prompt in keep]


def _read_rows(path: Path) -> list[dict]:
    """Whole rows of a JSONL file; a last line cut short by a kill is dropped (and cut off)."""
    if not path.is_file():
        return []
    rows, good_bytes = [], 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            rows.append(json.loads(raw))
            good_bytes += len(raw)
    if good_bytes != path.stat().st_size:
        os.truncate(path, good_bytes)  # appending after a partial line would corrupt both
    return rows


def _prompt(row: dict) -> str:
    """A written row's prompt text (a chat row's: its last message)."""
    return row["prompt"] if "prompt" in row else row["messages"][-1]["content"]


def _read_done(path: Path) -> set[str]:
    return {r["prompt"] for r in _read_rows(path)}


@torch.no_grad()
def generate_rft_data(run, examples, output: str | Path) -> dict:
    """Writes the accepted completions of `examples` to `output`; returns the summary."""
    model, tok, scorer, cfg, device, dist = (run.model, run.tok, run.scorer, run.cfg,
                                             run.device, run.dist)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    prompts = list(dict.fromkeys(ex.prompt for ex in examples))  # distinct, in split order
    first = {}
    for ex in examples:
        first.setdefault(ex.prompt, ex)
    order = {p: i for i, p in enumerate(prompts)}
    mine = shard(prompts, dist.rank, dist.world_size)
    shard_path = Path(f"{output}.rank{dist.rank}")
    done_path = Path(f"{shard_path}.done")
    done = _read_done(done_path) | {_prompt(r) for r in _read_rows(shard_path)} \
        | {_prompt(r) for r in _read_rows(output)}
    todo = [p for p in mine if p not in done]
    K, B = cfg.rft_oversample, cfg.rft_prompts_per_batch
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 7 + dist.rank)
    stats = torch.zeros(4, dtype=torch.float64)  # prompts, completions, accepted rows, reward
    t0 = time.perf_counter()
    if dist.is_main:
        print(f"[rft] {len(prompts)} prompts x {K} completions, {B} prompts per batch; "
              f"{len(mine) - len(todo)} of this rank's {len(mine)} already done", flush=True)
    with open(shard_path, "a") as out, open(done_path, "a") as done_f:
        for i in range(0, len(todo), B):
            batch = todo[i:i + B]
            rows = [p for p in batch for _ in range(K)]
            with run.precision.autocast(generation=True):
                r = sample(model, tok, [first[p].model_input for p in rows], cfg.max_new_tokens,
                           temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                           generator=gen)
            exs = [first[p] for p in rows]
            res = scorer.score(rows, r.texts, [ex.target for ex in exs],
                               scored_metas([ex.meta for ex in exs], r.lengths(),
                                            cfg.max_new_tokens))
            lines = []
            for j, p in enumerate(batch):
                cand = {}  # distinct completions of this prompt -> row index
                for k in range(j * K, (j + 1) * K):
                    if res.total[k] >= cfg.rft_min_reward:
                        cand.setdefault(r.texts[k], k)
                picked = sorted(cand.values(), key=lambda k: -res.total[k])
                for k in picked[:1] if cfg.rft_keep == "best" else picked:
                    ask = {"messages": first[p].messages} if first[p].messages else {"prompt": p}
                    lines.append(json.dumps({
                        **ask, "target": first[p].target, "completion": r.texts[k],
                        "reward": float(res.total[k]),
                        "rewards": {n: float(c[k]) for n, c in res.columns.items()}}) + "\n")
                    stats[2] += 1
                    stats[3] += float(res.total[k])
            out.write("".join(lines))  # whole lines, then the prompts they finish
            out.flush()
            done_f.write("".join(json.dumps({"prompt": p}) + "\n" for p in batch))
            done_f.flush()
            stats[0] += len(batch)
            stats[1] += len(rows)
            if dist.is_main:
                dt = time.perf_counter() - t0
                rate = stats[1].item() / dt
                eta = (len(todo) - i - len(batch)) * K / rate
                print(f"[rft] prompts {int(stats[0])}/{len(todo)} (this rank), "
                      f"{rate:.0f} completions/s, ETA {eta / 60:.1f}m", flush=True)
    dt = time.perf_counter() - t0
    total = D.all_reduce_sum(stats.to(device)).cpu()
    D.barrier()
    summary = {}
    if dist.is_main:
        merged: dict[str, list[dict]] = {}
        for path in [output, *(Path(f"{output}.rank{k}") for k in range(dist.world_size))]:
            for r in _read_rows(path):
                merged.setdefault(r["prompt"], []).append(r)
        rows = [r for p in sorted(merged, key=lambda p: order.get(p, len(order)))
                for r in merged[p]]
        tmp = Path(f"{output}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, output)
        for rank in range(dist.world_size):
            Path(f"{output}.rank{rank}").unlink(missing_ok=True)
            Path(f"{output}.rank{rank}.done").unlink(missing_ok=True)
        covered = len({r["prompt"] for r in rows})
        summary = {
            "prompts": len(prompts), "prompts_generated_now": int(total[0]),
            "completions_generated_now": int(total[1]), "rows": len(rows),
            "prompts_with_accepted_row": covered, "acceptance_rate": covered / len(prompts),
            "mean_kept_reward": sum(r["reward"] for r in rows) / max(1, len(rows)),
            "seconds": dt, "completions_per_s": total[1].item() / dt if dt > 0 else 0.0,
            "oversample": K, "prompts_per_batch": B, "min_reward": cfg.rft_min_reward,
            "keep": cfg.rft_keep, "world_size": dist.world_size}
        Path(f"{output}.summary.json").write_text(json.dumps(summary, indent=2))
        print(f"[rft] {covered}/{len(prompts)} prompts with an accepted completion "
              f"({100 * summary['acceptance_rate']:.1f}%), mean kept reward "
              f"{summary['mean_kept_reward']:.3f}, {summary['completions_per_s']:.0f} "
              f"completions/s, {dt:.1f}s -> {output}", flush=True)
    D.barrier()
    return summary
