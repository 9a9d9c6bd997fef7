"""Whole-network attribution baselines on the same model, data and queries: kronfluence EK-FAC and its
other strategies, TRAK (``traker``), and the hybrid's whole-network scores on the top-M prototype-space
candidates (``hybrid_scores``, ``WholeNetworkGradients``).

Invariant: the same task as prototype space — the summed cross-entropy of a training sequence, measured
on a query's measured tokens, positive = helpful — over every ``nn.Linear`` of a deep copy of the model
(the caller's model is untouched). Task and tracked modules in full: docs/attribution.md ("Whole-network
baselines").
"""

from __future__ import annotations

import copy
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.errors import PrismError
    from prismlm.model import PrismLM

__all__ = [
    "KronfluenceBaseline",
    "PrismTask",
    "QueryDataset",
    "TrainDataset",
    "TrakBaseline",
    "WholeNetworkGradients",
    "hybrid_scores",
]


class _Scratch:
    """A temporary output folder, made when none is given and removed by ``close()`` (or on collection)."""

    _tmp: str | None = None

    def _scratch(self, out_dir: str | Path | None, prefix: str) -> str | Path:
        if out_dir is not None:
            return out_dir
        self._tmp = tempfile.mkdtemp(prefix=prefix)
        return self._tmp

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


class TrainDataset(torch.utils.data.Dataset):
    """Training sequences [0, n) exactly as the trainer sees them: ``(T+1,)`` tokens, all T targets measured."""

    def __init__(self, shards: ShardSet, block_size: int, n: int):
        self.shards, self.T, self.n = shards, block_size, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> dict[str, torch.Tensor]:
        x = torch.from_numpy(self.shards.train.sequence(int(j), self.T))  # (T+1,)
        return {"input_ids": x, "mask": torch.ones(self.T, dtype=torch.bool)}


class QueryDataset(torch.utils.data.Dataset):
    """Queries (token ids, measure_from), right-padded to one length (causal attention: padding after the
    last token changes nothing before it); only targets ``ids[measure_from:]`` are measured."""

    def __init__(self, queries: list[tuple[list[int], int]], pad_id: int, block_size: int):
        qs = [(list(ids)[-(block_size + 1) :], max(1, s - max(0, len(ids) - block_size - 1))) for ids, s in queries]
        self.L = max(len(ids) for ids, _ in qs)
        self.items = []
        for ids, s in qs:
            x = torch.full((self.L,), pad_id, dtype=torch.long)
            x[: len(ids)] = torch.tensor(ids)
            m = torch.zeros(self.L - 1, dtype=torch.bool)
            m[s - 1 : len(ids) - 1] = True
            self.items.append({"input_ids": x, "mask": m})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def _task_class(tracked: tuple[str, ...] | None = None):
    from kronfluence.task import Task

    class _PrismTask(Task):
        """Summed token CE of a sequence (train) / of its measured tokens (measurement)."""

        def _logits(self, batch, model):
            x = batch["input_ids"]
            return model(x[:, :-1]).logits.float(), x[:, 1:]  # (B, T, V), (B, T)

        def compute_train_loss(self, batch, model, sample: bool = False) -> torch.Tensor:
            logits, y = self._logits(batch, model)
            if sample:
                with torch.no_grad():
                    y = torch.multinomial(F.softmax(logits.detach().reshape(-1, logits.shape[-1]), -1), 1).view_as(y)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
            return (ce * batch["mask"].reshape(-1)).sum()

        def compute_measurement(self, batch, model) -> torch.Tensor:
            logits, y = self._logits(batch, model)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
            return (ce * batch["mask"].reshape(-1)).sum()

        def get_influence_tracked_modules(self) -> list[str] | None:
            return None if tracked is None else list(tracked)

    return _PrismTask


def PrismTask(tracked: tuple[str, ...] | None = None):  # noqa: N802 - a factory: importing this module does not import kronfluence
    """The kronfluence ``Task`` for PRISM / dense models of this package; ``tracked``: the names of the
    ``nn.Linear`` modules it tracks (None: kronfluence's default, every one)."""
    return _task_class(tracked)()


