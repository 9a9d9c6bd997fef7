"""Explorer views: terminal rendering and self-contained HTML reports of explanations."""

from prismlm.explore.report import RunHeader, render_html, render_terminal, write_html

__all__ = ["RunHeader", "render_html", "render_terminal", "write_html"]
