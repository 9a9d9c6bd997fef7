"""Explorer screenshots for the ``explanations`` stage of ``bench/real_claims.py``: ``prism serve``'s app
(``prismlm.web.server.create_app`` over ``Explorer.open``) on a free 127.0.0.1 port in a thread, driven
by playwright with Debian's chromium (``/usr/bin/chromium``; ``playwright install`` is never used, it
downloads browsers), as ``tests/test_explorer_browser.py`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlencode

from playwright.sync_api import sync_playwright

from prismlm.app.explorer import Explorer
from prismlm.web.server import serve_in_background

CHROMIUM = Path("/usr/bin/chromium")
VIEWPORT = {"width": 1280, "height": 1000}


class ShotLike(Protocol):
    name: str
    text: str
    position: int


def take_screenshots(run: Path, shots: Sequence[ShotLike], out_dir: Path) -> list[Path]:
    """One PNG per shot, ``out_dir / <name>-explorer.png``: the explain view of its text with the token at
    its position selected (waterfall and active prototypes' cards), clipped to the first screens."""
    if not CHROMIUM.exists():
        raise FileNotFoundError(f"{CHROMIUM} (apt-get install chromium)")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with serve_in_background(Explorer.open(run, device="cpu")) as base, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = browser.new_page(viewport=VIEWPORT)
        page.set_default_timeout(180_000)  # the first explain request loads the index on one thread
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        for s in shots:
            page.goto(base + "#/explain?" + urlencode({"text": s.text, "pos": s.position}))
            page.wait_for_selector("#explain-cards .card")
            page.wait_for_timeout(300)
            height = min(page.evaluate("document.body.scrollHeight"), 1300)
            path = out_dir / f"{s.name}-explorer.png"
            page.screenshot(
                path=str(path), full_page=True, clip={"x": 0, "y": 0, "width": VIEWPORT["width"], "height": height}
            )
            paths.append(path)
        browser.close()
    if errors:
        raise RuntimeError(f"page errors: {errors}")
    return paths