@dataclass
class KronfluenceBaseline(_Scratch):
    """Fit kronfluence factors once on the training sequences, then score query batches against them."""

    model: PrismLM
    """The model (PRISM or the dense baseline); deep-copied, never modified."""
    shards: ShardSet
    """The token shards; the training sequences are ``shards.train.sequence(j, T)``."""
    strategy: str = "ekfac"
    """identity, diagonal, kfac or ekfac."""
    max_sequences: int | None = None
    """The first N training sequences only (None: all)."""
    batch_size: int = 16
    """Sequences per batch of the factor fit and of scoring."""
    damping: float | None = None
    """None: kronfluence's heuristic (0.1 × mean eigenvalue)."""
    out_dir: str | Path | None = None
    """Where kronfluence writes factors and scores (default: a temporary folder)."""
    reuse_factors: bool = False
    """Load the factors already in ``out_dir`` instead of fitting them again (the folder must be this
    model's, corpus's and strategy's: the caller keys it)."""
    seed: int = 0
    """Seed of the labels the factor fit samples from the model's softmax (true Fisher): without it, two
    fits of one model gave scores up to 14% apart. The caller's RNG state is left as it was."""
    modules: tuple[str, ...] | None = None
    """Names (``named_modules``) of the ``nn.Linear`` modules to track, e.g. the fine-tuned blocks' (None:
    every one, the unembedding included, whose V×V gradient factor is out of reach for a real vocabulary)."""
    factor_examples: int | None = None
    """Fit the factors (covariances and eigenvalue corrections) on at most this many training sequences, the
    first ones (kronfluence's ``covariance_max_examples`` / ``lambda_max_examples``); scores still cover every
    training sequence. None: all. The factors' cost is then fixed as the corpus grows; the scores' is not."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of each stage (factor fit, scoring), filled in as they run."""

    def __post_init__(self) -> None:
        from kronfluence.analyzer import Analyzer, prepare_model
        from kronfluence.arguments import FactorArguments

        logging.getLogger("kronfluence").setLevel(logging.WARNING)
        net = copy.deepcopy(self.model).float().eval()
        self.T = net.config.block_size
        n_all = self.shards.train.num_sequences(self.T)
        self.n = n_all if self.max_sequences is None else min(n_all, self.max_sequences)
        self.train_set = TrainDataset(self.shards, self.T, self.n)
        self.out_dir = self._scratch(self.out_dir, "kronfluence-")
        self.task = PrismTask(self.modules)
        self.net = prepare_model(net, self.task)
        self.analyzer = Analyzer(
            analysis_name="prism",
            model=self.net,
            task=self.task,
            cpu=True,
            disable_tqdm=True,
            output_dir=str(self.out_dir),
            disable_model_save=True,
        )
        limit = {} if self.factor_examples is None else {
            "covariance_max_examples": self.factor_examples, "lambda_max_examples": self.factor_examples,
        }  # fmt: skip
        self.factor_args = FactorArguments(strategy=self.strategy, **limit)
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # CPU: the sampled labels (torch.multinomial) draw from it
            torch.manual_seed(self.seed)
            self.analyzer.fit_all_factors(
                factors_name=self.strategy,
                dataset=self.train_set,
                per_device_batch_size=self.batch_size,
                factor_args=self.factor_args,
                overwrite_output_dir=not self.reuse_factors,
            )
        self.timings["factors_seconds"] = time.perf_counter() - t0
        self._calls = 0

    def scores(
        self,
        queries: list[tuple[list[int], int]],
        pad_id: int = 0,
        *,
        query_batch_size: int = 8,
        train_ids: list[int] | None = None,
    ) -> torch.Tensor:
        """(num_queries, num_train) influence scores of queries given as (token ids, measure_from);
        ``train_ids``: against those training sequences only, (num_queries, len(train_ids)) (the factors
        stay those fitted on all sequences: what the hybrid's EK-FAC re-scoring of M candidates costs)."""
        from kronfluence.arguments import ScoreArguments

        qset = QueryDataset(queries, pad_id, self.T)
        train = (
            self.train_set
            if train_ids is None
            else torch.utils.data.Subset(self.train_set, [int(j) for j in train_ids])
        )
        self._calls += 1
        name = f"scores_{self._calls}"
        t0 = time.perf_counter()
        self.analyzer.compute_pairwise_scores(
            scores_name=name,
            factors_name=self.strategy,
            query_dataset=qset,
            train_dataset=train,
            per_device_query_batch_size=min(query_batch_size, len(qset)),
            per_device_train_batch_size=self.batch_size,
            score_args=ScoreArguments(damping_factor=self.damping),
            overwrite_output_dir=True,
        )
        self.timings["last_scores_seconds"] = time.perf_counter() - t0
        scores = self.analyzer.load_pairwise_scores(name)["all_modules"].double()
        if self.reuse_factors:  # a long-lived factors folder: one query's scores are not kept beside them
            shutil.rmtree(Path(str(self.out_dir)) / "prism" / f"scores_{name}", ignore_errors=True)
        return scores

    def scores_on(self, queries: list[tuple[list[int], int]], train_ids: list[int], pad_id: int = 0) -> torch.Tensor:
        """``scores(queries, train_ids=train_ids)`` with every query in one batch."""
        return self.scores(queries, pad_id, query_batch_size=len(queries), train_ids=train_ids)


