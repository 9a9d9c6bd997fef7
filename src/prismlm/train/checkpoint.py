"""Checkpoints: safetensors weights + JSON config + manifest + optimizer/RNG/data-position state.

A checkpoint is ``RUN/checkpoints/step-XXXXXX/`` (weights, resolved config, manifest, trainer state,
tokenizer: self-contained). Invariant: it is written to ``step-XXXXXX.tmp`` and renamed into place, and
``latest`` is replaced atomically after that, so a crash never leaves a half-written checkpoint that a
resume would pick. The run-folder layout: docs/modules.md.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch
from safetensors.torch import load_model, save_model

from prismlm.artifacts import (
    JSON,
    FileRecord,
    atomic_dir,
    atomic_write_text,
    file_records,
    provenance,
    reading,
    sha256_file,
    verify_files,
)
from prismlm.config import RunConfig
from prismlm.errors import ArtifactCorrupt, ArtifactMismatch, CheckpointError
from prismlm.model import PrismLM
from prismlm.model.pretrained import Pretrained, from_prism_weights, is_transformers_folder

if TYPE_CHECKING:
    from torch.optim.optimizer import StateDict

    from prismlm.data.tokenizer import Tokenizer


class RngState(TypedDict):
    """The RNG states a checkpoint records: torch's CPU generator and, on a GPU, the device's."""

    torch: torch.Tensor
    cuda: torch.Tensor | None


class TrainerState(TypedDict):
    """``trainer_state.pt``: what a resumed run continues from."""

    step: int
    optimizer: StateDict | str
    """The optimizer's state dict, or ``fsdp.SHARDED_DIR`` (each rank's shard is a file in that folder)."""
    rng: RngState
    data: dict[str, object]
    """The feed's position (``Batches.position``)."""


class DataRecord(TypedDict):
    """The token shards a checkpoint was trained on (from their manifest)."""

    key: str | None
    corpus: JSON
    tokenizer: JSON


class CheckpointManifest(TypedDict, total=False):
    """A checkpoint's ``manifest.json`` (older checkpoints may lack ``files``; ``source`` only for retrofits)."""

    kind: str
    step: int
    model_sha256: str
    """sha256 of ``model.safetensors``: the model's identity, which artifacts are tied to."""
    is_prism: bool
    num_parameters: int
    data: DataRecord | None
    source: dict[str, object]
    """Where a retrofit's weights came from (``RunConfig.source``)."""
    files: dict[str, FileRecord]
    prismlm_version: str
    torch_version: str


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: PrismLM,
    cfg: RunConfig,
    *,
    trainer_state: Mapping[str, object] | None = None,
    tokenizer: Tokenizer | None = None,
    data_manifest: Mapping[str, object] | None = None,
    keep: int = 2,
    sharded: Path | None = None,
) -> Path:
    """Write a complete checkpoint atomically and prune old ones; returns its folder.

    ``sharded``: a folder of per-rank optimizer shards already written by an FSDP job
    (``prismlm.train.fsdp.save_sharded_optimizer``); it is moved into the checkpoint as ``sharded/`` before
    the manifest is written, so its files are recorded and verified like the others."""
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    final = ckpt_root / name
    with atomic_dir(final) as tmp:  # step-XXXXXX.tmp, renamed into place
        save_model(model, str(tmp / "model.safetensors"))
        cfg.to_json(tmp / "config.json")
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer")
        if trainer_state is not None:
            torch.save(trainer_state, tmp / "trainer_state.pt")
        if sharded is not None:
            os.replace(sharded, tmp / "sharded")
        files = file_records(tmp)
        manifest = {
            "kind": "prismlm-checkpoint",
            "step": step,
            "model_sha256": files["model.safetensors"]["sha256"],  # hashed once, by file_records
            "is_prism": model.is_prism,
            "num_parameters": model.num_parameters(),
            "data": {k: data_manifest.get(k) for k in ("key", "corpus", "tokenizer")} if data_manifest else None,
            **({"source": cfg.source} if cfg.source is not None else {}),
            "files": files,
            **provenance(),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    atomic_write_text(ckpt_root / "latest", name + "\n")
    complete = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir() and not p.name.endswith((".tmp", ".old")))
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find_checkpoint(path: str | Path) -> Path:
    """Resolve a run folder (→ its latest checkpoint), a ``checkpoints/`` folder, or a checkpoint folder."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no such run or checkpoint: {path}")
    if (path / "model.safetensors").exists():
        return path
    for root in (path / "checkpoints", path):
        latest = root / "latest"
        if latest.exists():
            ckpt = root / latest.read_text().strip()
            if (ckpt / "model.safetensors").exists():
                return ckpt
            previous = ckpt.with_name(ckpt.name + ".old")  # killed while re-saving this step: the live copy
            if (previous / "model.safetensors").exists():
                return previous
            raise CheckpointError(f"{latest} points to {ckpt.name}, which is missing or incomplete")
    raise CheckpointError(f"{path} holds no checkpoint (expected model.safetensors or checkpoints/latest)")


@dataclass
class Checkpoint:
    path: Path
    model: PrismLM
    config: RunConfig
    manifest: CheckpointManifest
    tokenizer: Tokenizer | None

    def require_tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer; ``CheckpointError`` when it was saved without one."""
        if self.tokenizer is None:
            raise CheckpointError(f"checkpoint {self.path} has no tokenizer/ folder", path=self.path)
        return self.tokenizer

    def trainer_state(self, map_location: str | torch.device = "cpu") -> TrainerState:  # as the trainer saved it
        f = self.path / "trainer_state.pt"
        if not f.exists():
            raise CheckpointError(f"{self.path} has no trainer_state.pt; it cannot be resumed")
        return torch.load(f, map_location=map_location, weights_only=False)


