"""``prismlm.tda.storage_study`` on a tiny trained model, and bergson's input files (``prismlm.integrations.bergson``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import QUERY_TEXTS, train_tiny_run

from prismlm.integrations.bergson import write_datasets
from prismlm.tda.storage_study import StorageStudySettings, _doc_sum, storage_study


def test_document_sums_add_each_documents_sequences():
    S = np.arange(12.0).reshape(2, 6)
    docs = np.array([0, 0, 1, 2, 2, 2])
    assert np.array_equal(_doc_sum(S, docs, 3), np.array([[1.0, 2, 12], [13, 8, 30]]))


def test_an_orthogonal_sketch_at_full_rank_keeps_the_full_methods_ranking(tiny_shards, tmp_path):
    ckpt, _ = train_tiny_run(tiny_shards, tmp_path, steps=20, batch_size=8, warmup_steps=2)
    net = ckpt.model.eval()
    tok = ckpt.tokenizer
    queries = [([tok.eot_id] + tok.encode(t), s) for t, s in QUERY_TEXTS[:3]]
    d = net.config.n_embd
    s = StorageStudySettings(
        max_sequences=64, curvature_sequences=32, pca_sequences=32, projections=("orthogonal",), ranks=(d, 2 * d),
        main_rank=d, dtypes=("float32", "int8"), prunes=(0.0,), aggregates=("sequence",),
    )  # fmt: skip
    study = storage_study(net, tiny_shards, queries, s, tmp_path / "work")
    rows = {r["name"]: r for r in study["compression"]}
    # r = 2d is skipped; float32 gets both id encodings, int8 delta only
    assert sorted(rows) == sorted(
        [f"r{d}-orthogonal-float32-p0-sequence-int32", f"r{d}-orthogonal-float32-p0-sequence-delta",
         f"r{d}-orthogonal-int8-p0-sequence-delta"]
    )  # fmt: skip
    exact = rows[f"r{d}-orthogonal-float32-p0-sequence-int32"]
    assert exact["top10_vs_full"] == pytest.approx(1.0) and exact["top10_vs_fp32"] == 1.0
    assert rows[f"r{d}-orthogonal-int8-p0-sequence-delta"]["bytes_per_token"] < exact["bytes_per_token"]
    assert study["num_train"] == 64 and study["queries"] == 3 and study["reference"]["r"] == d
    assert study["best_at_32_bytes_documents"] is None  # no document-level variant was asked for
    assert set(study["per_query"]) == set(rows)


def test_bergson_datasets_label_every_training_target_and_only_the_measured_query_targets(tiny_shards, tmp_path):
    T = 8
    queries = [(list(range(1, 13)), 10), ([5, 6, 7], 1)]  # the first is cut to its last T tokens
    write_datasets(tmp_path, tiny_shards, queries, 3, T)
    train = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(train) == 3 and all(r["labels"] == r["input_ids"] and len(r["input_ids"]) == T for r in train)
    assert train[1]["input_ids"] == tiny_shards.train.sequence(1, T).tolist()[:T]
    q = [json.loads(x) for x in (tmp_path / "query.jsonl").read_text().splitlines()]
    assert q[0]["input_ids"] == list(range(5, 13)) and q[0]["labels"] == [-100] * 6 + [11, 12]
    assert q[1] == {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}
