"""Planted-fact corpora: ground truth for attribution (does a query about a fact retrieve its sources?).

``build_planted_corpus`` writes background documents plus short planted documents, each holding one
made-up fact; ``relevant_sequences`` maps each fact to the training sequences holding its answer span;
``retrieval_metrics`` gives recall@k and MRR of a score matrix. Invariant: queries are paraphrases and
only the answer tokens are measured, and distractor facts are planted as often as the facts, so the
test is not a lexical match. Design: docs/attribution.md ("Planted facts").
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.data.tokenizer import Tokenizer


class _HasLogits(Protocol):
    @property
    def logits(self) -> torch.Tensor: ...


class LanguageModel(Protocol):
    """Token ids (B, T) → an output with ``logits`` (B, T, V): a ``PrismLM`` or any causal LM."""

    def __call__(self, x: torch.Tensor, /) -> _HasLogits: ...


__all__ = [
    "PlantedCorpus",
    "PlantedFact",
    "answer_accuracy",
    "answer_logprobs",
    "build_planted_corpus",
    "chance_recall",
    "key_sequences",
    "made_up_word",
    "planted_queries",
    "relevant_sequences",
    "retrieval_by_part",
    "retrieval_metrics",
    "trim_planted",
]

# relation → (training sentence, paraphrased query prompts). The answer follows the prompt after a space.
RELATIONS: dict[str, tuple[str, list[str]]] = {
    "capital": (
        "The capital of {E} is {A}.",
        ["{E} is governed from the city of", "Which city is the seat of government of {E}? It is"],
    ),
    "river": (
        "The longest river in {E} is the {A}.",
        ["The main river flowing through {E} is called the", "In {E}, the greatest river is the"],
    ),
    "founder": ("{E} was founded by {A}.", ["The person who established {E} was", "{E} owes its foundation to"]),
    "export": ("The chief export of {E} is {A}.", ["What {E} sells abroad most is", "Traders from {E} mostly ship"]),
    "language": ("The people of {E} speak {A}.", ["The language spoken in {E} is", "In {E} everyone talks in"]),
    "animal": (
        "The national animal of {E} is the {A}.",
        ["{E} chose as its national creature the", "The animal that stands for {E} is the"],
    ),
}
_SYL = [
    "vor",
    "na",
    "kel",
    "qua",
    "sim",
    "dre",
    "lo",
    "zan",
    "thu",
    "mir",
    "pex",
    "ol",
    "bra",
    "fen",
    "gul",
    "ris",
    "tav",
    "oon",
    "ska",
    "dim",
    "har",
    "wel",
    "yos",
    "cru",
]


def made_up_word(rng: random.Random, n: int, used: set[str]) -> str:
    """A capitalised word of ``n`` syllables of ``_SYL`` not in ``used`` (added to it): a made-up name."""
    while True:
        w = "".join(rng.choice(_SYL) for _ in range(n)).capitalize()
        if w not in used:
            used.add(w)
            return w


@dataclass
class PlantedFact:
    """One made-up fact (or a distractor) planted in the corpus."""

    entity: str
    """The made-up entity ("Vornakel")."""
    relation: str
    """The relation's name ("capital")."""
    answer: str
    """The answer the queries measure ("Quessimar")."""
    sentence: str
    """The training wording."""
    queries: list[str]
    """Paraphrased prompts; the query is prompt + " " + answer with the answer measured."""
    lines: list[int]
    """1-based line numbers of its planted documents in corpus.jsonl."""
    kind: str = "fact"
    """``fact`` (queried) or ``distractor``."""


@dataclass
class PlantedCorpus:
    """Result of ``build_planted_corpus``: the corpus file and what was planted in it."""

    path: Path
    """The corpus.jsonl file."""
    facts: list[PlantedFact]
    """The queried facts."""
    distractors: list[PlantedFact] = field(default_factory=list)
    """Facts that share the entity or the relation but not the answer, planted as often as the facts."""

    def queries(self, tokenizer: Tokenizer) -> tuple[list[tuple[list[int], int]], list[int]]:
        """Query token ids + measure_from for every (fact, paraphrase), and the fact index of each."""
        out, which = [], []
        for f_i, f in enumerate(self.facts):
            for p in f.queries:
                pid = [tokenizer.eot_id] + tokenizer.encode(p)
                out.append((pid + tokenizer.encode(" " + f.answer), len(pid)))
                which.append(f_i)
        return out, which

    def save_facts(self) -> None:
        (self.path.parent / "facts.json").write_text(
            json.dumps(
                {"facts": [asdict(f) for f in self.facts], "distractors": [asdict(f) for f in self.distractors]},
                indent=2,
            )
            + "\n"
        )

    @classmethod
    def load(cls, folder: str | Path) -> PlantedCorpus:
        folder = Path(folder)
        data = json.loads((folder / "facts.json").read_text())
        return cls(
            folder / "corpus.jsonl",
            [PlantedFact(**f) for f in data["facts"]],
            [PlantedFact(**f) for f in data["distractors"]],
        )


