"""Tokenizer and chat template of a model directory (local files only), or the built-ins that
`--load-format dummy` brings.

From a model dir: `tokenizer.json` through the `tokenizers` library (what the released
checkpoint's fast tokenizer is), else transformers' AutoTokenizer with ``local_files_only``
(e.g. only a sentencepiece `tokenizer.model`). The chat template comes from
`chat_template.jinja`, `chat_template.json` or `tokenizer_config.json` and is rendered with
jinja2 in a sandbox, as transformers does.

Built-in (dummy): a byte-level tokenizer (every UTF-8 byte is one token) whose special tokens
map to the config's ids, and the released template, so the whole path runs without a model dir.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Protocol, Sequence

from .config import PaddleOCRVLConfig
from ..checkpoint_checks import decode_byte_tokens

log = logging.getLogger(__name__)

BOS, EOS, UNK = "<|begin_of_sentence|>", "</s>", "<unk>"
IMAGE_START, IMAGE_PLACEHOLDER, IMAGE_END = "<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>"

# The released PaddleOCR-VL template, rendering e.g.
# "<|begin_of_sentence|>User: <|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>OCR:\nAssistant: "
# (images first, then the text parts of the user turn; one placeholder per image, which
# build_prompt expands to h*w/4 image tokens).
DEFAULT_CHAT_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = true -%}{%- endif -%}"
    "{%- if not cls_token is defined -%}{%- set cls_token = \"<|begin_of_sentence|>\" -%}{%- endif -%}"
    "{%- if not eos_token is defined -%}{%- set eos_token = \"</s>\" -%}{%- endif -%}"
    "{%- if not image_token is defined -%}"
    "{%- set image_token = \"<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>\" -%}{%- endif -%}"
    "{{- cls_token -}}"
    "{%- for message in messages -%}"
    "{%- if message[\"role\"] == \"user\" -%}"
    "{{- \"User: \" -}}"
    "{%- for content in message[\"content\"] -%}"
    "{%- if content[\"type\"] == \"image\" -%}{{ image_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for content in message[\"content\"] -%}"
    "{%- if content[\"type\"] == \"text\" -%}{{ content[\"text\"] }}{%- endif -%}"
    "{%- endfor -%}"
    "{{ \"\\n\" -}}"
    "{%- elif message[\"role\"] == \"assistant\" -%}"
    "{{- \"Assistant: \" -}}"
    "{%- for content in message[\"content\"] -%}"
    "{%- if content[\"type\"] == \"text\" -%}{{ content[\"text\"] }}{%- endif -%}"
    "{%- endfor -%}"
    "{{ eos_token -}}"
    "{%- elif message[\"role\"] == \"system\" -%}"
    "{%- for content in message[\"content\"] -%}"
    "{%- if content[\"type\"] == \"text\" -%}{{ content[\"text\"] + \"\\n\" }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- \"Assistant: \" -}}{%- endif -%}"
)


class TokenizerError(ValueError):
    """The model directory's tokenizer or chat template cannot be used; names the file."""


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class ByteTokenizer:
    """Every UTF-8 byte is one token (ids byte_base .. byte_base+255); the special tokens are
    single tokens with the config's ids. Ids outside both ranges (a random model emits any id of
    its vocab) decode to U+FFFD, so the text of a dummy run is well-formed."""
    special: dict[str, int]
    byte_base: int = 3

    def __post_init__(self):
        clash = [t for t, i in self.special.items() if self.byte_base <= i < self.byte_base + 256]
        if clash:
            raise TokenizerError(f"special tokens {clash} collide with the byte ids {self.byte_base}..{self.byte_base + 255}")
        self._by_id = {i: t for t, i in self.special.items()}
        # longest first, so that no special token is split at a shorter one's prefix
        self._specials = sorted(self.special, key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        i = 0
        while i < len(text):
            if text[i] == "<":
                hit = next((t for t in self._specials if text.startswith(t, i)), None)
                if hit is not None:
                    out.append(self.special[hit])
                    i += len(hit)
                    continue
            j = text.find("<", i + 1)
            j = len(text) if j < 0 else j
            out.extend(self.byte_base + b for b in text[i:j].encode("utf-8"))
            i = j
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return decode_byte_tokens(ids, self.byte_base, self._by_id, skip_special_tokens)


def builtin_special_tokens(cfg: PaddleOCRVLConfig) -> dict[str, int]:
    return {UNK: cfg.pad_token_id, BOS: cfg.bos_token_id, EOS: cfg.eos_token_id,
            IMAGE_PLACEHOLDER: cfg.image_token_id, IMAGE_START: cfg.vision_start_token_id,
            IMAGE_END: cfg.vision_end_token_id}


class HFTokenizer:
    """A `tokenizers.Tokenizer` (tokenizer.json): specials are matched as single tokens, no
    special tokens are added on encode (the chat template writes the BOS itself)."""

    def __init__(self, tok, source: str):
        self.tok, self.source = tok, source

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


class AutoTokenizerAdapter(HFTokenizer):
    """transformers' AutoTokenizer (local files only) behind the same two methods."""

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        i = self.tok.convert_tokens_to_ids(token)
        return None if i == self.tok.unk_token_id and token != self.tok.unk_token else i


@dataclass
class ChatTemplate:
    source: str
    template: str
    extra: dict = field(default_factory=dict)   # bos_token, eos_token, ... from tokenizer_config.json

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return _compile(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                  **self.extra)
        except Exception as e:     # jinja2 errors and raise_exception() from the template
            raise TokenizerError(f"chat template ({self.source}) failed to render: {e}") from None


def _raise(message: str):
    raise TokenizerError(message)


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
    return env.from_string(template)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from None


def _token_str(v) -> str | None:
    if isinstance(v, dict):       # {"content": "...", ...} in older tokenizer_config.json files
        v = v.get("content")
    return v if isinstance(v, str) else None


def load_chat_template(model_dir: str | Path | None) -> ChatTemplate:
    if model_dir is None:
        return ChatTemplate("built-in (the released PaddleOCR-VL template)", DEFAULT_CHAT_TEMPLATE)
    d = Path(model_dir)
    extra: dict = {}
    tc = d / "tokenizer_config.json"
    tc_data = _read_json(tc) if tc.is_file() else {}
    for k in ("bos_token", "eos_token", "pad_token", "unk_token", "cls_token"):
        s = _token_str(tc_data.get(k))
        if s is not None:
            extra[k] = s
    if (d / "chat_template.jinja").is_file():
        return ChatTemplate(str(d / "chat_template.jinja"), (d / "chat_template.jinja").read_text(), extra)
    if (d / "chat_template.json").is_file():
        t = _read_json(d / "chat_template.json").get("chat_template")
        if isinstance(t, str):
            return ChatTemplate(str(d / "chat_template.json"), t, extra)
    t = tc_data.get("chat_template")
    if isinstance(t, str):
        return ChatTemplate(str(tc), t, extra)
    if isinstance(t, list) and t:      # [{"name": "default", "template": ...}, ...]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        return ChatTemplate(str(tc), named.get("default") or next(iter(named.values())), extra)
    raise TokenizerError(f"{d}: no chat template (looked for chat_template.jinja, chat_template.json and "
                         f"'chat_template' in tokenizer_config.json)")


def load_tokenizer(model_dir: str | Path | None, cfg: PaddleOCRVLConfig) -> TextTokenizer:
    """The model dir's tokenizer (local files only), or the built-in byte tokenizer when
    ``model_dir`` is None. The image tokens must map to the ids config.json names."""
    if model_dir is None:
        return ByteTokenizer(builtin_special_tokens(cfg))
    d = Path(model_dir)
    if (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        try:
            tok = HFTokenizer(Tokenizer.from_file(str(d / "tokenizer.json")), str(d / "tokenizer.json"))
        except Exception as e:
            raise TokenizerError(f"{d / 'tokenizer.json'}: cannot load ({e})") from None
    else:
        try:
            from transformers import AutoTokenizer
            tok = AutoTokenizerAdapter(AutoTokenizer.from_pretrained(str(d), local_files_only=True), str(d))
        except Exception as e:
            raise TokenizerError(f"{d}: no tokenizer.json and transformers' AutoTokenizer cannot load a "
                                 f"tokenizer from it ({e})") from None
    for token, want in ((IMAGE_PLACEHOLDER, cfg.image_token_id), (IMAGE_START, cfg.vision_start_token_id),
                        (IMAGE_END, cfg.vision_end_token_id)):
        got = tok.token_to_id(token)
        if got != want:
            raise TokenizerError(f"{tok.source}: token {token} has id {got}, config.json says {want}")
    log.info("tokenizer from %s", tok.source)
    return tok
