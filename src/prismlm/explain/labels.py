"""Automatic prototype labels from neighbourhoods: a rule-based labeller, and an optional LLM labeller.

``rule_labels`` is offline and deterministic (the classes of a prototype's neighbours' target tokens);
``llm_labels`` asks an OpenAI-compatible endpoint and keeps the rule label on any failure. Labels live
in the index folder's ``labels.json``. The rules and categories: docs/architecture.md (labels).
"""

from __future__ import annotations

import json
import math
import os
import re
import string
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from prismlm.artifacts import atomic_write_text
from prismlm.errors import ArtifactError
from prismlm.explain.index import LABELS_FILE, Labels, PrototypeIndex

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.model import PrismLM

__all__ = [
    "CATEGORIES",
    "classify_token",
    "corpus_token_counts",
    "llm_labels",
    "rule_labels",
    "save_labels",
    "load_labels",
]

CATEGORIES = ("morphology", "grammar", "punctuation", "layout", "number", "name", "boundary", "content", "mixed")

# Closed-class English words: the "grammatical scaffolding" of the paper's taxonomy.
_FUNCTION_WORDS = frozenset(
    """
a an the this that these those some any no every each all both either neither
of in on at by for with from to into onto upon over under about above below between through during
before after since until against among within without across along around behind beyond near
and or but nor so yet if then than because while although though unless whether as
i me my mine we us our ours you your yours he him his she her hers it its they them their theirs
who whom whose which what where when why how there here
is am are was were be been being have has had do does did will would shall should can could may might
must not very too also just only even still
""".split()
)
_NUMBER_WORDS = frozenset(
    "one two three four five six seven eight nine ten eleven twelve hundred thousand "
    "million billion first second third fourth fifth".split()
)
_PUNCT = set(string.punctuation) | set("“”‘’—–…«»")


def classify_token(tok: str, *, eot: str | None = None) -> str:
    """The surface class of one decoded token (see the module docstring)."""
    if eot is not None and tok == eot:
        return "boundary"
    if tok == "" or tok.isspace():
        return "layout"
    s = tok.strip()
    if all(c in _PUNCT for c in s):
        return "punctuation"
    if any(c.isdigit() for c in s) or s.lower() in _NUMBER_WORDS:
        return "number"
    if s.lower() in _FUNCTION_WORDS:
        return "grammar"
    starts_word = tok[:1].isspace() or tok[:1] in _PUNCT
    if not starts_word and s.isalpha():
        return "morphology"
    if s[:1].isupper():
        return "name"
    return "content"


def corpus_token_counts(shards: ShardSet, chunk: int = 1 << 24) -> np.ndarray:
    """Token frequencies of the training split, streamed in chunks (O(V) memory)."""
    toks = shards.train.tokens
    V = shards.tokenizer.vocab_size
    counts = np.zeros(V, dtype=np.int64)
    for s in range(0, len(toks), chunk):
        counts += np.bincount(np.asarray(toks[s : s + chunk], dtype=np.int64), minlength=V)[:V]
    return counts


def _q(tok: str) -> str:
    return json.dumps(tok, ensure_ascii=False)


