"""Evaluation: perplexity and coverage metrics."""

from prismlm.eval.metrics import CoverageAccumulator, evaluate

__all__ = ["CoverageAccumulator", "evaluate"]
