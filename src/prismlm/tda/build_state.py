"""The build folder of an attribution cache (``OUT.build``) and the checksums a resumed build checks.

A cache build appends its postings batch by batch to three raw files (``seq.raw`` int32, ``proto.raw``
int32, ``sketch.raw`` rows of r floats) and saves the curvature and projection it fitted
(``curvature.safetensors``, ``projection.npy``). ``PostingFiles`` keeps, next to them:

- ``batches.jsonl``: one line per written batch — its end sequence ``j1``, the rows written up to it, the
  tokens, and the crc32 of the batch's bytes in each raw file (appended after the rows are flushed);
- ``state.json``: the build's identity (model, corpus, part, options), the batches recorded, the sha256 of
  the fitted files (rewritten atomically after each batch: the record a resume starts from).

``resume_build`` checks all of it before a resumed build continues: a fitted file that changed is refused
by name (``ArtifactCorrupt``, fix: start over); raw rows that are missing or differ from their batch's crc32
(a truncated, zero-filled or overwritten file) roll the build back to the last batch before them — those
batches are run again, never read as zeros. Bytes past the recorded rows (a write torn by a kill) are
dropped. The check reads each raw file once (crc32: ~1 GB/s); a build pays one crc32 of the bytes it writes.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from prismlm.artifacts import reading, sha256_file
from prismlm.errors import ArtifactCorrupt, ArtifactError

__all__ = ["FITTED", "RAW", "PostingFiles", "Resumed", "record_fitted", "resume_build"]

STATE = "state.json"
"""The progress record of a cache build folder: its identity and the batches written."""
LOG = "batches.jsonl"
"""One line per batch written: ``{"j1", "rows", "tokens", "crc": {name: crc32}}``."""
RAW = ("seq", "proto", "sketch")
"""The raw posting files, ``<name>.raw``, in the order each batch appends to them."""
FITTED = ("curvature.safetensors", "projection.npy")
"""What the fit passes leave for a resumed build (it reads them instead of fitting again)."""
_START_OVER = "rerun without --resume to start the build over"


def write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def record_fitted(folder: Path) -> dict[str, str]:
    """sha256 of the fitted files just saved in ``folder`` (recorded in ``state.json``)."""
    return {name: sha256_file(folder / name) for name in FITTED}


@dataclass
class Resumed:
    """Where a resumed build continues: the state it was interrupted in, rolled back to its last good batch."""

    state: dict[str, Any]
    """``state.json`` with ``done_to``, ``rows``, ``tokens``, ``batches`` of the last good batch."""
    log: list[dict[str, Any]]
    """The good batches' records (``batches.jsonl``)."""
    note: str | None = None
    """What was rolled back, if anything (shown to the user)."""


def _state(folder: Path, started: dict[str, Any]) -> dict[str, Any] | None:
    """``state.json`` of ``folder`` (None: nothing to resume), refused when started otherwise."""
    path = folder / STATE
    if not path.exists():
        return None
    with reading(path, "cache build progress", fix=_START_OVER):
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
    differ = sorted(k for k in started if state.get(k) != started[k])
    if differ:
        raise ArtifactError(f"cannot resume the cache build in {folder}: it was started with other {', '.join(differ)}",
                            fix="rerun with the same model, shards and options, or without --resume to start over",
                            path=folder)
    if not isinstance(state.get("fitted"), dict) or not isinstance(state.get("batches"), int):
        raise ArtifactError(f"cannot resume the cache build in {folder}: it records no checksums (an older prismlm "
                            "wrote it), so its files cannot be checked", fix=_START_OVER, path=folder)
    return state


def _check_fitted(folder: Path, fitted: dict[str, str]) -> None:
    for name, digest in fitted.items():
        f = folder / name
        if not f.is_file() or sha256_file(f) != digest:
            raise ArtifactCorrupt(f"cannot resume the cache build in {folder}: {f} is missing or was changed after "
                                  f"it was fitted (its sha256 differs from {folder / STATE})", fix=_START_OVER, path=f)


def _read_log(folder: Path, n: int) -> list[dict[str, Any]]:
    """The first ``n`` records of ``batches.jsonl`` (lines after them: a write torn by a kill, dropped)."""
    path = folder / LOG
    with reading(path, "cache build log", fix=_START_OVER):
        lines = path.read_bytes().split(b"\n")[:n] if n else []
        log = [json.loads(line) for line in lines]
        if len(log) < n or any(not isinstance(e, dict) or set(e) != {"j1", "rows", "tokens", "crc"} for e in log):
            raise ValueError(f"{len(log)} of the {n} batches recorded in {STATE} are complete")
    return log


