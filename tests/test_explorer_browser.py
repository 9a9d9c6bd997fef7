"""The explorer in a real browser: headless Debian chromium driven by playwright, against uvicorn serving a
tiny trained run on a free 127.0.0.1 port.

``PRISM_SCREENSHOTS=1`` also saves a screenshot of each view into ``docs/img/explorer-*.png``; with
``PRISM_SCREENSHOTS_RUN=RUN`` the views show that run (e.g. a trained cpu-small run with its index) instead
of the tests' tiny one, for screenshots that read well.
chromium is installed by ``scripts/setup.sh`` (``apt-get install chromium``); ``playwright install`` is
never used (it downloads browsers).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("playwright")
from fastapi.testclient import TestClient  # noqa: E402
from playwright.sync_api import Page, sync_playwright  # noqa: E402
from test_chat import chat  # noqa: E402, F401  (the fixture)
from test_explorer_api import LIMITS, build_explorer_run  # noqa: E402
from test_explorer_jobs import gate  # noqa: E402, F401  (the fixture)

from prismlm.app.explorer import Explorer  # noqa: E402
from prismlm.web.server import create_app, serve_in_background  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(__file__).resolve().parents[1] / "docs" / "img"
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"

if not CHROMIUM.exists():  # pragma: no cover - scripts/setup.sh installs it; say so loudly rather than skip
    pytest.fail(
        "tests/test_explorer_browser.py needs /usr/bin/chromium: run scripts/setup.sh (apt-get install chromium)",
        pytrace=False,
    )


@pytest.fixture(scope="module")
def served(tiny_shards, tmp_path_factory) -> Iterator[tuple[str, Explorer]]:
    run, concept = build_explorer_run(tiny_shards, tmp_path_factory.mktemp("explorer"))
    other = os.environ.get("PRISM_SCREENSHOTS_RUN")
    ex = (
        Explorer.open(other, device="cpu", limits=LIMITS)
        if other
        else Explorer.open(run, device="cpu", concepts=[concept], limits=LIMITS)
    )
    with serve_in_background(ex, timeout=30) as base:
        yield base, ex


@pytest.fixture(scope="module")
def browser_page(served) -> Iterator[tuple[Page, list[str]]]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1320, "height": 900})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(20_000)
        yield page, errors
        browser.close()


@pytest.fixture(autouse=True)
def _fresh_errors(browser_page) -> None:
    browser_page[1].clear()  # each test answers for its own console errors


def _shot(page: Page, name: str) -> None:
    if os.environ.get("PRISM_SCREENSHOTS"):
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"explorer-{name}.png"), full_page=True)


def _no_errors(errors: list[str]) -> None:
    assert errors == [], errors
    errors.clear()


def test_explain_click_a_token_shows_its_waterfall(served, browser_page):
    base, ex = served
    page, errors = browser_page
    page.goto(base + "#/explain?text=" + quote(TEXT))
    page.wait_for_selector("#explain-tokens span.tok[data-pos]")
    api = ex.explain(TEXT, alternatives=5)
    t = 5
    page.click(f"#explain-tokens span.tok[data-pos='{t}']")
    page.wait_for_selector("#explain-tokens span.tok.sel[data-pos='5']")
    wf = page.locator("#wf-chosen svg.wf")
    rows = wf.locator("rect:not(.total)")
    assert rows.count() == len(api.positions[t].active) + 1  # one bar per active prototype + the residual
    # the waterfall's last row is the logit of the token the model predicted there
    assert wf.locator("text").last.text_content() == f"{api.positions[t].chosen.logit:.3f}"
    assert api.positions[t].chosen.token in page.inner_text("#explain-detail h2")
    page.click("#explain-detail tr[data-alt='0']")  # why not the best alternative?
    page.wait_for_selector("#wf-alt svg.wf")
    gap = api.positions[t].chosen.logit - api.positions[t].alternatives[0].logit
    assert page.locator("#wf-alt svg.wf").nth(1).locator("text").last.text_content() == f"{gap:.3f}"
    assert "pos=6" in page.url  # the selection is part of the shareable URL: the index of the token shown
    page.select_option("#explain-color", "residual")
    assert "residual share" in page.inner_text("#explain-legend")
    _shot(page, "explain")
    _no_errors(errors)


def test_prototype_view_shows_contexts(served, browser_page):
    base, ex = served
    page, errors = browser_page
    page.goto(base + "#/explain?text=" + quote(TEXT) + "&pos=4")
    page.wait_for_selector("#explain-cards .card a.plink")
    pid = page.locator("#explain-cards .card a.plink").first.get_attribute("data-id")
    page.click("#explain-cards .card a.plink >> nth=0")
    page.wait_for_selector("#proto-contexts li")
    assert f"#/prototype/{pid}" in page.url
    card = ex.prototype(int(pid), neighbours=12).card
    items = page.locator("#proto-contexts li")
    assert items.count() == len(card["neighbours"]) > 0
    assert items.first.locator("mark").inner_text() == card["neighbours"][0]["target"].replace("\n", "↵")
    assert page.locator("svg.hist rect").count() > 0
    detail = ex.prototype(int(pid), neighbours=12)
    # pushed down as well as up, the logit histogram, and examples across the activation range
    assert page.locator("#proto-down span").count() == len(card["bottom_tokens"]) > 0
    assert page.locator("#proto-down span").first.inner_text().startswith(_vis(card["bottom_tokens"][0][0]))
    assert detail.logit_histogram is not None and detail.bands
    assert page.locator("#proto-logit-hist rect").count() == len(detail.logit_histogram["counts"])
    assert page.locator("#proto-bands ol[data-band]").count() == len(detail.bands) == 4  # activation intervals
    assert "uniform random sample" in page.inner_text("#proto-bands")
    _shot(page, "prototype")
    page.click("#proto-contexts a.doc >> nth=0")  # the whole document, target marked
    page.wait_for_selector("#doc-target")
    assert card["neighbours"][0]["doc_id"] in page.inner_text("#doc-out")
    _no_errors(errors)


def test_prototype_view_labels_activation_intervals_and_the_fallback(served, browser_page):
    """The bands are drawn as activation intervals of a uniform sample (bounds and counts as the API gives
    them); for an index without a sample, the rank thirds with the note saying so."""
    base, ex = served
    page, errors = browser_page
    i = int(ex.index.counts.argmax())
    bands = ex.prototype(i).bands
    assert bands and bands[0]["kind"] == "activation"
    page.goto(base + f"#/prototype/{i}")
    page.wait_for_selector("#proto-bands ol[data-band]")
    heads = page.locator("#proto-bands h3")
    assert heads.count() == len(bands)
    for j, b in enumerate(bands):
        text = heads.nth(j).inner_text()
        assert f"activation interval ({b['interval'][0]:.3f}, {b['interval'][1]:.3f}]" in text, text
        assert f"{b['count']} of the {b['sampled']} sampled firings" in text, text
    assert page.locator("#proto-bands li").count() == sum(len(b["examples"]) for b in bands)
    sample, ex.index.sample = ex.index.sample, None  # as an index written before the sample
    try:
        page.goto(base + f"#/prototype/{(i + 1) % ex.num_prototypes}")  # another route: the view re-renders
        page.goto(base + f"#/prototype/{i}")
        page.wait_for_selector("#proto-bands .notes")
        assert "no activation sample" in page.inner_text("#proto-bands .notes")
        assert page.locator("#proto-bands ol[data-band]").count() == 3
    finally:
        ex.index.sample = sample
    _no_errors(errors)


def test_map_draws_and_search_highlights(served, browser_page):
    base, ex = served
    page, errors = browser_page
    page.goto(base + "#/map")
    page.wait_for_selector("#map-canvas[data-drawn]")
    assert page.get_attribute("#map-canvas", "data-drawn") == str(ex.num_prototypes)
    m = ex.map()
    category = m.categories[next(c for c in m.category if c >= 0)]  # one that some prototype has
    page.fill("#map-q", category)
    page.click("#map-go")
    page.wait_for_selector("#map-hits table tr td")
    assert f"map?q={category}" in page.url
    heads = page.locator("#map-hits table tr th")  # the hits table has a header, one cell per column
    assert heads.count() == page.locator("#map-hits table tr:nth-child(2) td").count() == 5
    assert "why" in heads.nth(3).inner_text()
    _shot(page, "map")
    page.click("#map-hits a.plink >> nth=0")
    page.wait_for_selector("#proto-contexts li")
    _no_errors(errors)


def test_suppression_toggle_changes_the_generated_text(served, browser_page):
    base, ex = served
    page, errors = browser_page
    client = TestClient(create_app(ex), base_url="http://127.0.0.1")
    live = [i for i, c in enumerate(client.get("/api/map").json()["count"]) if c > 0][:8]
    prompt = "It is a truth"
    # a seed at which suppressing the live prototypes changes the sample (found through the API)
    seed = next(
        s
        for s in range(40)
        if client.post(
            "/api/steer", json={"prompt": prompt, "tokens": 12, "seed": s, "steering": {"suppress": live}}
        ).json()["first_difference"]
        is not None
    )
    page.goto(base + f"#/steer?prompt={quote(prompt)}&tokens=12&seed={seed}&suppress={','.join(map(str, live))}")
    page.wait_for_selector("#steer-steered")
    steered, base_text = page.inner_text("#steer-steered"), page.inner_text("#steer-base")
    assert steered != base_text and page.locator("#steer-steered span.diff").count() > 0
    assert page.locator("#steer-steps tr").count() == 12 + 1
    _shot(page, "steer")
    for cb in page.locator(".steer-toggle").all():  # switch every suppression off again …
        cb.uncheck()
    page.click("#steer-go")
    page.wait_for_function("document.querySelector('#steer-steered span.diff') === null")
    # … and the steered text is the base model's again
    assert page.inner_text("#steer-steered") == base_text != steered
    assert "off=" in page.url
    # steering only prototypes that never fire on the text: the view says so, not just "identical"
    idle = client.post(
        "/api/steer",
        json={"prompt": prompt, "tokens": 12, "seed": seed, "steering": {"suppress": list(range(ex.num_prototypes))}},
    ).json()["inactive"][:3]
    page.goto(base + f"#/steer?prompt={quote(prompt)}&tokens=12&seed={seed}&suppress={','.join(map(str, idle))}")
    page.wait_for_selector("#steer-summary")
    idle_run = client.post(
        "/api/steer", json={"prompt": prompt, "tokens": 12, "seed": seed, "steering": {"suppress": idle}}
    ).json()
    if idle_run["first_difference"] is None and idle_run["inactive"] == idle:
        assert "none of the steered prototypes fires on this text" in page.inner_text("#steer-summary")
    assert idle_run["inactive"] and "never fire on this text" in page.inner_text("#steer-out")
    _no_errors(errors)


def test_training_data_view_filters_per_token(served, browser_page):
    base, _ = served
    page, errors = browser_page
    page.goto(
        base
        + "#/training?prompt="
        + quote("It is a truth")
        + "&completion="
        + quote(" universally acknowledged, that")
        + "&top=5"
    )
    page.wait_for_selector("#train-items tr td")
    assert page.locator("#train-items tr").count() == 5 + 1
    _shot(page, "training")
    page.click("#train-tokens a[data-tok='1']")
    page.wait_for_selector("#train-tokens a.on[data-tok='1']")
    assert "token=1" in page.url
    _no_errors(errors)


def _reference_logits(ex: Explorer, ids: list[int]) -> torch.Tensor:
    """(n, V) logits of a plain forward: the independent reference of what a click explains."""
    with torch.no_grad():
        return ex.run.model(torch.tensor([ids])).logits[0].double()


def _vis(s: str) -> str:
    return s.replace("\n", "↵").replace("\t", "⇥")


def test_a_click_means_the_prediction_of_that_token_in_app_and_report(served, browser_page, tmp_path):
    """Clicking the j-th token (in reading order) in ``prism serve`` and in the ``prism explain --html`` report
    draws the waterfall of the same logit: logits[j − 1, ids[j]] of a plain forward."""
    from prismlm.explain import explain
    from prismlm.render import write_html

    base, ex = served
    page, errors = browser_page
    ids = ex.run.tokenizer.encode(TEXT)
    tokens = [ex.run.tokenizer.id_to_token(i) for i in ids]
    ref = _reference_logits(ex, ids)
    expl = explain(ex.run.model, ex.run.tokenizer, TEXT)
    report = write_html(expl, tmp_path / "report.html")
    page.goto(base + "#/explain?text=" + quote(TEXT))
    page.wait_for_selector("#explain-tokens span.tok[data-pos]")
    assert "prediction of that token" in page.inner_text("#view .convention")
    for j in (2, 6):
        span = page.locator("#explain-tokens span.tok").nth(j)
        assert span.inner_text() == _vis(tokens[j])
        span.click()
        page.wait_for_selector("#wf-chosen svg.wf")
        assert page.locator("#wf-chosen svg.wf text").last.text_content() == f"{float(ref[j - 1, ids[j]]):.3f}"
        alone = page.inner_text("#explain-detail .alone")  # what the prototypes alone would have predicted
        assert f"prototypes alone would predict {_vis(expl.positions[j - 1].prototype_top_token)}" in alone
    page.goto(report.as_uri())
    assert "prediction of that token" in page.inner_text("#convention")
    for j in (2, 6):
        span = page.locator("#text span.t").nth(j)
        assert span.inner_text() == tokens[j]
        span.click()
        page.wait_for_selector("#detail svg.wf")
        assert page.locator("#detail svg.wf text").last.text_content() == f"{float(ref[j - 1, ids[j]]):.3f}"
        top = expl.positions[j - 1].prototype_top_token
        assert f"prototypes alone would predict {json.dumps(top, ensure_ascii=False)}" in page.inner_text("#detail")
    _no_errors(errors)


def test_where_it_fires_marks_the_tokens_it_helps_predict(served, browser_page):
    base, ex = served
    page, errors = browser_page
    ids = ex.run.tokenizer.encode(TEXT)
    with torch.no_grad():
        out = ex.run.model(torch.tensor([ids]))
    act = out.activations[0] > 0
    pid = int(out.indices[0, 3][act[3]][0])
    # token j is marked when the prototype is active at position j - 1 (it adds to token j's logit)
    want = {t + 1 for t in range(len(ids)) if bool(((out.indices[0, t] == pid) & act[t]).any())}
    page.goto(base + f"#/prototype/{pid}?text=" + quote(TEXT))
    page.wait_for_selector("#proto-fires span.tok")
    spans = page.locator("#proto-fires span.tok")
    marked = {j for j in range(spans.count()) if "background" in (spans.nth(j).get_attribute("style") or "")}
    assert marked == want and 4 in want
    _no_errors(errors)


def test_explain_at_1024px_the_waterfall_stays_clear_of_the_cards(served, browser_page):
    base, _ = served
    page, errors = browser_page
    page.set_viewport_size({"width": 1024, "height": 800})
    try:
        page.goto(base + "#/explain?text=" + quote(TEXT) + "&pos=5")
        page.wait_for_selector("#wf-chosen svg.wf")
        page.click("#explain-detail tr[data-alt='0']")
        page.wait_for_selector("#wf-alt svg.wf")
        _shot(page, "explain-1024")
        detail = page.locator("#explain-detail").bounding_box()
        cards = page.locator("#explain-cards").bounding_box()
        assert detail and cards
        for k in range(page.locator("#explain-detail svg.wf").count()):
            wf = page.locator("#explain-detail svg.wf").nth(k).bounding_box()
            assert wf is not None
            assert wf["x"] >= detail["x"] and wf["x"] + wf["width"] <= detail["x"] + detail["width"] + 0.5, (
                k,
                wf,
                detail,
            )
            overlap_x = min(wf["x"] + wf["width"], cards["x"] + cards["width"]) - max(wf["x"], cards["x"])
            overlap_y = min(wf["y"] + wf["height"], cards["y"] + cards["height"]) - max(wf["y"], cards["y"])
            assert overlap_x <= 0 or overlap_y <= 0, (k, wf, cards)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1024  # nothing sticks out sideways
    finally:
        page.set_viewport_size({"width": 1320, "height": 900})
    _no_errors(errors)


def test_an_empty_text_explains_the_first_prediction(served, browser_page):
    base, ex = served
    page, errors = browser_page
    page.goto(base + "#/explain")
    page.wait_for_selector("#explain-go")
    page.fill("#explain-text", "")
    page.click("#explain-go")
    page.wait_for_selector("#wf-chosen svg.wf")  # like `prism explain ""`: the prediction after end-of-text
    want = ex.explain("", alternatives=0).positions[0].chosen
    assert page.locator("#wf-chosen svg.wf text").last.text_content() == f"{want.logit:.3f}"
    assert "empty input" in page.inner_text("#explain-out")
    _no_errors(errors)


def test_a_url_position_is_the_index_of_the_token_shown(served, browser_page):
    """``pos=K`` in the URL selects token K of the text (the K-th after the first, as the tooltips number them)
    — the prediction of that token — not the token after it."""
    base, ex = served
    page, errors = browser_page
    ids = ex.run.tokenizer.encode(TEXT)
    k = 7
    page.goto(base + "#/explain?text=" + quote(TEXT) + f"&pos={k}")
    page.wait_for_selector("#explain-tokens span.tok.sel")
    sel = page.locator("#explain-tokens span.tok.sel")
    assert sel.get_attribute("data-token") == str(k)
    assert sel.inner_text() == _vis(ex.run.tokenizer.id_to_token(ids[k]))
    assert f"token {k}" in page.inner_text("#explain-head")
    _no_errors(errors)


@pytest.mark.slow
def test_explain_answers_while_training_data_is_working(tiny_shards, tmp_path_factory, browser_page, gate):  # noqa: F811
    """A Training data request without an attribution cache runs as a job (held mid-build by ``gate``); the
    Explain view, opened meanwhile in another tab, answers; then the training page shows its result."""
    run, concept = build_explorer_run(tiny_shards, tmp_path_factory.mktemp("explorer"))
    ex = Explorer.open(run, device="cpu", concepts=[concept], limits=LIMITS)
    page, errors = browser_page
    with serve_in_background(ex, timeout=30) as base:
        page.goto(
            base + "#/training?prompt=" + quote("It is a truth") + "&completion=" + quote(" universally") + "&top=4"
        )
        page.wait_for_selector("#job-status[data-state='running'] progress")
        assert "prism attribute-cache" in page.inner_text("#job-status")
        other = page.context.browser.new_page()
        other.goto(base + "#/explain?text=" + quote(TEXT))
        other.wait_for_selector("#wf-chosen svg.wf")  # answered while the training job is held
        assert page.locator("#job-status[data-state='running']").count() == 1
        other.close()
        gate.set()
        page.wait_for_selector("#train-items tr td")
        assert page.locator("#train-items tr").count() == 4 + 1
    _no_errors(errors)


@pytest.mark.slow
def test_the_chat_box_answers_and_explains_up_to_the_end_of_turn(chat, browser_page):  # noqa: F811
    """A run with a chat template gets a chat box: the message (after the system prompt) is answered with the
    template, greedily, up to its end-of-turn token, and the answer is explained."""
    from test_chat import MESSAGE

    page, errors = browser_page
    ex = Explorer(chat.run, limits=LIMITS)
    with serve_in_background(ex, timeout=30) as base:
        page.goto(base + "#/explain")
        page.wait_for_selector("#explain-chat")
        page.fill("#explain-text", MESSAGE)
        page.check("#explain-chat")
        page.fill("#explain-system", "Answer in one word.")
        page.click("#explain-go")
        page.wait_for_selector("#wf-chosen svg.wf")
        assert "chat=1" in page.url and "system=" in page.url
        view = ex.explain(MESSAGE, chat=True, system="Answer in one word.")
        shown = page.locator("#explain-tokens span.tok[data-pos]")
        assert shown.count() == len(view.positions)
        assert shown.last.inner_text() == _vis(chat.run.tokenizer.id_to_token(chat.end))  # the answer's last token
        page.goto(base + "#/steer")
        page.wait_for_selector("#steer-chat")
    _no_errors(errors)


def test_type_a_competing_token_and_open_the_residual(served, browser_page):
    base, ex = served
    page, errors = browser_page
    ids = ex.run.tokenizer.encode(TEXT)
    page.goto(base + "#/explain?text=" + quote(TEXT) + "&pos=6")
    page.wait_for_selector("#alt-token")
    page.fill("#alt-token", " the")
    page.click("#alt-go")
    page.wait_for_selector("#wf-alt svg.wf")
    c = ex.contrast(ids, 6, " the").view.chosen
    chosen = ex.explain(TEXT, alternatives=0).positions[5].chosen
    gap = page.locator("#wf-alt svg.wf").nth(1).locator("text").last.text_content()
    assert gap == f"{chosen.logit - c.logit:.3f}"  # the difference waterfall ends at the logit gap
    page.click("#resid-go")
    page.wait_for_selector("#resid-anchors li")
    assert page.locator("#resid-anchors li").count() == 8
    assert "W r pushes up" in page.inner_text("#resid-up")
    _no_errors(errors)
