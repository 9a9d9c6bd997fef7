"""``python -m prismlm.cli …`` (e.g. under ``torchrun``) runs the ``prism`` command line."""

from prismlm.cli.root import app

app()