def verify_checkpoint(ckpt: Path, manifest: CheckpointManifest, *, full: bool = False) -> list[str]:
    """Check a checkpoint's files against its manifest (``artifacts.verify_files``); the weights are always
    hashed whole (their sha256 is the model's identity). An edited config is ``ArtifactMismatch``, any other
    changed file ``ArtifactCorrupt``. Checkpoints from before per-file records are checked by their weights.
    Returns the files checked."""
    weights = ckpt / "model.safetensors"
    if not weights.is_file():  # gone, or a folder in its place (opening it would raise IsADirectoryError)
        raise ArtifactCorrupt(
            f"{weights} is {'a folder, not the weights file' if weights.is_dir() else 'missing'}",
            fix="restore the file or use an earlier checkpoint",
            path=weights,
        )
    if manifest.get("model_sha256") and sha256_file(weights) != manifest["model_sha256"]:
        raise ArtifactCorrupt(
            f"{weights} does not match the sha256 recorded in {ckpt / 'manifest.json'}: the weights are corrupt",
            fix="restore the file or use an earlier checkpoint",
            path=weights,
        )
    fix = "restore the file or use an earlier checkpoint (or retrain to change the recipe)"
    try:
        return ["model.safetensors"] + verify_files(
            ckpt, manifest.get("files"), what="checkpoint", fix=fix, full=full, skip=("model.safetensors",)
        )
    except ArtifactCorrupt as e:
        if e.path is not None and e.path.name == "config.json":
            raise ArtifactMismatch(e.message, fix=fix, path=e.path) from None
        raise


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Checkpoint:
    """Load a model (and its tokenizer) from a run folder or checkpoint folder, verified against its
    manifest (``verify_checkpoint``)."""
    ckpt = find_checkpoint(path)
    for required in ("config.json", "manifest.json"):
        if not (ckpt / required).exists():
            raise CheckpointError(f"checkpoint {ckpt} is incomplete: {required} is missing")
    with reading(ckpt / "manifest.json", "checkpoint manifest"):
        manifest = json.loads((ckpt / "manifest.json").read_text())
    verify_checkpoint(ckpt, manifest)
    cfg = RunConfig.from_json(ckpt / "config.json")
    model = PrismLM(cfg.model)
    missing, unexpected = load_model(model, str(ckpt / "model.safetensors"), strict=False, device=str(device))
    if missing or unexpected:
        raise CheckpointError(
            f"{ckpt}: weights do not match config.json (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    model.to(device).eval()
    tokenizer: Tokenizer | None = None
    if (ckpt / "tokenizer").exists():
        from prismlm.data.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(ckpt / "tokenizer")
    model.tokenizer = tokenizer  # model.generate("text") encodes with it
    return Checkpoint(path=ckpt, model=model, config=cfg, manifest=manifest, tokenizer=tokenizer)


def pretrained_from_run(source: str, *, block_size: int | None = None) -> Pretrained | None:
    """A prismlm run or checkpoint folder (its latest checkpoint) as a ``Pretrained`` backbone for a retrofit;
    None when ``source`` is no such folder (then it names a model for ``prismlm.model.pretrained.
    load_pretrained``)."""
    path = Path(source).expanduser()
    if not path.is_dir() or is_transformers_folder(path):
        return None
    try:
        ckpt_dir = find_checkpoint(path)
    except CheckpointError:
        return None
    ckpt = load_checkpoint(ckpt_dir)
    return from_prism_weights(source, ckpt.config.model, ckpt.model.state_dict(), ckpt.require_tokenizer(), block_size)
