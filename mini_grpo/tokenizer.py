"""Tokenizers: the character tokenizer built from a task's alphabet (pad/bos/eos/unk), and
HFTokenizer for a local Hugging Face model directory (tokenizers + a jinja2 chat template).

Both offer one small interface: encode / decode, `encode_prompt` (how a task's prompt becomes
ids: BOS + text, or the chat template), the special ids (bos_id, eos_id, eos_ids, pad_id),
vocab_size, `state()` (what a checkpoint stores; `from_state` rebuilds it) and
`save_pretrained(dir)` (Hugging Face files that transformers' AutoTokenizer loads).

CharTokenizer: ids 0..3 are the special tokens, then one id per character in sorted order.
Characters outside the alphabet encode to <unk> by default; `encode(..., strict=True)` raises
instead, naming the character, which is what data loaders use to reject rows they could never
learn. Its state is the alphabet, so a model always travels with its vocabulary.

Tokenizer files and a checkpoint's tokenizer state are untrusted input, checked in one place
each way in (`HFTokenizer.from_dir`, `tokenizer_from_state`, both through HFTokenizer's
constructor): JSON through the bounded reader (jsonio.py), the chat template compiled and
rendered only through chat_template.py; bad input is a ValueError (ConfigError) of one line.
The parts of tokenizer.json that run on every text are checked by tokenizer_parts.py, and a
panic of the library's Rust code while it encodes or decodes (a regex past its retry limit)
is that error too, naming the tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .chat_template import MAX_SOURCE_CHARS, ChatTemplate, template_text
from .fields import ConfigError, show
from .jsonio import check_tree, read_json_object
from .outputs import write_atomic, write_file
from .tokenizer_parts import check_parts
from .tool_calls import CALL_TOKENS, call_format

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")

# the tool list in the system message, for a template that has no place for one: the Hermes
# format, in the words of Qwen2.5's template (calls come back as <tool_call> JSON: tool_calls.py)
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


class CharTokenizer:
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3
    call_format = "hermes"  # it has no chat template, so it takes no tools (configure_chat)

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
        """Text of the ids, stopping at the first <eos>; pad/bos are dropped, <unk> (and an id
        past the alphabet, which a model larger than its tokenizer may sample) shows as '?'."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if len(SPECIALS) <= i < len(self.itos):
                out.append(self.itos[i])
            elif i == self.unk_id or i >= len(self.itos):
                out.append("?")
        return "".join(out)

    @property
    def eos_ids(self) -> list[int]:
        return [self.eos_id]

    def encode_prompt(self, text: str | list[dict]) -> list[int]:
        if not isinstance(text, str):
            raise ValueError("chat_template: rows with messages need a Hugging Face "
                             "tokenizer with a chat template (init_from a model directory)")
        return self.encode(text, bos=True)

    def configure_chat(self, chat_template: str, system_prompt: str,
                       tools: list[dict] = ()) -> None:
        if chat_template == "on" or system_prompt:
            raise ValueError("chat_template: the character tokenizer has no chat template "
                             "(chat_template and system_prompt need a Hugging Face tokenizer)")
        if tools:
            raise ValueError("tools: a multi-turn conversation needs a chat template (a "
                             "Hugging Face tokenizer that has one); the character tokenizer "
                             "has none")

    def state(self) -> list[str]:
        return list(self.chars)

    def save(self, path: str | Path) -> None:
        write_file(path, json.dumps({"type": "char", "chars": self.chars}, ensure_ascii=False))

    def save_pretrained(self, path: str | Path) -> None:
        """tokenizer.json + tokenizer_config.json: a BPE with no merges over our characters
        (so each character is its own token, ids unchanged), BOS prepended like ours."""
        from tokenizers import Tokenizer, decoders, models, processors

        vocab = {t: i for i, t in enumerate(self.itos)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        tk.add_special_tokens(list(SPECIALS))
        tk.decoder = decoders.Fuse()
        tk.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", self.bos_id)])
        path = Path(path)
        write_atomic(path / "tokenizer.json", lambda tmp: tk.save(str(tmp)))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>",
                  "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
        write_file(path / "tokenizer_config.json", json.dumps(config, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        data = read_json_object(path)  # bounded, one line naming the file (a ValueError)
        if data is None:
            raise ValueError(f"{path}: cannot read tokenizer file (no such file)")
        if data.get("type") != "char" or \
                not isinstance(data.get("chars"), list):
            raise ValueError(f"{path}: not a mini-grpo tokenizer file")
        return cls(data["chars"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars


class HFTokenizer:
    """A Hugging Face tokenizer from a local model directory: `tokenizer.json` through the
    `tokenizers` library, special tokens and the chat template from `tokenizer_config.json`
    (or `chat_template.jinja`), extra EOS ids from `generation_config.json`.

    Special tokens: `eos_ids` holds every id that ends a completion (a model may name several,
    e.g. Llama 3's <|eot_id|> and <|end_of_text|>); `eos_id` is the first. A tokenizer without
    a pad token pads with its EOS (pad positions are masked out everywhere, so the id only has
    to exist). The chat template is rendered the way transformers' `apply_chat_template`
    renders it: a sandboxed jinja2 environment with trim_blocks and lstrip_blocks,
    `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII characters, and the
    special tokens (`bos_token`, `eos_token`, ...) as variables, bounded in time and size
    (chat_template.py). Nothing is downloaded.

    The constructor checks what both ways in give it (a directory's files, a checkpoint's
    state: the EOS ids, the chat template), `where` naming the source of each in the errors;
    `config` is a mapping the bounded JSON reader (or `from_state`) has checked.
    """

    def __init__(self, tokenizer, config: dict, chat_template: str | None = None,
                 extra_eos: Iterable[int] = (), where: dict[str, str] | None = None):
        where = {"chat_template": "chat template", "eos": "EOS ids",
                 "no_eos": "tokenizer: no EOS token (eos_token in tokenizer_config.json or "
                           "eos_token_id in generation_config.json)",
                 "tokenizer": "tokenizer.json", **(where or {})}
        extra_eos = list(extra_eos)
        check_parts(tokenizer, where["tokenizer"])
        self.tk, self.where = tokenizer, where["tokenizer"]
        self.config = config
        self.specials = {name: _token_text(config.get(name)) for name in
                         ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.bos_id = self._id(self.specials["bos_token"])
        eos = self._id(self.specials["eos_token"])
        for i in extra_eos:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ConfigError(f"{where['eos']}: {show(i)} is not a token id of this "
                                  f"tokenizer (0 to {self.vocab_size - 1})")
        self.eos_ids = list(dict.fromkeys([i for i in [eos, *extra_eos] if i is not None]))
        if not self.eos_ids:
            raise ConfigError(where["no_eos"])
        self.eos_id = self.eos_ids[0]
        pad = self._id(self.specials["pad_token"])
        self.pad_id = pad if pad is not None else self.eos_id  # masked out wherever it is used
        self.chat_template = chat_template
        self.template = None if chat_template is None else \
            ChatTemplate(chat_template, where["chat_template"])  # compiled: syntax errors here
        self.chat, self.system_prompt = chat_template is not None, ""
        self.tools, self.tools_in_template = [], False
        self.call_format = "hermes"  # how the model writes a tool call (tool_calls.py)
        self._kept: dict[int, str] = {}  # special tokens of its calls, kept by decode

    def configure_chat(self, chat_template: str, system_prompt: str,
                       tools: list[dict] = ()) -> None:
        """chat_template auto | on | off: whether prompts go through the template (auto: when
        the tokenizer has one); system_prompt: a system message before each prompt; tools:
        the JSON schemas of the tools the model may call (tools.tool_schema), rendered into
        every prompt: through the template where it takes `tools` (it renders them, and the
        calls are read in its family's format: call_format), else in the system message, in
        the Hermes format (TOOLS_PROMPT), which is how the calls are read."""
        if chat_template == "on" and self.chat_template is None:
            raise ValueError("chat_template: on, but the tokenizer has none (no chat_template "
                             "in tokenizer_config.json, no chat_template.jinja)")
        self.chat = self.chat_template is not None and chat_template != "off"
        if system_prompt and not self.chat:
            raise ValueError("system_prompt: needs the chat template (chat_template: auto or "
                             "on, and a tokenizer that has one)")
        if tools and not self.chat:
            raise ValueError("tools: a multi-turn conversation needs the chat template "
                             "(chat_template: auto or on, and a tokenizer that has one)")
        self.system_prompt, self.tools, self.tools_in_template = system_prompt, list(tools), False
        if self.tools:  # does the template render a tool list? (if not, the system message)
            probe = [{"role": "user", "content": "?"}]
            self.tools_in_template = self._render(probe, True, tools=self.tools) != \
                self._render(probe, True)
        self.call_format = call_format(self.chat_template) if self.tools_in_template else "hermes"
        kept = CALL_TOKENS[self.call_format] if self.tools else ()
        self._kept = {i: t.content for i, t in self.tk.get_added_tokens_decoder().items()
                      if t.special and t.content in kept} if kept else {}

    def messages_of(self, prompt: str | list[dict]) -> list[dict]:
        """A task's prompt as the conversation the template renders: one user message, or
        the row's own messages; after the system prompt (if any, and if the row has no
        system message of its own), and the tool list where the template has no place for
        it (appended to the system message)."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            [dict(m) for m in prompt]
        if self.system_prompt and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if self.tools and not self.tools_in_template:
            listed = TOOLS_PROMPT.format(tools="\n".join(
                json.dumps(t, ensure_ascii=False) for t in self.tools))
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = f"{messages[0].get('content', '')}\n\n{listed}"
            else:
                messages.insert(0, {"role": "system", "content": listed})
        return messages

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """A conversation (messages_of's, and what followed) as the template renders it,
        with the tools where the template takes them."""
        return self._render(messages, add_generation_prompt,
                            **({"tools": self.tools} if self.tools_in_template else {}))

    def _id(self, text: str | None) -> int | None:
        return None if text is None else self.tk.token_to_id(text)

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"{path}: no tokenizer.json (a Hugging Face model directory "
                              f"saved with save_pretrained has one)")
        if file.stat().st_size > MAX_TOKENIZER_BYTES:
            raise ConfigError(f"{file}: larger than {MAX_TOKENIZER_BYTES} bytes")
        config = read_json_object(path / "tokenizer_config.json") or {}
        where = {"eos": f"{path / 'generation_config.json'}: eos_token_id",
                 "no_eos": f"{path}: no EOS token (eos_token in tokenizer_config.json or "
                           f"eos_token_id in generation_config.json)",
                 "tokenizer": str(file)}
        jinja = path / "chat_template.jinja"
        if jinja.is_file():
            template, where["chat_template"] = _read_text(jinja), str(jinja)
        else:
            file_config = path / "tokenizer_config.json"
            template = template_text(config.get("chat_template"), str(file_config))
            where["chat_template"] = f"{file_config}: chat_template"
        gen = read_json_object(path / "generation_config.json") or {}
        extra = gen.get("eos_token_id")
        extra = extra if isinstance(extra, list) else [] if extra is None else [extra]
        tk = _library(f"{file}: cannot load", Tokenizer.from_file, str(file))
        return cls(tk, config, template, extra, where)

    @classmethod
    def from_state(cls, state: dict) -> HFTokenizer:
        """The tokenizer a checkpoint stored (`state()`), checked as its files would be."""
        from tokenizers import Tokenizer

        types = {"tokenizer.json": str, "config": dict, "chat_template": (str, type(None)),
                 "eos_ids": list}
        for key, tp in types.items():
            if not isinstance(state.get(key), tp):
                raise ConfigError(f"tokenizer: the stored {key} is missing or of the wrong "
                                  f"type ({type(state.get(key)).__name__})")
        check_tree(state["config"], "tokenizer: the stored config")
        if len(state["tokenizer.json"]) > MAX_TOKENIZER_BYTES:
            raise ConfigError(f"tokenizer: the stored tokenizer.json is larger than "
                              f"{MAX_TOKENIZER_BYTES} characters")
        tk = _library("tokenizer: cannot rebuild the stored tokenizer", Tokenizer.from_str,
                      state["tokenizer.json"])
        return cls(tk, state["config"], state["chat_template"], state["eos_ids"],
                   {"chat_template": "the checkpoint's chat template",
                    "eos": "tokenizer: the stored eos_ids",
                    "tokenizer": "tokenizer: the stored tokenizer.json"})

    def state(self) -> dict:
        return {"type": "hf", "tokenizer.json": self.tk.to_str(), "config": self.config,
                "chat_template": self.chat_template, "eos_ids": self.eos_ids}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFTokenizer) and self.state() == other.state()

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def unknown_chars(self, text: str) -> list[str]:
        return []  # a BPE tokenizer encodes any text (bytes, or its own fallback)

    def encode_prompt(self, text: str | list[dict]) -> list[int]:
        """A task's prompt as ids: when chat is on, through the chat template as one user
        message, or a row's own messages, after the system prompt (if any, and if the row has
        no system message of its own); else BOS + text."""
        if not self.chat:
            if not isinstance(text, str):
                raise ValueError("chat_template: rows with messages need the chat template "
                                 "(chat_template: auto or on, and a tokenizer that has one)")
            ids = self.encode(text, bos=True)
        else:
            ids = self.encode(self.render(self.messages_of(text)))
        if not ids:  # the model cannot start from nothing
            raise ConfigError(f"prompt {show(text)}: encodes to no tokens (the tokenizer adds "
                              f"no BOS: give a non-empty prompt, or use the chat template)")
        return ids

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids; `bos=True` adds what the tokenizer puts at a sequence's start (its
        post-processor: BOS for Llama, nothing for Qwen or GPT-2), as transformers'
        `tokenizer(text)` does; False encodes the text alone (a rendered chat template
        carries its own BOS)."""
        ids = _library(f"{self.where}: cannot encode a text of {len(text)} characters",
                       self.tk.encode, text, add_special_tokens=bos).ids
        return ids + [self.eos_id] if eos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids up to the first EOS, special tokens dropped but those the model
        writes its tool calls with (Mistral's [TOOL_CALLS], [ARGS]: configure_chat), which
        the calls are found by."""
        out = []
        for i in ids:
            if int(i) in self.eos_ids:
                break
            out.append(int(i))
        if not self._kept or not self._kept.keys() & set(out):
            return self._decode(out)
        parts, start = [], 0
        for k, i in enumerate(out):
            if i in self._kept:
                parts += [self._decode(out[start:k]), self._kept[i]]
                start = k + 1
        return "".join(parts) + self._decode(out[start:])

    def _decode(self, ids: list[int]) -> str:
        return _library(f"{self.where}: cannot decode {len(ids)} ids", self.tk.decode, ids,
                        skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The rendered conversation, as text (encode it with bos=False)."""
        return self._render(messages, add_generation_prompt, **kwargs)

    def _render(self, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
        if self.template is None:
            raise ValueError("tokenizer: no chat template (chat_template: off, or a model "
                             "directory whose tokenizer_config.json has one)")
        return self.template.render(
            messages, add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in self.specials.items() if v is not None}, **kwargs)

    def save_pretrained(self, path: str | Path) -> None:
        """tokenizer.json, tokenizer_config.json (with the chat template) into a directory."""
        path = Path(path)
        write_atomic(path / "tokenizer.json", lambda tmp: self.tk.save(str(tmp)))
        config = dict(self.config)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        write_file(path / "tokenizer_config.json", json.dumps(config, indent=2,
                                                              ensure_ascii=False))


Tokenizer = CharTokenizer | HFTokenizer


def tokenizer_from_state(state) -> Tokenizer:
    """The tokenizer a checkpoint stored, checked like a tokenizer file: an alphabet (sorted
    single characters, each once, as `CharTokenizer.state()` writes it) or an HFTokenizer
    state. ValueError (ConfigError) of one line otherwise."""
    if isinstance(state, list):
        if all(isinstance(c, str) and len(c) == 1 for c in state) and \
                state == sorted(set(state)):
            return CharTokenizer(state)
        raise ConfigError("tokenizer: the stored alphabet must be sorted single characters, "
                          "each once")
    if isinstance(state, dict) and state.get("type") == "hf":
        return HFTokenizer.from_state(state)
    raise ConfigError("tokenizer: not a mini-grpo tokenizer state")


def check_model_vocab(tok: Tokenizer, vocab_size: int) -> None:
    """A tokenizer agrees with the model it comes with: a character tokenizer's ids are the
    model's embedding rows exactly; a Hugging Face model may have more rows than its tokenizer
    has tokens (padded embeddings), never fewer. ConfigError otherwise."""
    if tok.vocab_size > vocab_size or (isinstance(tok, CharTokenizer) and
                                       tok.vocab_size != vocab_size):
        raise ConfigError(f"tokenizer: {tok.vocab_size} tokens, the model's embedding "
                          f"{vocab_size}")


MAX_TOKENIZER_BYTES = 128 << 20  # tokenizer.json: the largest vocabularies are ~35 MB


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_text(path: Path) -> str:
    """chat_template.jinja: bounded, UTF-8."""
    with open(path, "rb") as f:
        raw = f.read(4 * MAX_SOURCE_CHARS + 1)
    if len(raw) > 4 * MAX_SOURCE_CHARS:
        raise ConfigError(f"{path}: larger than {4 * MAX_SOURCE_CHARS} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not valid UTF-8") from None


def _library(failed: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), a call into the tokenizers library, whose failure is a ConfigError
    `failed: <its first line>`. Its Rust code may panic on what a file gave it (a regex past
    Oniguruma's retry limit), which pyo3 raises as a PanicException: a BaseException, which
    `except Exception` lets through."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise ConfigError(f"{failed} ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
