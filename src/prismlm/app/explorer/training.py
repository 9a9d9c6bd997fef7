"""The explorer's Training data view: the training sequences that most influenced a completion, with the
prototypes that connect them; and the Document view, where such a sequence (or a neighbour) came from.

Invariant: a document is addressed by its index in the run's own training shard, never by a path; an
item's |prototype shares| and |rest_share| add up to 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple, TypedDict

from prismlm.app.attribution import attribute_text
from prismlm.app.explorer.limits import UnknownDocumentError
from prismlm.app.explorer.plain import Plain
from prismlm.app.explorer.session import Session
from prismlm.errors import ConfigError
from prismlm.progress import Progress
from prismlm.tda.attribute import AttributedSequence, Attribution, QuerySpec, SearchSpec, attribute, make_query

__all__ = [
    "DocumentView",
    "ItemPrototype",
    "MeasuredToken",
    "TrainingItem",
    "TrainingView",
    "document_view",
    "training_query",
    "training_view",
]


class MeasuredToken(TypedDict):
    index: int
    token: str


class ItemPrototype(TypedDict):
    """A prototype connecting a training sequence to the query."""

    id: int
    contribution: float
    share: float
    """contribution / (Σ listed |contribution| + |rest|), signed."""
    label: str | None


class TrainingItem(TypedDict):
    """One influential training sequence, its snippet split around the marked token."""

    rank: int
    sequence: int
    doc_id: str | None
    doc_index: int | None
    score: float
    relative: float
    """score / max |score| shown, in [−1, 1]."""
    before: str
    target: str
    after: str
    prototypes: list[ItemPrototype]
    rest: float
    """score − Σ listed contributions (the other prototypes' net; 0 for a rescored score)."""
    rest_share: float


@dataclass
class TrainingView(Plain):
    """What ``Explorer.training`` returns: the most influential training sequences, best first."""

    prompt: str
    completion: str
    measured: list[MeasuredToken]
    """The measured tokens: what per-token filtering picks from."""
    token: int | None
    """The measured token the attribution is restricted to (None: all)."""
    method: str
    """How the scores were computed (``prismlm.tda.attribute.Attribution.method``)."""
    num_train: int
    """Training sequences scored."""
    query_loss: float
    """Summed cross-entropy of the measured tokens."""
    items: list[TrainingItem]
    seconds: float
    """Wall time of the whole request (a gradient build without a cache included)."""
    notes: list[str]


@dataclass
class DocumentView(Plain):
    """What ``Explorer.document`` returns: a window of one training document, the target token marked."""

    doc_index: int
    doc_id: str
    position: int | None
    """The target token's position in the document (None: the window starts at the document's start)."""
    before: str
    target: str
    after: str
    start: int
    """Token position of the first shown token in the document."""
    length: int
    """Tokens in the whole document."""


def split_snippet(snippet: str) -> tuple[str, str, str]:
    """``…before⟦target⟧after…`` → (before, target, after); the whole text as ``before`` when unmarked."""
    if "⟦" in snippet and "⟧" in snippet:
        b, rest = snippet.split("⟦", 1)
        t, a = rest.split("⟧", 1)
        return b, t, a
    return snippet, "", ""


def training_is_slow(s: Session) -> bool:
    """Whether a training request would first build gradients over the training shard (no attribution cache,
    and none built yet): minutes on a real model, so the explorer runs it as a job."""
    return not s.has_cache and not s.full_gradients_ready


def slow_training_message(s: Session) -> str:
    """What a slow training request says before it starts: what it does, that it takes a while, the fast path."""
    return (
        f"no attribution cache: building exact gradients of the first {s.limits.full_attribution_sequences:,} "
        f"training sequences first (two passes over them: seconds on a toy model, minutes on a real one; "
        f"other views keep answering meanwhile). The fast path: `prism attribute-cache {s.run.path}` "
        f"(the explorer picks the cache up without a restart)"
    )


class Query(NamedTuple):
    """A training request's measured tokens, checked: the ids attributed and how many of their last are measured."""

    measured: list[MeasuredToken]
    sel: list[int]
    n_measure: int


def training_query(s: Session, prompt: str, completion: str, *, token: int | None, top: int) -> Query:
    """The checks of a training request (its limits, ``token`` among the measured tokens) and what it measures:
    quick, so a request that would be refused is refused before any job is queued."""
    s.limits.check_text(prompt + completion, "prompt + completion")
    s.limits.check_top(top, "top")
    if top < 1:
        raise ConfigError(f"top must be >= 1, got {top}")
    tok = s.run.tokenizer
    ids, start = make_query(tok, prompt, completion or None)
    full_len = len(ids)
    ids = ids[-(s.model.config.block_size + 1) :]  # the context window (+ the last target)
    start = max(1, start - (full_len - len(ids)))
    measured: list[MeasuredToken] = [{"index": j, "token": tok.id_to_token(t)} for j, t in enumerate(ids[start:])]
    if token is not None:
        if not 0 <= token < len(measured):
            raise ConfigError(f"token must be in [0, {len(measured)}) (the measured tokens), got {token}")
        return Query(measured, ids[: start + token + 1], 1)
    return Query(measured, ids, len(ids) - start)


def training_view(
    s: Session, prompt: str, completion: str, *, token: int | None, top: int, progress: Progress = False
) -> TrainingView:
    """``Explorer.training``: the ``top`` training sequences that most influenced ``completion`` (every token
    of ``prompt`` when there is none), or only its ``token``-th measured token. ``progress``: the gradient
    build's batches, without a cache."""
    t0 = time.monotonic()
    measured, sel, n_measure = training_query(s, prompt, completion, token=token, top=top)
    att, notes = _attribution(s, prompt, sel, n_measure, top, progress)
    scale = max((abs(it.score) for it in att.top), default=0.0) or 1.0
    labs = s.labelled(sorted({int(pp["id"]) for it in att.top for pp in it.prototypes}))
    summed = "+" not in att.method  # a rescored (hybrid) score is another method's, not Σ contributions
    return TrainingView(
        prompt=prompt,
        completion=completion,
        measured=measured,
        token=token,
        method=att.method,
        num_train=att.num_train,
        query_loss=att.query_loss,
        items=[training_item(it, scale, labs, summed) for it in att.top],
        seconds=time.monotonic() - t0,
        notes=notes + list(att.notes),
    )


def _attribution(
    s: Session, prompt: str, sel: list[int], n_measure: int, top: int, progress: Progress
) -> tuple[Attribution, list[str]]:
    """Attribution of the last ``n_measure`` tokens of ``sel``: through the cache, or (without one) exactly
    over the first ``Limits.full_attribution_sequences`` training sequences, said in a note (their gradients
    are built batch by batch, each batch under the lock: ``Session.full_gradients``)."""
    if s.has_cache:
        with s.lock:
            att = attribute_text(
                s.run,
                prompt,
                QuerySpec(completion=n_measure),
                SearchSpec(top=top),
                cache=s.cache_dir,
                shards=s.shards_dir(),
                token_ids=sel,
            )
        return att, []
    shards = s.run.shards(s.shards_dir())
    full = s.full_gradients(shards, progress)
    with s.lock:
        att = attribute(
            s.model,
            s.run.tokenizer,
            prompt,
            QuerySpec(completion=n_measure),
            source=full,
            search=SearchSpec(top=top),
            shards=shards,
            token_ids=sel,
        )
    note = (
        f"no attribution cache: exact prototype-space influence over the first {att.num_train:,} training "
        f"sequences (build the cache with `prism attribute-cache` for all of them)"
    )
    return att, [note]


def training_item(
    it: AttributedSequence, scale: float, labs: dict[int, tuple[str | None, str | None]], summed: bool
) -> TrainingItem:
    """``it`` with its relative score and each listed prototype's signed share; ``summed``: the score is
    Σ contributions (not a rescored one)."""
    b, t, a = split_snippet(it.snippet)
    # shares of the |contributions| (signed: − hurts), the unlisted prototypes' net as one more part,
    # so |shares| + |rest share| = 1 — a share of a signed sum can read 136% (and the rest −36%)
    rest = it.score - sum(pp["contribution"] for pp in it.prototypes) if summed else 0.0
    denom = sum(abs(pp["contribution"]) for pp in it.prototypes) + abs(rest) or 1.0
    protos: list[ItemPrototype] = [
        {
            "id": int(pp["id"]),
            "contribution": pp["contribution"],
            "share": pp["contribution"] / denom,
            "label": labs[int(pp["id"])][0],
        }
        for pp in it.prototypes
    ]
    return {
        "rank": it.rank,
        "sequence": it.sequence,
        "doc_id": it.doc_id,
        "doc_index": it.doc_index,
        "score": it.score,
        "relative": it.score / scale,
        "before": b,
        "target": t,
        "after": a,
        "prototypes": protos,
        "rest": rest,
        "rest_share": rest / denom,
    }


def document_view(s: Session, doc_index: int, *, position: int | None, window: int) -> DocumentView:
    """``Explorer.document``: document ``doc_index`` of the training shard, ``window`` tokens around
    ``position`` (the marked target), or from its start."""
    shards = s.shards()
    train = shards.train
    if isinstance(doc_index, bool) or not 0 <= doc_index < train.num_docs:
        raise UnknownDocumentError(
            f"unknown document {doc_index!r}: the training shard has {train.num_docs} "
            f"documents (0–{train.num_docs - 1})"
        )
    window = max(1, min(window, 2000))
    toks = train.document(doc_index)
    L = len(toks)
    if position is not None and not 0 <= position < L:
        raise ConfigError(
            f"position must be in [0, {L}) (the tokens of document {doc_index}), got {position}",
            fix="leave position out to show the document's start",
        )
    tok = shards.tokenizer
    if position is None:
        st, e = 0, min(L, window)
        before, target, after = tok.decode(toks[st:e].tolist()), "", ""
    else:
        st, e = max(0, position - window // 2), min(L, position + window // 2)
        before = tok.decode(toks[st:position].tolist())
        target = tok.decode(toks[position : position + 1].tolist())
        after = tok.decode(toks[position + 1 : e].tolist())
    return DocumentView(
        doc_index=doc_index,
        doc_id=train.doc_ids[doc_index],
        position=position,
        before=before,
        target=target,
        after=after,
        start=st,
        length=L,
    )