# ----- TRAK ---------------------------------------------------------------------------------------------
def _trak_output_class():
    from trak.modelout_functions import AbstractModelOutput

    class _CausalLMOutput(AbstractModelOutput):
        """TRAK's model output for a causal LM: the summed log-odds margin
        ``f = Σ_t [ℓ_{t,y_t} − logsumexp_{v≠y_t} ℓ_{t,v}]`` over the measured tokens; out-to-loss weight
        ``Q = mean_t (1 − p_{t,y_t})`` (one scalar per sequence, as TRAK's classification outputs)."""

        def __init__(self) -> None:
            super().__init__()

        @staticmethod
        def _margins(model, input_ids, mask):
            logits = model(input_ids[:, :-1]).logits.float()  # (B, T, V)
            y = input_ids[:, 1:]
            correct = logits.gather(-1, y[..., None])[..., 0]
            others = logits.scatter(-1, y[..., None], float("-inf")).logsumexp(-1)
            return logits, y, (correct - others) * mask

        def get_output(self, model, weights, buffers, input_ids, mask):  # noqa: ARG002 - TRAK's signature
            return self._margins(model, input_ids, mask).__getitem__(2).sum(-1)  # (B,)

        def get_out_to_loss_grad(self, model, weights, buffers, batch):  # noqa: ARG002
            input_ids, mask = batch
            with torch.no_grad():
                logits, y, _ = self._margins(model, input_ids, mask)
                p = torch.softmax(logits, -1).gather(-1, y[..., None])[..., 0]
                q = ((1 - p) * mask).sum(-1) / mask.sum(-1).clamp_min(1)
            return q[:, None]

    return _CausalLMOutput


def _trak_gradient_computer():
    from trak.gradient_computers import AbstractGradientComputer, IterativeGradientComputer

    class _Iterative(IterativeGradientComputer):
        """TRAK's per-sample gradients, three changes from ``IterativeGradientComputer``:

        * ``grad_wrt`` is honoured (traker's own iterative computer ignores it, while ``TRAKer`` sizes
          ``grad_dim``, the projector and the feature normalisation √grad_dim by it): only the named
          parameters are differentiated, concatenated in ``named_parameters`` order — the order of traker's
          functional computer — and their total size must be ``grad_dim``;
        * ``allow_unused``: the logits do not depend on the prototype bank (∂ℓ/∂P ≡ 0, spec §6), so those
          parameters get zero gradients instead of an autograd error;
        * one forward per sample: a backward from one sample's margin through a batch's graph costs the whole
          batch's backward (B× the work); the gradients are the same."""

        def __init__(self, model, task, grad_dim, dtype, device, grad_wrt=None) -> None:
            AbstractGradientComputer.__init__(self, model, task, grad_dim, dtype, device)
            self.grad_wrt = None if grad_wrt is None else frozenset(grad_wrt)
            self.load_model_params(model)

        def load_model_params(self, model) -> None:
            self.model = model
            self.model_params = [p for n, p in model.named_parameters() if self.grad_wrt is None or n in self.grad_wrt]
            size = sum(p.numel() for p in self.model_params)
            if size != self.grad_dim:  # TRAKer's grad_dim and ours disagree: the features would be misaligned
                raise RuntimeError(
                    f"TRAK: the differentiated parameters hold {size} values, grad_dim is {self.grad_dim}"
                )

        def compute_per_sample_grad(self, batch):
            grads = torch.zeros(batch[0].shape[0], self.grad_dim, device=batch[0].device)  # (B, grad_dim)
            for b in range(batch[0].shape[0]):
                margin = self.modelout_fn.get_output(self.model, None, None, *(x[b : b + 1] for x in batch))
                g = torch.autograd.grad(margin.sum(), self.model_params, allow_unused=True)
                grads[b] = torch.cat(
                    [
                        (gi if gi is not None else torch.zeros_like(p)).reshape(-1)
                        for gi, p in zip(g, self.model_params, strict=True)
                    ]
                )
            return grads

    return _Iterative


