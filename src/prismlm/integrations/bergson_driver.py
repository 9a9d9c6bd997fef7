"""Run bergson (EleutherAI, ``bergson==2.5.1``) on a ``prism export``ed model, from bergson's own venv.

Run by ``prismlm.integrations.bergson`` (by its path, outside the package): ``PYTHON bergson_driver.py build ARGS...`` runs
``bergson build ARGS...``; ``PYTHON bergson_driver.py scores TRAIN_IDX QUERY_IDX OUT.npy`` writes the
(queries × training sequences) dot products of the two indexes' projected gradients.

Two workarounds, both needed with bergson 2.5.1 and this package's export: ``prismlm`` must be importable
(the export's ``modeling_prism.py`` imports it — the caller puts ``src`` on PYTHONPATH), and bergson reads
``model.base_model.device``, where the export's ``base_model`` is the raw ``PrismLM`` module (no ``.device``),
so the property is added here.
"""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    if sys.argv[1] == "scores":
        import numpy as np
        from bergson import load_gradients

        g = np.asarray(load_gradients(sys.argv[2]), dtype=np.float64)  # (N, projected dims)
        q = np.asarray(load_gradients(sys.argv[3]), dtype=np.float64)  # (Q, projected dims)
        np.save(sys.argv[4], q @ g.T)
    else:
        from prismlm.model import PrismLM

        PrismLM.device = property(lambda self: next(self.parameters()).device)  # type: ignore[attr-defined]
        sys.argv = ["bergson"] + sys.argv[1:]
        runpy.run_module("bergson", run_name="__main__")