def rule_labels(
    index: PrototypeIndex,
    *,
    shards: ShardSet | None = None,
    neighbours: int | None = None,
    context: int = 8,
    corpus_counts: np.ndarray | None = None,
    pushes: Sequence[Sequence[int]] | None = None,
) -> Labels:
    """Label every prototype of ``index`` from what it does, then its neighbourhood (shards attached or given).

    ``pushes``: per prototype, the tokens W p_i raises most (``pushed_tokens``): the label leads with them
    (``↑ " Paris"|" Rome"``, not the token its nearest context happened to predict), and ``quality`` is how
    often one of them is the next token where the prototype fires (its nearest training contexts).
    Returns prototype id → {label, category, quality, evidence}; evidence: the pushed tokens, next- and
    previous-token counts, distinctive context words (log-ratio of neighbourhood to corpus frequency,
    add-one smoothed), whether the prototype is dead."""
    shards = shards if shards is not None else index.shards
    if shards is None:
        raise ArtifactError(
            "rule labels need the token shards the index points into: attach them with "
            "`index.attach(shards)` or pass `shards=`"
        )
    tok = shards.tokenizer
    eot = tok.decode([tok.eot_id])
    counts = corpus_token_counts(shards) if corpus_counts is None else corpus_counts
    total = float(counts.sum()) or 1.0
    train = shards.train.tokens
    out: Labels = {}
    for i in range(index.num_prototypes):
        nbs = index.neighbours(i, neighbours, before=0, after=0, shards=shards)
        nexts: Counter[int] = Counter()
        prevs: Counter[int] = Counter()
        ctx: Counter[int] = Counter()
        for nb in nbs:
            assert nb.target_id is not None and nb.doc_index is not None  # filled from the shards
            nexts[int(nb.target_id)] += 1
            prevs[int(train[nb.offset])] += 1
            a = max(int(shards.train.doc_offsets[nb.doc_index]), nb.offset + 1 - context)
            ctx.update(int(t) for t in np.asarray(train[a : nb.offset + 1]))
        n = max(1, len(nbs))
        classes = Counter(classify_token(tok.decode([t]), eot=eot) for t in nexts.elements())
        prev_classes = Counter(classify_token(tok.decode([t]), eot=eot) for t in prevs.elements())
        cls, c = classes.most_common(1)[0] if classes else ("mixed", 0)
        if c / n < 0.5:
            pcls, pc = prev_classes.most_common(1)[0] if prev_classes else ("mixed", 0)
            cls = pcls if pc / n >= 0.5 else "mixed"
        ctx_n = float(sum(ctx.values())) or 1.0
        scores = []
        for t, k in ctx.items():
            word = tok.decode([t]).strip()
            if k < 2 or len(word) < 3 or not word.isalpha() or word.lower() in _FUNCTION_WORDS:
                continue
            scores.append((math.log((k / ctx_n) / ((counts[t] + 1) / total)), word))
        distinctive = [w for _, w in sorted(scores, reverse=True)[:3]]
        top_next = [(tok.decode([t]), k) for t, k in nexts.most_common(3)]
        top_prev = [(tok.decode([t]), k) for t, k in prevs.most_common(3)]
        pushed = list(pushes[i][:LABEL_TOKENS]) if pushes is not None else []
        parts = _label_parts([tok.decode([t]) for t in pushed], top_next, top_prev, n, distinctive, cls)
        dead = bool(index.counts[i] == 0)
        label = ("(dead) " if dead else "") + " ".join(parts)
        quality = sum(k for t, k in nexts.items() if t in pushed) / n if pushed and nbs else None
        out[i] = {
            "label": label[:80],
            "category": cls,
            **({"quality": quality} if quality is not None else {}),
            "evidence": {
                "pushed_tokens": [tok.decode([t]) for t in pushed],
                "quality": quality,
                "next_tokens": top_next,
                "previous_tokens": top_prev,
                "distinctive_words": distinctive,
                "next_token_classes": dict(classes),
                "neighbours": len(nbs),
                "dead": dead,
                "labeller": "rules",
            },
        }
    return out


LABEL_TOKENS = 3
"""Pushed tokens a label leads with (and its ``quality`` is measured on)."""


def _label_parts(
    pushed: list[str],
    top_next: list[tuple[str, int]],
    top_prev: list[tuple[str, int]],
    n: int,
    distinctive: list[str],
    cls: str,
) -> list[str]:
    """A rule label's parts: what it pushes (``↑``), its contexts' next tokens (``→``), their previous token
    (``after``) and, for content, distinctive context words."""
    parts = []
    if pushed:
        parts.append("↑ " + "|".join(_q(t) for t in pushed))
    if top_next:
        shown = [t for t, k in top_next if k / n >= 0.15] or [top_next[0][0]]
        parts.append("→ " + "|".join(_q(t) for t in shown[:3]))
    if top_prev and top_prev[0][1] / n >= 0.5:
        parts.append(f"after {_q(top_prev[0][0])}")
    if distinctive and cls in ("content", "mixed", "name"):
        parts.append("ctx: " + ", ".join(distinctive))
    return parts


