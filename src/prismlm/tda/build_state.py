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
from typing import Any, BinaryIO

import numpy as np

from prismlm.artifacts import reading, sha256_file
from prismlm.errors import ArtifactCorrupt, ArtifactError

__all__ = ["FITTED", "RAW", "PostingFiles", "Resumed", "record_fitted", "resume_build"]

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


def _write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
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
    """``state.json`` with the last good batch's ``done_to``, ``rows``, ``tokens`` and ``postings_seconds``."""
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
    return state


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


def _read_log(folder: Path) -> tuple[list[dict[str, Any]], bool]:
    """The records of ``batches.jsonl`` up to its first incomplete or garbled line, and whether a garbled
    line (not the last one, which a kill may tear) cut it short."""
    path = folder / LOG
    lines = path.read_bytes().split(b"\n") if path.is_file() else [b""]
    log: list[dict[str, Any]] = []
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
    last = log[-1] if log else {"j1": state["start"], "rows": 0, "tokens": 0, "seconds": 0.0}
    state = {
        **state,
        "done_to": int(last["j1"]),
        "rows": int(last["rows"]),
        "tokens": int(last["tokens"]),
        "postings_seconds": float(last["seconds"]),
    }
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

    def open(self, widths: dict[str, int], started: dict[str, Any] | None) -> None:
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
        entry = {"j1": j1, "rows": self.rows, "tokens": tokens, "seconds": seconds, "crc": crc}
        self.log.append(entry)
        self.record.write(json.dumps(entry).encode() + b"\n")
        self.record.flush()

    def close(self) -> None:
        for f in [*self.files.values(), *([self.record] if self.record else [])]:
            f.close()
        self.files, self.record = {}, None