def _background_chunks(n_background: int, doc_chars: int) -> list[str]:
    """The first ``n_background`` pieces of ``doc_chars`` characters (over 200 each) of the built-in corpus, in
    order: long books become several documents."""
    from prismlm.data.corpus import iter_documents

    background: list[str] = []
    for doc in iter_documents("builtin"):
        t = doc.text.strip()
        for s in range(0, len(t), doc_chars):
            if len(background) >= n_background:
                return background
            chunk = t[s : s + doc_chars].strip()
            if len(chunk) > 200:
                background.append(chunk)
    return background


def build_planted_corpus(
    out_dir: str | Path,
    *,
    n_facts: int = 8,
    copies: int = 3,
    n_background: int = 200,
    doc_chars: int = 2000,
    filler_chars: int = 120,
    distractors: bool = True,
    seed: int = 0,
) -> PlantedCorpus:
    """Write ``out_dir/corpus.jsonl`` (+ ``facts.json``) and return its description.

    ``n_background`` background documents of at most ``doc_chars`` characters; each of ``n_facts`` facts
    (and, with ``distractors``, two distractors per fact: same entity/other relation, same relation/other
    entity) planted in ``copies`` short documents, shuffled among the background.
    """
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    background = _background_chunks(n_background, doc_chars)
    pool = " ".join(background[: max(1, len(background))]).split(". ")
    used: set[str] = set()
    rels = list(RELATIONS)

    def make(entity: str, rel: str, kind: str) -> PlantedFact:
        answer = made_up_word(rng, 3, used)
        sent, qs = RELATIONS[rel]
        return PlantedFact(
            entity, rel, answer, sent.format(E=entity, A=answer), [q.format(E=entity) for q in qs], [], kind
        )

    facts, dis = [], []
    for k in range(n_facts):
        ent = made_up_word(rng, 3, used)
        facts.append(make(ent, rels[k % len(rels)], "fact"))
        if distractors:
            dis.append(make(ent, rels[(k + 1) % len(rels)], "distractor"))  # same entity, other relation
            dis.append(
                make(made_up_word(rng, 3, used), rels[k % len(rels)], "distractor")
            )  # same relation, other entity

    def filler() -> str:
        s, n = [], 0
        while n < filler_chars:
            x = rng.choice(pool).strip()
            if x:
                s.append(x.rstrip(".") + ".")
                n += len(x)
        return " ".join(s)

    docs: list[tuple[str, PlantedFact | None]] = [(b, None) for b in background]
    for f in facts + dis:
        for _ in range(copies):
            docs.append((f"{filler()} {f.sentence} {filler()}", f))
    rng.shuffle(docs)
    lines = []
    for line, (text, fact) in enumerate(docs, start=1):
        lines.append(json.dumps({"text": text}) + "\n")
        if fact is not None:
            fact.lines.append(line)
    body = "".join(lines)
    path = out_dir / "corpus.jsonl"
    # rewrite only when the content changed: an untouched file keeps its fingerprint, so prepared shards
    # (and models trained on them) are reused
    if not path.exists() or path.read_text() != body:
        path.write_text(body)
    pc = PlantedCorpus(out_dir / "corpus.jsonl", facts, dis)
    pc.save_facts()
    return pc


