"""Operations on an opened ``Run``: sample, evaluate, explain, verify, look up prototypes.

Each ``prism`` command is one of these plain functions (or one in ``app.indexing``, ``app.attribution``,
``app.control``, ``app.training``). They return values — dataclasses, lists, dicts — and never print; user mistakes raise
``prismlm.errors.PrismError``. The CLI derives its options from their signatures and docstrings.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from prismlm.app.chat import CHAT_ANSWER_TOKENS, chat_prompt, stops_for
from prismlm.app.control import intervention_activity
from prismlm.app.run import Run, require
from prismlm.artifacts import folder_kind, reading, verify_files
from prismlm.data.shards import load_shards
from prismlm.data.tokenizer import Tokenizer
from prismlm.errors import (
    ArtifactCorrupt,
    ConfigError,
    DataError,
)
from prismlm.eval.metrics import evaluate as evaluate_model
from prismlm.explain import (
    Explanation,
    PrototypeCard,
    explain,
    explain_generation,
    prototype_card,
)
from prismlm.explain.index import KIND as INDEX_KIND
from prismlm.explain.index import LABELS_FILE
from prismlm.model import PrismLM
from prismlm.model.generation import GREEDY, TEXT_SAMPLING, Sampling
from prismlm.model.stored_activations import open_stored_z
from prismlm.tda.cache import KIND as CACHE_KIND
from prismlm.train.checkpoint import verify_checkpoint
from prismlm.train.run_folder import STORED_Z_DIR

MAX_NEW_TOKENS = 65536
"""Most tokens ``generate`` makes per sample: past the context window every new token recomputes a full
window, so a mistyped ``-n 1000000000`` would run for days instead of failing."""


def check_sampling(tokens: int, samples: int = 1, tokens_name: str = "tokens") -> None:
    """``ConfigError`` naming the parameter for counts that cannot work (``Sampling`` checks itself)."""
    require(tokens >= 0, tokens_name, ">= 0", tokens)
    require(samples >= 1, "samples", ">= 1", samples)


# ----- sampling and evaluation ----------------------------------------------------------------------------
def sample_continuations(
    model: PrismLM,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    samples: int,
    tokens: int,
    sampling: Sampling,
    generator: torch.Generator | None = None,
    stop_id: int | Sequence[int] | None = None,
) -> list[str]:
    """``samples`` sampled continuations of ``prompt`` (continuation text only; an empty prompt starts
    from the end-of-text token), one batch through ``model.generate`` at ``sampling`` (``generator``:
    instead of ``sampling.seed``'s). ``stop_id`` (an end-of-turn token, or several: ``Tokenizer.end_of_turn_ids``):
    generation ends once every sample has produced one, and each continuation is cut before it."""
    stop_ids = [int(stop_id)] if isinstance(stop_id, int) else [int(i) for i in stop_id or ()]
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]
    dev = next(model.parameters()).device
    x = torch.tensor([ids] * samples, dtype=torch.long, device=dev)  # (samples, T)
    generator = generator if generator is not None else sampling.generator(dev)
    if not stop_ids:
        y = model.generate(x, tokens, sampling, generator=generator)
        return [tokenizer.decode(row[len(ids) if prompt else 1 :].tolist()) for row in y]
    new: list[torch.Tensor] = []  # (samples, 1) each
    ended = torch.zeros(samples, dtype=torch.bool, device=dev)  # (samples,)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=dev)  # (S,)
    for _, nxt in model.generate_steps(x, tokens, sampling, generator=generator):
        new.append(nxt)
        ended |= torch.isin(nxt[:, 0], stops)
        if bool(ended.all()):
            break
    rows = torch.cat(new, dim=1).tolist() if new else [[] for _ in range(samples)]
    cut = [next((j for j, t in enumerate(row) if t in stop_ids), len(row)) for row in rows]
    return [tokenizer.decode(row[:c]) for row, c in zip(rows, cut)]


def _check_chat(chat: str | None, prompt: str) -> None:
    if chat is not None and prompt:
        raise ConfigError(
            "`chat` and a prompt were both given", fix="give one: the chat message becomes the prompt", param="chat"
        )


class Samples(list[str]):
    """What ``generate`` returns: the texts, and ``notes`` — what the reader should know about them (which of
    the prototypes the run's interventions change were active on each, and a warning when none was where it
    mattered)."""

    def __init__(self, texts: list[str], notes: list[str] | None = None) -> None:
        super().__init__(texts)
        self.notes: list[str] = list(notes or [])


def intervention_notes(run: Run, token_ids: list[int]) -> list[str]:
    """The summary and, if any, the warning of ``intervention_activity`` on ``token_ids`` — nothing when the run
    applies no intervention."""
    if not run.interventions:
        return []
    act = intervention_activity(run, token_ids)
    what = "suppressed" if run.suppression is not None and len(run.interventions) == 1 else "intervened"
    warning = act.warning(what)
    return [act.summary(what)] + ([warning] if warning else [])


def generate(
    run: Run,
    prompt: str = "",
    *,
    chat: str | None = None,
    tokens: int = 100,
    samples: int = 1,
    sampling: Sampling = TEXT_SAMPLING,
) -> Samples:
    """Sample text from a trained model (with the run's interventions applied; ``Samples.notes`` says which of
    their prototypes were active on each text, and warns when none was).

    Args:
        prompt: Text to continue (empty: start from end-of-text).
        chat: A chat message instead of a prompt: it is written with the model's chat template and the
            assistant's answer is returned, ending at the end-of-turn token (at most ``tokens``).
        tokens: New tokens per sample. At most 65,536 (past the context window, the window slides).
        samples: Number of samples.
        sampling: Temperature, top tokens and seed.
    """
    check_sampling(tokens, samples)
    require(
        tokens <= MAX_NEW_TOKENS,
        "tokens",
        f"<= {MAX_NEW_TOKENS:,} (generate longer texts in steps, continuing from the last output)",
        tokens,
    )
    _check_chat(chat, prompt)
    text = chat_prompt(run, chat) if chat is not None else prompt
    with run.intervened() as model:
        conts = sample_continuations(
            model,
            run.tokenizer,
            text,
            samples=samples,
            tokens=tokens,
            sampling=sampling,
            generator=sampling.generator(run.device),
            stop_id=stops_for(run, chat is not None),
        )
    notes = [
        f"sample {j + 1}: {n}"
        for j, c in enumerate(conts)
        for n in intervention_notes(run, run.tokenizer.encode(text + c))
    ]
    return Samples(conts if chat is not None else [prompt + c for c in conts], notes)


def evaluate(
    run: Run, *, batches: int = 50, batch_size: int | None = None, shards: Path | None = None
) -> dict[str, float | int | None]:
    """Validation loss, perplexity and coverage metrics (R̄1, R2, dead prototypes, residual share) on the
    run's own validation split.

    Args:
        batches: Validation batches (a fixed, evenly spread sample).
        batch_size: Sequences per batch (default: the run's).
        shards: Token shard folder the run was trained on (default: prepared from its data config).
    """
    require(batches >= 1, "batches", ">= 1", batches)
    require(batch_size is None or batch_size >= 1, "batch_size", ">= 1", batch_size)
    cfg = run.config
    shard_set = run.shards(shards)
    with run.intervened() as model:
        metrics: dict[str, float | int | None] = dict(
            evaluate_model(
                model,
                shard_set.val,
                seq_len=cfg.model.block_size,
                batch_size=batch_size or cfg.train.batch_size,
                max_batches=batches,
                device=run.device,
                autocast=run.autocast(),
            )
        )
    metrics["step"] = run.step
    return metrics


# ----- explanations ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExplanationRequest:
    """What ``explain_text`` explains besides the prompt (a chat answer or a generation) and what its prototype
    cards show: one option of ``prism explain`` per field, shared by ``explain_report``."""

    chat: str | None = None
    """A chat message instead of a prompt: written with the model's chat template, the assistant's answer is
    generated greedily (at most ``generate`` tokens, default 64, ending at the end-of-turn token) and its tokens
    are explained."""
    system: str | None = None
    """With ``chat``: the system prompt written before the message (default: the template's own, if any)."""
    generate: int | None = None
    """Sample N tokens after the prompt and explain them (default: none; with a chat message, the answer of
    at most 64 tokens; 0: explain the chat prompt alone, generating nothing)."""
    index: Path | None = None
    """Index folder (default RUN/index if it exists)."""
    use_index: bool = True
    """Use the prototype index if there is one."""
    shards: Path | None = None
    """Token shard folder (default: the index's / the run's)."""
    neighbours: int = 5
    """Training snippets per prototype card."""

    def __post_init__(self) -> None:
        require(self.neighbours >= 0, "neighbours", ">= 0", self.neighbours)


DEFAULT_EXPLANATION = ExplanationRequest()


def explain_text(
    run: Run,
    prompt: str = "",
    request: ExplanationRequest = DEFAULT_EXPLANATION,
    sampling: Sampling = GREEDY,
) -> Explanation:
    """Explain each next-token logit: active prototypes with labels and shares, residual share, exactly.

    Args:
        prompt: Text to explain (empty: the first prediction after end-of-text).
        request: What else is explained and what the cards show (chat, generate, index, shards,
            neighbours): ``ExplanationRequest``, one option per field.
        sampling: How the ``generate`` tokens are sampled (temperature, top tokens, seed); greedy by default,
            as for a chat answer.
    """
    chat, generate, neighbours = request.chat, request.generate, request.neighbours
    _check_chat(chat, prompt)
    model = run.prism_model("an explanation")
    check_sampling(generate or 0, tokens_name="generate")
    if chat is not None:
        # None, not 0, means "not given": an explicit 0 generates nothing (it used to mean the 64-token default)
        prompt, generate = chat_prompt(run, chat, request.system), CHAT_ANSWER_TOKENS if generate is None else generate
        sampling = replace(sampling, temperature=0.0)
    generate = generate or 0
    require(
        generate <= model.config.block_size,  # one explanation covers one context window
        "generate",
        f"at most the context window ({model.config.block_size} tokens)",
        generate,
    )
    tokenizer = run.tokenizer
    idx = run.index(request.index, request.shards) if request.use_index else None
    with run.intervened():  # a suppressed or controlled run is explained as it predicts (decompose stays exact)
        if generate > 0:
            expl = explain_generation(
                model,
                tokenizer,
                prompt,
                generate,
                model_sha256=run.identity,
                sampling=sampling,
                index=idx,
                neighbours=neighbours,
                stop_id=stops_for(run, chat is not None),
            )
        else:
            expl = explain(model, tokenizer, prompt, model_sha256=run.identity, index=idx, neighbours=neighbours)
    if idx is None:
        expl.notes.append(f"no prototype index: build one with `prism index {run.path}` for neighbourhoods and labels")
    expl.notes += intervention_notes(run, [*expl.token_ids, expl.positions[-1].next_id])
    return expl


# ----- verification ---------------------------------------------------------------------------------------
@dataclass
class VerifyReport:
    """What ``verify_run`` checked (each file against its manifest), and what it could not find."""

    checked: list[str]
    notes: list[str] = field(default_factory=list)


def verify_run(
    run: Run, *, shards: Path | None = None, index: Path | None = None, cache: Path | None = None
) -> VerifyReport:
    """Check every artifact of a run against its manifest with full checksums: checkpoint files (weights,
    trainer state, config, tokenizer), token shards, every prototype index (with its labels.json),
    attribution cache and search index in the run folder, and a retrofit's stored hidden states (RUN/stored-z:
    file lengths and each batch's sha256). A corrupt or foreign one, or one whose
    manifest.json is missing, is refused with its file name and the command that rebuilds it.

    Args:
        shards: Token shard folder (default: the run's).
        index: Index folder (default: every index in the run folder).
        cache: Attribution cache folder (default: every cache in the run folder).
    """
    ckpt = run.checkpoint
    checked = [str(ckpt.path / f) for f in verify_checkpoint(ckpt.path, ckpt.manifest, full=True)]
    notes: list[str] = []
    shard_set = run.shards(shards)
    load_shards(shard_set.root, verify=True)  # sha256 of every shard file
    checked.append(f"{shard_set.root} (train.bin, val.bin, offsets, tokenizer)")
    folders = (
        [p for p in sorted(run.folder.iterdir()) if p.is_dir() and p.name != "checkpoints"]
        if run.folder.is_dir() and run.folder != ckpt.path
        else []
    )
    indexes = [index] if index is not None else [p for p in folders if _looks_like(p, INDEX_KIND)]
    caches = [cache] if cache is not None else [p for p in folders if _looks_like(p, CACHE_KIND)]
    if run.model.is_prism:
        for p in indexes:
            checked += _verify_index(run, p, shards)
        for p in caches:
            checked += _verify_cache(run, p, shards)
    notes += [
        f"no {what}"
        for what, found in (("prototype index", indexes), ("attribution cache", caches))
        if not found or not run.model.is_prism
    ]
    if run.suppression is not None:
        checked.append(str(ckpt.path / "suppression.json"))
    stored = run.folder / STORED_Z_DIR
    if run.folder != ckpt.path and stored.is_dir():
        store = open_stored_z(stored).verify()  # lengths, state.json, every batch's sha256
        if not store.complete:
            notes.append(f"the stored z at {stored} is unfinished: a retrofit run again finishes it")
        checked.append(str(stored))
    return VerifyReport(checked=checked, notes=notes)


# files each artifact holds besides its manifest: a folder with one of them and no manifest.json lost it
_ARTIFACT_FILES = {
    INDEX_KIND: ("index.safetensors", "labels.json"),
    CACHE_KIND: ("sketch.npy", "seq.npy", "offsets.npy", "curvature.safetensors"),
}
_DEFAULT_NAME = {INDEX_KIND: "index", CACHE_KIND: "attribution-cache"}


def _looks_like(folder: Path, kind: str) -> bool:
    """``folder`` holds (or held: its manifest is gone) an artifact of ``kind``; unfinished builds
    (``.tmp``, ``.old``, ``.build``, ``.part-…``) are not artifacts yet."""
    if any(s in folder.name for s in (".tmp", ".old", ".build", ".part-")):
        return False
    found = folder_kind(folder)
    if found is not None:
        return found == kind
    return folder.name == _DEFAULT_NAME[kind] or any((folder / f).exists() for f in _ARTIFACT_FILES[kind])


def _require_manifest(folder: Path, what: str, rebuild: str) -> None:
    if not (folder / "manifest.json").is_file():
        raise ArtifactCorrupt(
            f"the {what} {folder} has no manifest.json: its files cannot be checked",
            fix=f"delete {folder} and rebuild it with `{rebuild}`",
            path=folder / "manifest.json",
        )


def _verify_index(run: Run, folder: Path, shards: Path | None) -> list[str]:
    """Full checksums of an index and a check of its labels.json (ids of this bank, a label and category each)."""
    fix = f"prism index {run.path} --out {folder} --overwrite"
    _require_manifest(folder, "prototype index", fix)
    idx = run.index(folder, shards)
    assert idx is not None and idx.path is not None
    verify_files(idx.path, idx.manifest.get("files"), what="prototype index", fix=fix, full=True)
    done = [str(idx.path)]
    labels = idx.path / LABELS_FILE
    if labels.exists():
        _check_labels(labels, idx.num_prototypes, fix=f"prism label {run.path} --index {folder}")
        done.append(str(labels))
    return done


def _check_labels(path: Path, num_prototypes: int, *, fix: str) -> None:
    """``ArtifactCorrupt`` naming ``path`` unless it maps prototype ids in [0, K) to {label, category} strings."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ArtifactCorrupt(f"{path} cannot be read ({type(e).__name__}: {e})", fix=fix, path=path) from e
    bad = (
        "it is not a JSON object"
        if not isinstance(data, dict)
        else next(
            (
                f"entry {k!r}"
                for k, v in data.items()
                if not (
                    k.isdigit()
                    and int(k) < num_prototypes
                    and isinstance(v, dict)
                    and isinstance(v.get("label"), str)
                    and isinstance(v.get("category"), str)
                )
            ),
            None,
        )
    )
    if bad is not None:
        raise ArtifactCorrupt(
            f"{path} is not a labels file of {num_prototypes} prototypes ({bad}: expected "
            "prototype id → {label, category})",
            fix=fix,
            path=path,
        )


def _verify_cache(run: Run, folder: Path, shards: Path | None) -> list[str]:
    """Full checksums of an attribution cache and of its search index (CACHE/search) if it has one."""
    fix = f"prism attribute-cache {run.path} --out {folder} --overwrite"
    _require_manifest(folder, "attribution cache", fix)
    c = run.cache(folder, shards)
    assert c.path is not None  # a cache opened from a folder knows it
    verify_files(c.path, c.manifest.get("files"), what="attribution cache", fix=fix, full=True)
    c.verify()  # every file the cache reads must have a manifest record, and its search sidecar's files too
    done = [str(c.path)]
    side = c.path / "search"
    if side.is_dir():
        rebuild = f"prism attribute-search {run.path} --cache {folder} --overwrite"
        _require_manifest(side, "search index", rebuild)
        with reading(side / "manifest.json", "search index manifest", fix=rebuild):
            files = json.loads((side / "manifest.json").read_text(encoding="utf-8")).get("files")
        verify_files(side, files, what="search index", fix=rebuild, full=True)
        run.search(folder, shards)  # and that it was built from this cache
        done.append(str(side))
    return done


# ----- looking prototypes up -----------------------------------------------------------------------------
@dataclass
class PrototypeRow:
    """One line of a prototype listing."""

    id: int
    label: str
    category: str
    active_tokens: int | None
    """How many indexed tokens it is active on (None without an index)."""
    top_tokens: list[str]
    """The tokens W p_i pushes most."""
    token_push: float | None = None
    """(W p_i)_tok for the token searched for, if any."""
    quality: float | None = None
    """Its label's quality: how often a token the label names is the next token where it fires (rule labels)."""


TOKEN_MATCH_TOP = 20
"""A prototype matches a token search when the token is among the N tokens its signature W p_i raises most."""


@dataclass
class PrototypeListing:
    rows: list[PrototypeRow]
    matched: int
    num_prototypes: int
    has_index: bool
    token: str | None = None
    """The token searched for (``matched``: the prototypes that have it among their ``TOKEN_MATCH_TOP`` pushed
    tokens, strongest push first)."""
    match_top: int = TOKEN_MATCH_TOP


def find_prototypes(
    run: Run,
    *,
    search: str | None = None,
    token: str | None = None,
    index: Path | None = None,
    shards: Path | None = None,
    limit: int = 20,
) -> PrototypeListing:
    """List or search prototypes by label, category or token.

    Args:
        search: Only prototypes whose label or category contains TEXT.
        token: Prototypes that push this token: it is among the 20 tokens their signature W p_i raises most;
            strongest push first.
        index: Index folder (default RUN/index if it exists).
        shards: Token shard folder (default: the index's / the run's).
        limit: Rows to list.
    """
    require(limit >= 1, "limit", ">= 1", limit)
    model = run.prism_model("listing prototypes")
    assert model.prototypes is not None
    tok = run.tokenizer
    idx = run.index(index, shards)
    labs = idx.labels() if idx is not None else {}
    K = model.prototypes.num_prototypes
    ids = list(range(K))
    score: dict[int, float] = {}
    if token is not None:
        tid = tok.encode(token)
        if len(tid) != 1:
            raise DataError(
                f"token {token!r} is {len(tid)} tokens {tid}; give a single token (e.g. with its leading space: ' the')"
            )
        with torch.no_grad():
            sig = model.signatures().float()[:, : tok.vocab_size]  # (K, V)
            col = sig[:, tid[0]]  # (K,)
            rank = (sig > col[:, None]).sum(-1)  # (K,) the token's place among each prototype's pushes
        score = {i: float(col[i]) for i in ids}
        ids = sorted((i for i in ids if int(rank[i]) < TOKEN_MATCH_TOP), key=lambda i: -score[i])
    elif idx is not None:
        ids.sort(key=lambda i: -int(idx.counts[i]))
    if search:
        q = search.lower()
        ids = [
            i
            for i in ids
            if q in (labs.get(i, {}).get("label", "") + " " + labs.get(i, {}).get("category", "")).lower()
        ]
    rows: list[PrototypeRow] = []
    if ids:
        with torch.no_grad():
            sig = model.signatures(torch.tensor(ids[:limit], dtype=torch.long, device=run.device)).float()  # (n, V)
        sig[:, tok.vocab_size :] = -float("inf")
        top = sig.topk(5, dim=-1).indices  # (n, 5)
        for row, i in enumerate(ids[:limit]):
            lab = labs.get(i, {})
            rows.append(
                PrototypeRow(
                    id=i,
                    label=lab.get("label", ""),
                    category=lab.get("category", ""),
                    active_tokens=int(idx.counts[i]) if idx is not None else None,
                    top_tokens=[tok.id_to_token(int(t)) for t in top[row]],
                    token_push=score.get(i) if token is not None else None,
                    quality=lab.get("quality"),
                )
            )
    return PrototypeListing(rows=rows, matched=len(ids), num_prototypes=K, has_index=idx is not None, token=token)


@dataclass
class PrototypeView:
    """One prototype's card, and whether an index was there to fill its neighbourhood."""

    card: PrototypeCard
    has_index: bool


def show_prototype(
    run: Run, prototype: int, *, index: Path | None = None, shards: Path | None = None, neighbours: int = 8
) -> PrototypeView:
    """One prototype's card: label, statistics, top tokens of W p_i, nearest training contexts."""
    require(neighbours >= 0, "neighbours", ">= 0", neighbours)
    model = run.prism_model("a prototype card")
    idx = run.index(index, shards)
    labs = idx.labels() if idx is not None else {}
    card = prototype_card(model, run.tokenizer, prototype, index=idx, labels=labs, neighbours=neighbours)
    return PrototypeView(card=card, has_index=idx is not None)


def prototypes(
    run: Run,
    *,
    search: str | None = None,
    token: str | None = None,
    id: int | None = None,
    index: Path | None = None,
    shards: Path | None = None,
    limit: int = 20,
    neighbours: int = 8,
) -> PrototypeListing | PrototypeView:
    """List or search prototypes by label, category or token; an ``id`` shows one prototype's card.

    Args:
        search: Only prototypes whose label or category contains TEXT.
        token: Prototypes that push this token: it is among the 20 tokens their signature W p_i raises most;
            strongest push first.
        id: Show one prototype's card (neighbours, histogram, tokens).
        index: Index folder (default RUN/index if it exists).
        shards: Token shard folder (default: the index's / the run's).
        limit: Rows to list.
        neighbours: Snippets shown with ``id``.
    """
    if id is not None:
        return show_prototype(run, id, index=index, shards=shards, neighbours=neighbours)
    return find_prototypes(run, search=search, token=token, index=index, shards=shards, limit=limit)


__all__ = [
    "VerifyReport",
    "verify_run",
    "PrototypeListing",
    "PrototypeRow",
    "PrototypeView",
    "prototypes",
    "evaluate",
    "explain_text",
    "find_prototypes",
    "generate",
    "sample_continuations",
    "show_prototype",
]