def _good_batches(folder: Path, log: list[dict[str, Any]], widths: dict[str, int]) -> int:
    """How many leading batches of ``log`` are whole and intact in every raw file: each file read once,
    batch by batch, its bytes compared with the batch's crc32."""
    good = len(log)
    for name in RAW:
        with open(folder / f"{name}.raw", "rb") as f:
            lo = 0
            for b, e in enumerate(log[:good]):
                data = f.read((int(e["rows"]) - lo) * widths[name])
                if len(data) != (int(e["rows"]) - lo) * widths[name] or zlib.crc32(data) != int(e["crc"][name]):
                    good = b
                    break
                lo = int(e["rows"])
    return good


def resume_build(folder: Path, started: dict[str, Any], widths: dict[str, int]) -> Resumed | None:
    """The build to continue in ``folder`` (None: no recorded state, start over), checked: its identity
    (``ArtifactError`` if started otherwise), the fitted files (``ArtifactCorrupt`` naming a changed one),
    and every recorded batch of the raw files against its crc32 — a damaged or missing batch and all after
    it are dropped and written again. ``widths``: bytes per row of each raw file."""
    state = _state(folder, started)
    if state is None:
        return None
    _check_fitted(folder, state["fitted"])
    for name in RAW:
        (folder / f"{name}.raw").touch()
    log = _read_log(folder, state["batches"])
    good = _good_batches(folder, log, widths)
    note = None
    if good < len(log):
        first = int(log[good - 1]["j1"]) if good else int(state["start"])
        note = (f"{folder}: the raw postings of sequences from {first} on are missing or damaged (their crc32 "
                f"differs from {LOG}); building them again")
        log = log[:good]
        last = log[-1] if log else {"j1": state["start"], "rows": 0, "tokens": 0}
        state = {**state, "done_to": int(last["j1"]), "rows": int(last["rows"]), "tokens": int(last["tokens"]),
                 "batches": good}
    return Resumed(state=state, log=log, note=note)


class PostingFiles:
    """The raw posting files of a build folder, appended a batch at a time: each batch's bytes, then its
    record in ``batches.jsonl``, then ``state.json`` (so a record never precedes its rows)."""

    def __init__(self, folder: Path, record: dict[str, Any], resumed: Resumed | None) -> None:
        self.folder = folder
        self.record = record
        """What every ``state.json`` holds: the build's identity, its start and the fitted files' sha256."""
        self.log = resumed.log if resumed is not None else []
        self.rows = int(resumed.state["rows"]) if resumed is not None else 0
        self.widths: dict[str, int] = {}
        self.files: dict[str, BinaryIO] = {}

    def open(self, widths: dict[str, int]) -> None:
        """Truncate every file to the recorded rows (drops a torn write and rolled-back batches), append after."""
        self.widths = widths
        for name in RAW:
            path = self.folder / f"{name}.raw"
            path.touch()
            os.truncate(path, self.rows * widths[name])
            self.files[name] = open(path, "ab")  # noqa: SIM115 — closed by close()
        with open(self.folder / LOG, "wb") as f:  # the good records only
            f.write(b"".join(json.dumps(e).encode() + b"\n" for e in self.log))

    def append(self, rows: dict[str, np.ndarray], *, j1: int, tokens: int, **extra: float) -> None:
        """Write one batch (``rows[name]``: (n,) int32 or (n, r) sketches) and record it as done up to ``j1``."""
        crc = {}
        for name in RAW:
            data = np.ascontiguousarray(rows[name]).tobytes()
            crc[name] = zlib.crc32(data)
            self.files[name].write(data)
        for f in self.files.values():
            f.flush()
        self.rows += len(rows["seq"])
        entry = {"j1": j1, "rows": self.rows, "tokens": tokens, "crc": crc}
        self.log.append(entry)
        with open(self.folder / LOG, "ab") as f:
            f.write(json.dumps(entry).encode() + b"\n")
        write_json_atomic(self.folder / STATE, {**self.record, "done_to": j1, "tokens": tokens, "rows": self.rows,
                                                "batches": len(self.log), **extra})

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}