@dataclass
class TrakBaseline(_Scratch):
    """TRAK (PyPI ``traker``) over every parameter of the network, or the named ones, one checkpoint, on CPU.

    Features: per-sequence gradients of the summed log-odds margin of every token (training) / of the
    measured tokens (queries), computed one sequence at a time (``IterativeGradientComputer``: the PRISM
    forward's top-k does not go through ``torch.func.vmap``), projected to ``proj_dim`` by TRAK's dense
    Gaussian ``BasicProjector`` (the CUDA projector needs a GPU). ``proj_dim`` must be > 100 (smaller: the
    projector's block size) and well below the number of training sequences unless ``lambda_reg > 0`` —
    otherwise (XᵀX)⁻¹ is singular and the scores are silently garbage; ``__post_init__`` refuses that.
    Cost on CPU: the projector draws its (grad_dim, 100) Gaussian block again for every 100 dimensions of
    every featurisation call when ``proj_dim > 100`` (~18 s per block for 7.2M parameters on one thread), so
    a large ``batch_size`` means fewer draws. Score sign: positive = helpful, as the other methods."""

    model: PrismLM
    """The model (PRISM or the dense baseline)."""
    shards: ShardSet
    """The token shards; the training sequences are ``shards.train.sequence(j, T)``."""
    proj_dim: int = 512
    """Dimension of the random projection of the per-sequence gradients (> 100)."""
    lambda_reg: float = 0.0
    """Ridge term added to XᵀX (needed when proj_dim is near the number of training sequences)."""
    lambda_relative: bool = False
    """Read ``lambda_reg`` as a multiple of the mean eigenvalue of XᵀX (trace / proj_dim, X the projected
    training features), kronfluence's damping convention: scale-free. The absolute value is
    ``self.lambda_abs`` once the features are in."""
    parameters: Sequence[str] | None = None
    """Names (``named_parameters``) of the parameters to differentiate and project, e.g. a fine-tune's (None:
    every parameter); the others are held fixed. Every name must be one of the model's."""
    max_sequences: int | None = None
    """The first N training sequences only (None: all)."""
    batch_size: int = 16
    """Sequences per featurisation / scoring call (the projector's unit of work)."""
    seed: int = 0
    """Seed of the projector."""
    out_dir: str | Path | None = None
    """Where TRAK writes its features and scores (default: a temporary folder)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of each stage (featurise, score), filled in as they run."""

    def __post_init__(self) -> None:
        from trak import TRAKer

        from prismlm.errors import ConfigError

        logging.getLogger("TRAK").setLevel(logging.WARNING)
        logging.getLogger("GradientComputer").setLevel(logging.ERROR)
        self.net = copy.deepcopy(self.model).float().eval()
        self.T = self.net.config.block_size
        n_all = self.shards.train.num_sequences(self.T)
        self.n = n_all if self.max_sequences is None else min(n_all, self.max_sequences)
        if self.proj_dim <= 100 or (self.lambda_reg <= 0 and self.proj_dim >= self.n):
            raise ConfigError(
                f"TRAK needs 100 < proj_dim < training sequences ({self.n}) or lambda_reg > 0; got "
                f"proj_dim={self.proj_dim}, lambda_reg={self.lambda_reg}"
            )
        self.grad_wrt = self._differentiated(ConfigError)
        self.out_dir = self._scratch(self.out_dir, "trak-")
        self.traker = TRAKer(
            model=self.net,
            task=_trak_output_class()(),
            train_set_size=self.n,
            save_dir=str(Path(self.out_dir) / "trak"),
            load_from_save_dir=True,
            device="cpu",
            gradient_computer=_trak_gradient_computer(),
            proj_dim=self.proj_dim,
            use_half_precision=False,
            projector_seed=self.seed,
            lambda_reg=self.lambda_reg,
            grad_wrt=self.grad_wrt,
            logging_level=logging.WARNING,
        )
        self.train_set = TrainDataset(self.shards, self.T, self.n)
        t0 = time.perf_counter()
        self.traker.load_checkpoint(self.net.state_dict(), model_id=0)
        for j0 in range(0, self.n, self.batch_size):
            items = [self.train_set[j] for j in range(j0, min(self.n, j0 + self.batch_size))]
            batch = (torch.stack([it["input_ids"] for it in items]), torch.stack([it["mask"] for it in items]).float())
            self.traker.featurize(batch=batch, num_samples=len(items))
        self.lambda_abs = self.lambda_reg
        if self.lambda_relative:
            X = torch.as_tensor(self.traker.saver.current_store["grads"]).double()  # (N, proj_dim)
            self.lambda_abs = self.lambda_reg * float(X.pow(2).sum()) / self.proj_dim
            self.traker.score_computer.lambda_reg = self.lambda_abs  # read by finalize_features
        self.traker.finalize_features()
        self.timings["features_seconds"] = time.perf_counter() - t0
        self._calls = 0

    def _differentiated(self, error: type[PrismError]) -> list[str] | None:
        """The names of the parameters to differentiate, in ``named_parameters`` order (None: all), with
        ``requires_grad`` set on exactly those in the copy (no graph is kept for the others). A tied weight may
        be named under any of its names; it is differentiated once."""
        if self.parameters is None:
            for p in self.net.parameters():
                p.requires_grad_(True)
            return None
        every = dict(self.net.named_parameters(remove_duplicate=False))  # tied weights under every name
        wanted = set(self.parameters)
        missing = sorted(wanted - every.keys())
        if missing or not wanted:
            raise error(
                f"TRAK: `parameters` names {len(missing)} parameter(s) the model does not have: "
                f"{', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}"
                if missing
                else "TRAK: `parameters` is empty (None differentiates every parameter)",
                param="parameters",
            )
        chosen = {id(every[n]) for n in wanted}
        for p in self.net.parameters():
            p.requires_grad_(id(p) in chosen)
        return [n for n, p in self.net.named_parameters() if id(p) in chosen]

    def scores(self, queries: list[tuple[list[int], int]], pad_id: int = 0) -> torch.Tensor:
        """(num_queries, num_train) TRAK scores."""
        qset = QueryDataset(queries, pad_id, self.T)
        self._calls += 1
        name = f"q{self._calls}"
        t0 = time.perf_counter()
        self.traker.start_scoring_checkpoint(
            exp_name=name, checkpoint=self.net.state_dict(), model_id=0, num_targets=len(qset)
        )
        for a in range(0, len(qset), self.batch_size):
            items = [qset[i] for i in range(a, min(len(qset), a + self.batch_size))]
            batch = (torch.stack([it["input_ids"] for it in items]), torch.stack([it["mask"] for it in items]).float())
            self.traker.score(batch=batch, num_samples=len(items))
        S = torch.as_tensor(self.traker.finalize_scores(exp_name=name)).double().T.contiguous()  # (Q, N)
        self.timings["last_scores_seconds"] = time.perf_counter() - t0
        return S


