"""Control (spec §4): prototype suppression, concept search, sparse controllers, judges, SAE baseline.

    with model.suppress(ids): ...            # remove prototypes' logit slices exactly (always restores)
    with model.intervene(sset.intervention(), Control(c)): ...  # interventions as values, composed
    with model.control(c): ...               # ℓ' = W r + Σ (1 + c_i) a_i W p_i (c = 0: the base model)
    SuppressionSet.load(path) / .save(path)  # a set with its evidence, bound to a model
    find_concept(model, tok, concept_texts, neutral_texts, ConceptSelection(...))  # → SuppressionSet

Heavier pieces (controllers, SAE, judges) are imported from their modules.
"""

from prismlm.control.concept import ConceptSelection, find_concept
from prismlm.control.suppress import SuppressionSet

__all__ = ["ConceptSelection", "SuppressionSet", "find_concept"]
