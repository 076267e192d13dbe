"""The vLLM engine checked in a process of its own (vLLM sets up process-wide state: a
process group, thread binding), printing one JSON line for tests/test_vllm.py:

    python tests/vllm_worker.py parity qwen2 DIR   # greedy and log-probs against ours, sync
    python tests/vllm_worker.py parity qwen3,gpt2 DIR   # each in turn: {family: result}
    python tests/vllm_worker.py train DIR [--stale] [--lora]   # 3 GRPO steps; --stale: sync
                                                    # only once; --lora: LoRA adapters, r 4
    python tests/vllm_worker.py turns LM DIR [URL]  # multi-turn greedy conversations against
                                                    # ours (URL: a vllm-serve's, server mode)
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from conftest import tiny, tiny_lm_dir  # noqa: E402

from mini_grpo.engines import Sampling  # noqa: E402
from mini_grpo.engines.native import NativeEngine  # noqa: E402
from mini_grpo.logprobs import completion_logprobs  # noqa: E402


def gap(run, r, temperature) -> float:
    """max |engine log-prob - the policy's| over the rollout's tokens."""
    lp = completion_logprobs(run.model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                             r.completion_mask, temperature)
    return (lp - r.logprobs).abs().max().item()


def parity(family: str, root: Path) -> dict:
    from mini_grpo.run import setup

    lm = tiny_lm_dir(root / family, family, heads=2)  # head_dim 32: vLLM's CPU minimum
    cfg = tiny(root / "out", init_from=str(lm), rollout_engine="vllm", max_new_tokens=12,
               block_size=256)
    with setup(cfg, log=False) as run:
        engine, native = run.engine, NativeEngine(run.model, run.tok)
        prompts = [ex.model_input for ex in run.task.train[:4]]
        out = {"dummy_gap": None}
        greedy = Sampling(12, greedy=True)
        r = engine.generate(prompts, greedy)  # the engine's own (dummy) weights: no sync yet
        out["dummy_gap"] = gap(run, r, 1.0)
        engine.sync(run.model)
        r, n = engine.generate(prompts, greedy), native.generate(prompts, greedy)
        out["greedy_equal"] = torch.equal(r.completion_ids, n.completion_ids) and \
            torch.equal(r.completion_mask, n.completion_mask) and \
            torch.equal(r.finished, n.finished) and r.texts == n.texts
        out["greedy_gap"] = gap(run, r, 1.0)
        s = Sampling(12, temperature=0.7)
        r = engine.generate(prompts * 2, s, torch.Generator().manual_seed(0))
        out["sampled_gap"] = gap(run, r, 0.7)
        again = engine.generate(prompts * 2, s, torch.Generator().manual_seed(0))
        out["same_seed_same_rows"] = torch.equal(r.completion_ids, again.completion_ids)
        out["rows_differ"] = len({tuple(x) for x in r.completion_ids.tolist()}) > 1
        eos = set(run.tok.eos_ids)
        out["finished_rows_end_in_eos"] = all(
            (ids[int(m.sum()) - 1] in eos) == bool(f) for ids, m, f in
            zip(r.completion_ids.tolist(), r.completion_mask, r.finished.tolist()))
        with torch.no_grad():  # a new policy: the engine serves the old one until a sync
            for p in run.model.parameters():
                p.mul_(1.1).add_(0.02 * torch.randn_like(p))
        r = engine.generate(prompts, s, torch.Generator().manual_seed(1))
        out["stale_gap"] = gap(run, r, 0.7)
        engine.sync(run.model)
        r = engine.generate(prompts, s, torch.Generator().manual_seed(1))
        out["synced_gap"] = gap(run, r, 0.7)
    return out


class Nudge:
    """An environment that answers every turn the model ends (up to max_tool_calls), with a
    reward part per turn: a random model's turns are answered whatever they say."""

    def reset(self, prompt):
        self.turns = 0

    def step(self, reply: str):
        from mini_grpo.envs import Step

        self.turns += 1
        return Step([{"role": "user", "content": f"go on ({self.turns})"}], done=False,
                    rewards={"turn": 0.5}, calls=1)


