"""The run-folder guard: a new run never replaces another unless asked (``overwrite``), a resume needs a run
to continue, and ``clear_run_folder`` removes only the files a run writes."""

from __future__ import annotations

import json
from pathlib import Path

from prismlm.artifacts import RUN, RUN_FILES, check_out_folder, folder_kind
from prismlm.errors import CheckpointError, RunError
from prismlm.train.checkpoint import find_checkpoint

STORED_Z_DIR = "stored-z"
"""Where a retrofit keeps the frozen backbone's stored z: ``RUN/stored-z`` (``prismlm.model.stored_activations``)."""


def _holds_run(folder: Path) -> bool:
    """A run folder, even one stopped before env.json was written (its config.json is a RunConfig) or a
    retrofit stopped in its z pass (only ``RUN/stored-z`` so far)."""
    if folder_kind(folder) == RUN or (folder / STORED_Z_DIR / "manifest.json").exists():
        return True
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "model" in cfg and "train" in cfg


def has_checkpoint(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a complete checkpoint (``find_checkpoint`` finds one)."""
    try:
        find_checkpoint(out_dir)
    except CheckpointError:
        return False
    return True


def restart_fix(out_dir: Path) -> str:
    """How to go on with a run folder that has nothing to resume."""
    if not any((out_dir / name).exists() for name in RUN_FILES) and (out_dir / STORED_Z_DIR).is_dir():
        return "its z pass was interrupted: run the same retrofit again as a new run (not resumed) to continue it"
    if _holds_run(out_dir):
        return (
            "nothing to resume: start it again with `overwrite` (a retrofit's stored z is kept and reused), "
            "or choose another run folder"
        )
    return "start it as a new run (not resumed)"


def check_run_folder(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start a new run in a folder that holds one, unless ``overwrite``; refuse to resume a
    folder that does not exist (before the lock would create it); refuse a file, a run's checkpoints or a
    non-empty folder that holds no run whatever the flags (``check_out_folder``)."""
    if resume and not out_dir.exists():
        raise CheckpointError(f"cannot resume {out_dir}: no such run", fix="start it as a new run (not resumed)")
    check_out_folder(out_dir, "run", holds=_holds_run, overwrite=True)  # the run itself: decided below
    if resume or overwrite or not out_dir.exists():
        return
    held = [name for name in RUN_FILES if (out_dir / name).exists()]
    if held and not has_checkpoint(out_dir):  # stopped before its first checkpoint: nothing to resume
        raise RunError(
            f"{out_dir} already holds a run stopped before its first checkpoint ({', '.join(held)})",
            fix=restart_fix(out_dir),
            param="overwrite",
        )
    if held:
        raise RunError(
            f"{out_dir} already holds a run ({', '.join(held)})",
            fix="continue it with `resume`, replace it with `overwrite`, or choose another run folder",
            param=("resume", "overwrite"),
        )


def clear_run_folder(out_dir: Path) -> None:
    """``overwrite``: remove the previous run's files (only those a run writes)."""
    import shutil

    for name in RUN_FILES:
        p = out_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
