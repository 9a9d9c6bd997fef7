"""Exact per-token explanations (spec §1.5, §3.1): one forward pass, then index look-ups.

At every position the chosen token's logit is split exactly into Σ a_i (W p_i)_y + (W r)_y (+ b_y) by
``prismlm.model.decompose`` on the model's one ``PrismOutput``; each active prototype gets a card (label,
signature tokens, training neighbours). Invariant: ``total − logit`` is float rounding only, and cached
card parts are never stale. Shares, caches and edge cases (none raises): docs/architecture.md.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prismlm.artifacts import model_identity, write_output
from prismlm.errors import ArtifactMismatch, ConfigError, ModelError, UnknownPrototypeError
from prismlm.eval.faithfulness import prototype_choice
from prismlm.explain.index import Labels, Neighbour, PrototypeIndex, PrototypeStats
from prismlm.explain.records import CardDict, ExplanationDict, SliceDict, TokenDict
from prismlm.model import PrismOutput, decompose
from prismlm.model.generation import TEXT_SAMPLING, Sampling, decode_steps
from prismlm.progress import Progress, Reporter

StepGuard = Callable[[], AbstractContextManager[object]]
"""What each model step of a generation runs inside (``contextlib.nullcontext`` by default)."""

if TYPE_CHECKING:
    from prismlm.data.tokenizer import Tokenizer
    from prismlm.model import PrismLM

__all__ = [
    "Explanation",
    "PrototypeCard",
    "PrototypeSlice",
    "TokenExplanation",
    "clear_card_cache",
    "explain",
    "explain_generation",
    "prototype_card",
]


@dataclass
class PrototypeSlice:
    """One active prototype's part of a logit."""

    id: int
    """Prototype id i in [0, K)."""
    activation: float
    """a_{t,i} = relu(cos(z_t, p_i)) ≥ 0."""
    slice: float
    """a_{t,i} (W p_i)_y: its additive part of the chosen token's logit."""
    share: float
    """slice / (Σ|slices| + |residual slice|), signed."""
    label: str | None = None
    """Its label from ``labels.json`` (None: unlabelled)."""
    category: str | None = None
    """Its label category (``morphology``, ``grammar``, …)."""

    def to_dict(self) -> SliceDict:
        return SliceDict(
            id=self.id,
            activation=self.activation,
            slice=self.slice,
            share=self.share,
            label=self.label,
            category=self.category,
        )


@dataclass
class TokenExplanation:
    """The decomposition at one position: ``logit == Σ prototype slices + residual_slice + bias_slice``."""

    position: int
    """Position t in ``Explanation.token_ids`` (0-based)."""
    token_id: int
    """Id of the input token at t."""
    token: str
    """The input token at this position (the last token of the context)."""
    next_id: int
    """Id of the chosen next token y."""
    next_token: str
    """The chosen next token whose logit is explained."""
    chosen_by: str
    """``text`` (the actual next token), ``argmax``, ``sampled`` or ``given``."""
    logit: float
    """ℓ_{t,y} as the forward computed it."""
    prob: float
    """softmax probability of the chosen token."""
    residual_slice: float
    """(W r_t)_y: the part of the logit no prototype carries."""
    residual_share: float
    """residual_slice / (Σ|slices| + |residual slice|), signed."""
    prototypes: list[PrototypeSlice]
    """Every active prototype (a > 0), by decreasing |slice|; inactive ones contribute exactly 0."""
    total: float
    """Σ slices + residual slice + bias slice, summed in the model's dtype."""
    error: float
    """total − logit (float rounding only; ~1e-16 relative in float64)."""
    bias_slice: float = 0.0
    """b_y, the unembedding's bias for the chosen token (0 unless the model's W has a bias, e.g. Phi)."""
    model_top_id: int = -1
    """argmax ℓ_t, the model's own prediction (-1: not computed). The prototypes agree with it when equal to:"""
    prototype_top_id: int = -1
    """argmax ℓ̂_t, ℓ̂ = W ẑ (+ b) (``prismlm.eval.faithfulness``): what the prototypes alone would predict."""
    prototype_top_token: str = ""
    prototype_prob: float = 0.0
    """softmax(ℓ̂_t) of the chosen token y: the probability the prototypes alone give it."""

    def to_dict(self) -> TokenDict:
        return TokenDict(
            position=self.position,
            token_id=self.token_id,
            token=self.token,
            next_id=self.next_id,
            next_token=self.next_token,
            chosen_by=self.chosen_by,
            logit=self.logit,
            prob=self.prob,
            residual_slice=self.residual_slice,
            residual_share=self.residual_share,
            prototypes=[p.to_dict() for p in self.prototypes],
            total=self.total,
            error=self.error,
            bias_slice=self.bias_slice,
            model_top_id=self.model_top_id,
            prototype_top_id=self.prototype_top_id,
            prototype_top_token=self.prototype_top_token,
            prototype_prob=self.prototype_prob,
            token_index=self.position + 1,  # the explained token's index: the views' one convention
        )


