"""Evaluation: perplexity and coverage metrics, log-likelihood scoring, multiple-choice tasks.

``prismlm.integrations.lm_eval_adapter`` (optional ``lm-eval``) registers the ``prism`` model with lm-eval; the
``prism-lm-eval`` command is lm-eval's command line with it.
"""

from prismlm.eval.metrics import CoverageAccumulator, evaluate
from prismlm.eval.scoring import loglikelihoods, mc_accuracy, text_perplexity

__all__ = ["CoverageAccumulator", "evaluate", "loglikelihoods", "mc_accuracy", "text_perplexity"]
