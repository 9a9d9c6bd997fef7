"""A prototype bank on its own: the (K, d) prototypes of a retrofit, saved apart from the model they were
trained on, so that a retrofit can start from it instead of seeding and training a bank (``train.init_bank``).

The file is safetensors: one tensor ``prototypes`` (K, d) and string metadata — ``kind``, ``backbone`` (the
``backbone_identity`` of the model whose z the bank was trained on: it serves that model only), ``top_k``,
``step`` (the bank-stage step it was saved at: where a retrofit starting from it continues), and ``made_by``
(how it was made: the recipe, the command, the code's revision; free text for the reader). Why a file of its
own: ``prism demo`` ships the bank it explains with, trained offline longer than the demo's time allows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from prismlm.artifacts import reading
from prismlm.errors import ArtifactError, ArtifactMismatch
from prismlm.model.gpt import PrismLM
from prismlm.model.stored_activations import backbone_identity

KIND = "prismlm-bank"


@dataclass(frozen=True)
class BankFile:
    """A bank read from a file (``load_bank``)."""

    path: Path
    prototypes: torch.Tensor
    """(K, d) as stored (float16 or float32)."""
    backbone: str
    """``backbone_identity`` of the model the bank serves."""
    top_k: int
    step: int
    """The bank-stage step it was saved at."""
    made_by: dict[str, str]
    """How it was made (recipe, command, revision)."""


def save_bank(
    path: str | Path, model: PrismLM, *, step: int, made_by: dict[str, str], dtype: torch.dtype = torch.float16
) -> Path:
    """Write ``model``'s bank to ``path`` (safetensors, ``dtype``: float16 halves the file; the demo's K=8,192
    bank is 9.4 MB so) with what it serves and how it was made."""
    bank = model.require_prototypes()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "kind": KIND,
        "backbone": backbone_identity(model),
        "top_k": str(bank.cfg.top_k),
        "step": str(step),
        "made_by": json.dumps(made_by, sort_keys=True),
    }
    save_file({"prototypes": bank.weight.detach().to("cpu", dtype).contiguous()}, str(path), metadata=metadata)
    return path


def load_bank(path: str | Path) -> BankFile:
    """Read a bank file; ``ArtifactError`` naming it when it is missing or not a prismlm bank."""
    path = Path(path)
    fix = "point train.init_bank at a file written by prismlm.model.bank_file.save_bank, or leave it unset"
    if not path.is_file():
        raise ArtifactError(f"no prototype bank file at {path}", fix=fix, path=path)
    with reading(path, "prototype bank", fix=fix):
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
        except SafetensorError as e:
            raise ValueError(str(e)) from e
        if meta.get("kind") != KIND or "prototypes" not in tensors:
            raise ValueError(f"not a prismlm bank (kind {meta.get('kind')!r})")
        return BankFile(
            path=path,
            prototypes=tensors["prototypes"],
            backbone=meta["backbone"],
            top_k=int(meta["top_k"]),
            step=int(meta["step"]),
            made_by={str(k): str(v) for k, v in json.loads(meta.get("made_by", "{}")).items()},
        )


def install_bank(model: PrismLM, bank: BankFile) -> None:
    """Copy ``bank`` into ``model``'s bank after checking that it serves this model: the same backbone
    (``ArtifactMismatch``), the same K, d and k (``ArtifactMismatch`` naming the recipe options to match)."""
    layer = model.require_prototypes()
    K, d = layer.weight.shape
    if bank.backbone != backbone_identity(model):
        raise ArtifactMismatch(
            f"the prototype bank {bank.path} was trained on another model's hidden states",
            fix="train a bank for this model (leave train.init_bank unset), or use this bank with its own model",
        )
    if tuple(bank.prototypes.shape) != (K, d) or bank.top_k != layer.cfg.top_k:
        raise ArtifactMismatch(
            f"the prototype bank {bank.path} holds K={bank.prototypes.shape[0]} prototypes of d="
            f"{bank.prototypes.shape[1]} with k={bank.top_k}; this model's bank is K={K}, d={d}, k={layer.cfg.top_k}",
            fix=f"retrofit with {bank.prototypes.shape[0]} prototypes and top_k {bank.top_k} (the bank's shape)",
        )
    with torch.no_grad():  # in place on the parameter: bumps its version for any cache
        layer.weight.copy_(bank.prototypes.to(layer.weight.dtype))


__all__ = ["BankFile", "install_bank", "load_bank", "save_bank"]
