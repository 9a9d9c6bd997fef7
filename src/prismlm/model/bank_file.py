"""A prototype bank on its own: the (K, d) prototypes of a retrofit, saved apart from the model they were
trained on, so that a retrofit can start from it instead of seeding and training a bank (``train.init_bank``).

The file is safetensors: one tensor ``prototypes`` (K, d) — float16/float32, or int8 with float32
``prototype_scales`` (K,) and ``prototype_column_scales`` (d,) beside it (entry = int8 × its row's scale × its
column's scale, ``quantize_rows``; the demo's K=8,192 bank so fits in 4.8 MB, under the repository's 5 MiB
limit for a tracked file) — and string metadata — ``kind``, ``backbone`` (the
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
    """(K, d) as stored (float16 or float32); an int8 file's rows dequantized to float32."""
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
    """Write ``model``'s bank to ``path`` (``write_bank``) with what it serves and how it was made."""
    bank = model.require_prototypes()
    return write_bank(
        path,
        bank.weight.detach(),
        backbone=backbone_identity(model),
        top_k=bank.cfg.top_k,
        step=step,
        made_by=made_by,
        dtype=dtype,
    )


def write_bank(
    path: str | Path,
    prototypes: torch.Tensor,
    *,
    backbone: str,
    top_k: int,
    step: int,
    made_by: dict[str, str],
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write (K, d) ``prototypes`` as a bank file (safetensors). ``dtype``: float16 halves a float32 file;
    int8 quarters it, a scale per row and per column (``quantize_rows``); ``load_bank`` reads every one back as a float
    tensor."""
    if dtype not in (torch.float32, torch.float16, torch.int8):
        raise ArtifactError(
            f"a bank file stores float32, float16 or int8 prototypes, not {dtype}",
            fix="pass dtype=torch.float16 (the default), torch.float32 or torch.int8",
            path=path,
            param="dtype",
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "kind": KIND,
        "backbone": backbone,
        "top_k": str(top_k),
        "step": str(step),
        "made_by": json.dumps(made_by, sort_keys=True),
    }
    weight = prototypes.detach().to("cpu", torch.float32)
    if dtype == torch.int8:
        q, rows, columns = quantize_rows(weight)
        tensors = {"prototypes": q, "prototype_scales": rows, "prototype_column_scales": columns}
    else:
        tensors = {"prototypes": weight.to(dtype).contiguous()}
    save_file(tensors, str(path), metadata=metadata)
    return path


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K, d) float → (K, d) int8, (K,) row scales and (d,) column scales, float32, with
    ``weight ≈ int8 × row scale × column scale``. Why columns first: a model's hidden states have a few outlier
    dimensions, and a row scale alone, set by its outlier, leaves the other entries a coarse grid (SmolLM2's
    demo bank: worst row cosine 0.9991 with row scales, 0.99989 with both). Each column is divided by its
    largest |entry|, then each row of that by its own over 127, so every entry of the divided weight is off by
    at most half a row scale (an all-zero row or column keeps scale 1)."""
    columns = _scale(weight.abs().amax(dim=0), 1.0)
    divided = weight / columns
    rows = _scale(divided.abs().amax(dim=1), 127.0)
    q = torch.round(divided / rows[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), rows.contiguous(), columns.contiguous()


def _scale(absmax: torch.Tensor, levels: float) -> torch.Tensor:
    return torch.where(absmax > 0, absmax / levels, torch.ones_like(absmax)).float()


def dequantize_rows(q: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``quantize_rows``' inverse up to rounding: (K, d) float32."""
    return q.float() * rows.float()[:, None] * columns.float()[None, :]


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
        prototypes = tensors["prototypes"]
        if prototypes.dtype == torch.int8:
            rows = tensors.get("prototype_scales", torch.empty(0))
            columns = tensors.get("prototype_column_scales", torch.empty(0))
            if rows.shape != prototypes.shape[:1] or columns.shape != prototypes.shape[1:]:
                raise ValueError(
                    "int8 prototypes without a prototype_scales per row and prototype_column_scales per column"
                )
            prototypes = dequantize_rows(prototypes, rows, columns)
        return BankFile(
            path=path,
            prototypes=prototypes,
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


__all__ = ["BankFile", "dequantize_rows", "install_bank", "load_bank", "quantize_rows", "save_bank", "write_bank"]