def turns(lm: Path, root: Path, url: str = "") -> dict:
    """Greedy multi-turn rollouts (Nudge answers every turn that ends) on the vLLM engine
    against the native engine's: the same ids, masks (the model's own tokens), finished
    flags, conversations and counts."""
    from mini_grpo.engines.turns import ToolSetup
    from mini_grpo.run import setup

    server = {"vllm_mode": "server", "vllm_server_url": url} if url else {}
    cfg = tiny(root / "out", init_from=str(lm), rollout_engine="vllm", max_new_tokens=120,
               block_size=512, task="jsonl", data_path="examples/guess_number.jsonl",
               environment="vllm_worker:Nudge", max_tool_calls=3, **server)
    with setup(cfg, log=False) as run:
        engine = run.engine
        native = NativeEngine(run.model, run.tok, tools=ToolSetup.of(cfg))
        prompts = [ex.model_input for ex in run.task.train[:6]]
        engine.sync(run.model)
        out = {}
        # 72 tokens: a third turn runs out of room (cut off); 120: the cap of 3 rounds ends it
        for budget in (72, 120):
            greedy = Sampling(budget, greedy=True)
            r, n = engine.generate(prompts, greedy), native.generate(prompts, greedy)
            same = {
                "ids": torch.equal(r.completion_ids, n.completion_ids),
                "mask": torch.equal(r.completion_mask, n.completion_mask),
                "model_mask": torch.equal(r.model_mask, n.model_mask),
                "finished": torch.equal(r.finished, n.finished),
                "texts": r.texts == n.texts, "conversations": r.conversations == n.conversations,
                "counts": torch.equal(r.turn_counts, n.turn_counts),
                "env_rewards": r.env_rewards == n.env_rewards}
            lp = completion_logprobs(run.model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                     r.completion_mask, 1.0)
            out[budget] = {"same": same, "rounds": n.turn_counts[:, 2].tolist(),
                           "finished": n.finished.tolist(),
                           "gap": (lp - r.logprobs)[r.model_mask].abs().max().item(),
                           "answered_tokens": int((r.completion_mask & ~r.model_mask).sum())}
        return out


def train_run(root: Path, stale: bool, lora: bool) -> dict:
    from mini_grpo.engines.vllm import VLLMEngine
    from mini_grpo.job import train

    if stale:  # the control: the engine keeps the weights of its first sync
        sync, done = VLLMEngine.sync, []

        def once(self, model):
            if not done:
                done.append(1)
                sync(self, model)
        VLLMEngine.sync = once
    lm = tiny_lm_dir(root / "lm", "qwen2", heads=2)
    out = root / "run"
    extra = {"lora_r": 4, "lr": 3e-2, "beta": 0.04} if lora else {}
    train(tiny(out, init_from=str(lm), rollout_engine="vllm", max_steps=3, **{
        "lr": 3e-3, "warmup_steps": 0, "max_new_tokens": 16, "block_size": 256,
        "eval_every": 100, "save_every": 100, "beta": 0.0, **extra}))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "engine/logp_diff" in m]
    from safetensors.torch import load_file
    trained, base = (load_file(str(d / "model.safetensors")) for d in (out / "hf", lm))
    return {"steps": [m["step"] for m in steps],
            "logp_diff": [m["engine/logp_diff"] for m in steps],
            "engine_kl": [m["engine/kl"] for m in steps],
            "hf": (out / "hf" / "config.json").exists(),
            "moved": max((trained[k] - v).abs().max().item() for k, v in base.items())}


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "parity" and "," in rest[0]:
        result = {f: parity(f, Path(rest[1]) / f) for f in rest[0].split(",")}
    elif mode == "parity":
        result = parity(rest[0], Path(rest[1]))
    elif mode == "turns":
        result = turns(Path(rest[0]), Path(rest[1]), *rest[2:])
    else:
        result = train_run(Path(rest[0]), "--stale" in rest, "--lora" in rest)
    print("RESULT " + json.dumps(result), flush=True)
