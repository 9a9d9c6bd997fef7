"""``python -m prismlm.cli …`` (e.g. under ``torchrun``) runs the ``prism`` command line."""

from prismlm.cli.main import app

app()
