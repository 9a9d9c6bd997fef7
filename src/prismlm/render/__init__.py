"""Views of results: terminal rendering and self-contained HTML reports of explanations and attributions."""

from prismlm.render.report import RunHeader, render_html, render_terminal, write_html

__all__ = ["RunHeader", "render_html", "render_terminal", "write_html"]
