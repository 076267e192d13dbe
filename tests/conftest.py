"""Shared helpers for the tests: the tiny config, a tiny GPT, torchrun on loopback.

Test files import them as `from conftest import ...` (pytest puts tests/ on the path).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mini_grpo.config import load_config
from mini_grpo.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent

# the precision probe's verdicts (dtype_probe.py) go to a cache of this session, not the
# user's: a verdict measured on a machine busy with tests must not steer their later runs
os.environ.setdefault("MINI_GRPO_PROBE_CACHE",
                      str(Path(tempfile.mkdtemp(prefix="mini_grpo_probe_")) / "probe.json"))

# GRPO alone, fp32 (exact reproducibility and resume are promised for fp32 on CPU), a small
# held-out split, rewards scored in the trainer's thread
TINY = {"mode": "grpo", "num_eval": 8, "use_amp": False, "reward_executor": "serial"}

# Under pytest-xdist (the GPU machine's check runs 14 workers on 16 cores) each worker's runs
# take its share of the cores: the default splits the cores between one run's ranks, and
# 14 workers x 16 threads timed tests out there. Subprocess runs read NUM_THREADS.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ.setdefault("NUM_THREADS", str(_SHARE))
    TINY["num_threads"] = int(os.environ["NUM_THREADS"])
    torch.set_num_threads(TINY["num_threads"])


def tiny(out_dir=None, **overrides):
    """configs/tiny.yaml with TINY and `overrides` on top, environment ignored."""
    over = dict(TINY)
    if out_dir is not None:
        over["out_dir"] = str(out_dir)
    over.update(overrides)
    return load_config("tiny", {k: v if isinstance(v, dict) else str(v)
                                for k, v in over.items()}, env={})


def make_rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs=None,
                 finished=None, sampling=None, **kw):
    """A Rollout as an engine's single-turn one: logprobs 0, every row finished, sampled at
    temperature 1 unless given; `kw`: any other field (model_mask, texts, ...)."""
    from mini_grpo.engines.base import Rollout, Sampling

    B, N = completion_ids.shape
    kw.setdefault("model_mask", completion_mask)
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                   completion_ids=completion_ids, completion_mask=completion_mask,
                   logprobs=torch.zeros(B, N) if logprobs is None else logprobs,
                   finished=torch.ones(B, dtype=torch.bool) if finished is None else finished,
                   nonfinite=kw.pop("nonfinite", torch.tensor(False)),
                   sampling=Sampling(N, 1.0) if sampling is None else sampling, **kw)


def rows_rollout(lengths, plen=3):
    """A rollout of completions of `lengths` tokens after prompts of `plen`, and its mask."""
    B = len(lengths)
    cmask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    return make_rollout(torch.zeros(B, plen, dtype=torch.long),
                        torch.ones(B, plen, dtype=torch.bool),
                        torch.zeros_like(cmask, dtype=torch.long), cmask), cmask


def tiny_gpt(seed: int = 0, vocab_size: int = 24) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=2,
                         n_embd=32)).eval()


def metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").open()]


def events(out_dir) -> list[tuple[int, str]]:
    return [(r["step"], r["event"]) for r in metrics(out_dir) if "event" in r]


def clean_env(**extra) -> dict:
    """os.environ without the switches a developer may have set, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("USE_AMP", "MAX_STEPS", "MAX_MINUTES", "OUT_DIR", "RANK", "WORLD_SIZE",
                        "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra})
    return env


def ranks_env(nproc: int) -> dict:
    """GPUs hidden from a test's `nproc` ranks where the machine has fewer GPUs than ranks
    (one each, as device: auto asks): they meet on gloo over loopback, as on a CPU."""
    return {"CUDA_VISIBLE_DEVICES": ""} if 0 < torch.cuda.device_count() < nproc else {}


def torchrun(*args, extra_env=None, timeout=300, nproc=2):
    """`torchrun --standalone --nproc_per_node=2 ARGS` on loopback, from the repository root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=clean_env(**ranks_env(nproc), **(extra_env or {})),
                          timeout=timeout)


def entry(*args, env=None, timeout=300, cwd=None):
    """`python distributed_train.py ARGS` as a user runs it."""
    return subprocess.run([sys.executable, str(ROOT / "distributed_train.py"), *args],
                          capture_output=True, text=True, cwd=cwd or ROOT,
                          env=clean_env(**(env or {})), timeout=timeout)


# ChatML, as Qwen2.5 writes it: a default system message, <|im_start|>role ... <|im_end|>
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tiny_lm_dir(path, model_type: str = "qwen2", seed: int = 0, heads: int = 4,
                positions: int = 512) -> Path:
    """A pretrained-style model directory as save_pretrained writes it, built locally with
    transformers (nothing downloaded): a 2-layer, 64-wide `model_type` model with random
    weights, `heads` attention heads (half as many key/value heads; vLLM's CPU attention
    wants head_dim >= 32, so heads=2 there), and a byte-level BPE tokenizer trained on chess
    text with a ChatML template (eos <|im_end|>, pad <|endoftext|>)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ["e2e4 e7e5 g1f3 b8c6 f1b5 a7a6: write the FEN of the final position",
              "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq - 0 1",
              "system user assistant You are a helpful assistant."]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                                  pad_token="<|endoftext|>")
    hf_tok.chat_template = CHATML
    # Gemma 3: a sliding window shorter than a prompt, one layer of each kind; the head is
    # the width over the heads, as the other families' (heads=2: vLLM's CPU minimum of 32)
    gemma = dict(head_dim=64 // heads, query_pre_attn_scalar=64 // heads, sliding_window=8,
                 layer_types=["sliding_attention", "full_attention"])
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=tk.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=positions,
        tie_word_embeddings=model_type in ("qwen2", "gemma3_text"),
        eos_token_id=tk.token_to_id("<|im_end|>"),
        **(gemma if model_type == "gemma3_text" else {}))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    out = Path(path)
    model.save_pretrained(out)
    hf_tok.save_pretrained(out)
    return out


class Boom:
    """A pickle that runs a command when loaded plainly (pickle.load, torch.load with
    weights_only=False): it names os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_in_shard(dcp_dir, fqn: str, marker) -> None:
    """Appends torch.save(Boom(marker)) to a shard of sharded checkpoint `dcp_dir` and points
    its item `fqn` (a non-tensor one, as the optimizer's "optim.param_groups.0.lr") at those
    bytes, rewriting DCP's index with a plain pickle of its real classes (which the index's
    allowlist passes): torch's default load planner would run the payload."""
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    meta_path = Path(dcp_dir) / ".metadata"
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)  # written by the test's own run
    key = next(k for k in meta.storage_data if k.fqn == fqn)
    shard = Path(dcp_dir) / meta.storage_data[key].relative_path
    payload = io.BytesIO()
    torch.save(Boom(marker), payload)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    meta.storage_data[key] = _StorageInfo(relative_path=shard.name, offset=offset,
                                          length=len(payload.getvalue()))
    meta_path.write_bytes(pickle.dumps(meta))