@dataclass
class PrototypeCard:
    """What a reader needs to understand one prototype."""

    id: int
    """Prototype id i in [0, K)."""
    label: str | None
    """Its label (None: unlabelled)."""
    category: str | None
    """Its label category."""
    top_tokens: list[tuple[str, float]]
    """Tokens with the largest entries of the signature W p_i, with their values (what it pushes up)."""
    neighbours: list[Neighbour] = field(default_factory=list)
    """Nearest training contexts (needs an index with shards)."""
    stats: PrototypeStats | None = None
    """Activation count, frequency, mean activation, histogram (needs an index)."""
    evidence: dict[str, object] | None = None
    """What the labeller based the label on (``labels.json``'s evidence), or None."""
    bottom_tokens: list[tuple[str, float]] = field(default_factory=list)
    """Tokens with the most negative entries of W p_i, most negative first (what it pushes down)."""

    def to_dict(self) -> CardDict:
        return {
            "id": self.id,
            "label": self.label,
            "category": self.category,
            "top_tokens": [[t, v] for t, v in self.top_tokens],
            "bottom_tokens": [[t, v] for t, v in self.bottom_tokens],
            "neighbours": [n.to_dict() for n in self.neighbours],
            "stats": self.stats,
            "evidence": self.evidence,
        }


@dataclass
class Explanation:
    """A whole text (or generation), position by position, plus a card per prototype used."""

    text: str
    """The explained text (for a generation: prompt and continuation, as decoded)."""
    token_ids: list[int]
    """The tokens the model saw (after truncation)."""
    tokens: list[str]
    """The readable string of each of ``token_ids`` (n,)."""
    positions: list[TokenExplanation]
    """One decomposition per position (n,), in order."""
    prototypes: dict[int, PrototypeCard]
    """A card per prototype active anywhere in the text, by id."""
    truncated_tokens: int = 0
    """Tokens dropped from the front because the input was longer than block_size."""
    prompt_tokens: int | None = None
    """For a generation: how many of ``token_ids`` are the prompt."""
    model_sha256: str | None = None
    """The checkpoint's identity, when given."""
    index: str | None = None
    """Path of the prototype index used, if any."""
    notes: list[str] = field(default_factory=list)
    """What the reader should know: truncation, unverified index, generation settings."""

    @property
    def max_abs_error(self) -> float:
        return max((abs(p.error) for p in self.positions), default=0.0)

    def to_dict(self) -> ExplanationDict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "tokens": self.tokens,
            "truncated_tokens": self.truncated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "model_sha256": self.model_sha256,
            "index": self.index,
            "notes": self.notes,
            "max_abs_error": self.max_abs_error,
            "positions": [p.to_dict() for p in self.positions],
            "prototypes": {str(k): v.to_dict() for k, v in sorted(self.prototypes.items())},
        }

    def to_json(self, path: str | Path | None = None, option: str = "path") -> str:
        text = json.dumps(self.to_dict(), indent=1, ensure_ascii=False)
        if path is not None:
            write_output(path, text + "\n", option=option)
        return text


