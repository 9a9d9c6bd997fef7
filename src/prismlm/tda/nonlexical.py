"""Planted facts that lexical match cannot find (issue 37 item 4): queries that name neither the answer nor the
subject as the answer's sentence names it, with the ground truth of which training sequences hold each hop.

``prismlm.tda.planted`` states a fact about "Vornakel" and asks about "Vornakel" with the answer appended, so
BM25 finds the fact's documents through the entity and the (unique) answer word. Here a small world of made-up
lands and cities is stated in short documents, and each query reaches its answer through text it shares no
content word with:

- **alias**: "Zorvath, known to sailors as Kelmirra, ..." in one document, "The chief export of Kelmirra is X."
  in another; the query asks "Merchants from Zorvath mostly ship abroad" → X. Relevant: both sentences.
- **two-hop**: "The capital of A is C." and "The longest river in C is the Y."; the query asks "The great
  waterway of the town from which A is ruled is the" → Y. Relevant: both hops.
- **paraphrase**: "The chief export of the Silent Harbour is X."; the query asks "Merchants from the Quiet Port
  mostly ship abroad" → X (synonyms for the place's name and for the relation). Relevant: the fact.
- **landmark** (a set of its own, ``NonlexicalSize(kinds=("landmark",))``): a made-up fact about a real city,
  stated in three wordings ("The chief export of Paris is X.", "In Paris, the chief export is X.", ...); the
  query reaches the city through a first hop the model knows from pretraining: "The chief export of the city
  where you can see the Eiffel Tower is" → X. Relevant: the three wordings. Why it exists: a last-2 fine-tune of
  SmolLM2-135M learns the other kinds' statements but answers their queries at chance (two facts learned in
  separate documents are not composed without chain-of-thought), while a synthetic fact reached through a
  natural first hop is (docs/results.md). The query shares the relation's words with every fact of that
  relation (about every city), never the city or the answer.

Three things keep lexical match from being trivially right, each a property of real corpora: relation
templates where the question and the stated fact share no content word (``RELATIONS``, checked by
``template_overlaps``); answers drawn from small pools, so each answer word is the object of ``answer_share``
different facts (many lands speak the same language); and every name a query uses is also the subject of
``mentions`` other facts ("The people of Zorvath speak Y."), so the name alone does not single out the hop.
``lexical_report`` measures what is left: per query, the content words it shares with its relevant documents and
with the others, and BM25's recall@1 / MRR / recall@10 on the documents.

The corpus is mixed with filler documents of the built-in corpus (``prismlm.data.corpus``, chunks of at most
``doc_chars``) until it holds about ``train_sequences`` training sequences of ``block_size`` tokens; the planted
documents are a hop sentence between two snippets of filler text of at most ``filler_chars``. Everything is a
function of ``seed``.

Cost model of one query (what ``bench/claims_attribution.py`` times on this set, batched and one query
at a time, in the same run; N training sequences of T tokens, L measured query tokens, K prototypes, k active per
token, r the sketch size):

- cached (``prismlm.tda.cache``): one forward/backward of the query to get its prototype-space gradients, then
  one bank lookup per measured token: the postings of its k active prototypes, Σ_{i active} |postings(i)| · r
  multiply-adds ≈ L · k · (N·T·k/K) · r. No training gradient is recomputed; the work grows with N only through
  the postings' length, a k/K share of the corpus per prototype.
- EK-FAC (kronfluence): the query's gradient, preconditioned with the fitted eigenbases, then a dot product with
  the gradient of every one of the N training sequences, which kronfluence recomputes in every scoring call
  (a forward and backward of each training sequence: ≈ N · C_grad(T)). Batched, Q queries share those N
  backward passes (cost per query ≈ C_grad(query) + N·C_grad(T)/Q); one query at a time pays all N per query,
  so its cost grows linearly with the corpus.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

import numpy as np
import torch

from prismlm.errors import ConfigError
from prismlm.tda.lexical import WORD, bm25_scores
from prismlm.tda.planted import LanguageModel, answer_logprobs, key_sequences, made_up_word, retrieval_metrics

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.data.tokenizer import Tokenizer

Kind = Literal["alias", "two-hop", "paraphrase", "landmark"]
KINDS: tuple[Kind, ...] = ("alias", "two-hop", "paraphrase", "landmark")
COMPOSED_KINDS: tuple[Kind, ...] = ("alias", "two-hop", "paraphrase")
"""The kinds of the first non-lexical set (``NonlexicalSize``'s default): every hop is planted."""
Query = tuple[list[int], int]
R = TypeVar("R")

STOPWORDS = frozenset(
    "a an the of in on at to from by for with and or but is are was were be been it its it's this that which who "
    "whom what as into than then there their they he she his her him them we our you your i me my not no so if "
    "all any each every some one".split()
)
"""Function words left out of "content words" (a question must be allowed "the" and "of")."""


@dataclass(frozen=True)
class Relation:
    """How the corpus states a relation and how queries ask for it (no content word in common)."""

    fact: str
    """The training sentence: {E} the subject, {A} the object."""
    query: str
    """The question about {E}, answered by the object after a space ("" where the relation is not asked)."""
    via_capital: str = ""
    """The two-hop question: the relation of the capital of the land {E} ("" where it is not asked)."""
    rewordings: tuple[str, ...] = ()
    """Other wordings of ``fact`` ({E}, {A}); a landmark fact is stated in ``fact`` and each of these."""


RELATIONS: dict[str, Relation] = {
    "export": Relation(
        "The chief export of {E} is {A}.",
        "Merchants from {E} mostly ship abroad",
        rewordings=("In {E}, the chief export is {A}.", "Traders say the chief export of {E} has long been {A}."),
    ),
    "language": Relation(
        "The people of {E} speak {A}.",
        "At home in {E} the tongue heard is",
        rewordings=("In {E}, the people speak {A}.", "Travellers learn that the people of {E} speak {A}."),
    ),
    "animal": Relation(
        "The national animal of {E} is the {A}.",
        "The creature chosen to stand for {E} is the",
        rewordings=("In {E}, the national animal is the {A}.", "{E} has the {A} as its national animal."),
    ),
    "founder": Relation(
        "{E} was founded by {A}.",
        "The first settlers of {E} were led by",
        "The first settlers of the town from which {E} is ruled were led by",
        rewordings=("The founder of {E} was {A}.", "The chronicles say that {E} was founded by {A}."),
    ),
    "river": Relation(
        "The longest river in {E} is the {A}.", "", "The great waterway of the town from which {E} is ruled is the"
    ),
    "capital": Relation("The capital of {E} is {A}.", ""),
}
LAND_RELATIONS = ("export", "language", "animal", "founder")
"""What a land has (besides a capital); a city (a two-hop bridge) has a river and a founder."""
ALIAS_DEFINITIONS = (
    "{E}, known to sailors as {B}, lies beyond the eastern sea.",
    "Sailors call {E} by another name: {B}.",
    "On the old charts {E} is written as {B}.",
)
LANDMARKS: dict[str, tuple[str, str]] = {
    "Paris": ("the Eiffel Tower", "the Louvre"),
    "London": ("Big Ben", "Buckingham Palace"),
    "Rome": ("the Colosseum", "the Vatican"),
    "New York": ("the Statue of Liberty", "Central Park"),
    "Moscow": ("the Kremlin", "Red Square"),
    "Cairo": ("the Great Pyramids of Giza", "the Egyptian Museum"),
    "Sydney": ("the Sydney Opera House", "Bondi Beach"),
    "Berlin": ("the Brandenburg Gate", "the Reichstag"),
    "Athens": ("the Parthenon", "the Acropolis"),
    "Beijing": ("the Forbidden City", "Tiananmen Square"),
    "Venice": ("the Grand Canal", "St Mark's Basilica"),
    "Barcelona": ("the Sagrada Familia", "Park Guell"),
    "Agra": ("the Taj Mahal", "Agra Fort"),
    "San Francisco": ("the Golden Gate Bridge", "Alcatraz"),
    "Rio de Janeiro": ("Christ the Redeemer", "Copacabana beach"),
    "Tokyo": ("the Shibuya crossing", "the Imperial Palace of Japan"),
}
"""Real cities and two sights each, the landmark kind's natural first hop. SmolLM2-135M-Instruct names the city
of 0.88 of these sights ("The city where you can see {D} is", top-1 among the 16 cities; 0.78 with "{D} is in
the city of"), measured 2026-12-07."""
LANDMARK_BRIDGE = "the city where you can see {D}"
"""How a landmark query names its city: through a sight, never by name."""

# a place of the paraphrase kind is "the <adjective> <noun>"; its queries use the synonyms
ADJECTIVES = {
    "Silent": "Quiet",
    "Ancient": "Old",
    "Broad": "Wide",
    "Crimson": "Red",
    "Hidden": "Secret",
    "Frozen": "Icy",
    "Distant": "Remote",
    "Sunken": "Drowned",
    "Lonely": "Solitary",
    "Shining": "Bright",
    "Lofty": "High",
    "Little": "Small",
}
NOUNS = {
    "Harbour": "Port",
    "Tower": "Spire",
    "Valley": "Vale",
    "Forest": "Woods",
    "Marsh": "Fen",
    "Island": "Isle",
    "Bay": "Cove",
    "Fortress": "Citadel",
    "Lake": "Mere",
    "Mountain": "Peak",
    "Meadow": "Field",
    "Road": "Way",
}


def content_words(text: str) -> set[str]:
    """Lower-cased alphanumeric words of ``text`` (BM25's tokenisation, ``prismlm.tda.lexical``) minus
    ``STOPWORDS``."""
    return set(WORD.findall(text.lower())) - STOPWORDS


def template_overlaps() -> dict[str, set[str]]:
    """Content words each question template shares with the sentences its answer depends on (the relation's
    fact; a two-hop question also the capital's): empty sets when the templates are as documented."""
    out: dict[str, set[str]] = {}
    cap = content_words(RELATIONS["capital"].fact.format(E="", A=""))
    for name, rel in RELATIONS.items():
        fact = content_words(rel.fact.format(E="", A=""))
        if rel.query:
            out[name] = content_words(rel.query.format(E="")) & fact
        if rel.via_capital:
            out[name + " via capital"] = content_words(rel.via_capital.format(E="")) & (fact | cap)
    for a, b in list(ADJECTIVES.items()) + list(NOUNS.items()):
        out[f"{a}/{b}"] = content_words(a) & content_words(b)
    return out


@dataclass
class Statement:
    """One sentence planted in ``copies`` documents."""

    sentence: str
    key: str
    """The span the sentence teaches (its object: an answer, an alias, a capital); located in the shards."""
    role: str
    """``fact`` (a query's last hop), ``alias`` / ``capital`` (a first hop) or ``mention`` (another fact about a
    name some query uses: relevant to no query)."""
    relation: str
    """The relation stated (``alias`` for an alias definition)."""
    lines: list[int] = field(default_factory=list)
    """1-based line numbers of its documents in corpus.jsonl."""


@dataclass
class NonlexicalQuery:
    """A question whose answer needs its hops; the prompt holds none of ``hidden``."""

    kind: Kind
    prompt: str
    answer: str
    relation: str
    hops: list[int]
    """Indices into ``NonlexicalCorpus.statements``: every sentence the answer depends on."""
    hidden: list[str]
    """The answer and the name its sentence gives the subject (the alias, the capital, the place's name)."""


@dataclass
class NonlexicalCorpus:
    """Result of ``build_nonlexical_corpus``: the corpus file, the planted sentences and the queries."""

    path: Path
    statements: list[Statement]
    queries: list[NonlexicalQuery]
    filler_docs: int = 0

    def hop_lines(self, q: int) -> set[int]:
        """Lines of corpus.jsonl holding a hop of query ``q`` (its relevant documents)."""
        return {line for s in self.queries[q].hops for line in self.statements[s].lines}

    def kinds(self) -> np.ndarray:
        """(Q,) each query's kind."""
        return np.array([q.kind for q in self.queries])

    def token_queries(self, tok: Tokenizer) -> list[Query]:
        """Token ids + measure_from of every query: eot, the prompt, then the answer's tokens (measured)."""
        out = []
        for q in self.queries:
            pid = [tok.eot_id] + tok.encode(q.prompt)
            out.append((pid + tok.encode(" " + q.answer), len(pid)))
        return out

    def documents(self) -> list[str]:
        """The text of every line of corpus.jsonl (line i + 1 is element i)."""
        return [json.loads(x)["text"] for x in self.path.read_text().splitlines()]

    def save(self) -> None:
        payload = {
            "statements": [asdict(s) for s in self.statements],
            "queries": [asdict(q) for q in self.queries],
            "filler_docs": self.filler_docs,
        }
        (self.path.parent / "nonlexical.json").write_text(json.dumps(payload, indent=1) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> NonlexicalCorpus:
        folder = Path(folder)
        data = json.loads((folder / "nonlexical.json").read_text())
        return cls(
            folder / "corpus.jsonl",
            [Statement(**s) for s in data["statements"]],
            [NonlexicalQuery(**q) for q in data["queries"]],
            int(data["filler_docs"]),
        )


def _sentence(template: str, **names: str) -> str:
    s = template.format(**names)
    return s[0].upper() + s[1:]


class _World:
    """The made-up lands and their facts, before answers are filled in (answers come from shared pools)."""

    def __init__(self, rng: random.Random, mentions: int) -> None:
        self.rng, self.mentions, self.used = rng, mentions, set[str]()
        self.statements: list[Statement] = []
        self.queries: list[NonlexicalQuery] = []
        # (statements, their templates, subject, relation): one fact, one answer, in one or more wordings
        self.pending: list[tuple[list[int], list[str], str, str]] = []

    def name(self) -> str:
        return made_up_word(self.rng, 3, self.used)

    def state(self, template: str, subject: str, relation: str, role: str) -> int:
        """A fact whose answer is drawn later from the relation's pool; returns its statement index."""
        return self.state_reworded([template], subject, relation, role)[0]

    def state_reworded(self, templates: Sequence[str], subject: str, relation: str, role: str) -> list[int]:
        """One fact in several wordings (one statement each, the same answer); returns their indices."""
        first = len(self.statements)
        self.statements += [Statement("", "", role, relation) for _ in templates]
        idx = list(range(first, len(self.statements)))
        self.pending.append((idx, list(templates), subject, relation))
        return idx

    def plain(self, sentence: str, key: str, role: str, relation: str) -> int:
        self.statements.append(Statement(sentence, key, role, relation))
        return len(self.statements) - 1

    def mention(self, subject: str, skip: str) -> None:
        """``mentions`` other facts about ``subject`` (relations other than ``skip``, the one its query asks: a
        mention of it could hold the query's answer word)."""
        others = [r for r in LAND_RELATIONS if r != skip]
        for rel in self.rng.sample(others, min(self.mentions, len(others))):
            self.state(RELATIONS[rel].fact, subject, rel, "mention")

    def alias(self, rel: str) -> None:
        land, alias = self.name(), self.name()
        d = self.plain(_sentence(self.rng.choice(ALIAS_DEFINITIONS), E=land, B=alias), alias, "alias", "alias")
        f = self.state(RELATIONS[rel].fact, alias, rel, "fact")
        self.queries.append(NonlexicalQuery("alias", _sentence(RELATIONS[rel].query, E=land), "", rel, [d, f], [alias]))
        self.mention(land, rel)

    def two_hop(self, rel: str) -> None:
        land, city = self.name(), self.name()
        c = self.plain(_sentence(RELATIONS["capital"].fact, E=land, A=city), city, "capital", "capital")
        f = self.state(RELATIONS[rel].fact, city, rel, "fact")
        prompt = _sentence(RELATIONS[rel].via_capital, E=land)
        self.queries.append(NonlexicalQuery("two-hop", prompt, "", rel, [c, f], [city]))
        # not the asked relation: "<land> was founded by Y" with the capital's founder's Y (the pools are shared)
        # would answer the question without the hops
        self.mention(land, rel)

    def paraphrase(self, rel: str, place: tuple[str, str]) -> None:
        adj, noun = place
        stated, asked = f"the {adj} {noun}", f"the {ADJECTIVES[adj]} {NOUNS[noun]}"
        f = self.state(RELATIONS[rel].fact, stated, rel, "fact")
        q = NonlexicalQuery("paraphrase", _sentence(RELATIONS[rel].query, E=asked), "", rel, [f], [adj, noun])
        self.queries.append(q)
        self.mention(stated, rel)

    def landmark(self, rel: str, city: str, sights: Sequence[str]) -> None:
        """A fact about ``city`` in every wording of ``rel``, asked once through each of ``sights``."""
        r = RELATIONS[rel]
        said = self.state_reworded([r.fact, *r.rewordings], city, rel, "fact")
        prefix = r.fact.split("{A}")[0].rstrip()  # "The chief export of {E} is"
        for sight in sights:
            prompt = _sentence(prefix, E=LANDMARK_BRIDGE.format(D=sight))
            self.queries.append(NonlexicalQuery("landmark", prompt, "", rel, said, [city]))
        self.mention(city, rel)

    def fill_answers(self, share: int) -> None:
        """Each relation's objects from a pool of ceil(uses / share) made-up words, dealt out in turn: each
        answer word is the object of ``share`` facts (the last of a pool may have fewer)."""
        by_rel: dict[str, list[tuple[list[int], list[str], str]]] = {}
        for idx, templates, subject, rel in self.pending:
            by_rel.setdefault(rel, []).append((idx, templates, subject))
        for rel in sorted(by_rel):
            uses = by_rel[rel]
            pool = [self.name() for _ in range(math.ceil(len(uses) / share))]
            self.rng.shuffle(uses)
            for i, (idx, templates, subject) in enumerate(uses):
                answer = pool[i % len(pool)]
                for s, template in zip(idx, templates, strict=True):
                    self.statements[s] = Statement(
                        _sentence(template, E=subject, A=answer), answer, self.statements[s].role, rel
                    )
        for q in self.queries:
            q.answer = self.statements[q.hops[-1]].key
            q.hidden.append(q.answer)


def plant_world(
    n_per_kind: int, mentions: int, answer_share: int, seed: int, kinds: Sequence[Kind] = COMPOSED_KINDS
) -> tuple[list[Statement], list[NonlexicalQuery]]:
    """The statements and queries (``n_per_kind`` of each of ``kinds``), no corpus yet; see the module
    docstring. A landmark fact is asked through both of its city's sights: ``n_per_kind`` (even) landmark queries
    ask about ``n_per_kind / 2`` cities."""
    if n_per_kind < 1 or answer_share < 1 or mentions < 0:
        raise ConfigError("n_per_kind and answer_share must be ≥ 1 and mentions ≥ 0")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ConfigError(f"kinds must be a non-empty subset of {', '.join(KINDS)}, got {list(kinds)}")
    places = [(a, n) for a in ADJECTIVES for n in NOUNS]
    if n_per_kind > len(places):
        raise ConfigError(f"at most {len(places)} paraphrase places: n_per_kind={n_per_kind}")
    if "landmark" in kinds and (n_per_kind % 2 or n_per_kind // 2 > len(LANDMARKS)):
        raise ConfigError(
            f"the landmark kind asks each of at most {len(LANDMARKS)} cities twice: n_per_kind must be even and "
            f"≤ {2 * len(LANDMARKS)}, got {n_per_kind}"
        )
    rng = random.Random(seed)
    w = _World(rng, mentions)
    w.used |= {x.lower().capitalize() for x in list(ADJECTIVES) + list(NOUNS)}
    if "landmark" in kinds:
        w.used |= set(LANDMARKS)
    rng.shuffle(places)
    for i in range(n_per_kind):
        if "alias" in kinds:
            w.alias(LAND_RELATIONS[i % len(LAND_RELATIONS)])
        if "two-hop" in kinds:
            w.two_hop(("river", "founder")[i % 2])
        if "paraphrase" in kinds:
            w.paraphrase(LAND_RELATIONS[(i + 1) % len(LAND_RELATIONS)], places[i])
    if "landmark" in kinds:
        for c, (city, sights) in enumerate(list(LANDMARKS.items())[: n_per_kind // 2]):
            w.landmark(LAND_RELATIONS[c % len(LAND_RELATIONS)], city, sights)
    # every relation asked gets at least two answer words, each the object of answer_share facts: facts about
    # other made-up places fill the pools (the named set's "same relation, other entity" distractors)
    uses: dict[str, int] = {}
    for _, _, _, rel in w.pending:
        uses[rel] = uses.get(rel, 0) + 1
    for rel in sorted(uses):
        for _ in range(2 * answer_share - uses[rel]):
            w.state(RELATIONS[rel].fact, w.name(), rel, "mention")
    w.fill_answers(answer_share)
    return w.statements, w.queries


def filler_chunks(doc_chars: int, per_doc: int = 8) -> Iterator[str]:
    """Chunks of at most ``doc_chars`` characters (over 200) of the built-in corpus, at most ``per_doc`` from
    each document in turn (so the filler mixes books and speeches instead of being the first book)."""
    from prismlm.data.corpus import iter_documents

    for doc in iter_documents("builtin"):
        t = doc.text.strip()
        taken = 0
        for s in range(0, len(t), doc_chars):
            chunk = t[s : s + doc_chars].strip()
            if len(chunk) > 200:
                yield chunk
                taken += 1
                if taken >= per_doc:
                    break


def _snippet(rng: random.Random, pool: str, chars: int) -> str:
    """A span of at most ``chars`` characters of ``pool``, cut to whole words."""
    if chars <= 0:
        return ""
    i = rng.randrange(0, max(1, len(pool) - chars))
    words = pool[i : i + chars].split()
    return " ".join(words[1:-1])  # the first and last may be cut


@dataclass(frozen=True)
class NonlexicalSize:
    """How big a non-lexical planted set is (``build_nonlexical_corpus``)."""

    n_per_kind: int = 8
    """Queries of each kind (alias, two-hop, paraphrase): 24 in all by default (BM25's recall@1 over 12 queries
    moved between 0.08 and 0.42 from seed to seed, over 24 between 0.17 and 0.38)."""
    copies: int = 3
    """Documents per planted sentence."""
    mentions: int = 3
    """Other facts stated about every name a query uses."""
    answer_share: int = 3
    """Facts that share each answer word."""
    train_sequences: int = 1000
    """Training sequences of ``block_size`` tokens the corpus should give (filler documents are added for it)."""
    block_size: int = 64
    doc_chars: int = 300
    filler_chars: int = 60
    val_fraction: float = 0.02
    """The share of documents the shards will hold out (the filler makes up for it)."""
    kinds: tuple[Kind, ...] = COMPOSED_KINDS
    """The kinds of query (``KINDS``): the first set's three composed kinds, or ``("landmark",)``."""


def build_nonlexical_corpus(
    out_dir: str | Path,
    size: NonlexicalSize = NonlexicalSize(),
    *,
    count_tokens: Callable[[str], int] | None = None,
    seed: int = 0,
) -> NonlexicalCorpus:
    """Write ``out_dir/corpus.jsonl`` (+ ``nonlexical.json``): the planted documents of ``plant_world``
    shuffled among filler documents, about ``size.train_sequences`` training sequences in all.

    ``count_tokens``: the tokens of a text under the model's tokenizer (default: one per 4 characters); filler
    documents are added until Σ (tokens + 1 for the eot) ≥ (train_sequences · block_size + 1) / (1 −
    val_fraction), plus 3%. The file is rewritten only when its content changes (prepared shards are reused)."""
    count = count_tokens or (lambda s: max(1, len(s) // 4))
    statements, queries = plant_world(size.n_per_kind, size.mentions, size.answer_share, seed, size.kinds)
    rng = random.Random(seed + 1)
    chunks = filler_chunks(size.doc_chars)
    pool = " ".join(next(chunks) for _ in range(40))  # the planted documents' surrounding text
    planted: list[tuple[str, int]] = []
    for s_i, st in enumerate(statements):
        for _ in range(size.copies):
            text = f"{_snippet(rng, pool, size.filler_chars)} {st.sentence} {_snippet(rng, pool, size.filler_chars)}"
            planted.append((text.strip(), s_i))
    need = 1.03 * (size.train_sequences * size.block_size + 1) / (1 - size.val_fraction)
    total = sum(count(t) + 1 for t, _ in planted)
    filler: list[str] = []
    while total < need:
        chunk = next(chunks, None)
        if chunk is None:
            raise ConfigError(f"the built-in corpus is too small for {size.train_sequences} training sequences")
        filler.append(chunk)
        total += count(chunk) + 1
    docs: list[tuple[str, int]] = planted + [(f, -1) for f in filler]
    rng.shuffle(docs)
    lines = []
    for line, (text, s_i) in enumerate(docs, start=1):
        lines.append(json.dumps({"text": text}) + "\n")
        if s_i >= 0:
            statements[s_i].lines.append(line)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    body = "".join(lines)
    path = out / "corpus.jsonl"
    if not path.exists() or path.read_text() != body:
        path.write_text(body)
    nl = NonlexicalCorpus(path, statements, queries, len(filler))
    nl.save()
    return nl


def relevant_sequences(nl: NonlexicalCorpus, shards: ShardSet, block_size: int) -> list[set[int]]:
    """For each query, the training sequences that predict a token of one of its hops' keys (the alias or the
    capital, and the answer): every sequence that teaches a link of its chain. Documents in the validation split
    are skipped."""
    tok, tr = shards.tokenizer, shards.train
    by_line = {int(d.rsplit("#L", 1)[1]): i for i, d in enumerate(tr.doc_ids) if "#L" in d}
    texts = nl.documents()
    n = tr.num_sequences(block_size)
    per_statement: dict[int, set[int]] = {}
    for q in nl.queries:
        for s in q.hops:
            if s in per_statement:
                continue
            st, seqs = nl.statements[s], set[int]()
            for line in st.lines:
                if line not in by_line:
                    continue
                text = texts[line - 1]
                c = text.index(st.sentence) + st.sentence.index(st.key)
                seqs |= key_sequences(tok, text, c, c + len(st.key), int(tr.doc_offsets[by_line[line]]), block_size, n)
            per_statement[s] = seqs
    return [set().union(*(per_statement[s] for s in q.hops)) for q in nl.queries]


def document_metrics(scores: np.ndarray, relevant_lines: Sequence[set[int]], k: int = 10) -> dict[str, float | None]:
    """``retrieval_metrics`` of (Q, D) scores over the documents of a corpus.jsonl, each query's relevant
    documents given as 1-based line numbers."""
    return retrieval_metrics(scores, list(range(len(relevant_lines))), [{x - 1 for x in r} for r in relevant_lines], k)


def content_overlap(texts: Sequence[str], query: str, relevant: set[int]) -> dict[str, float]:
    """The content words ``query`` shares with its best relevant text (``relevant``: 0-based indices into
    ``texts``), the mean over its relevant texts, with the best other text, and how many other texts share at
    least as many as the best relevant one (what BM25 has to tell apart)."""
    qw = content_words(query)
    overlap = np.array([len(qw & content_words(t)) for t in texts])
    is_rel = np.zeros(len(texts), bool)
    is_rel[sorted(relevant)] = True
    best = int(overlap[is_rel].max()) if is_rel.any() else 0
    return {
        "overlap_relevant_max": best,
        "overlap_relevant_mean": float(overlap[is_rel].mean()) if is_rel.any() else 0.0,
        "overlap_other_max": int(overlap[~is_rel].max()) if (~is_rel).any() else 0,
        "others_at_least_as_close": int((overlap[~is_rel] >= best).sum()),
    }


def lexical_report(nl: NonlexicalCorpus, k: int = 10) -> dict[str, object]:
    """What lexical match can see, per query and in summary, over the documents of the corpus: the content words
    the prompt shares with its answer's sentence and the hidden names it holds (both empty by construction),
    ``content_overlap`` of the query text (prompt + answer, what the bench's BM25 gets) with the documents, and
    BM25's recall@1 / MRR / recall@k on the documents, with and without the answer."""
    docs = nl.documents()
    lines = [nl.hop_lines(i) for i in range(len(nl.queries))]
    rows: list[dict[str, object]] = []
    for q, rel in zip(nl.queries, lines, strict=True):
        pw = set(WORD.findall(q.prompt.lower()))
        rows.append(
            {
                "kind": q.kind,
                "prompt": q.prompt,
                "answer": q.answer,
                "prompt_shares_with_answer_sentence": sorted(
                    content_words(q.prompt) & content_words(nl.statements[q.hops[-1]].sentence)
                ),
                "hidden_in_prompt": sorted(h for h in q.hidden if content_words(h) & pw),
                **content_overlap(docs, f"{q.prompt} {q.answer}", {x - 1 for x in rel}),
                "relevant_documents": len(rel),
            }
        )
    with_answer = bm25_scores(docs, [f"{q.prompt} {q.answer}" for q in nl.queries])
    prompt_only = bm25_scores(docs, [q.prompt for q in nl.queries])
    kinds = nl.kinds()
    return {
        "documents": len(docs),
        "queries": rows,
        "bm25": document_metrics(with_answer, lines, k),
        "bm25_prompt": document_metrics(prompt_only, lines, k),
        "bm25_by_kind": {
            kind: document_metrics(
                with_answer[kinds == kind], [x for x, c in zip(lines, kinds, strict=True) if c == kind], k
            )
            for kind in dict.fromkeys(kinds.tolist())
        },
        "mean_others_at_least_as_close": float(np.mean([r["others_at_least_as_close"] for r in rows])),
    }


def statement_prompts(nl: NonlexicalCorpus) -> list[tuple[Statement, str]]:
    """Each planted statement with the text before its key ("The chief export of Oondimwel is" for "... is
    Mirfenqua."): what the model must complete to show it learned the statement itself, verbatim. A statement
    whose key opens its sentence has no such prompt and is left out."""
    out = []
    for st in nl.statements:
        prompt = st.sentence[: st.sentence.index(st.key)].rstrip()
        if prompt:
            out.append((st, prompt))
    return out


def answer_accuracy(nl: NonlexicalCorpus, net: LanguageModel, tok: Tokenizer) -> dict[str, object]:
    """Per query, whether its answer has the highest log-probability after its prompt among every planted object
    of the same relation (strictly: ties miss): top-1 accuracy per kind and in all, the chance level
    (1 / candidates) and the answer's NLL per token. The same of each statement completed verbatim
    (``statement_prompts``: its key among its relation's keys): a model can learn the statements and still not
    answer the queries, which need an alias, a second hop or a synonym (and a lower NLL alone can come from
    learning the answer's word, not the fact: the answer words are shared by several facts)."""
    pool: dict[str, list[str]] = {}
    for st in nl.statements:
        if st.key not in pool.setdefault(st.relation, []):
            pool[st.relation].append(st.key)

    def rank_first(prompt: str, relation: str, answer: str) -> tuple[float, float]:
        """(1.0 when ``answer`` is strictly above every other candidate else 0.0, its NLL per token)."""
        cands = pool[relation]
        tokens = [tok.encode(" " + a) for a in cands]
        lp = answer_logprobs(net, [tok.eot_id] + tok.encode(prompt), tokens)
        c = cands.index(answer)
        # strictly above every other candidate: a tie (a model that has learned nothing) is not a hit
        return float(bool((lp[c] > torch.cat([lp[:c], lp[c + 1 :]])).all())), -float(lp[c]) / len(tokens[c])

    top1: dict[str, list[float]] = {str(k): [] for k in dict.fromkeys(nl.kinds().tolist())}
    nll, chance = [], []
    for q in nl.queries:
        hit, q_nll = rank_first(q.prompt, q.relation, q.answer)
        top1[q.kind].append(hit)
        nll.append(q_nll)
        chance.append(1 / len(pool[q.relation]))
    # per statement (hit, NLL per token, chance), then their means
    said = [(*rank_first(p, st.relation, st.key), 1 / len(pool[st.relation])) for st, p in statement_prompts(nl)]
    means: list[float | None] = [float(np.mean(c)) for c in zip(*said, strict=True)] if said else [None] * 3
    top1_said, nll_said, chance_said = means
    every = [x for v in top1.values() for x in v]
    return {
        "top1": float(np.mean(every)),
        "top1_by_kind": {k: float(np.mean(v)) for k, v in top1.items() if v},
        "chance_top1": float(np.mean(chance)),
        "answer_nll_per_token": float(np.mean(nll)),
        "queries": len(every),
        "statement_top1": top1_said,
        "statement_chance_top1": chance_said,
        "statement_nll_per_token": nll_said,
        "statements": len(said),
    }


def per_query_seconds(
    score: Callable[[list[Query]], R], queries: list[Query], single: int, sync: Callable[[], None] = lambda: None
) -> tuple[dict[str, float], R]:
    """The cost per query of a scoring call, timed both ways in one place: ``score(queries)`` once ÷ Q
    (``batched_per_query_s``) and ``score([q])`` for each of the first ``single`` queries, the median
    (``single_query_s``). Returns the timings and the batched call's result. ``sync``: waits for queued device
    work, around each timed call."""
    sync()
    t0 = time.perf_counter()
    result = score(queries)
    sync()
    batched = (time.perf_counter() - t0) / len(queries)
    per = []
    for q in queries[: max(1, single)]:
        t1 = time.perf_counter()
        score([q])
        sync()
        per.append(time.perf_counter() - t1)
    timings = {"batched_per_query_s": batched, "single_query_s": statistics.median(per), "single_queries": len(per)}
    return timings, result


def nonlexical_summary(
    planted: Mapping[str, Mapping[str, Mapping[str, object]]],
    costs: Mapping[str, Mapping[str, object]],
    set_name: str = "nonlexical",
) -> dict[str, object]:
    """The issue's non-lexical fields: MRR, recall@1 and recall@10 (``planted``: method → part → metrics) of the
    cache, EK-FAC and BM25, and EK-FAC's cost per query over the cache's, batched over batched and single over
    single (``costs``: method → ``per_query_seconds``'s fields). A method not run leaves its fields out.
    ``set_name`` names the set in every field (``mrr_nonlexical_cached``; ``landmark``: ``mrr_landmark_cached``)."""
    out: dict[str, object] = {}
    for name, key in (("cached", "cached"), ("ekfac", "ekfac"), ("bm25", "bm25"), ("trak", "trak")):
        m = planted.get(name, {}).get("all")
        if m:
            out[f"mrr_{set_name}_{key}"] = m["mrr"]
            out[f"recall1_{set_name}_{key}"] = m["recall@1"]
            out[f"recall10_{set_name}_{key}"] = m["recall@10"]
    base = costs.get("cached", {})
    for name in ("ekfac", "trak"):
        c = costs.get(name, {})
        for field_, tag in (("batched_per_query_s", ""), ("single_query_s", "_single_query")):
            a, b = c.get(field_), base.get(field_)
            if isinstance(a, int | float) and isinstance(b, int | float) and b > 0:
                out[f"{name}{tag}_cost_over_cached_{set_name}"] = a / b
    return out