# ----- whole-network gradients and the hybrid ------------------------------------------------------------
class WholeNetworkGradients:
    """Per-sequence gradients of the summed token cross-entropy with respect to every trainable parameter
    (flattened, float64), computed on demand — one backward pass per sequence — and optionally memoised.
    ``dot(query, ids)``: whole-network gradient dot products g_qᵀ g_j (positive = helpful), the re-scorer
    of the hybrid. ``computed`` counts the training gradients actually computed (the hybrid's cost)."""

    def __init__(self, model: PrismLM, shards: ShardSet, *, memo: bool = True):
        self.net = copy.deepcopy(model).eval()
        if next(self.net.parameters()).dtype not in (torch.float32, torch.float64):
            self.net = self.net.float()
        self.shards, self.T, self.memo = shards, self.net.config.block_size, memo
        self.params = [p for p in self.net.parameters() if p.requires_grad]
        self._cache: dict[int, torch.Tensor] = {}
        self.computed = 0

    def _grad(self, ids: list[int], start: int) -> torch.Tensor:
        x = torch.tensor(ids)[None]
        logits = self.net(x[:, :-1]).logits[0]  # (L-1, V)
        ce = F.cross_entropy(logits[start - 1 :], x[0, start:], reduction="sum")
        g = torch.autograd.grad(ce, self.params, allow_unused=True)
        return torch.cat(
            [
                (gi if gi is not None else torch.zeros_like(p)).reshape(-1).double()
                for gi, p in zip(g, self.params, strict=True)
            ]
        )

    def query(self, ids: list[int], measure_from: int) -> torch.Tensor:
        ids = list(ids)[-(self.T + 1) :]
        return self._grad(ids, max(1, min(measure_from, len(ids) - 1)))

    def train(self, j: int) -> torch.Tensor:
        if j in self._cache:
            return self._cache[j]
        g = self._grad(self.shards.train.sequence(int(j), self.T).tolist(), 1)
        self.computed += 1
        if self.memo:
            self._cache[j] = g
        return g

    def dot(self, gq: torch.Tensor, ids: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.stack([gq @ self.train(int(j)) for j in ids]) if len(ids) else gq.new_zeros(0)


def hybrid_scores(base: torch.Tensor, rescore, m: int, *, keep_order: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Prototype-space candidates re-ranked by a whole-network score on the top-M only.

    ``base``: (Q, N) scores of the fast method (e.g. the cached prototype-space scores). ``rescore(q, ids)``:
    the whole-network scores (len(ids),) of query q on training sequences ``ids``. For each query the M
    highest base scores are the candidates; they get their whole-network score s_j. Every other sequence keeps
    its base order below them: ``α_q · base_j − c_q``, where α_q > 0 is the least-squares scale (through the
    origin) from base to whole-network scores on the candidates (1 when that fit is not positive) and the one
    shift c_q ≥ 0 per query puts the best non-candidate just below the lowest candidate (by
    δ = 1e-9·(1+|min s|)). So the ranking is: candidates by the whole-network score, then the rest in the
    base order; and sums over subsets (LDS) see scores on one scale. ``keep_order=False`` leaves the rest at
    ``α_q · base_j`` (no shift): the calibrated estimate of each one's influence, which sums over subsets
    should read — the shift adds c_q per candidate in the subset — at the cost of the ranking (a
    non-candidate may then score above a candidate).
    With M ≥ N the result is exactly the whole-network score. Returns (scores (Q, N) float64, candidates
    (Q, M) int64)."""
    base = base.double()
    Q, N = base.shape
    m = max(0, min(int(m), N))
    out = torch.empty_like(base)
    cands = torch.argsort(-base, dim=1, stable=True)[:, :m]
    for q in range(Q):
        c = cands[q]
        s = torch.as_tensor(rescore(q, c.tolist()), dtype=torch.float64).reshape(-1)
        if m == N:
            out[q] = 0
            out[q, c] = s
            continue
        b = base[q, c]
        den = float((b * b).sum())
        alpha = float((b * s).sum()) / den if den > 0 else 0.0
        alpha = alpha if alpha > 0 else 1.0
        rest = alpha * base[q]
        if m and keep_order:
            floor = float(s.min())
            floor -= 1e-9 * (1 + abs(floor))
            rest[c] = float("-inf")
            rest = rest - max(0.0, float(rest.max()) - floor)  # one shift for all: the base order is kept
        out[q] = rest
        out[q, c] = s
    return out, cands
