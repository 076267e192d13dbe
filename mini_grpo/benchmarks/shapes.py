"""Hugging Face model directories in the shapes of real models, with random weights, built
here (nothing is downloaded): what the benchmarks of pretrained-model work run on.

    python -m mini_grpo.benchmarks.shapes smollm2-135m models/smollm2-135m-shape
    python -m mini_grpo.benchmarks.shapes qwen2.5-0.5b models/qwen2.5-0.5b-shape

configs/smollm2_135m.yaml and configs/qwen25_05b.yaml point `init_from` at those directories,
and benchmark.py builds a missing one whose name it knows (`ensure`). Each directory holds
config.json, model.safetensors (fp32), and a word-level tokenizer of the model's vocabulary
size (the specials, then filler words; a prompt's words it does not know are <unk>) with a
ChatML template, so prompts go through a chat template as with the real model. Needs
transformers (the dev extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]

# config.json fields of the real models (their sizes, GQA, rope base, tying)
SHAPES = {
    "smollm2-135m": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
                     "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3,
                     "max_position_embeddings": 2048, "rope_theta": 100000.0,
                     "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
    "qwen2.5-0.5b": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
                     "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                     "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
}

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' + "
          "message['content'] + ' <|im_end|> ' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}")


def build(name: str, directory: str | Path, seed: int = 0) -> Path:
    """The directory of shape `name` (a key of SHAPES), random weights from `seed`."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    fields = dict(SHAPES[name])
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    while len(vocab) < fields["vocab_size"]:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                               pad_token="<|endoftext|>", unk_token="<unk>",
                                               additional_special_tokens=SPECIALS[1:3])
    tok.chat_template = CHATML
    config = transformers.AutoConfig.for_model(
        fields.pop("model_type"), **fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(directory)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def known(directory: str | Path) -> str | None:
    """The shape a directory's name asks for ("models/smollm2-135m-shape" -> smollm2-135m)."""
    stem = Path(directory).name.removesuffix("-shape")
    return stem if stem in SHAPES else None


def ensure(directory: str) -> None:
    """Builds `directory` if it is missing and its name is one of the known shapes."""
    if not directory or Path(directory).exists() or known(directory) is None:
        return
    print(f"[bench] building {directory}: {known(directory)}'s shape with random weights",
          file=sys.stderr, flush=True)
    build(known(directory), directory)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in SHAPES:
        sys.exit(f"usage: python -m mini_grpo.benchmarks.shapes {{{','.join(SHAPES)}}} DIR")
    print(build(sys.argv[1], sys.argv[2]))
