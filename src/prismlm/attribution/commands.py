"""`prism` commands for training-data attribution (prototype-space influence, baselines)."""

import typer


def register(app: typer.Typer) -> None:
    """Add this package's commands to the ``prism`` app."""
