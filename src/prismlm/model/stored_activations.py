"""Stored activations: the frozen backbone's z (and stage 2's boundary activations) over a shard, computed
once and memory-mapped. The one reader, writer and verifier of ``RUN/stored-z``: the retrofit's stages
(``prismlm.train.bank_stage``, ``prismlm.train.stage2``) train on it and the index
(``prismlm.explain.index.build``) reads z from it.

``build_stored_z`` runs the frozen backbone once over the aligned sequences of one split and writes
``z.bin`` (rows, d), ``targets.bin`` (rows,), ``state.json`` and ``manifest.json`` (what z belongs to); with
``boundary_layer`` L also ``boundary.bin`` (rows, d), the residual stream entering block L in the same pass
(what stage 2 on stored activations trains the blocks L… on, ``prismlm.train.stage2``).
``build_stored_candidates`` adds ``candidates.bin`` (rows, c) int32: each row's c most likely tokens under
the frozen unembedding, so the KL terms over a candidate set (``loss.kl_candidates``) never need the (rows, V)
product again (``candidates.json`` names the head, c and the file's sha256).
Invariants: row ``r`` is position ``r % T`` of sequence ``r // T`` (the offset the prototype index stores);
a killed pass resumed with the same arguments ends with files equal byte for byte to an uninterrupted one.
File layout and resume: docs/modules.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict

import numpy as np
import torch

from prismlm.artifacts import atomic_write_text, provenance, reading
from prismlm.errors import ArtifactCorrupt, ArtifactError, ArtifactMismatch, ConfigError
from prismlm.model import PrismLM, eval_mode
from prismlm.progress import Progress, Reporter

if TYPE_CHECKING:
    from prismlm.data.shards import ShardSet, TokenShard

KIND = "prismlm-stored-z"
FORMAT_VERSION = 1
CANDIDATES_FILE = "candidates.bin"
CANDIDATES_MANIFEST = "candidates.json"
ZDtype = Literal["float16", "bfloat16", "float32"]
_TORCH_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_NUMPY_DTYPES: dict[str, type[np.generic]] = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
_FLOAT16_MAX = 65504.0


def backbone_identity(model: PrismLM, below_layer: int | None = None) -> str:
    """``backbone:<sha256>`` of every weight except the prototype bank: what z (and the logits) depend on.
    Equal for a source model and its frozen retrofit at any step of stage 1. ``below_layer`` L: only the
    weights the residual stream entering block L depends on (embeddings, blocks 0 … L − 1; not the later
    blocks, the final norm or the head), equal at every step of a stage 2 that trains the last blocks."""
    h = hashlib.sha256()
    skip: tuple[str, ...] = ("prototypes.",)
    if below_layer is not None:
        skip += (*model.block_prefixes()[below_layer:], *model.final_norm_prefixes(), "lm_head.")
    for name, t in sorted(model.state_dict().items()):
        if name.startswith(skip):
            continue
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "backbone:" + h.hexdigest()


def head_identity(lm_head: torch.nn.Linear) -> str:
    """``head:<sha256>`` of the unembedding's weight (and bias): what stored candidates depend on."""
    h = hashlib.sha256()
    for t in (lm_head.weight, lm_head.bias):
        if t is not None:
            h.update(str(t.dtype).encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "head:" + h.hexdigest()


class CandidateManifest(TypedDict):
    """``candidates.json``: what ``candidates.bin`` (rows, candidates) int32 was made from."""

    candidates: int
    """c: the most likely tokens kept per row, most likely first."""
    rows: int
    head: str
    """``head_identity`` of the unembedding that ranked them."""
    store_backbone: str
    """The store's ``backbone``: the z they were ranked on."""
    sha256: str
    """Of ``candidates.bin``, checked before the first read."""


class StoreSettings(TypedDict):
    """What a store of z was made with (its ``manifest.json`` holds these plus ``created`` and versions); a
    store is resumed only with exactly the same settings."""

    kind: str
    format_version: int
    backbone: str
    """``backbone_identity`` of the model whose z this is."""
    shard_key: str
    split: str
    block_size: int
    d: int
    dtype: str
    """float16, bfloat16 or float32."""
    batch_size: int
    num_sequences: int
    rows: int
    """num_sequences · block_size."""
    num_batches: int
    boundary_layer: int | None
    """The block whose input is stored in ``boundary.bin`` (None: z only)."""
    boundary_backbone: str | None
    """``backbone_identity(model, below_layer=boundary_layer)``: what the boundary rows depend on (None: z only)."""


class StoreManifest(StoreSettings):
    """``StoredZ.manifest``: the settings, when and with which versions the store was made, and (from
    ``state.json`` when opened) how far it got."""

    created: str
    prismlm_version: str
    torch_version: str
    batches_done: int
    complete: bool


class FillState(TypedDict):
    """``state.json``: how far a pass got, with a sha256 per batch done (resume checks them)."""

    batches_done: int
    digests: list[str]
    seconds: float


@dataclass
class StoredZ:
    """An opened store: memory-mapped ``z`` (rows, d) and ``targets`` (rows,), with its manifest and the
    sha256 of each batch (``state.json``). Every read (``hidden``, ``rows``) first checks the batches it
    touches against their digests, once per batch per open store: a damaged batch is never used
    (``ArtifactCorrupt`` naming it); ``verify`` checks them all."""

    path: Path
    manifest: StoreManifest
    z: np.ndarray
    targets: np.ndarray
    boundary: np.ndarray | None = None
    """(rows, d) the residual stream entering block ``manifest["boundary_layer"]``, or None."""
    digests: list[str] = field(default_factory=list)
    _checked: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool), repr=False)
    """(num_batches,) bool: batches whose digest this store has checked."""
    candidates: np.ndarray | None = None
    """(rows, c) int32 each row's c most likely tokens, most likely first (``build_stored_candidates``), or None."""
    candidate_manifest: CandidateManifest | None = None
    _candidates_verified: str | None = field(default=None, repr=False)
    """The head identity the candidates were checked against (file digest and head), once per open store."""

    @property
    def block_size(self) -> int:
        return int(self.manifest["block_size"])

    @property
    def num_sequences(self) -> int:
        return int(self.manifest["num_sequences"])

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def hidden(self, seq_ids: np.ndarray) -> torch.Tensor:
        """z of whole sequences → (len(seq_ids), T, d) float32 (one gather from the map)."""
        return self._gather(self.z, seq_ids)

    def next_tokens(self, seq_ids: np.ndarray) -> torch.Tensor:
        """The stored next token of every position of whole sequences → (len(seq_ids), T) int64."""
        rows = self._rows(seq_ids)
        return torch.from_numpy(np.asarray(self.targets[rows], dtype=np.int64)).view(-1, self.block_size)

    @property
    def boundary_layer(self) -> int | None:
        layer = self.manifest.get("boundary_layer")
        return None if layer is None else int(layer)

    def boundary_hidden(self, seq_ids: np.ndarray) -> torch.Tensor:
        """The stored boundary activations of whole sequences → (len(seq_ids), T, d) float32."""
        if self.boundary is None:
            raise ArtifactError(
                f"the stored activations at {self.path} hold no boundary layer",
                fix="rebuild them with a boundary layer (a retrofit whose stage 2 trains the last N blocks does)",
            )
        return self._gather(self.boundary, seq_ids)

    def _gather(self, source: np.ndarray, seq_ids: np.ndarray) -> torch.Tensor:
        rows = self._rows(seq_ids)
        return _to_float32(source[rows], self.manifest["dtype"]).view(-1, self.block_size, source.shape[-1])

    def _rows(self, seq_ids: np.ndarray) -> np.ndarray:
        """The stored rows of whole sequences, in order (len(seq_ids)·T,), their batches' checksums checked."""
        T = self.block_size
        ids = np.asarray(seq_ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_sequences):
            raise IndexError(f"sequence ids out of range [0, {self.num_sequences}) of the stored z at {self.path}")
        if len(ids):
            self._check_batches(np.unique(ids // int(self.manifest["batch_size"])))
        return (ids[:, None] * T + np.arange(T)[None, :]).reshape(-1)

    def candidates_for(self, candidates: int, lm_head: torch.nn.Linear) -> bool:
        """Whether stored candidates serve a candidate KL over ``candidates`` tokens per row with ``lm_head``:
        False when there are none or fewer per row; ``ArtifactMismatch`` when they were ranked by another head,
        ``ArtifactCorrupt`` when the file does not match its sha256 (both checked once per open store)."""
        m = self.candidate_manifest
        if self.candidates is None or m is None or candidates < 1 or candidates > m["candidates"]:
            return False
        if self._candidates_verified is None:
            fix = f"remove {self.path / CANDIDATES_FILE}; the retrofit (or build_stored_candidates) ranks them again"
            if _file_digest(self.path / CANDIDATES_FILE) != m["sha256"]:
                raise ArtifactCorrupt(
                    f"{self.path / CANDIDATES_FILE} does not match its sha256 in {CANDIDATES_MANIFEST}",
                    fix=fix,
                    path=self.path / CANDIDATES_FILE,
                )
            if m["store_backbone"] != self.manifest["backbone"] or m["head"] != head_identity(lm_head):
                raise ArtifactMismatch(
                    f"the stored candidates at {self.path / CANDIDATES_FILE} were ranked by another model's head",
                    fix=fix,
                )
            self._candidates_verified = m["head"]
        return True

    def candidate_ids(self, seq_ids: np.ndarray, candidates: int) -> torch.Tensor:
        """The ``candidates`` most likely tokens of every row of whole sequences → (len(seq_ids)·T, c) int64,
        most likely first; call ``candidates_for`` first (it checks the file and the head)."""
        if self.candidates is None or self._candidates_verified is None:
            raise ArtifactError(
                f"the stored activations at {self.path} hold no checked candidates",
                fix="call candidates_for(c, lm_head) first; build them with build_stored_candidates",
            )
        T = self.block_size
        ids = np.asarray(seq_ids, dtype=np.int64).reshape(-1)
        rows = (ids[:, None] * T + np.arange(T)[None, :]).reshape(-1)
        return torch.from_numpy(self.candidates[rows, :candidates].astype(np.int64))

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """z of rows ``[start, stop)`` → (stop − start, d) float32."""
        per = int(self.manifest["batch_size"]) * self.block_size
        if stop > start:
            self._check_batches(np.arange(start // per, (stop - 1) // per + 1))
        return _to_float32(self.z[start:stop], self.manifest["dtype"])

    def verify(self) -> StoredZ:
        """Check every batch done against its sha256 in ``state.json`` (the reads check the batches they touch;
        this checks all at once, for ``prism verify`` and before a reader commits to the store).
        ``ArtifactCorrupt`` naming the first damaged batch."""
        self._check_batches(np.arange(int(self.manifest["batches_done"])))
        return self

    def _check_batches(self, batches: np.ndarray) -> None:
        """Digest-check ``batches`` (batch numbers) not checked yet; refuse a damaged or unrecorded one."""
        if len(self._checked) != int(self.manifest["num_batches"]):  # made without open_stored_z
            self._checked = np.zeros(int(self.manifest["num_batches"]), dtype=bool)
        todo = batches[~self._checked[batches]]
        per = int(self.manifest["batch_size"]) * self.block_size
        rows = int(self.manifest["rows"])
        for b in todo.tolist():
            if b >= len(self.digests):
                raise ArtifactCorrupt(
                    f"batch {b} of the stored z at {self.path} has no checksum in state.json (unfinished store)",
                    fix=f"finish it (run the same command again) or remove {self.path}",
                    path=self.path / "state.json",
                )
            sl = slice(b * per, min((b + 1) * per, rows))
            boundary = self.boundary[sl] if self.boundary is not None else None
            if _batch_digest(self.z[sl], self.targets[sl], boundary) != self.digests[b]:
                raise ArtifactCorrupt(
                    f"batch {b} (rows {sl.start}–{sl.stop - 1}) of the stored z at {self.path} does not match its "
                    "checksum in state.json: z.bin, targets.bin or boundary.bin is damaged",
                    fix=f"remove {self.path}; a retrofit run again recomputes it from the model",
                    path=self.path / "z.bin",
                )
            self._checked[b] = True

    def check(
        self,
        *,
        backbone: str | None = None,
        shard_key: str | None = None,
        block_size: int | None = None,
        split: str | None = None,
    ) -> StoredZ:
        """Refuse a store of another backbone, corpus, block size or split (``ArtifactMismatch``), or an
        unfinished one (``ArtifactError``)."""
        m = self.manifest
        fix = f"rebuild it (remove {self.path})"
        for what, want, have in (
            ("backbone", backbone, m["backbone"]),
            ("shards", shard_key, m["shard_key"]),
            ("block size", block_size, m["block_size"]),
            ("split", split, m["split"]),
        ):
            if want is not None and want != have:
                raise ArtifactMismatch(
                    f"the stored z at {self.path} belongs to another {what} ({have}, not {want})", fix=fix
                )
        if not self.complete:
            raise ArtifactError(
                f"the stored z at {self.path} is unfinished ({m['batches_done']} of {m['num_batches']} batches)",
                fix="finish it: run the same command again",
            )
        return self


def _to_float32(a: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.require(a, requirements=["C", "W"]))  # a slice of the read-only map is copied
    if dtype == "bfloat16":
        return t.view(torch.bfloat16).float()
    return t.float()


def _encode(z: torch.Tensor, dtype: str) -> np.ndarray:
    """(n, d) float → the stored words; float16 refuses values past its range rather than storing inf."""
    if dtype == "float16" and bool((z.abs() > _FLOAT16_MAX).any()):
        raise ConfigError(
            f"hidden states reach {float(z.abs().max()):.3g}, past float16's range",
            fix="store z as bfloat16 or float32 (train.stored_z_dtype)",
        )
    q = z.to(_TORCH_DTYPES[dtype]).cpu().contiguous()
    return (q.view(torch.int16) if dtype == "bfloat16" else q).numpy().view(_NUMPY_DTYPES[dtype])


def open_stored_z(path: str | Path) -> StoredZ:
    """Open a store read-only (memory-mapped); ``ArtifactError`` when there is none at ``path``."""
    path = Path(path)
    mpath = path / "manifest.json"
    if not mpath.exists():
        raise ArtifactError(f"no stored z at {path}", fix="build it with a retrofit (stage 1) or build_stored_z")
    fix = f"remove {path}; a retrofit run again recomputes it from the model"
    with reading(mpath, "stored z manifest", fix=fix):
        m: StoreManifest = json.loads(mpath.read_text())
        rows, d, width = int(m["rows"]), int(m["d"]), np.dtype(_NUMPY_DTYPES[m["dtype"]]).itemsize
    with reading(path / "state.json", "stored z state", fix=fix):
        state = json.loads((path / "state.json").read_text()) if (path / "state.json").exists() else {}
        done, digests = int(state.get("batches_done", 0)), [str(x) for x in state.get("digests", [])]
        if not 0 <= done <= len(digests) or done > int(m["num_batches"]):
            raise ValueError(f"{done} batches done with {len(digests)} checksums")
    m["batches_done"] = done
    m["complete"] = done == m["num_batches"]
    sizes = [("z.bin", rows * d * width), ("targets.bin", rows * 4)]
    if m.get("boundary_layer") is not None:
        sizes.append(("boundary.bin", rows * d * width))
    for name, size in sizes:
        have = (path / name).stat().st_size if (path / name).exists() else None
        if have != size:
            raise ArtifactCorrupt(
                f"{path / name} is {'missing' if have is None else f'{have:,} bytes'}, not the {size:,} bytes the "
                "stored z's manifest says",
                fix=fix,
                path=path / name,
            )
    z = np.memmap(path / "z.bin", dtype=_NUMPY_DTYPES[m["dtype"]], mode="r", shape=(rows, d))
    targets = np.memmap(path / "targets.bin", dtype=np.int32, mode="r", shape=(rows,))
    m.setdefault("boundary_layer", None)  # stores written before boundary layers existed
    m.setdefault("boundary_backbone", None)
    boundary = None
    if m["boundary_layer"] is not None:
        boundary = np.memmap(path / "boundary.bin", dtype=_NUMPY_DTYPES[m["dtype"]], mode="r", shape=(rows, d))
    checked = np.zeros(int(m["num_batches"]), dtype=bool)
    candidates, cm = _open_candidates(path, rows)
    return StoredZ(
        path=path,
        manifest=m,
        z=z,
        targets=targets,
        boundary=boundary,
        digests=digests[:done],
        _checked=checked,
        candidates=candidates,
        candidate_manifest=cm,
    )


def _open_candidates(path: Path, rows: int) -> tuple[np.ndarray | None, CandidateManifest | None]:
    """The stored candidates' map and manifest, or (None, None) when there are none or the pair is not whole
    (a pass killed between writing the file and its manifest: ``build_stored_candidates`` makes them again)."""
    try:
        cm: CandidateManifest = json.loads((path / CANDIDATES_MANIFEST).read_text())
        c = int(cm["candidates"])
        size = (path / CANDIDATES_FILE).stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    if int(cm["rows"]) != rows or size != rows * c * 4:
        return None, None
    return np.memmap(path / CANDIDATES_FILE, dtype=np.int32, mode="r", shape=(rows, c)), cm


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@torch.no_grad()
def build_stored_candidates(
    store: StoredZ,
    lm_head: torch.nn.Linear,
    candidates: int,
    *,
    batch_rows: int = 2048,
    progress: Progress = True,
) -> StoredZ:
    """Rank, once, every stored row's ``candidates`` most likely tokens under ``lm_head`` (the frozen
    unembedding: softmax(W z) of the source model) into ``candidates.bin``; returns the store reopened.

    Stored candidates with at least that many per row, from the same head and z, are kept as they are. The
    pass writes a temporary file and renames it, the manifest last: a killed pass leaves nothing that is read.
    Cost: one (rows, V) product, as one epoch of the per-step candidate choice it replaces."""
    if candidates < 1:
        raise ConfigError(f"`candidates` must be >= 1, got {candidates}", param="candidates")
    store.check()
    head = head_identity(lm_head)
    m = store.candidate_manifest
    if (
        m is not None
        and m["candidates"] >= min(candidates, lm_head.out_features)
        and m["head"] == head
        and m["store_backbone"] == store.manifest["backbone"]
    ):
        return store
    rows, c = int(store.manifest["rows"]), min(candidates, lm_head.out_features)
    tmp = store.path / (CANDIDATES_FILE + ".tmp")
    out = np.memmap(tmp, dtype=np.int32, mode="w+", shape=(rows, c))
    dtype = lm_head.weight.dtype
    with Reporter(progress, "candidates", rows, unit="tok") as bar:
        for start in range(0, rows, batch_rows):
            stop = min(start + batch_rows, rows)
            logits = lm_head(store.rows(start, stop).to(lm_head.weight.device, dtype))  # (n, V)
            out[start:stop] = logits.topk(c, dim=-1).indices.cpu().numpy().astype(np.int32)  # (n, c)
            bar.update(stop - start)
    out.flush()
    del out
    (store.path / CANDIDATES_MANIFEST).unlink(missing_ok=True)  # no manifest ever describes a half-made file
    os.replace(tmp, store.path / CANDIDATES_FILE)
    manifest: CandidateManifest = {
        "candidates": c,
        "rows": rows,
        "head": head,
        "store_backbone": store.manifest["backbone"],
        "sha256": _file_digest(store.path / CANDIDATES_FILE),
    }
    atomic_write_text(store.path / CANDIDATES_MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return open_stored_z(store.path)


def _batch_digest(z: np.ndarray, targets: np.ndarray, boundary: np.ndarray | None = None) -> str:
    h = hashlib.sha256(np.ascontiguousarray(z).tobytes() + np.ascontiguousarray(targets).tobytes())
    if boundary is not None:
        h.update(np.ascontiguousarray(boundary).tobytes())
    return h.hexdigest()


def build_stored_z(
    model: PrismLM,
    shards: ShardSet,
    out: str | Path,
    *,
    split: str = "train",
    dtype: ZDtype = "float16",
    batch_size: int = 8,
    max_sequences: int | None = None,
    device: str | torch.device | None = None,
    progress: Progress = True,
    stop_after_batches: int | None = None,
    boundary_layer: int | None = None,
) -> StoredZ:
    """Compute (or finish, or reuse) the stored z of ``model``'s backbone over ``shards.<split>``.

    ``max_sequences``: only the first N aligned sequences. A complete store
    with the same settings is returned as it is; an unfinished one is resumed (see the module docstring);
    one made with other settings or another backbone is replaced. ``stop_after_batches``: stop early
    (simulates a kill in tests). ``boundary_layer`` L: also store the residual stream entering block L."""
    if dtype not in _TORCH_DTYPES:
        raise ConfigError(f"stored z dtype must be float16, bfloat16 or float32, got {dtype!r}")
    out = Path(out)
    shard = getattr(shards, split)
    T, d = model.config.block_size, model.config.n_embd
    if boundary_layer is not None and not 0 <= boundary_layer < model.config.n_layer:
        raise ConfigError(
            f"boundary layer {boundary_layer} is outside the model's {model.config.n_layer} blocks",
            fix=f"unfreeze between 1 and {model.config.n_layer} blocks (last-N)",
        )
    n_seq = shard.num_sequences(T) if max_sequences is None else min(shard.num_sequences(T), max_sequences)
    if n_seq < 1:
        raise ArtifactError(f"the {split} split holds no complete sequence of {T + 1} tokens to store z for")
    want: StoreSettings = {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "backbone": backbone_identity(model),
        "shard_key": shards.manifest["key"],
        "split": split,
        "block_size": T,
        "d": d,
        "dtype": dtype,
        "batch_size": batch_size,
        "num_sequences": n_seq,
        "rows": n_seq * T,
        "num_batches": -(-n_seq // batch_size),
        "boundary_layer": boundary_layer,
        "boundary_backbone": None if boundary_layer is None else backbone_identity(model, boundary_layer),
    }
    resumed = _resume_state(out, want)
    state: FillState
    if resumed is not None:
        state = resumed
    else:  # new, or made with other settings: start over
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        np.memmap(out / "z.bin", dtype=_NUMPY_DTYPES[dtype], mode="w+", shape=(n_seq * T, d)).flush()
        np.memmap(out / "targets.bin", dtype=np.int32, mode="w+", shape=(n_seq * T,)).flush()
        if boundary_layer is not None:
            np.memmap(out / "boundary.bin", dtype=_NUMPY_DTYPES[dtype], mode="w+", shape=(n_seq * T, d)).flush()
        atomic_write_text(
            out / "manifest.json",
            json.dumps({**want, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **provenance()}, indent=1) + "\n",
        )
        state = {"batches_done": 0, "digests": [], "seconds": 0.0}
        atomic_write_text(out / "state.json", json.dumps(state) + "\n")
    _fill(model, shard, out, want, state, device=device, progress=progress, stop_after_batches=stop_after_batches)
    return open_stored_z(out)


def _resume_state(out: Path, want: StoreSettings) -> FillState | None:
    """The state of a store at ``out`` made with exactly ``want``'s settings, its recorded batches checked
    against their checksums (cut at the first that fails); None when there is none to continue."""
    try:
        m = json.loads((out / "manifest.json").read_text())
        state = json.loads((out / "state.json").read_text())
    except (OSError, ValueError):
        return None
    if any(m.get(k) != v for k, v in want.items()):  # a missing boundary_layer reads as None
        return None
    try:
        store = open_stored_z(out)
    except ArtifactError:  # a file of the wrong length or a garbled state.json: start over
        return None
    rows_per = want["batch_size"] * want["block_size"]
    good = 0
    for b, digest in enumerate(state["digests"][: state["batches_done"]]):
        sl = slice(b * rows_per, min((b + 1) * rows_per, want["rows"]))
        boundary = store.boundary[sl] if store.boundary is not None else None
        if _batch_digest(store.z[sl], store.targets[sl], boundary) != digest:
            break
        good = b + 1
    state["batches_done"], state["digests"] = good, state["digests"][:good]
    return state


@torch.no_grad()
def _fill(
    model: PrismLM,
    shard: TokenShard,
    out: Path,
    want: StoreSettings,
    state: FillState,
    *,
    device: str | torch.device | None,
    progress: Progress,
    stop_after_batches: int | None,
) -> None:
    """Run the backbone over the batches not yet done, writing each batch's rows and checksum."""
    T, B, n_seq, dtype = want["block_size"], want["batch_size"], want["num_sequences"], want["dtype"]
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    z_map = np.memmap(out / "z.bin", dtype=_NUMPY_DTYPES[dtype], mode="r+", shape=(want["rows"], want["d"]))
    t_map = np.memmap(out / "targets.bin", dtype=np.int32, mode="r+", shape=(want["rows"],))
    layer = want["boundary_layer"]
    h_map = None
    if layer is not None:
        h_map = np.memmap(out / "boundary.bin", dtype=_NUMPY_DTYPES[dtype], mode="r+", shape=(want["rows"], want["d"]))
    done0 = state["batches_done"]
    bar = Reporter(progress, "stored-z", want["rows"], unit="tok", initial=min(done0 * B, n_seq) * T)
    t0, ran, spent = time.perf_counter(), 0, 0.0
    with bar, eval_mode(model), torch.inference_mode():
        for b in range(done0, want["num_batches"]):
            ids = np.arange(b * B, min((b + 1) * B, n_seq), dtype=np.int64)
            seqs = shard.sequences(ids, T)  # (b, T + 1)
            x = torch.from_numpy(seqs[:, :-1]).to(dev)
            sl = slice(int(ids[0]) * T, (int(ids[-1]) + 1) * T)
            if h_map is not None and layer is not None:
                bo = model.backbone_outputs(x, output_hidden_states=True)
                assert bo.hidden_states is not None
                h_map[sl] = _encode(bo.hidden_states[layer].reshape(-1, want["d"]), dtype)  # (b·T, d)
                h_map.flush()
                z = bo.z.reshape(-1, want["d"])  # (b·T, d)
            else:
                z = model.backbone(x).reshape(-1, want["d"])  # (b·T, d)
            z_map[sl] = _encode(z, dtype)
            t_map[sl] = seqs[:, 1:].reshape(-1).astype(np.int32)
            z_map.flush()
            t_map.flush()
            state["digests"].append(_batch_digest(z_map[sl], t_map[sl], h_map[sl] if h_map is not None else None))
            state["batches_done"] = b + 1
            now = time.perf_counter()
            state["seconds"] = float(state.get("seconds", 0.0)) + (now - t0)
            spent, t0 = spent + (now - t0), now
            atomic_write_text(out / "state.json", json.dumps(state) + "\n")
            ran += 1
            bar.update(x.numel(), tokens_per_s=round(ran * B * T / max(spent, 1e-9)))
            if stop_after_batches is not None and ran >= stop_after_batches:
                break


__all__ = [
    "CandidateManifest",
    "StoredZ",
    "ZDtype",
    "backbone_identity",
    "build_stored_candidates",
    "build_stored_z",
    "head_identity",
    "open_stored_z",
]
