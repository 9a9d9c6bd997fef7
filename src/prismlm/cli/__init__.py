"""The ``prism`` command line: parses arguments, calls ``prismlm.app``, renders through one console."""

from prismlm.cli.main import app

__all__ = ["app"]