def _check_index(index: PrototypeIndex, net: PrismLM, model_sha256: str | None) -> list[str]:
    K = net.require_prototypes().num_prototypes
    if index.num_prototypes != K:
        raise ArtifactMismatch(
            f"prototype index{'' if index.path is None else ' ' + str(index.path)} has "
            f"{index.num_prototypes} prototypes, the model has {K}: it was built for "
            f"model {index.manifest['model_sha256']}"
        )
    if model_sha256 is not None:
        index.check(model_sha256=model_sha256)
        return []
    if str(index.manifest["model_sha256"]).startswith("weights:"):
        index.check(model_sha256=model_identity(net))
        return []
    return ["the model was passed without its model_sha256, so the index's model hash was not verified"]


def prototype_card(
    model: PrismLM,
    tokenizer: Tokenizer | None,
    i: int,
    *,
    index: PrototypeIndex | None = None,
    labels: Labels | None = None,
    neighbours: int = 5,
    signature_tokens: int = 10,
) -> PrototypeCard:
    """A card for prototype ``i``: label, signature top tokens and (with an index) neighbourhood and
    activation statistics. An id outside [0, K) raises ``UnknownPrototypeError``."""
    net = model
    if net.prototypes is None:
        raise ModelError("prototype cards need a PRISM model: the dense baseline has no prototypes")
    K = net.prototypes.num_prototypes
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < K:
        raise UnknownPrototypeError(f"unknown prototype id {i!r}: the model has {K} prototypes (ids 0–{K - 1})")
    return _cards(net, tokenizer, [i], index, labels or {}, neighbours, signature_tokens)[i]


def _cards(
    net: PrismLM,
    tokenizer: Tokenizer | None,
    ids: list[int],
    index: PrototypeIndex | None,
    labels: Labels,
    neighbours: int,
    signature_tokens: int,
) -> dict[int, PrototypeCard]:
    if not ids:
        return {}
    tops = _top_tokens(net, tokenizer, ids, signature_tokens)
    stats = index.stats_of(ids) if index is not None else {}
    nbs = index.neighbours_of(ids, neighbours) if index is not None else {}
    cards = {}
    for i in ids:
        lab = labels.get(i, {})
        cards[i] = PrototypeCard(
            id=i,
            label=lab.get("label"),
            category=lab.get("category"),
            evidence=lab.get("evidence"),
            top_tokens=list(tops[i][0]),
            bottom_tokens=list(tops[i][1]),
            neighbours=nbs.get(i, []),
            stats=stats.get(i),
        )
    return cards


# ----- cached card parts -------------------------------------------------------------------------------
_WeightsState = tuple[tuple[int, int, tuple[int, ...], torch.dtype, torch.device], ...]
"""Per weight tensor: (storage address, ``_version``, shape, dtype, device)."""
_SIG_BLOCK_ELEMS = 1 << 22
"""Entries of one (prototypes × V) signature block: 16 MiB in float32. Never K × V at once."""


class _SignatureCache:
    """The top signature tokens ``(token, (W p_i)_token)`` of a model's prototypes, valid for one state of
    the two weights that determine them: the prototype bank and the unembedding ``lm_head.weight``.

    The state is each tensor's identity (a weak reference: replacing a parameter invalidates), storage
    address, shape, dtype, device and ``_version`` — which every in-place update (an optimizer step,
    ``load_state_dict``, ``weight.add_(…)`` under ``no_grad``) increments. Writes through ``.data`` bypass
    the version counter: call ``clear_card_cache(model)`` after them."""

    __slots__ = ("refs", "state", "tops", "pinned")

    def __init__(self, tensors: tuple[torch.Tensor, torch.Tensor], state: _WeightsState) -> None:
        self.refs = tuple(weakref.ref(t) for t in tensors)
        self.state = state
        self.tops: dict[tuple[int, int, int], dict[int, _TopBottom]] = {}
        """(id(tokenizer), tokens, valid vocabulary) → prototype id → its top and bottom tokens with their
        values."""
        self.pinned: dict[int, object] = {}  # tokenizers by id() (pass-through): ids stay unique while cached

    def valid_for(self, tensors: tuple[torch.Tensor, torch.Tensor], state: _WeightsState) -> bool:
        return self.state == state and all(r() is t for r, t in zip(self.refs, tensors))


