"""Evaluation: perplexity, coverage and faithfulness metrics, log-likelihood scoring, multiple-choice tasks.

``prismlm.integrations.lm_eval_adapter`` (optional ``lm-eval``) registers the ``prism`` model with lm-eval; the
``prism-lm-eval`` command is lm-eval's command line with it.
"""

from prismlm.eval.faithfulness import FaithfulnessAccumulator, Yardstick, fit_yardstick
from prismlm.eval.metrics import CoverageAccumulator, evaluate
from prismlm.eval.scoring import loglikelihoods, mc_accuracy, text_perplexity

__all__ = [
    "CoverageAccumulator",
    "FaithfulnessAccumulator",
    "Yardstick",
    "evaluate",
    "fit_yardstick",
    "loglikelihoods",
    "mc_accuracy",
    "text_perplexity",
]
