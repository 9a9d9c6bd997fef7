"""The settings every ``prism`` command group shares (help text, option names, width): imported by both the
fast root (``cli/root.py``) and the real commands (``cli/main.py``), so neither imports the other for them."""

import typer

HELP = "prismlm: train, sample, evaluate, explain, attribute and control prototype language models (PRISM)."
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
"""Every command takes ``-h``; help text wraps at the terminal's width (at most 100 columns)."""


def _version(value: bool) -> None:
    if value:
        from prismlm._version import __version__
        from prismlm.cli.console import echo  # rank 0 only under torchrun

        echo(f"prismlm {__version__}")
        raise typer.Exit()


def root_options(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """prismlm: train, sample, evaluate, explain, attribute and control prototype language models (PRISM)."""