_TopBottom = tuple[tuple[tuple[str, float], ...], tuple[tuple[str, float], ...]]
"""(top tokens, bottom tokens) of one signature, each as (token string, value)."""
_SIGNATURES: weakref.WeakKeyDictionary[PrismLM, _SignatureCache] = weakref.WeakKeyDictionary()
_TOKEN_STRINGS: weakref.WeakKeyDictionary[Tokenizer, dict[int, str]] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def _weights_state(net: PrismLM) -> tuple[tuple[torch.Tensor, torch.Tensor], _WeightsState]:
    p, w = net.require_prototypes().weight, net.lm_head.weight
    return (p, w), tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device) for t in (p, w))


def clear_card_cache(model: PrismLM | None = None) -> None:
    """Forget the cached signature top tokens of ``model`` (None: of every model, and the memoised token
    strings of every tokenizer). Needed only after writing weights through ``.data`` (which does not bump
    the tensors' version counters); every other change of the prototype bank or of ``lm_head`` is
    detected. (A ``PrototypeIndex`` keeps its own snippet cache: ``index.clear_cache()``.)"""
    with _CACHE_LOCK:
        if model is None:
            _SIGNATURES.clear()
            _TOKEN_STRINGS.clear()
        else:
            _SIGNATURES.pop(model, None)


def _token_strs(tokenizer: Tokenizer | None, ids: Sequence[int]) -> list[str]:
    """The readable string of each id (``tokenizer.id_to_token``; ``<id>`` without a tokenizer), memoised
    per tokenizer: an id's string never changes."""
    if tokenizer is None:
        return [f"<{i}>" for i in ids]
    try:
        memo = _TOKEN_STRINGS.get(tokenizer)
        if memo is None:
            memo = _TOKEN_STRINGS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no memo
        memo = {}
    out = []
    for i in ids:
        s = memo.get(i)
        if s is None:
            s = memo[i] = tokenizer.id_to_token(i)
        out.append(s)
    return out


