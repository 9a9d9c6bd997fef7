"""bergson (EleutherAI, ``bergson==2.5.1``) scores of a run's model, from bergson's own venv: a baseline of
``bench/attribution.py --bergson PYTHON`` and of the ``attribution`` stage of ``bench/real_claims.py``
(``BERGSON_PYTHON``).

The venv: ``python3 -m venv V && V/bin/pip install torch==<this torch> bergson==2.5.1 && V/bin/pip uninstall -y
torchvision torchaudio`` (pip pulls builds of those two made for another torch, whose import then fails inside
transformers); ``bergson_driver.py`` beside this module (run by its path, so that bergson's venv need not
import prismlm's dependencies to dot two indexes) holds the workarounds bergson needs with this package's export.

Which modules: by default every module bergson tracks (each block's ``nn.Linear`` modules and the unembedding);
``modules`` (names as ``PrismLM.named_modules()`` gives them, e.g. ``transformer.layers.29.self_attn.o_proj``)
restricts the index to the gradients of those, so that bergson is given the same modules as another method
(EK-FAC's in ``bench/claims_attribution.py``). bergson 2.5.1 can only name modules to leave out (``--filter_modules``), so
the driver passes it the others (``bergson_driver.py``); ``build_index`` checks the index it gets. bergson still
runs the backward pass from the loss down to the input embeddings (it sets them to require a gradient), so
restricting the modules shrinks the index, not the backward pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from prismlm.data.shards import ShardSet
from prismlm.errors import ConfigError

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


def build_command(
    python: str,
    model_dir: Path,
    dataset: Path,
    index: Path,
    T: int,
    proj_dim: int,
    modules: Sequence[str] | None = None,
) -> list[str]:
    """The command line ``build_index`` runs: ``bergson build index --dataset dataset`` through the driver
    (summed token loss, fp32, ``proj_dim`` per module, batches of T tokens), restricted to ``modules`` when given
    (the driver's ``--keep_modules``; None: every module bergson tracks)."""
    cmd = [python, str(DRIVER), "build", str(index), "--dataset", str(dataset)]
    cmd += ["--model", str(model_dir), "--projection_dim", str(proj_dim), "--precision", "fp32"]
    cmd += ["--token_batch_size", str(T), "--model_kwargs", "trust_remote_code=True"]
    cmd += ["--loss_reduction", "sum", "--overwrite", "true"]
    if modules is not None:
        if not modules or any(not m or "," in m for m in modules):
            raise ConfigError(
                f"`modules` must be module names without commas, got {modules!r}",
                fix="pass None for every module bergson tracks",
                param="modules",
            )
        cmd += ["--keep_modules", ",".join(modules)]
    return cmd


def index_modules(index: Path) -> dict[str, int]:
    """The modules a bergson index holds, with the projected dimensions of each (its ``info.json``)."""
    info = json.loads((index / "info.json").read_text())
    return {str(k): int(v) for k, v in info["grad_sizes"].items()}


def build_index(
    python: str,
    model_dir: Path,
    dataset: Path,
    index: Path,
    T: int,
    proj_dim: int,
    threads: int | None = None,
    modules: Sequence[str] | None = None,
) -> float:
    """``bergson build index --dataset dataset`` under ``python`` (``build_command``, on CPU); returns its
    seconds (the subprocess's start and model load included). With ``modules``, raises ``RuntimeError`` unless
    the index holds exactly those modules."""
    cmd = build_command(python, model_dir, dataset, index, T, proj_dim, modules)
    t0 = time.perf_counter()
    _run(cmd, _env(threads), f"build {dataset.stem}")
    secs = time.perf_counter() - t0
    if modules is not None and set(index_modules(index)) != set(modules):
        raise RuntimeError(f"bergson indexed {sorted(index_modules(index))}, asked for {sorted(modules)}")
    return secs


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
    modules: Sequence[str] | None = None,
) -> tuple[np.ndarray, dict[str, float]]:
    """(Q, N) bergson gradient-similarity scores and the seconds of each step: ``prism export`` of the run
    (into ``work/model``), then ``bergson_driver.py`` under ``python`` (one with bergson==2.5.1 installed)
    builds an index of the training sequences and one of the queries (``write_datasets``; ``build_index``, of
    ``modules`` only when given) and dots them. Raises ``RuntimeError`` with bergson's last error line."""
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
            python, model_dir, work / f"{name}.jsonl", work / f"{name}-idx", T, proj_dim, threads, modules
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
