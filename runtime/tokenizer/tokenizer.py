"""The model's tokenizer and chat template.

Built from a GGUF file's metadata (vocabulary, merges, token types, pre-tokenizer name) or from a
Hugging Face directory's ``tokenizer.json``. The GGUF path builds a ``tokenizers`` byte-level BPE
once and caches it as ``tokenizer.json`` next to the dequantized weights.

Pre-tokenizers follow the rule the vocabulary was trained with, looked up by
``tokenizer.ggml.pre``. For SmolLM (``smollm``) digits are split one by one *before* the GPT-2
byte-level split, as in the model's own ``tokenizer.json`` and llama.cpp, so ``"a   1"`` becomes
``a | ĠĠĠ | 1``, not ``a | ĠĠ | Ġ | 1`` as a plain GPT-2 split would give.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

from phloem.runtime.model_files import ModelSource, default_model_path, gguf_cache_dir, read_gguf
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["Tokenizer", "load_tokenizer", "render_chat_template"]

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_EOS_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>")
_TOKENIZER_FILE, _META_FILE = "tokenizer.json", "tokenizer_meta.json"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """Pre-tokenizer for a ``tokenizer.ggml.pre`` name (GPT-2 byte-level split by default)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre or "")
    if split is None:
        return byte_level
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_from_gguf_metadata(md: dict[str, Any]) -> tuple[RustTokenizer, dict[str, Any]]:
    """A byte-level BPE ``tokenizers.Tokenizer`` and its meta (special ids, template) from GGUF metadata."""
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported yet (only byte-level 'gpt2')"
        )
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    spelled = [t if set(t) <= alphabet else "".join(spell[b] for b in t.encode()) for t in tokens]
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges, fuse_unk=False)
    tok = RustTokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(md.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(spelled, types) if ty == _CONTROL]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(spelled, types)
            if ty == _USER_DEFINED
        ]
    )
    meta = {
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
        "unk_token_id": md.get("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": md.get("tokenizer.chat_template"),
    }
    return tok, meta


class Tokenizer:
    """Encode/decode, special ids and the chat template of one model.

    Construct with :meth:`from_gguf`, :meth:`from_hf_dir` or :func:`load_tokenizer`.
    """

    def __init__(self, backend: RustTokenizer, meta: dict[str, Any]) -> None:
        self._tok = backend
        self._meta = meta
        self.chat_template: str | None = meta.get("chat_template")
        self.bos_token_id: int | None = meta.get("bos_token_id")
        eos = meta.get("eos_token_id")
        self.eos_token_id: int | None = eos
        pad = meta.get("pad_token_id")
        self.pad_token_id: int | None = pad if pad is not None else eos
        self.add_bos_token: bool = bool(meta.get("add_bos_token", False))
        named = {self._tok.token_to_id(n) for n in _EOS_NAMES}
        self.eos_token_ids: set[int] = {i for i in named | {eos} if i is not None}
        added = self._tok.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, t in added.items() if t.special)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str, *, use_cache: bool = True) -> Tokenizer:
        """Build from a GGUF file's metadata (cached as ``tokenizer.json`` after the first build)."""
        folder = gguf_cache_dir(path)
        tok_path, meta_path = os.path.join(folder, _TOKENIZER_FILE), os.path.join(folder, _META_FILE)
        if use_cache and os.path.exists(tok_path) and os.path.exists(meta_path):
            with open(meta_path) as f:
                return cls(RustTokenizer.from_file(tok_path), json.load(f))
        backend, meta = build_from_gguf_metadata(read_gguf(path).metadata)
        if use_cache:
            _write_atomic(tok_path, backend.to_str())
            _write_atomic(meta_path, json.dumps(meta))
        return cls(backend, meta)

    @classmethod
    def from_hf_dir(cls, folder: str) -> Tokenizer:
        """Build from ``tokenizer.json`` and ``tokenizer_config.json`` of a Hugging Face directory."""
        with open(os.path.join(folder, "tokenizer.json")) as f:
            tokenizer_json = f.read()
        cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if cfg.get("chat_template") is None and os.path.exists(jinja_path):
            with open(jinja_path) as f:
                cfg = {**cfg, "chat_template": f.read()}
        gen = _read_json(os.path.join(folder, "generation_config.json"))
        return cls.from_hf_files(tokenizer_json, cfg, gen)

    @classmethod
    def from_hf_files(
        cls,
        tokenizer_json: str | dict[str, Any],
        tokenizer_config: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
    ) -> Tokenizer:
        """Build from the contents of a Hugging Face folder's files: ``tokenizer.json`` (text or
        parsed), ``tokenizer_config.json`` and, optionally, ``generation_config.json`` (its
        ``eos_token_id``). The inverse of :meth:`to_hf_files`."""
        text = tokenizer_json if isinstance(tokenizer_json, str) else json.dumps(tokenizer_json)
        backend = RustTokenizer.from_str(text)
        cfg = tokenizer_config
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)

        def token_id(key: str) -> int | None:
            value = cfg.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            return backend.token_to_id(value) if value else None

        eos = (generation_config or {}).get("eos_token_id")
        meta = {
            "bos_token_id": token_id("bos_token"),
            "eos_token_id": token_id("eos_token") if token_id("eos_token") is not None else _first(eos),
            "pad_token_id": token_id("pad_token"),
            "add_bos_token": bool(cfg.get("add_bos_token", False)),
            "chat_template": template,
        }
        out = cls(backend, meta)
        out.eos_token_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return out

    def to_hf_files(self) -> dict[str, Any]:
        """This tokenizer as the contents of a Hugging Face folder's files, so a remote client can
        rebuild it with :meth:`from_hf_files`: ``tokenizer_json`` (the parsed ``tokenizer.json``),
        ``tokenizer_config`` (special tokens by name, ``add_bos_token``, ``chat_template``) and
        ``generation_config`` (every end-of-sequence id)."""

        def name(i: int | None) -> str | None:
            return self._tok.id_to_token(i) if i is not None else None

        return {
            "tokenizer_json": json.loads(self._tok.to_str()),
            "tokenizer_config": {
                "bos_token": name(self.bos_token_id),
                "eos_token": name(self.eos_token_id),
                "pad_token": name(self._meta.get("pad_token_id")),
                "add_bos_token": self.add_bos_token,
                "chat_template": self.chat_template,
            },
            "generation_config": {"eos_token_id": sorted(self.eos_token_ids)},
        }

    # ---- encode / decode ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_bytes(self) -> int | None:
        """Most bytes of text one token stands for: the longest vocabulary entry, as bytes of
        text (a byte-level piece such as ``Ġab`` is the 3 bytes `` ab``; an added token is its
        literal content). None when unknown: a normalizer may rewrite the text before it is
        split, so its length says nothing of the token count."""
        if self._tok.normalizer is not None:
            return None
        byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        alphabet = set(_byte_alphabet().values()) if byte_level else set()
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        longest = 0
        for piece in self._tok.get_vocab(with_added_tokens=True):
            one_per_byte = piece not in added and set(piece) <= alphabet
            longest = max(longest, len(piece) if one_per_byte else len(piece.encode()))
        return longest or None

    def token_floor(self, text: str, add_special_tokens: bool = False) -> int:
        """Fewest tokens :meth:`encode` can return for ``text``, from its length alone (0 when
        :attr:`max_token_bytes` is unknown): every token covers at most ``max_token_bytes``
        bytes of it. Lets a caller refuse an impossible prompt without encoding it."""
        longest = self.max_token_bytes
        if longest is None:
            return 0
        bos = add_special_tokens and self.add_bos_token and self.bos_token_id is not None
        return -(-len(text.encode()) // longest) + int(bos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are matched whole.

        ``add_special_tokens`` prepends BOS when the model asks for it (``add_bos_token``).
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """:meth:`encode` of every text, in one call: the Rust tokenizer releases the GIL and
        spreads the texts over its threads."""
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        bos = self.bos_token_id if add_special_tokens and self.add_bos_token else None
        return [e.ids if bos is None else [bos, *e.ids] for e in encs]

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """Text of ``ids``.

        ``spaces_between_special_tokens`` is accepted for API compatibility; byte-level BPE joins
        special tokens without spaces either way, as Hugging Face fast tokenizers do.
        """
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Vocabulary strings (byte-level spelling, e.g. ``Ġworld``) of ``ids``."""
        return [self._tok.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def backend(self) -> RustTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @cached_property
    def hf(self) -> PreTrainedTokenizerFast:
        """A ``transformers.PreTrainedTokenizerFast`` over the same tokenizer (for grammar engines)."""
        from transformers import PreTrainedTokenizerFast

        def name(i: int | None) -> str | None:
            return self._tok.id_to_token(i) if i is not None else None

        return PreTrainedTokenizerFast(
            tokenizer_object=self._tok,
            bos_token=name(self.bos_token_id),
            eos_token=name(self.eos_token_id),
            pad_token=name(self.pad_token_id),
            chat_template=self.chat_template,
            clean_up_tokenization_spaces=False,
        )

    # ---- chat template ------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` with the model's jinja2 chat template (sandboxed).

        Parameters
        ----------
        messages:
            ``[{"role": ..., "content": ...}, ...]``.
        add_generation_prompt:
            End with the header that starts the assistant's turn.
        tools:
            Tool (function) schemas, for templates that render them.
        **extra:
            Further template variables (e.g. ``enable_thinking``).

        Raises
        ------
        ValueError
            When the model has no chat template, or the template calls ``raise_exception``.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template")

        def name(i: int | None) -> str:
            return (self._tok.id_to_token(i) or "") if i is not None else ""

        return render_chat_template(
            self.chat_template,
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=name(self.bos_token_id),
            eos_token=name(self.eos_token_id),
            **extra,
        )


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None) -> Tokenizer:
    """Tokenizer for a resolved model; a dummy shape with the default model's vocabulary size
    borrows the default model's tokenizer. ``tokenizer_path`` (a GGUF file or a folder with
    ``tokenizer.json``) overrides both."""
    if tokenizer_path:
        if tokenizer_path.endswith(".gguf"):
            return Tokenizer.from_gguf(tokenizer_path)
        return Tokenizer.from_hf_dir(tokenizer_path)
    if source.kind == "gguf":
        return Tokenizer.from_gguf(source.path)
    if source.kind == "safetensors":
        return Tokenizer.from_hf_dir(source.path)
    from phloem.runtime.models.config import ModelConfig

    default = Tokenizer.from_gguf(default_model_path())
    if ModelConfig.dummy(source.path).vocab_size != default.vocab_size:
        raise ValueError(f"dummy shape {source.path!r} has no tokenizer; pass input ids directly")
    return default


def render_chat_template(template: str, **variables: Any) -> str:
    """Render a Hugging Face style chat template in a sandboxed jinja2 environment.

    Provides what such templates expect: ``raise_exception(msg)``, ``strftime_now(fmt)``, a
    ``tojson`` filter that keeps non-ASCII text, ``trim_blocks`` and ``lstrip_blocks``.
    """
    return _compile_template(template).render(**variables)


@lru_cache(maxsize=32)
def _compile_template(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _first(value: Any) -> int | None:
    return value[0] if isinstance(value, list) else value


def _write_atomic(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
