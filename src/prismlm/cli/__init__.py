"""The ``prism`` command line: parses arguments, calls ``prismlm.app``, renders through one console.

``app`` (``prismlm.cli.root``) loads the commands (``prismlm.cli.main``) only when one runs, so ``prism
--help`` does not import torch.
"""

from prismlm.cli.root import app

__all__ = ["app"]