@torch.no_grad()
def _top_tokens(
    net: PrismLM,
    tokenizer: Tokenizer | None,
    ids: list[int],
    m: int,
) -> dict[int, _TopBottom]:
    """The ``m`` largest and the ``m`` most negative entries of the signature W p_i over the real tokens
    (padded ids excluded), as (token string, value), for each prototype id in ``ids``: cached per model
    state (``_SignatureCache``); the missing ones are computed together, in blocks of at most
    ``_SIG_BLOCK_ELEMS`` entries, keeping only those 2m per prototype."""
    tensors, state = _weights_state(net)
    V = int(tensors[1].shape[0])
    valid = min(tokenizer.vocab_size, V) if tokenizer is not None else V
    with _CACHE_LOCK:
        cache = _SIGNATURES.get(net)
        if cache is None or not cache.valid_for(tensors, state):
            cache = _SIGNATURES[net] = _SignatureCache(tensors, state)
        tops = cache.tops.setdefault((id(tokenizer), m, valid), {})
        cache.pinned[id(tokenizer)] = tokenizer
        missing = [i for i in ids if i not in tops]
    if missing:
        rows = max(1, _SIG_BLOCK_ELEMS // V)
        sel = torch.tensor(missing, device=tensors[0].device)
        new: dict[int, _TopBottom] = {}
        for s in range(0, len(missing), rows):
            sig = net.signatures(sel[s : s + rows]).float()[:, :valid]  # (rows, V'): padded ids are not tokens
            vals_t, toks_t = sig.topk(min(m, valid), dim=-1)  # (rows, m)
            low_v, low_t = sig.topk(min(m, valid), dim=-1, largest=False)  # (rows, m), most negative first
            for i, toks, vals, lt, lv in zip(
                missing[s : s + rows], toks_t.tolist(), vals_t.tolist(), low_t.tolist(), low_v.tolist()
            ):
                new[i] = (tuple(zip(_token_strs(tokenizer, toks), vals)), tuple(zip(_token_strs(tokenizer, lt), lv)))
        with _CACHE_LOCK:
            if _weights_state(net)[1] == state:  # the weights did not change meanwhile
                tops.update(new)
        return {i: tops[i] if i in tops else new[i] for i in ids}
    return {i: tops[i] for i in ids}


@dataclass(frozen=True)
class _Evidence:
    """What the cards of an explanation attach (the keyword arguments of ``explain``)."""

    index: PrototypeIndex | None
    """Index for neighbourhoods, statistics and (default) labels; None: signatures only."""
    labels: Labels
    """Prototype id → {label, category}."""
    model_sha256: str | None
    """The checkpoint's identity, checked against the index and recorded."""
    neighbours: int
    """Training snippets per card."""
    signature_tokens: int
    """Top (and bottom) tokens of W p_i per card."""


@dataclass
class _Chosen:
    """The n tokens an explanation covers and the next token chosen at each position."""

    ids: list[int]
    """(n,) the tokens the model sees."""
    targets: list[int]
    """(n,) the chosen next token at each position."""
    how: list[str]
    """(n,) how each was chosen: ``text``, ``argmax``, ``sampled`` or ``given``."""
    text: str
    truncated: int
    """Tokens dropped from the front (input longer than the context window)."""
    notes: list[str]


def _require_prism(model: PrismLM) -> PrismLM:
    if not model.is_prism:
        raise ModelError("explain needs a PRISM model: the dense baseline has no prototypes to explain with")
    return model


def _evidence(
    net: PrismLM,
    index: PrototypeIndex | None,
    labels: Labels | None,
    model_sha256: str | None,
    neighbours: int,
    signature_tokens: int,
) -> tuple[_Evidence, list[str]]:
    """The checked evidence of a call (the index against the model; labels from the index by default) and
    the notes the check left."""
    notes: list[str] = []
    if index is not None:
        notes += _check_index(index, net, model_sha256)
        if labels is None:
            labels = index.labels()
    return _Evidence(index, labels or {}, model_sha256, neighbours, signature_tokens), notes


def _input_ids(
    net: PrismLM, tokenizer: Tokenizer | None, text_or_ids: str | Sequence[int] | torch.Tensor
) -> tuple[list[int], str]:
    """(token ids, text) of a text or of token ids; ids outside the vocabulary raise ``ModelError``."""
    if isinstance(text_or_ids, str):
        text = text_or_ids
        if text and tokenizer is None:
            raise ConfigError(
                "explain needs a tokenizer to encode text: pass `tokenizer=` (the checkpoint's) or token ids"
            )
        ids = tokenizer.encode(text) if text and tokenizer is not None else []
    else:
        seq = text_or_ids.reshape(-1).tolist() if isinstance(text_or_ids, torch.Tensor) else text_or_ids
        ids = [int(t) for t in seq]
        text = tokenizer.decode(ids) if tokenizer is not None else ""
    V = net.config.vocab_size
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise ModelError(f"token id(s) {bad[:5]} outside the model's vocabulary [0, {V})")
    return ids, text


@torch.no_grad()
def explain(
    model: PrismLM,
    tokenizer: Tokenizer | None,
    text_or_ids: str | Sequence[int] | torch.Tensor,
    *,
    model_sha256: str | None = None,
    index: PrototypeIndex | None = None,
    labels: Labels | None = None,
    targets: Sequence[int] | None = None,
    next_token: int | None = None,
    neighbours: int = 5,
    signature_tokens: int = 10,
    _chosen_by: Sequence[str] | None = None,
) -> Explanation:
    """Explain every next-token logit of a text: active prototypes, activations, slices, residual.

    ``model``: a PRISM ``PrismLM``; ``tokenizer``: its tokenizer (None: token ids only, shown as
    ``<id>``); ``model_sha256``: the checkpoint's ``manifest["model_sha256"]``, checked against the index
    and recorded in the explanation. ``text_or_ids``: a string or token ids. ``targets``: the chosen
    token at every position (default: the text's next token, and for the last position ``next_token`` or
    the model's argmax). ``labels``: prototype id → {label, category} (default: the index's
    ``labels.json``). Edge cases are listed in the module docstring; they never raise.
    """
    net = _require_prism(model)
    ev, notes = _evidence(net, index, labels, model_sha256, neighbours, signature_tokens)
    ids, text = _input_ids(net, tokenizer, text_or_ids)
    chosen_by = list(_chosen_by) if _chosen_by is not None else None
    if not ids:
        ids = [tokenizer.eot_id if tokenizer is not None else 0]
        notes.append("empty input: explaining the first prediction from the end-of-text token")
    truncated = max(0, len(ids) - net.config.block_size)
    if truncated:
        ids = ids[truncated:]
        targets = list(targets)[truncated:] if targets is not None else None
        chosen_by = chosen_by[truncated:] if chosen_by is not None else None
        notes.append(f"input longer than the context window: the first {truncated} tokens were dropped")
    x = torch.tensor([ids], dtype=torch.long, device=next(net.parameters()).device)  # (1, n)
    out = net(x)  # the model's one PrismOutput
    n = len(ids)
    if targets is not None:
        tgt = [int(t) for t in targets]
        if len(tgt) != n:
            raise ConfigError(f"targets must give one token per position ({n}), got {len(tgt)}")
        how = chosen_by or ["given"] * n
    else:
        last = "given"
        if next_token is None:
            valid = tokenizer.vocab_size if tokenizer is not None else net.config.vocab_size
            next_token, last = int(out.logits[0, -1, :valid].argmax()), "argmax"
        tgt = ids[1:] + [int(next_token)]
        how = chosen_by or (["text"] * (n - 1) + [last])
    return _explain_output(net, tokenizer, out, _Chosen(ids, tgt, how, text, truncated, notes), ev)


def _by_abs_slice(x: tuple[int, float, float]) -> float:
    return -abs(x[2])


@torch.no_grad()
def _explain_output(
    net: PrismLM, tokenizer: Tokenizer | None, out: PrismOutput, chosen: _Chosen, ev: _Evidence
) -> Explanation:
    """The explanation of ``chosen.ids`` (n tokens) from the model's output for them: ``out`` holds
    (1, n, ·) logits, prototype indices, activations and residuals."""
    assert out.activations is not None and out.indices is not None
    ids, tgt = chosen.ids, chosen.targets
    y = torch.tensor([tgt], dtype=torch.long, device=out.logits.device)  # (1, n)
    dec = decompose(net, out, y)
    # log-probabilities in the logits' precision (at least float32): the logits carry no more than that
    lg = out.logits[0]
    logp = torch.log_softmax(lg.to(torch.promote_types(lg.dtype, torch.float32)), dim=-1)
    logp = logp.gather(-1, y[0, :, None]).squeeze(-1)  # (n,)
    slices_t = dec.prototype_slices[0]  # (n, k)
    resid_t = dec.residual_slice[0]  # (n,)
    total_t = slices_t.sum(-1) + resid_t + dec.bias_slice[0]  # (n,) in the model's dtype
    error_t = total_t - dec.logit[0]  # (n,) in the model's dtype
    denom_t = slices_t.abs().sum(-1) + resid_t.abs()  # (n,)
    # Python lists in one transfer each (not one tensor indexing per value); float64 holds every value of
    # a float32/bf16 tensor exactly, so these are float() of each element.
    total, error, logit, prob, resid, denom, bias = torch.stack(
        [v.double() for v in (total_t, error_t, dec.logit[0], logp.exp(), resid_t, denom_t, dec.bias_slice[0])]
    ).tolist()
    acts, slices = torch.stack([out.activations[0].double(), slices_t.double()]).tolist()  # (n, k) each
    pids = out.indices[0].tolist()  # (n, k)
    valid = tokenizer.vocab_size if tokenizer is not None else net.config.vocab_size
    p_top, p_prob = prototype_choice(net, out, y, valid)  # (1, n) each: argmax W ẑ (+ b), its p̂ of y
    p_top_l, m_top, p_prob_l = p_top[0].tolist(), lg[:, :valid].argmax(-1).tolist(), p_prob[0].tolist()
    used = sorted({i for row, a_row in zip(pids, acts) for i, a in zip(row, a_row) if a > 0})
    shown = set(ids) | set(tgt) | set(p_top_l)
    tok_strs = dict(zip(shown, _token_strs(tokenizer, list(shown))))
    lab_of = {i: (lab.get("label"), lab.get("category")) for i in used if (lab := ev.labels.get(i))}
    none = (None, None)
    positions = []
    for t in range(len(ids)):
        d = denom[t] or 1.0
        protos = []
        # active prototypes only (a = 0 gives a slice of exactly 0), by decreasing |slice| (stable)
        for i, a, sl in sorted([x for x in zip(pids[t], acts[t], slices[t]) if x[1] > 0], key=_by_abs_slice):
            label, category = lab_of.get(i, none)
            protos.append(PrototypeSlice(i, a, sl, sl / d, label, category))  # id, activation, slice, share, …
        positions.append(
            TokenExplanation(
                position=t,
                token_id=ids[t],
                token=tok_strs[ids[t]],
                next_id=tgt[t],
                next_token=tok_strs[tgt[t]],
                chosen_by=chosen.how[t],
                logit=logit[t],
                prob=prob[t],
                residual_slice=resid[t],
                residual_share=resid[t] / d,
                prototypes=protos,
                total=total[t],
                error=error[t],
                bias_slice=bias[t],
                model_top_id=m_top[t],
                prototype_top_id=p_top_l[t],
                prototype_top_token=tok_strs[p_top_l[t]],
                prototype_prob=p_prob_l[t],
            )
        )
    index = ev.index
    return Explanation(
        text=chosen.text,
        token_ids=ids,
        tokens=[tok_strs[i] for i in ids],
        positions=positions,
        prototypes=_cards(net, tokenizer, used, index, ev.labels, ev.neighbours, ev.signature_tokens),
        truncated_tokens=chosen.truncated,
        model_sha256=ev.model_sha256,
        index=str(index.path) if index is not None and index.path is not None else None,
        notes=chosen.notes + _edit_notes(out),
    )


def _edit_notes(out: PrismOutput) -> list[str]:
    """A note naming the prototypes a residual-projecting suppression took out of the residual (the residual
    slices shown are those of the edited residual r' = r − Q Qᵀ r), else none."""
    ids = out.residual_projected_ids
    if not ids:
        return []
    shown = ", ".join(str(i) for i in ids[:10]) + (" …" if len(ids) > 10 else "")
    what = {
        "mean": "the unit mean direction (Q = u)",
        "contrast": "the contrast direction (Q = v, their mean minus the bank's mean)",
    }.get(str(out.residual_projection_mode), "the span")
    return [
        f"the residual is projected off {what} of {len(ids)} suppressed prototypes ({shown}): each residual "
        "slice is that of the edited residual r' = r − Q Qᵀ r"
    ]


def explain_generation(
    model: PrismLM,
    tokenizer: Tokenizer,
    prompt: str,
    n: int = 20,
    *,
    sampling: Sampling | None = None,
    model_sha256: str | None = None,
    index: PrototypeIndex | None = None,
    labels: Labels | None = None,
    neighbours: int = 5,
    signature_tokens: int = 10,
    stop_id: int | Sequence[int] | None = None,
    guard: StepGuard = nullcontext,
    progress: Progress = False,
) -> Explanation:
    """Sample ``n`` tokens after ``prompt`` (as ``model.generate`` does, with the KV cache, at ``sampling``,
    default ``TEXT_SAMPLING``) and explain each sampled token's logit (the sampled tokens are the
    chosen tokens). ``stop_id``: end the generation once this token (or one of these: the end-of-turn
    tokens, ``Tokenizer.end_of_turn_ids``) is sampled; it is the
    last token explained. ``guard``: what each model step runs inside (a server passes its model lock and
    the request's interventions, so that other requests run between tokens); ``progress`` gets each token
    (and may raise to stop). The other keywords are those of ``explain``.

    While prompt + n − 1 ≤ block_size the explanation is read off the generation's own forward
    outputs — the prompt's prefill (every position) and each cached decode step (one position) — so it
    decomposes exactly the logits the tokens were sampled from, and no second forward runs. Beyond,
    generation slides its window (every position shifts), and the explanation is one forward over the
    last ``block_size`` tokens.
    """
    s = sampling or TEXT_SAMPLING
    stops = frozenset([int(stop_id)] if isinstance(stop_id, int) else [int(i) for i in stop_id or ()])
    if n < 1:
        raise ConfigError(f"`n` (tokens to generate) must be >= 1, got {n}", param="n")
    net = _require_prism(model)
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]
    x = torch.tensor([ids], device=next(net.parameters()).device)  # (1, p)
    p = len(ids)
    ev, notes = _evidence(net, index, labels, model_sha256, neighbours, signature_tokens)
    if p + n - 1 > net.config.block_size:
        with guard():
            return _explain_long_generation(net, tokenizer, x, n, s, stops, ev)
    outs, new = [], []
    with torch.no_grad(), Reporter(progress, "generate", n, unit="tok") as bar:
        # the model's decode loop (what generate runs): its inference-mode tensors are joined by _concat
        # outside inference mode, which gives ordinary tensors without generate_steps' per-step copies
        steps = decode_steps(net, x, n, s, use_cache=True, prefill_logits=True)
        while True:
            with guard():  # one step at a time: the KV cache holds the hidden states, which no multiplier moves
                step = next(steps, None)
            if step is None:
                break
            outs.append(step[0])
            new.append(step[1])
            bar.update(1)
            if int(step[1]) in stops:
                break
    with torch.no_grad(), guard():
        full = ids + torch.cat(new, dim=1)[0].tolist()  # p + n tokens
        how = ["text"] * (p - 1) + ["sampled"] * len(new)  # position t chooses full[t + 1]
        # The steps' outputs cover positions 0 … p − 1 (prefill), then p … p + n − 2 (one per decode step).
        out = _concat(outs)
        if out.indices is None:  # unmodified model: the steps skipped the prototype layer; one call for all
            out = net.add_prototype_fields(out)
        notes.append(f"generated {len(new)} tokens ({s.describe()})")
        chosen = _Chosen(full[:-1], full[1:], how, tokenizer.decode(full), 0, notes)
        expl = _explain_output(net, tokenizer, out, chosen, ev)
    expl.prompt_tokens = p
    return expl


