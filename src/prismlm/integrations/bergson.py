"""bergson (EleutherAI, ``bergson==2.5.1``) scores of a run's model, from bergson's own venv: a baseline of
``bench/attribution.py --bergson PYTHON`` and of the ``attribution`` stage of ``bench/real_claims.py``
(``BERGSON_PYTHON``).

The venv: ``python3 -m venv V && V/bin/pip install torch==<this torch> bergson==2.5.1 && V/bin/pip uninstall -y
torchvision torchaudio`` (pip pulls builds of those two made for another torch, whose import then fails inside
transformers); ``bergson_driver.py`` beside this module (run by its path, so that bergson's venv need not
import prismlm's dependencies to dot two indexes) holds the two workarounds bergson needs with this package's export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from prismlm.data.shards import ShardSet

DRIVER = Path(__file__).with_name("bergson_driver.py")
SRC = Path(__file__).resolve().parents[2]  # the folder prismlm is imported from (the export's model code needs it)


def _run(cmd: list[str], env: dict[str, str], what: str) -> None:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bergson {what}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")


def write_datasets(folder: Path, shards: ShardSet, queries: list[tuple[list[int], int]], N: int, T: int) -> None:
    """``train.jsonl`` (the N training sequences, every target labelled) and ``query.jsonl`` (each query cut to
    its last T tokens, only the measured targets labelled, -100 elsewhere)."""
    with open(folder / "train.jsonl", "w") as f:
        for j in range(N):
            ids = shards.train.sequence(j, T).tolist()[:T]  # the model takes at most T tokens
            f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
    with open(folder / "query.jsonl", "w") as f:
        for ids, start in queries:
            ids = list(ids)
            cut = max(0, len(ids) - T)
            ids, start = ids[cut:], max(1, start - cut)
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * start + ids[start:]}) + "\n")


def _env(threads: int | None) -> dict[str, str]:
    """The subprocess's environment: ``src`` importable, no GPU, ``threads`` CPU threads (None: torch's default)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(SRC)}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def build_index(
    python: str, model_dir: Path, dataset: Path, index: Path, T: int, proj_dim: int, threads: int | None = None
) -> float:
    """``bergson build index --dataset dataset`` under ``python`` (summed token loss, fp32, ``proj_dim`` per
    module, every module bergson tracks, on CPU); returns its seconds (the subprocess's start and model load
    included)."""
    env = _env(threads)
    cmd = [python, str(DRIVER), "build", str(index), "--dataset", str(dataset)]
    cmd += ["--model", str(model_dir), "--projection_dim", str(proj_dim), "--precision", "fp32"]
    cmd += ["--token_batch_size", str(T), "--model_kwargs", "trust_remote_code=True"]
    cmd += ["--loss_reduction", "sum", "--overwrite", "true"]
    t0 = time.perf_counter()
    _run(cmd, env, f"build {dataset.stem}")
    return time.perf_counter() - t0


def bergson_scores(
    python: str,
    run_dir: Path,
    shards: ShardSet,
    queries: list[tuple[list[int], int]],
    N: int,
    T: int,
    work: Path,
    *,
    proj_dim: int = 16,
    threads: int | None = None,
) -> tuple[np.ndarray, dict[str, float]]:
    """(Q, N) bergson gradient-similarity scores and the seconds of each step: ``prism export`` of the run
    (into ``work/model``), then ``bergson_driver.py`` under ``python`` (one with bergson==2.5.1 installed)
    builds an index of the training sequences and one of the queries (``write_datasets``; ``build_index``) and
    dots them. Raises ``RuntimeError`` with bergson's last error line."""
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    prism = Path(sys.executable).parent / "prism"
    t0 = time.perf_counter()
    subprocess.run(
        [str(prism), "export", str(run_dir), str(model_dir), "--overwrite"], check=True, capture_output=True, text=True
    )
    write_datasets(work, shards, queries, N, T)
    secs = {"export_s": time.perf_counter() - t0}
    for name in ("train", "query"):
        secs[f"{name}_index_s"] = build_index(
            python, model_dir, work / f"{name}.jsonl", work / f"{name}-idx", T, proj_dim, threads
        )
    out = work / "scores.npy"
    t0 = time.perf_counter()
    _run(
        [python, str(DRIVER), "scores", str(work / "train-idx"), str(work / "query-idx"), str(out)],
        _env(threads),
        "scores",
    )
    secs["scores_s"] = time.perf_counter() - t0
    S = np.load(out)
    if S.shape != (len(queries), N):
        raise RuntimeError(f"bergson returned scores of shape {S.shape}, expected {(len(queries), N)}")
    return S, secs
