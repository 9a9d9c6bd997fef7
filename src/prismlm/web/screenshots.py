"""Screenshots of the explorer's explain view: ``prism serve``'s app (``create_app`` over ``Explorer.open``) on a
free 127.0.0.1 port in a thread, driven by playwright with Debian's chromium (``/usr/bin/chromium``;
``playwright install`` is never used, it downloads browsers), as ``tests/test_explorer_browser.py`` does. Used by
the explanations claim (``bench/real_claims.py --stage explanations``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

from prismlm.app.explorer import Explorer
from prismlm.errors import DependencyError
from prismlm.web.server import serve_in_background

CHROMIUM = Path("/usr/bin/chromium")
WIDTH, HEIGHT = 1280, 1000  # the browser viewport


@dataclass(frozen=True)
class Shot:
    """One screenshot: the explain view of ``text`` with the token at ``position`` selected."""

    name: str
    """The file is ``<name>-explorer.png``."""
    text: str
    position: int


def take_screenshots(run: Path, shots: Sequence[Shot], out_dir: Path) -> list[Path]:
    """One PNG per shot, ``out_dir / <name>-explorer.png``: the explain view of its text with the token at
    its position selected (waterfall and active prototypes' cards), clipped to the first screens."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise DependencyError("explorer screenshots need playwright (pip install playwright)") from e
    if not CHROMIUM.exists():
        raise DependencyError(f"explorer screenshots need {CHROMIUM} (apt-get install chromium)")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with serve_in_background(Explorer.open(run, device="cpu")) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), chromium_sandbox=False)  # as root in CI
        page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        page.set_default_timeout(180_000)  # the first explain request loads the index on one thread
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        for s in shots:
            page.goto(base + "#/explain?" + urlencode({"text": s.text, "pos": s.position}))
            page.wait_for_selector("#explain-cards .card")
            page.wait_for_timeout(300)
            height = min(page.evaluate("document.body.scrollHeight"), 1300)
            path = out_dir / f"{s.name}-explorer.png"
            page.screenshot(path=str(path), full_page=True, clip={"x": 0, "y": 0, "width": WIDTH, "height": height})
            paths.append(path)
        browser.close()
    if errors:
        raise RuntimeError(f"page errors: {errors}")
    return paths