@torch.no_grad()
def pushed_tokens(
    model: PrismLM, n: int = LABEL_TOKENS, vocab_size: int | None = None, block: int = 256
) -> list[list[int]]:
    """Per prototype, the ``n`` tokens (ids below ``vocab_size``) its signature W p_i raises most: what it
    pushes up, best first. In blocks of ``block`` prototypes (a K × V signature matrix can be large)."""
    K = model.require_prototypes().num_prototypes
    dev = next(model.parameters()).device
    out: list[list[int]] = []
    for a in range(0, K, block):
        sig = model.signatures(torch.arange(a, min(K, a + block), device=dev)).float()  # (b, V)
        if vocab_size is not None:
            sig = sig[:, :vocab_size]
        out += sig.topk(min(n, sig.shape[1]), dim=-1).indices.tolist()
    return out


def save_labels(labels: Labels, index_dir: str | Path) -> Path:
    """Write ``labels.json`` next to the index."""
    path = Path(index_dir) / LABELS_FILE
    atomic_write_text(
        path, json.dumps({str(k): v for k, v in sorted(labels.items())}, indent=1, ensure_ascii=False) + "\n"
    )
    return path


def load_labels(index_dir: str | Path) -> Labels:
    path = Path(index_dir) / LABELS_FILE
    if not path.exists():
        return {}
    return {int(k): v for k, v in json.loads(path.read_text(encoding="utf-8")).items()}


_PROMPT = """You label prototypes of a language model. A prototype is a direction in the model's hidden
space; below are the training contexts nearest to it, with the token that came next marked ⟦like this⟧,
and the tokens the prototype pushes up most. Reply with JSON only: {{"label": "<at most 6 words>",
"category": "<one of {cats}>"}}.

Top pushed tokens: {top}
Nearest contexts:
{snips}"""


def llm_labels(
    index: PrototypeIndex,
    base: Labels,
    *,
    endpoint: str,
    model: str,
    api_key_env: str = "OPENAI_API_KEY",
    ids: list[int] | None = None,
    neighbours: int = 8,
    timeout: float = 30.0,
    signature_tokens: dict[int, list[str]] | None = None,
) -> Labels:
    """Relabel prototypes with an OpenAI-compatible chat endpoint (``{endpoint}/chat/completions``).

    ``base``: the rule labels, kept where a request fails. The key is read from ``api_key_env`` (may be
    unset for local servers). Only called when asked (``label_prototypes(labeller="openai")``).
    """
    url = endpoint.rstrip("/") + ("" if endpoint.rstrip("/").endswith("/chat/completions") else "/chat/completions")
    key = os.environ.get(api_key_env, "")
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    out: Labels = {k: v.copy() for k, v in base.items()}
    for i in ids if ids is not None else range(index.num_prototypes):
        snips = "\n".join(f"- {nb.snippet!r}" for nb in index.neighbours(i, neighbours))
        top = ", ".join(repr(t) for t in (signature_tokens or {}).get(i, [])) or "(not given)"
        body = {
            "model": model,
            "temperature": 0,
            "messages": [{"role": "user", "content": _PROMPT.format(cats=", ".join(CATEGORIES), top=top, snips=snips)}],
        }
        entry = out.setdefault(i, {"label": "", "category": "mixed", "evidence": {}})
        ev = dict(entry.get("evidence") or {})
        try:
            req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                reply = json.loads(resp.read().decode())
            content = reply["choices"][0]["message"]["content"]
            m = re.search(r"\{.*\}", content, re.S)
            parsed = json.loads(m.group(0) if m else content)
            label = str(parsed["label"]).strip()[:80]
            cat = str(parsed.get("category", entry.get("category", "mixed"))).strip().lower()
            entry["label"] = label
            entry["category"] = cat if cat in CATEGORIES else entry.get("category", "mixed")
            ev.update({"labeller": f"llm:{model}", "rule_label": base.get(i, {}).get("label")})
        except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError, TypeError) as e:
            ev["llm_error"] = f"{type(e).__name__}: {e}"[:200]
        entry["evidence"] = ev
    return out
