"""``lm-eval`` model adapter: ``lm_eval --model prism --model_args pretrained=RUN[,suppress=FILE]``.

Importing this module registers the model name ``prism`` with lm-eval (``register_model``). The adapter
answers ``loglikelihood`` with ``prismlm.eval.scoring.loglikelihoods`` — the same function our own
multiple-choice scorer uses — so both give the same accuracies (tested). A suppressed or controlled
model is evaluated as such. ``lm-eval`` is an optional dependency (``pip install lm-eval``).

From the shell, lm-eval must import this module first; ``prism tasks eval --lm-eval`` does that, or::

    python -m prismlm.app.lm_eval_adapter \
        --model prism --model_args pretrained=runs/x --tasks prism_sotu_era --include_path tasks/
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from prismlm.data.tokenizer import Tokenizer
from prismlm.eval.scoring import loglikelihoods
from prismlm.model import Intervention, PrismLM


@register_model("prism")
class PrismEvalLM(LM):
    """A PRISM (or dense) checkpoint, or an in-memory model + tokenizer, as an lm-eval ``LM``."""

    def __init__(self, pretrained: str | None = None, *, model: PrismLM | None = None,
                 tokenizer: Tokenizer | None = None,
                 suppress: str | None = "auto", batch_size: int | str | None = 32, device: str | None = "cpu",
                 **_: Any) -> None:
        super().__init__()
        interventions: tuple[Intervention, ...]
        if model is None:
            if pretrained is None:
                raise ValueError("--model prism needs model_args pretrained=RUN_OR_CHECKPOINT")
            import torch

            from prismlm.app.run import Run

            # lm-eval's CLI defaults to a CUDA device; fall back to the CPU where there is none
            dev = device if device and (str(device).startswith("cpu") or torch.cuda.is_available()) else "cpu"
            run = Run.open(Path(pretrained), device=str(dev), suppress=suppress)
            model, tokenizer, interventions = run.model, run.tokenizer, run.interventions
        else:
            interventions = ()
        if tokenizer is None:
            raise ValueError("the prism lm-eval adapter needs a tokenizer")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.interventions = interventions
        self._bs = int(batch_size) if batch_size not in (None, "auto") else 32

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        with self.model.intervene(*self.interventions):
            return loglikelihoods(self.model, self.tokenizer, [r.args for r in requests], batch_size=self._bs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for r in requests:
            (text,) = r.args
            ids = self.tokenizer.encode(text)
            T = self.model.config.block_size
            total = 0.0
            # windows of block_size tokens, each conditioned on end-of-text (simple, exact for short texts)
            with self.model.intervene(*self.interventions):
                for s in range(0, len(ids), T):
                    chunk = self.tokenizer.decode(ids[s:s + T])
                    total += loglikelihoods(self.model, self.tokenizer, [("", chunk)], batch_size=1)[0][0]
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("the prism adapter scores log-likelihoods only (multiple-choice tasks)")


def evaluate_with_lm_eval(model: PrismLM, tokenizer: Tokenizer, task_folders: dict[str, str | Path], *,
                          split_limit: int | None = None, batch_size: int = 32) -> dict[str, dict[str, float]]:
    """Run lm-eval's own evaluator on our task folders (built by ``prismlm.eval.tasks``) with an
    in-memory model; returns task → {acc, acc_norm}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folders = sorted({str(Path(f).resolve()) for f in task_folders.values()})
    tm = TaskManager(include_path=folders, include_defaults=False)
    names = [f"prism_{t}" for t in task_folders]
    res = simple_evaluate(model=PrismEvalLM(model=model, tokenizer=tokenizer, batch_size=batch_size), tasks=names,
                          task_manager=tm, limit=split_limit, bootstrap_iters=0, log_samples=False,
                          random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    out = {}
    for t in task_folders:
        r = res["results"][f"prism_{t}"]
        out[t] = {"acc": float(r["acc,none"]), "acc_norm": float(r["acc_norm,none"])}
    return out


def main() -> None:  # pragma: no cover - thin wrapper over lm-eval's own CLI
    """``python -m prismlm.app.lm_eval_adapter ARGS``: lm-eval's command line with ``--model prism`` registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":  # pragma: no cover
    main()
