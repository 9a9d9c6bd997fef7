"""The settings every ``prism`` command group shares (help text, option names, width): imported by both the
fast root (``cli/root.py``) and the real commands (``cli/main.py``), so neither imports the other for them."""

HELP = "prismlm: train, sample, evaluate, explain, attribute and control prototype language models (PRISM)."
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
"""Every command takes ``-h``; help text wraps at the terminal's width (at most 100 columns)."""
