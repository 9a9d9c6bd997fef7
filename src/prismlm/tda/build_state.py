"""The build folder of an attribution cache (``OUT.build``) and the checksums a resumed build checks:
``PostingFiles`` appends each batch's raw rows and then its record line (``batches.jsonl``, with crc32s);
``resume_build`` checks them before a build continues.

Invariant: a resumed build never reads damaged rows — a changed fitted file is refused by name
(``ArtifactCorrupt``), missing or damaged rows roll the build back to the last intact batch. The files and
checks in full: docs/attribution.md ("The build folder").
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypedDict, cast

import numpy as np

from prismlm.artifacts import JSON, reading, sha256_file
from prismlm.errors import ArtifactCorrupt, ArtifactError

__all__ = [
    "FITTED",
    "RAW",
    "BatchRecord",
    "BuildStart",
    "BuildState",
    "PostingFiles",
    "Resumed",
    "record_fitted",
    "resume_build",
]

STATE = "state.json"
"""What a cache build folder was started with: its identity, first sequence and fitted files' sha256."""
LOG = "batches.jsonl"
"""One line per batch written: ``{"j1", "rows", "tokens", "seconds", "crc": {name: crc32}}``."""
_ENTRY = {"j1", "rows", "tokens", "seconds", "crc"}
RAW = ("seq", "proto", "sketch")
"""The raw posting files, ``<name>.raw``, in the order each batch appends to them."""
FITTED = ("curvature.safetensors", "projection.npy")
"""What the fit passes leave for a resumed build (it reads them instead of fitting again)."""
_START_OVER = "rerun without resuming to start the build over"


class BuildStart(TypedDict):
    """What a build must share with the one it resumes (the first entries of ``state.json``)."""

    model_sha256: str
    shard_key: str
    part: list[int]
    universe: int
    options: dict[str, JSON]
    """``AttributionConfig.to_dict()``."""
    curvature_given: bool
    curvature_F: str | None
    """sha256 of the given curvature's F, or None."""


class BuildState(BuildStart, total=False):
    """``state.json``: the start, then the first sequence and fitted files' sha256 (written once the fit
    passes are done), and, on a resume, where the last good batch left off."""

    start: int
    fitted: dict[str, str]
    curvature_seconds: float
    done_to: int
    rows: int
    tokens: int
    postings_seconds: float


class BatchRecord(TypedDict):
    """One line of ``batches.jsonl``: done up to sequence ``j1``, ``rows`` raw rows in all, the crc32 of
    this batch's bytes in each raw file."""

    j1: int
    rows: int
    tokens: int
    seconds: float
    crc: dict[str, int]


def _write_json_atomic(path: Path, obj: BuildState) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def record_fitted(folder: Path) -> dict[str, str]:
    """sha256 of the fitted files just saved in ``folder`` (recorded in ``state.json``)."""
    return {name: sha256_file(folder / name) for name in FITTED}


@dataclass
class Resumed:
    """Where a resumed build continues: the state it was interrupted in, rolled back to its last good batch."""

    state: BuildState
    """``state.json`` with the last good batch's ``done_to``, ``rows``, ``tokens`` and ``postings_seconds``."""
    log: list[BatchRecord]
    """The good batches' records (``batches.jsonl``)."""
    note: str | None = None
    """What was rolled back, if anything (shown to the user)."""


def _state(folder: Path, started: BuildStart) -> BuildState | None:
    """``state.json`` of ``folder`` (None: nothing to resume), refused when started otherwise."""
    path = folder / STATE
    if not path.exists():
        return None
    with reading(path, "cache build progress", fix=_START_OVER):
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
    differ = sorted(k for k, v in started.items() if state.get(k) != v)
    if differ:
        raise ArtifactError(
            f"cannot resume the cache build in {folder}: it was started with other {', '.join(differ)}",
            fix="rerun with the same model, shards and options, or without resuming to start over",
            path=folder,
        )
    if not isinstance(state.get("fitted"), dict) or not isinstance(state.get("start"), int):
        raise ArtifactError(
            f"cannot resume the cache build in {folder}: it records no checksums (an older prismlm "
            "wrote it), so its files cannot be checked",
            fix=_START_OVER,
            path=folder,
        )
    return cast(BuildState, state)  # a JSON object holding the start it is compared with, fitted and start


def _check_fitted(folder: Path, fitted: dict[str, str]) -> None:
    for name, digest in fitted.items():
        f = folder / name
        if not f.is_file() or sha256_file(f) != digest:
            raise ArtifactCorrupt(
                f"cannot resume the cache build in {folder}: {f} is missing or was changed after "
                f"it was fitted (its sha256 differs from {folder / STATE})",
                fix=_START_OVER,
                path=f,
            )


def _read_log(folder: Path) -> tuple[list[BatchRecord], bool]:
    """The records of ``batches.jsonl`` up to its first incomplete or garbled line, and whether a garbled
    line (not the last one, which a kill may tear) cut it short."""
    path = folder / LOG
    lines = path.read_bytes().split(b"\n") if path.is_file() else [b""]
    log: list[BatchRecord] = []
    for line in lines[:-1]:  # the last piece follows the last newline: empty, or a line torn by a kill
        try:
            e = json.loads(line)
        except ValueError:
            e = None
        if not _entry_ok(e, log[-1]["rows"] if log else 0):
            return log, True
        log.append(e)
    return log, False


def _ints(*v: object) -> bool:
    return all(type(x) is int for x in v)  # not bool


def _entry_ok(e: object, rows_before: int) -> bool:
    """Whether ``e`` is a whole batch record whose rows follow ``rows_before``."""
    return (
        isinstance(e, dict)
        and set(e) == _ENTRY
        and _ints(e["j1"], e["rows"], e["tokens"])
        and e["rows"] >= rows_before
        and isinstance(e["seconds"], int | float)
        and isinstance(e["crc"], dict)
        and set(e["crc"]) == set(RAW)
        and _ints(*e["crc"].values())
    )


def _good_batches(folder: Path, log: list[BatchRecord], widths: dict[str, int]) -> int:
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


def resume_build(folder: Path, started: BuildStart, widths: dict[str, int]) -> Resumed | None:
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
    log, garbled = _read_log(folder)
    good = _good_batches(folder, log, widths)
    note = None
    if good < len(log) or garbled:
        first = int(log[good - 1]["j1"]) if good else int(state["start"])
        note = (
            f"{folder}: the raw postings of sequences from {first} on are missing or damaged (their crc32 "
            f"differs from {LOG}, or their record is garbled); building them again"
        )
    log = log[:good]
    j1, rows, tokens, seconds = (
        (log[-1]["j1"], log[-1]["rows"], log[-1]["tokens"], log[-1]["seconds"]) if log else (state["start"], 0, 0, 0.0)
    )
    state = {**state, "done_to": int(j1), "rows": int(rows), "tokens": int(tokens), "postings_seconds": float(seconds)}
    return Resumed(state=state, log=log, note=note)


class PostingFiles:
    """The raw posting files of a build folder, appended a batch at a time: each batch's bytes (flushed),
    then its line in ``batches.jsonl`` (so a record never precedes its rows)."""

    def __init__(self, folder: Path, resumed: Resumed | None) -> None:
        self.folder = folder
        self.log = resumed.log if resumed is not None else []
        self.rows = int(resumed.state["rows"]) if resumed is not None else 0
        self.files: dict[str, BinaryIO] = {}
        self.record: BinaryIO | None = None

    def open(self, widths: dict[str, int], started: BuildState | None) -> None:
        """Truncate every raw file to the recorded rows (``widths``: bytes per row; drops a torn write and
        rolled-back batches) and the log to its good lines, to append after them. ``started``: a new
        build's ``state.json`` (None when resuming: kept as it is)."""
        if started is not None:
            _write_json_atomic(self.folder / STATE, started)
        for name in RAW:
            path = self.folder / f"{name}.raw"
            path.touch()
            os.truncate(path, self.rows * widths[name])
            self.files[name] = open(path, "ab")  # noqa: SIM115 — closed by close()
        log = b"".join(json.dumps(e).encode() + b"\n" for e in self.log)
        (self.folder / LOG).write_bytes(log)  # a kill now: the same good lines, or fewer (those batches rebuilt)
        self.record = open(self.folder / LOG, "ab")  # noqa: SIM115 — closed by close()

    def append(self, rows: dict[str, np.ndarray], *, j1: int, tokens: int, seconds: float) -> None:
        """Write one batch (``rows[name]``: (n,) int32 or (n, r) sketches) and record it as done up to ``j1``
        (``tokens`` and the pass's ``seconds`` so far)."""
        assert self.record is not None, "open() first"
        crc = {}
        for name in RAW:
            data = np.ascontiguousarray(rows[name]).tobytes()
            crc[name] = zlib.crc32(data)
            self.files[name].write(data)
        for f in self.files.values():
            f.flush()
        self.rows += len(rows["seq"])
        entry: BatchRecord = {"j1": j1, "rows": self.rows, "tokens": tokens, "seconds": seconds, "crc": crc}
        self.log.append(entry)
        self.record.write(json.dumps(entry).encode() + b"\n")
        self.record.flush()

    def close(self) -> None:
        for f in [*self.files.values(), *([self.record] if self.record else [])]:
            f.close()
        self.files, self.record = {}, None
