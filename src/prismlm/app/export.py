"""``prism export``: a run as a Hugging Face transformers folder.

The folder holds ``model.safetensors`` + ``config.json`` (``PrismConfig``) + ``generation_config.json`` + the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``) + two ``trust_remote_code`` shims. It loads with
``AutoModelForCausalLM.from_pretrained(OUT)`` after ``import prismlm`` (or with ``trust_remote_code=True``
without it), generates with ``generate()``, and evaluates with ``lm_eval --model hf --model_args
pretrained=OUT,trust_remote_code=True`` (lm-eval's command line does not import prismlm; in Python, ``HFLM``
after ``import prismlm`` needs no flag) — with the run's logits, bit for bit. The run's interventions (its suppression
set, ``--suppress FILE``) are baked in: ``config.json`` lists the suppressed prototype ids (and the
multipliers of controllers or scaling), and every forward applies them.

The tokenizer pads on the left (batched ``generate`` continues every row from its own last token; the
model takes padding on either side). ``AutoTokenizer.from_pretrained(OUT)`` needs the same as the model —
``import prismlm`` first or ``trust_remote_code=True`` — because transformers reads ``config.json`` (whose
``auto_map`` names the shims) before the tokenizer files; without either it asks ``[y/N]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prismlm._version import __version__
from prismlm.app.run import Run
from prismlm.artifacts import atomic_dir
from prismlm.errors import ArtifactError, TokenizerError


def _check_out(run: Run, out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a folder", fix="choose another OUT", path=out)
    target = out.resolve()
    for mine in (run.checkpoint.path.resolve(), run.path.resolve()):
        if mine == target or mine.is_relative_to(target):
            raise ArtifactError(f"{out} holds the run being exported ({run.checkpoint.path}); exporting there "
                                "would replace it", fix="choose another OUT (e.g. RUN/hf)", path=out)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ArtifactError(f"{out} already exists and is not empty", fix="pass --overwrite to replace it, or "
                            "choose another OUT", path=out)


def _source(run: Run) -> dict[str, Any]:
    """Where the exported weights came from (recorded in config.json as ``prism_source``)."""
    return {"checkpoint": str(run.checkpoint.path.resolve()), "model_sha256": run.identity, "step": run.step,
            "tokenizer": run.tokenizer.name, "prismlm_version": __version__,
            "interventions": [{"kind": type(iv).__name__.lower(), "label": iv.label} for iv in run.interventions]}


def export_run(run: Run, out: Path, *, overwrite: bool = False) -> Path:
    """Export the run as a Hugging Face transformers folder (AutoModelForCausalLM, generate, lm_eval --model hf).

    The run's suppression set (and any other intervention) is baked into the exported model. Load it with
    `AutoModelForCausalLM.from_pretrained(OUT)` after `import prismlm`, or with `trust_remote_code=True`.

    Args:
        out: Folder to write (created; written atomically).
        overwrite: Replace OUT if it already holds files.
    """
    out = Path(out)
    _check_out(run, out, overwrite)
    from prismlm.model.hf_model import PrismForCausalLM, fast_tokenizer  # DependencyError without transformers

    tok = run.tokenizer
    eot = tok.eot_id
    eot_token = tok.backend.id_to_token(eot)
    if eot_token is None:
        raise TokenizerError(f"the run's tokenizer has no token for its end-of-text id {eot}")
    hf = PrismForCausalLM.from_prism(run.model, interventions=run.interventions, bos_token_id=eot,
                                     eos_token_id=eot, pad_token_id=eot, prism_source=_source(run))
    fast = fast_tokenizer(tok.backend, eot_token, max_length=run.model.config.block_size)
    with atomic_dir(out) as stage:
        hf.save_pretrained(stage)
        fast.save_pretrained(stage)
    return out
