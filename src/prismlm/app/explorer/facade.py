"""``Explorer``: one run opened for ``prism serve``, with a method per view (explain, prototype, map, search,
steer, training data, document), each returning a dataclass whose ``to_dict()`` is JSON-ready.

Why a class and not plain functions like ``app.operations``: a web app answers many requests against one
opened run, so the things that cost seconds once (the run, its index, the 2-D map of the bank, the
neighbour-text search table) are built once and kept, and every model call is serialised by one lock
(``Session``). The views themselves live in this package's modules, one per view.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from prismlm.app.explorer.bank import MapView, SearchView, bank_map, search_view
from prismlm.app.explorer.explain import ExplainView, explain_view
from prismlm.app.explorer.info import RunInfo, run_info
from prismlm.app.explorer.jobs import Job, Work
from prismlm.app.explorer.limits import Limits
from prismlm.app.explorer.prototype import PrototypeDetail, prototype_view
from prismlm.app.explorer.residual import ContrastView, ResidualView, contrast_view, residual_view
from prismlm.app.explorer.session import Session
from prismlm.app.explorer.steer import Steering, SteerView, steer_view
from prismlm.app.explorer.training import (
    DocumentView,
    TrainingView,
    document_view,
    slow_training_message,
    training_is_slow,
    training_query,
    training_view,
)
from prismlm.app.run import Run
from prismlm.control.suppress import SuppressionSet
from prismlm.model.generation import GREEDY, TEXT_SAMPLING, Sampling
from prismlm.progress import Progress

__all__ = ["Explorer"]


class Explorer(Session):
    """One run opened for the explorer: its index, attribution cache, concept sets and limits. Build with
    ``Explorer.open(path)``; every method is safe to call from many threads (one model call at a time)."""

    def __init__(
        self,
        run: Run,
        *,
        index: Path | None = None,
        cache: Path | None = None,
        concepts: dict[str, SuppressionSet] | None = None,
        limits: Limits = Limits(),
    ) -> None:
        super().__init__(run, index=index, cache=cache, concepts=concepts, limits=limits)
        self._map: MapView | None = None

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        index: Path | None = None,
        cache: Path | None = None,
        device: str = "auto",
        suppress: str | Path | None = "auto",
        suppress_residual: str = "auto",
        concepts: Sequence[Path] = (),
        limits: Limits = Limits(),
    ) -> Explorer:
        """Open ``path`` (a run or checkpoint folder) with its index (default RUN/index if there is one),
        attribution cache (default RUN/attribution-cache), the suppression sets of ``concepts`` (named by
        their concept, else their file name) and ``limits``; ``suppress_residual`` as in ``Run.open``."""
        run = Run.open(path, device=device, suppress=suppress, suppress_residual=suppress_residual)
        sets: dict[str, SuppressionSet] = {}
        for p in concepts:
            s = SuppressionSet.load(p)
            sets[s.concept or Path(p).stem] = s
        if run.suppression is not None:
            sets.setdefault("checkpoint: " + (run.suppression.concept or "suppression.json"), run.suppression)
        return cls(run, index=index, cache=cache, concepts=sets, limits=limits)

    def info(self) -> RunInfo:
        """The run, model shape, artifacts found, categories, concept sets and limits."""
        return run_info(self)

    def explain(
        self,
        text: str,
        *,
        generate: int = 0,
        alternatives: int = 5,
        steering: Steering = Steering(),
        neighbours: int = 3,
        sampling: Sampling = GREEDY,
        chat: bool = False,
        system: str | None = None,
        progress: Progress = False,
    ) -> ExplainView:
        """Every next-token logit of ``text`` (or of ``generate`` tokens sampled after it) as a waterfall of
        prototype slices + residual (+ bias), with the ``alternatives`` most probable other tokens split the
        same way, under the request's ``steering``. ``chat``: ``text`` is a chat message (after the ``system``
        prompt, if given); the assistant's answer to it (written with the run's chat template) is generated
        greedily, at most ``generate`` tokens (default 64) up to the end-of-turn token, and explained. Any
        generation is greedy unless ``sampling`` says otherwise."""
        return explain_view(
            self,
            text,
            generate=generate,
            alternatives=alternatives,
            steering=steering,
            neighbours=neighbours,
            sampling=sampling,
            chat=chat,
            system=system,
            progress=progress,
        )

    def contrast(
        self, token_ids: list[int], token_index: int, token: str, *, steering: Steering = Steering()
    ) -> ContrastView:
        """Why the token at ``token_index`` and not ``token`` (any one token, typed): that token's logit at the
        same position, split into the same active prototypes' slices + residual (``residual.contrast_view``)."""
        return contrast_view(self, token_ids, token_index, token, steering)

    def residual(self, token_ids: list[int], token_index: int, *, answer_from: int = 1, top: int = 8) -> ResidualView:
        """The residual slice of the prediction of ``token_ids[token_index]`` as an object: the tokens W r pushes,
        the prototypes nearest to r with their contexts, and its mean share from ``answer_from`` on."""
        return residual_view(self, token_ids, token_index, answer_from=answer_from, top=top)

    def prototype(self, i: int, *, text: str | None = None, neighbours: int = 8, similar: int = 8) -> PrototypeDetail:
        """Prototype ``i``: label, category, signature tokens, activation histogram, nearest training
        contexts (doc ids, target marked), the most similar prototypes, and where it fires in ``text``."""
        return prototype_view(self, i, text=text, neighbours=neighbours, similar=similar)

    def map(self) -> MapView:
        """A 2-D projection of the bank (unit prototypes; UMAP when ``umap-learn`` is installed, else PCA),
        with category and use per prototype. Computed once and kept."""
        if self._map is None:
            with self.lock:
                if self._map is None:
                    self._map = bank_map(self)
        return self._map

    def search(self, query: str = "", *, token: str | None = None, limit: int = 20) -> SearchView:
        """Prototypes whose label or category contains ``query``, or whose nearest training context does
        (neighbour text), or — with ``token``, and for a ``query`` that is one token — that have to do with
        that token: among the top of their signature W p_i, or in their nearest contexts
        (``prismlm.app.bank_search``)."""
        return search_view(self, query, token=token, limit=limit)

    def steer(
        self,
        prompt: str,
        *,
        steering: Steering,
        tokens: int = 30,
        sampling: Sampling = TEXT_SAMPLING,
        chat: bool = False,
        system: str | None = None,
        progress: Progress = False,
    ) -> SteerView:
        """Generate from the base model and from the steered one with the same seed, side by side, and for
        every token of the steered text the exact change of its logit and the slices that explain it.
        ``chat``: ``prompt`` is a chat message (after the ``system`` prompt), written with the run's chat
        template; either generation ends at the end-of-turn token."""
        return steer_view(
            self,
            prompt,
            steering=steering,
            tokens=tokens,
            sampling=sampling,
            chat=chat,
            system=system,
            progress=progress,
        )

    def training(
        self,
        prompt: str,
        completion: str = "",
        *,
        token: int | None = None,
        top: int = 10,
        progress: Progress = False,
    ) -> TrainingView:
        """The training sequences that most influenced ``completion`` (every token of ``prompt`` when there
        is none) — or only its ``token``-th measured token — with normalised scores, the connecting
        prototypes (their share of each score) and a snippet with its document. Without an attribution
        cache the first request builds gradients first (``training_is_slow``; ``progress`` gets its batches)."""
        return training_view(self, prompt, completion, token=token, top=top, progress=progress)

    def check_training(self, prompt: str, completion: str = "", *, token: int | None = None, top: int = 10) -> None:
        """The checks ``training`` runs first (limits, ``token`` among the measured tokens): a request that
        would be refused is refused before it is queued as a job."""
        training_query(self, prompt, completion, token=token, top=top)

    def training_is_slow(self) -> bool:
        """Whether ``training`` would first build gradients over the training shard (no cache, none built)."""
        return training_is_slow(self)

    def slow_training_message(self) -> str:
        """What a slow ``training`` request says before it starts, with the fast path (the cache command)."""
        return slow_training_message(self)

    def submit(self, kind: str, work: Work, message: str) -> Job:
        """Run ``work`` as a background job (``jobs.Jobs``): poll ``job(id)`` for progress and the result."""
        return self.jobs.submit(kind, work, message)

    def job(self, job_id: str) -> Job:
        return self.jobs.get(job_id)

    def cancel(self, job_id: str) -> Job:
        """Cancel a job: a queued one never starts, a running one stops at its next batch."""
        return self.jobs.cancel(job_id)

    def document(self, doc_index: int, *, position: int | None = None, window: int = 400) -> DocumentView:
        """A training document of the run's own shard (by index; never by path), around ``position`` (the
        marked target token) — where a neighbour or an attributed sequence came from."""
        return document_view(self, doc_index, position=position, window=window)
