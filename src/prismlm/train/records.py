"""What a run writes besides its checkpoints: ``env.json`` (how to reproduce it), the ``metrics.jsonl`` log
(exact on resume: lines past the resumed step are dropped) and the validation line the progress bar shows."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import torch

from prismlm.artifacts import JSON
from prismlm.errors import RunError
from prismlm.eval.metrics import dead_text
from prismlm.train.distributed import DistInfo


def _git_revision() -> str | None:
    try:
        root = Path(__file__).resolve().parents[3]
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if rev.returncode != 0:
            return None
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment_info(info: DistInfo, device: torch.device, seed: int) -> dict[str, JSON]:
    """What a reader needs to reproduce a run: code revision, package versions, hardware, seed."""
    versions: dict[str, JSON] = {}
    for pkg in ("prismlm", "torch", "numpy", "tokenizers", "safetensors"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "git_revision": _git_revision(),
        "command": [*sys.argv],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "device": str(device),
        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "world_size": info.world_size,
        "torch_threads": torch.get_num_threads(),
        "seed": seed,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _records(text: str) -> list[str]:
    """The complete JSON lines of a metrics log; a torn line (a kill or a full disk mid-write) is dropped."""
    out = []
    for ln in text.splitlines():
        try:
            if ln.strip() and isinstance(json.loads(ln), dict):
                out.append(ln)
        except json.JSONDecodeError:
            continue
    return out


class MetricsLog:
    """Append-only JSONL log; on resume, lines past the resumed step (and torn lines) are dropped so the log
    stays exact."""

    def __init__(self, path: Path, resume_step: int | None, enabled: bool):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        if path.is_dir():
            raise RunError(
                f"{path} is a folder, but it is where the run's training log (a file) goes",
                fix=f"move that folder out of {path.parent} and run again",
                path=path,
            )
        if resume_step is not None and path.exists():
            kept = [
                ln for ln in _records(path.read_text(errors="replace")) if json.loads(ln).get("step", 0) <= resume_step
            ]
            path.write_text("".join(ln + "\n" for ln in kept))
        elif resume_step is None:
            path.write_text("")

    def write(self, record: Mapping[str, object]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def format_eval_line(step: int, m: dict[str, float], train_ce: float | None = None, top_k: int | None = None) -> str:
    """The validation line: val CE (``val_loss`` is the CE alone) beside the train CE of this step's batch
    (not the weighted total loss, which adds REC, R1 and R2); ``None`` when no CE was computed (a bank-only
    stage on stored z, where the logits are the frozen model's)."""
    s = f"step {step}: val CE {m['val_loss']:.4f} (ppl {m['val_ppl']:.1f})"
    if train_ce is not None:
        s += f", train CE {train_ce:.4f} (this step's batch)"
    if "r1_bar" in m:
        s += f" | R̄1 {m['r1_bar']:.3f} R2 {m['r2']:.3f} residual {m['residual_share']:.3f} {dead_text(m, top_k)}"
    if "top1_agreement" in m:  # faithfulness of the prototype-only prediction (prismlm.eval.faithfulness)
        s += f" | top1 {m['top1_agreement']:.2f} kl {m['kl']:.2f} margin {m['margin_share']:.2f} (pca {m['pca_margin_share']:.2f})"
    return s
