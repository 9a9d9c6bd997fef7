"""One run opened for the explorer (``Session``): the model, its index and attribution cache, the concept
sets, the limits, one lock, and the tables built once on first use. Every view module takes a ``Session``.

Invariant: every model call happens under ``Session.lock`` — the model's interventions are process-wide
state (``model.intervene`` sets multipliers on the module), so two requests steering differently must never
overlap, and queued requests cannot pile up activations. Slow work (a pass over the training shard) takes the
lock one batch at a time, from a background job (``Session.jobs``), so it never holds back a quick request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from prismlm.app.bank_search import TokenSearch
from prismlm.app.explorer.jobs import FairLock, Jobs
from prismlm.app.explorer.limits import Limits
from prismlm.app.run import Run
from prismlm.control.suppress import SuppressionSet
from prismlm.data.shards import ShardSet
from prismlm.errors import ArtifactError
from prismlm.explain import PrototypeIndex
from prismlm.explain.index import Labels
from prismlm.model import Intervention, PrismLM
from prismlm.progress import Progress
from prismlm.tda.influence import FullGradients

__all__ = ["Session"]


class Session:
    """One run opened for the explorer; safe to use from many threads (one model call at a time)."""

    def __init__(
        self,
        run: Run,
        *,
        index: Path | None = None,
        cache: Path | None = None,
        concepts: Mapping[str, SuppressionSet] | None = None,
        limits: Limits = Limits(),
    ) -> None:
        self.run = run
        self.model: PrismLM = run.prism_model("the explorer")
        self.limits = limits
        self.lock = FairLock()
        """Held around every model call (interventions are module state; see the module docstring); granted
        first come, first served."""
        self.jobs = Jobs(max_queued=limits.max_jobs)
        """The slow work of this run (``jobs.Jobs``): one background thread, a bounded queue."""
        self._build_lock = threading.Lock()
        self.index: PrototypeIndex | None = run.index(index)
        if self.index is not None:  # a corrupt labels.json: serve without labels and say so in /api/info
            self.index.lenient_labels = True
        self.cache_dir = cache
        if cache is not None and not self.has_cache:
            raise ArtifactError(f"no attribution cache at {cache}", fix=f"prism attribute-cache {run.path}")
        self.concepts = dict(concepts or {})
        for sset in self.concepts.values():
            sset.check(self.model, run.identity)
        self._neighbour_text: list[str] | None = None
        self._full: FullGradients | None = None
        self._token_search: TokenSearch | None = None

    @property
    def has_cache(self) -> bool:
        """Whether an attribution cache is there now (one built or rebuilt while serving is picked up:
        ``Run.cache`` re-opens a cache whose manifest changed)."""
        return (self.cache_dir or self.run.folder / "attribution-cache").joinpath("manifest.json").exists()

    @property
    def num_prototypes(self) -> int:
        return self.model.require_prototypes().num_prototypes

    def labels(self) -> Labels:
        return self.index.labels() if self.index is not None else {}

    def labelled(self, ids: Sequence[int]) -> dict[int, tuple[str | None, str | None]]:
        """Prototype id → (label, category), None where unlabelled."""
        labs = self.labels()
        return {i: (labs.get(i, {}).get("label"), labs.get(i, {}).get("category")) for i in ids}

    @contextmanager
    def locked(self, ivs: tuple[Intervention, ...]) -> Iterator[PrismLM]:
        """The model lock, then the run's interventions and ``ivs`` applied: one step of a generation that
        gives the lock back between tokens."""
        with self.lock, self.run.intervened(*ivs) as model:
            yield model

    def shards_dir(self) -> Path | None:
        """The shards the index points into (the run's own otherwise): attribution reads the same ones."""
        if self.index is not None and self.index.shards is not None:
            return Path(self.index.shards.root)
        return None

    def shards(self) -> ShardSet:
        if self.index is not None and self.index.shards is not None:
            return self.index.shards
        return self.run.shards()

    # ----- built once, on first use ---------------------------------------------------------------------------
    def neighbour_texts(self) -> list[str]:
        """The nearest training context of every prototype as text (decoded once, kept): what neighbour
        search matches. Needs an index."""
        if self._neighbour_text is None:
            assert self.index is not None
            with self.lock:
                if self._neighbour_text is None:
                    ids = list(range(self.num_prototypes))
                    nbs = self.index.neighbours_of(ids, 1, before=8, after=2)
                    self._neighbour_text = [
                        " ".join(n.before + (n.target or "") + n.after for n in nbs[i]) for i in ids
                    ]
        return self._neighbour_text

    def token_search(self) -> TokenSearch:
        """The signature/context tables of token search (``prismlm.app.bank_search``; they are built on first
        use, under their own lock)."""
        if self._token_search is None:
            self._token_search = TokenSearch(self.model, self.run.tokenizer, self.index)
        return self._token_search

    @property
    def full_gradients_ready(self) -> bool:
        """Whether ``full_gradients`` is built (a training request without a cache is quick from then on)."""
        return self._full is not None

    def full_gradients(self, shards: ShardSet, progress: Progress = False) -> FullGradients:
        """Without an attribution cache: the block gradients of the first ``Limits.full_attribution_sequences``
        training sequences, built once (every later request, e.g. a per-token filter, reuses them). Call it
        *without* holding ``lock``: each batch of the two passes takes it, so other requests run between
        batches; ``progress`` gets each batch (and may raise to stop the build)."""
        if self._full is None:
            with self._build_lock:
                if self._full is None:
                    self._full = FullGradients.build(
                        self.model,
                        shards,
                        max_sequences=self.limits.full_attribution_sequences,
                        progress=progress,
                        guard=lambda: self.lock,
                    )
        return self._full
