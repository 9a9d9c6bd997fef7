"""PRISM models seen through other libraries' APIs: transformers (``hf_model``, ``hf_auto``) and lm-eval
(``lm_eval_adapter``). Nothing here is imported by ``import prismlm`` except ``hf_auto`` (standard library only)."""