def _explain_long_generation(
    net: PrismLM,
    tokenizer: Tokenizer,
    x: torch.Tensor,
    n: int,
    sampling: Sampling,
    stops: frozenset[int],
    ev: _Evidence,
) -> Explanation:
    """``explain_generation`` past the context window: generate x (1, p) on, then one ``explain`` of the
    last window with the sampled tokens as the chosen ones."""
    p = x.shape[1]
    full = net.generate(x, n, sampling)[0].tolist()
    end = next((j for j in range(p, len(full)) if full[j] in stops), None)
    if end is not None:
        full = full[: end + 1]
    n = len(full) - p
    expl = explain(
        net,
        tokenizer,
        full[:-1],
        model_sha256=ev.model_sha256,
        index=ev.index,
        labels=ev.labels,
        targets=full[1:],
        neighbours=ev.neighbours,
        signature_tokens=ev.signature_tokens,
        _chosen_by=["text"] * (p - 1) + ["sampled"] * n,  # position t chooses full[t + 1]
    )
    expl.prompt_tokens = max(0, p - expl.truncated_tokens)
    expl.text = tokenizer.decode(full[expl.truncated_tokens :])
    expl.notes.append(f"generated {n} tokens ({sampling.describe()})")
    return expl


def _concat(outs: list[PrismOutput]) -> PrismOutput:
    """One ``PrismOutput`` (1, n, ·) of a whole sequence from the outputs of consecutive cached steps of
    ``generate_steps``: per-token fields joined along the sequence, ``proto_max_cos`` the max over steps.
    Prototype fields stay None when the steps did not compute them."""

    def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if ts[0] is None else torch.cat([t for t in ts if t is not None], dim=1)

    logits, hidden = cat([o.logits for o in outs]), cat([o.hidden for o in outs])
    assert logits is not None and hidden is not None
    first = outs[0]
    pmc = [o.proto_max_cos for o in outs if o.proto_max_cos is not None]
    return PrismOutput(
        logits=logits,
        hidden=hidden,
        indices=cat([o.indices for o in outs]),
        activations=cat([o.activations for o in outs]),
        residual=cat([o.residual for o in outs]),
        token_max_cos=cat([o.token_max_cos for o in outs]),
        proto_max_cos=torch.stack(pmc).amax(0) if pmc else None,
        prototype_multipliers=first.prototype_multipliers,
        residual_removed=cat([o.residual_removed for o in outs]),
        residual_projected_ids=first.residual_projected_ids,
        residual_projection_mode=first.residual_projection_mode,
    )
