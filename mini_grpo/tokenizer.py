"""Character-level tokenizer with pad/bos/eos/unk, built from a task's alphabet.

Ids 0..3 are the special tokens, then one id per character in sorted order. Characters outside
the alphabet encode to <unk> by default; `encode(..., strict=True)` raises instead, naming the
character, which is what data loaders use to reject rows they could never learn.
Saved as JSON next to checkpoints so a model always travels with its vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


class CharTokenizer:
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, chars: Iterable[str]):
        chars = sorted(set(chars))
        for c in chars:
            if len(c) != 1:
                raise ValueError(f"tokenizer alphabet entries must be single characters, got {c!r}")
        self.chars = chars
        self.stoi = {c: i + len(SPECIALS) for i, c in enumerate(chars)}
        self.itos = list(SPECIALS) + chars

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """The alphabet of every character that occurs in `texts`."""
        alphabet: set[str] = set()
        for t in texts:
            alphabet.update(t)
        return cls(alphabet)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def unknown_chars(self, text: str) -> list[str]:
        return sorted({c for c in text if c not in self.stoi})

    def encode(self, text: str, bos: bool = False, eos: bool = False,
               strict: bool = False) -> list[int]:
        if strict:
            bad = self.unknown_chars(text)
            if bad:
                raise ValueError(f"characters not in the tokenizer's alphabet: {bad}")
        ids = [self.stoi.get(c, self.unk_id) for c in text]
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids, stopping at the first <eos>; pad/bos are dropped, <unk> shows as '?'."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= len(SPECIALS):
                out.append(self.itos[i])
            elif i == self.unk_id:
                out.append("?")
        return "".join(out)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"type": "char", "chars": self.chars}, ensure_ascii=False))

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read tokenizer file ({e})") from None
        if not isinstance(data, dict) or data.get("type") != "char" or \
                not isinstance(data.get("chars"), list):
            raise ValueError(f"{path}: not a mini-grpo tokenizer file")
        return cls(data["chars"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars
