"""``prism export``: a run as a Hugging Face transformers folder.

The folder (weights, ``PrismConfig``, generation config, tokenizer, two ``trust_remote_code`` shims) loads
with ``AutoModelForCausalLM.from_pretrained(OUT)`` after ``import prismlm`` (or with
``trust_remote_code=True``) and gives the run's logits bit for bit, its suppression set and multipliers
baked in. The tokenizer pads on the left. Loading with lm-eval and without prismlm: docs/modules.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from prismlm._version import __version__
from prismlm.app.run import Run
from prismlm.artifacts import JSON, atomic_dir, check_out_folder, writes_folder
from prismlm.errors import ConfigError, TokenizerError
from prismlm.model.interventions import Intervention, Suppress


def is_export(folder: Path) -> bool:
    """A folder ``prism export`` wrote: its config.json records the run it came from (``prism_source``)."""
    try:
        return "prism_source" in json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def _source(run: Run) -> dict[str, JSON]:
    """Where the exported weights came from (recorded in config.json as ``prism_source``)."""
    return {
        "checkpoint": str(run.checkpoint.path.resolve()),
        "model_sha256": run.identity,
        "step": run.step,
        "tokenizer": run.tokenizer.name,
        "prismlm_version": __version__,
        "interventions": [_described(iv) for iv in run.interventions],
    }


def _described(iv: Intervention) -> dict[str, JSON]:
    """An intervention as ``prism_source`` records it: its kind and label (and a suppression's residual mode)."""
    out: dict[str, JSON] = {"kind": type(iv).__name__.lower(), "label": iv.label}
    if isinstance(iv, Suppress):
        out["residual"] = iv.residual
    return out


@writes_folder("out")  # one writer per export folder
def export_run(run: Run, out: Path, *, overwrite: bool = False) -> Path:
    """Export the run as a Hugging Face transformers folder (AutoModelForCausalLM, generate, lm_eval --model hf).

    The run's suppression set (and any other intervention) is baked into the exported model. Load it with
    `AutoModelForCausalLM.from_pretrained(OUT)` after `import prismlm`, or with `trust_remote_code=True`.

    Args:
        out: Folder to write (created; written atomically).
        overwrite: Replace OUT if it already holds an export (never a run or any other folder).
    """
    out = Path(out)
    check_out_folder(out, "Hugging Face export", holds=is_export, overwrite=overwrite, option="OUT")
    from prismlm.integrations.hf_model import PrismForCausalLM, fast_tokenizer  # DependencyError without transformers

    tok = run.tokenizer
    eot = tok.eot_id
    eot_token = tok.backend.id_to_token(eot)
    if eot_token is None:
        raise TokenizerError(f"the run's tokenizer has no token for its end-of-text id {eot}")
    hf = PrismForCausalLM.from_prism(
        run.model,
        interventions=run.interventions,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        prism_source=_source(run),
    )
    fast = fast_tokenizer(tok.backend, eot_token, max_length=run.model.config.block_size)
    try:
        with atomic_dir(out) as stage:
            hf.save_pretrained(stage)
            fast.save_pretrained(stage)
    except OSError as e:  # a read-only or immutable folder, a full disk: nothing was replaced (atomic_dir)
        raise ConfigError(
            f"OUT {out}: cannot write the export there ({e.strerror or e}: {e.filename})",
            fix="export into a folder you can write (check its permissions, attributes and free space)",
            path=out,
        ) from None
    return out
