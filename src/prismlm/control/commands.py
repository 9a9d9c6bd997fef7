"""`prism` commands for control (suppression, concepts, controllers, tasks)."""

import typer


def register(app: typer.Typer) -> None:
    """Add this package's commands to the ``prism`` app."""