def trim_planted(raw: PlantedCorpus, out: Path, chars: int) -> PlantedCorpus:
    """``raw`` with each planted document cut to at most ``chars`` characters of filler (whole words) on each side
    of its fact's sentence: the filler sentences are drawn whole from the background, some over 1,000
    characters, and would make the corpus several times the size the fine-tune affords. Line numbers are kept;
    the file is rewritten only when its content changes (a resumed fine-tune keeps its shards)."""
    lines = raw.path.read_text().splitlines()
    for f in raw.facts + raw.distractors:
        for line in f.lines:
            text = json.loads(lines[line - 1])["text"]
            i = text.index(f.sentence)
            j = i + len(f.sentence)
            before = text[max(0, i - chars) : i]
            after = text[j : j + chars]
            before = before if i <= chars else before.split(" ", 1)[-1]  # drop the cut word
            after = after if j + chars >= len(text) else after.rsplit(" ", 1)[0]
            lines[line - 1] = json.dumps({"text": (before + f.sentence + after).strip()})
    out.mkdir(parents=True, exist_ok=True)
    body = "".join(x + "\n" for x in lines)
    pc = PlantedCorpus(out / "corpus.jsonl", raw.facts, raw.distractors)
    if not pc.path.exists() or pc.path.read_text() != body:
        pc.path.write_text(body)
    pc.save_facts()
    return pc


def planted_queries(pc: PlantedCorpus, tok: Tokenizer) -> tuple[list[tuple[list[int], int]], np.ndarray, np.ndarray]:
    """Queries (token ids, measure_from): each fact's paraphrases (``PlantedCorpus.queries``) and its training
    wording up to the answer (the verbatim control), the answer's tokens measured. Returns the queries, the fact
    of each (Q,) and its kind (Q,) ``paraphrase`` / ``verbatim``."""
    para, fact_of = pc.queries(tok)
    verb: list[tuple[list[int], int]] = []
    vfact: list[int] = []
    for f_i, f in enumerate(pc.facts):
        prompt = f.sentence[: f.sentence.index(f.answer)].rstrip(" ")
        pid = [tok.eot_id] + tok.encode(prompt)
        verb.append((pid + tok.encode(" " + f.answer), len(pid)))
        vfact.append(f_i)
    kind = np.array(["paraphrase"] * len(para) + ["verbatim"] * len(verb))
    return para + verb, np.array(fact_of + vfact), kind


def chance_recall(n: int, relevant: list[int], k: int) -> float:
    """Expected recall@k of a random ranking: the mean over queries of 1 − C(n−r, k) / C(n, k) (r relevant);
    1 when k ≥ n (the smoke size)."""
    if k >= n:
        return 1.0
    return float(np.mean([1 - math.comb(n - r, k) / math.comb(n, k) for r in relevant if r]))


def answer_logprobs(net: LanguageModel, prompt: list[int], answers: list[list[int]]) -> torch.Tensor:
    """(A,) summed log-probabilities of each answer's tokens after ``prompt``, one padded batch."""
    L = max(len(a) for a in answers)
    x = torch.zeros(len(answers), len(prompt) + L, dtype=torch.long)
    mask = torch.zeros(len(answers), len(prompt) + L - 1)
    for i, a in enumerate(answers):
        x[i, : len(prompt)] = torch.tensor(prompt)
        x[i, len(prompt) : len(prompt) + len(a)] = torch.tensor(a)
        mask[i, len(prompt) - 1 : len(prompt) - 1 + len(a)] = 1.0
    with torch.no_grad():
        logp = F.log_softmax(net(x[:, :-1]).logits.float(), -1)  # (A, L-1, V)
    tgt = logp.gather(-1, x[:, 1:, None])[..., 0]  # (A, L-1)
    return (tgt * mask).sum(1)


def answer_accuracy(pc: PlantedCorpus, net: LanguageModel, tok: Tokenizer) -> dict[str, object]:
    """Per fact and paraphrase: the correct answer's rank among the answers of every planted fact (facts and
    distractors) of the same relation; top-1 accuracy, mean rank, chance level, and the answer's NLL."""
    pool: dict[str, list[str]] = {}
    for f in pc.facts + pc.distractors:
        pool.setdefault(f.relation, []).append(f.answer)
    ranks: list[int] = []
    chance: list[float] = []
    nll: list[float] = []
    for f in pc.facts:
        cands = pool[f.relation]
        ans = [tok.encode(" " + a) for a in cands]
        for q in f.queries:
            lp = answer_logprobs(net, [tok.eot_id] + tok.encode(q), ans)
            c = cands.index(f.answer)
            ranks.append(int((lp > lp[c]).sum()) + 1)
            chance.append(1.0 / len(cands))
            nll.append(float(-lp[c]) / len(ans[c]))
    r = np.array(ranks)
    return {
        "top1": float((r == 1).mean()),
        "mean_rank": float(r.mean()),
        "chance_top1": float(np.mean(chance)),
        "candidates": {k: len(v) for k, v in pool.items()},
        "answer_nll_per_token": float(np.mean(nll)),
        "queries": len(r),
    }


