"""Whole-network attribution baselines on the same model, data and queries: kronfluence EK-FAC and its
``identity`` strategy (plain gradient dot products), plus other kronfluence strategies (kfac, diagonal).

**Task.** The training loss is the *summed* token cross-entropy of a training sequence (the trainer's
sequence j = ``shards.train.sequence(j, T)``); with ``sample=True`` the labels are drawn from the model's
own softmax (true Fisher). The measurement is the summed cross-entropy of a query's measured tokens
(e.g. an answer's tokens only), the same quantity the prototype-space methods attribute. Positive score =
helpful (a step on the training sequence lowers the query's loss), as in ``prismlm.tda.influence``.

**Tracked modules.** Every ``nn.Linear`` of the network (``c_attn``, ``c_proj``, ``c_fc``, ``lm_head``);
the model calls each once per forward and uses no subclass or ``F.linear`` on their weights.
``lm_head.weight`` is tied to ``wte.weight``: kronfluence tracks the ``lm_head`` *module* (its
input/output), so the tied embedding lookup is simply not part of the attributed parameters — like the
prototype bank, layer norms and position embeddings, which are not ``nn.Linear``. The model is deep-copied
before ``prepare_model`` (which rewrites modules in place), so the caller's model is untouched.
"""

from __future__ import annotations

import copy
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet
    from prismlm.model import PrismLM

__all__ = ["KronfluenceBaseline", "PrismTask", "QueryDataset", "TrainDataset"]


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
        qs = [(list(ids)[-(block_size + 1):], max(1, s - max(0, len(ids) - block_size - 1))) for ids, s in queries]
        self.L = max(len(ids) for ids, _ in qs)
        self.items = []
        for ids, s in qs:
            x = torch.full((self.L,), pad_id, dtype=torch.long)
            x[:len(ids)] = torch.tensor(ids)
            m = torch.zeros(self.L - 1, dtype=torch.bool)
            m[s - 1:len(ids) - 1] = True
            self.items.append({"input_ids": x, "mask": m})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def _task_class():
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

    return _PrismTask


def PrismTask():  # noqa: N802 - a factory so that importing this module does not import kronfluence
    """The kronfluence ``Task`` for PRISM / dense models of this package."""
    return _task_class()()


@dataclass
class KronfluenceBaseline:
    """Fit kronfluence factors once on the training sequences, then score query batches against them."""

    model: PrismLM
    """The model (PRISM or the dense baseline); deep-copied, never modified."""
    shards: ShardSet
    strategy: str = "ekfac"
    """identity, diagonal, kfac or ekfac."""
    max_sequences: int | None = None
    batch_size: int = 16
    damping: float | None = None
    """None: kronfluence's heuristic (0.1 × mean eigenvalue)."""
    out_dir: str | Path | None = None
    """Where kronfluence writes factors and scores (default: a temporary folder)."""
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kronfluence.analyzer import Analyzer, prepare_model
        from kronfluence.arguments import FactorArguments

        logging.getLogger("kronfluence").setLevel(logging.WARNING)
        net = copy.deepcopy(self.model).float().eval()
        self.T = net.config.block_size
        n_all = self.shards.train.num_sequences(self.T)
        self.n = n_all if self.max_sequences is None else min(n_all, self.max_sequences)
        self.train_set = TrainDataset(self.shards, self.T, self.n)
        self._tmp = None
        if self.out_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="kronfluence-")
            self.out_dir = self._tmp
        self.task = PrismTask()
        self.net = prepare_model(net, self.task)
        self.analyzer = Analyzer(analysis_name="prism", model=self.net, task=self.task, cpu=True,
                                 disable_tqdm=True, output_dir=str(self.out_dir), disable_model_save=True)
        self.factor_args = FactorArguments(strategy=self.strategy)
        t0 = time.perf_counter()
        self.analyzer.fit_all_factors(factors_name=self.strategy, dataset=self.train_set,
                                      per_device_batch_size=self.batch_size, factor_args=self.factor_args,
                                      overwrite_output_dir=True)
        self.timings["factors_seconds"] = time.perf_counter() - t0
        self._calls = 0

    def scores(self, queries: list[tuple[list[int], int]], pad_id: int = 0, *, query_batch_size: int = 8) -> torch.Tensor:
        """(num_queries, num_train) influence scores of queries given as (token ids, measure_from)."""
        from kronfluence.arguments import ScoreArguments

        qset = QueryDataset(queries, pad_id, self.T)
        self._calls += 1
        name = f"scores_{self._calls}"
        t0 = time.perf_counter()
        self.analyzer.compute_pairwise_scores(
            scores_name=name, factors_name=self.strategy, query_dataset=qset, train_dataset=self.train_set,
            per_device_query_batch_size=min(query_batch_size, len(qset)), per_device_train_batch_size=self.batch_size,
            score_args=ScoreArguments(damping_factor=self.damping), overwrite_output_dir=True)
        self.timings["last_scores_seconds"] = time.perf_counter() - t0
        return self.analyzer.load_pairwise_scores(name)["all_modules"].double()

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