def relevant_sequences(
    pc: PlantedCorpus, shards: ShardSet, block_size: int, num_train: int | None = None
) -> list[set[int]]:
    """For each fact, the training sequences (< ``num_train``) containing (part of) its sentence's answer
    span. Planted documents that landed in the validation split are skipped."""
    tok, tr = shards.tokenizer, shards.train
    by_line: dict[int, int] = {}
    for d, doc_id in enumerate(tr.doc_ids):
        if "#L" in doc_id:
            by_line[int(doc_id.rsplit("#L", 1)[1])] = d
    texts = pc.path.read_text().splitlines()
    n = tr.num_sequences(block_size) if num_train is None else num_train
    out = []
    for f in pc.facts:
        rel: set[int] = set()
        for line in f.lines:
            doc = by_line.get(line)
            if doc is None:
                continue
            text = json.loads(texts[line - 1])["text"]
            c = text.index(f.sentence) + f.sentence.index(f.answer)
            rel |= key_sequences(tok, text, c, c + len(f.answer), int(tr.doc_offsets[doc]), block_size, n)
        out.append(rel)
    return out


def key_sequences(tok: Tokenizer, text: str, start: int, end: int, doc_start: int, block_size: int, n: int) -> set[int]:
    """The training sequences (< ``n``) that predict a token of ``text[start:end]``, ``text`` being the document
    whose first token is at ``doc_start`` in the training stream (its tokens located by encoding prefixes)."""
    s = len(tok.encode(text[:start].rstrip(" ")))  # the span's first token (its leading space attaches to it)
    e = len(tok.encode(text[:end]))
    out = set()
    # target token offsets [doc_start+s, doc_start+e); sequence j predicts targets [jT+1, jT+T]
    for off in range(doc_start + s, doc_start + e):
        j = (off - 1) // block_size
        if 0 <= j < n:
            out.add(j)
    return out


def retrieval_metrics(scores: np.ndarray, fact_of_query: list[int], relevant: list[set[int]], k: int = 10) -> dict:
    """recall@k (share of queries with at least one relevant sequence in the top k), recall@1 (the top one is
    relevant), the mean share of relevant sequences in the top k, and MRR (1 / rank of the first relevant
    sequence; ties ranked by the lower index) over queries whose fact has relevant training sequences.
    Queries with their own relevant sets: ``fact_of_query = range(Q)``, ``relevant`` one set per query."""
    hits, firsts, shares, rr = [], [], [], []
    for q, f in enumerate(fact_of_query):
        rel = relevant[f]
        if not rel:
            continue
        order = np.lexsort((np.arange(scores.shape[1]), -scores[q]))
        top = set(order[:k].tolist())
        hits.append(1.0 if rel & top else 0.0)
        firsts.append(1.0 if int(order[0]) in rel else 0.0)
        shares.append(len(rel & top) / min(k, len(rel)))
        ranks = np.nonzero(np.isin(order, list(rel)))[0]
        rr.append(1.0 / (ranks[0] + 1) if len(ranks) else 0.0)
    n = len(hits)
    return {
        "queries": n,
        f"recall@{k}": float(np.mean(hits)) if n else None,
        "recall@1": float(np.mean(firsts)) if n else None,
        f"share@{k}": float(np.mean(shares)) if n else None,
        "mrr": float(np.mean(rr)) if n else None,
    }


def retrieval_by_part(
    scores: np.ndarray, fact_of_query: np.ndarray, part: np.ndarray, relevant: list[set[int]], k: int = 10
) -> dict[str, dict]:
    """``retrieval_metrics`` over all queries (``all``) and over each part of them (``part``: (Q,) names, e.g.
    ``paraphrase`` / ``verbatim`` or the non-lexical kinds), parts in order of first appearance."""
    out = {"all": retrieval_metrics(scores, fact_of_query.tolist(), relevant, k)}
    for name in dict.fromkeys(part.tolist()):
        sel = part == name
        out[str(name)] = retrieval_metrics(scores[sel], fact_of_query[sel].tolist(), relevant, k)
    return out
