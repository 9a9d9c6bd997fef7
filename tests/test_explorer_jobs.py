"""Slow explorer work off the request path (issue 35, item 1): a training request without an attribution cache
is a background job that says so first, shows progress, can be cancelled — and never holds back an Explain.

The slow job is made deliberately slow and deterministic: its progress report (after each batch of its
gradient build, outside the model lock) waits on an event the test sets once the Explain has answered.
Every wait has a deadline, used only to fail rather than hang.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
from test_explorer_api import LIMITS, TEXT, build_explorer_run  # noqa: E402

from prismlm.app.explorer import Explorer, JobsFullError  # noqa: E402
from prismlm.app.explorer.jobs import FairLock, Job, Jobs  # noqa: E402
from prismlm.progress import ProgressEvent  # noqa: E402
from prismlm.web.server import serve_in_background  # noqa: E402

DEADLINE = 120.0
"""Seconds after which a wait counts as a failure (never a timing assertion)."""


def _http(base: str, path: str, body: object | None = None, method: str | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base.rstrip("/") + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _until(base: str, job_id: str, ok, what: str) -> dict:
    t0 = time.monotonic()
    while True:
        _, job = _http(base, f"/api/jobs/{job_id}")
        if ok(job):
            return job
        assert time.monotonic() - t0 < DEADLINE, f"job never {what}: {job}"
        time.sleep(0.05)


@pytest.fixture()
def gate(monkeypatch) -> Iterator[threading.Event]:
    """Every job's progress report waits until the event is set (the job's batches are its slow part)."""
    release = threading.Event()
    report = Job.report

    def slow_report(self: Job, e: ProgressEvent) -> None:
        report(self, e)  # records progress (and raises once cancelled)
        if not release.wait(DEADLINE):
            raise AssertionError("the gate was never opened")
        report(self, e)  # a cancel asked for while waiting stops the job here

    monkeypatch.setattr(Job, "report", slow_report)
    yield release
    release.set()


@pytest.fixture()
def served(tiny_shards, tmp_path_factory) -> Iterator[tuple[str, Explorer]]:
    """A fresh explorer (no attribution cache, no gradients built) on a threaded uvicorn at 127.0.0.1."""
    run, concept = build_explorer_run(tiny_shards, tmp_path_factory.mktemp("explorer"))
    ex = Explorer.open(run, device="cpu", concepts=[concept], limits=LIMITS)
    assert not ex.has_cache and ex.training_is_slow()
    with serve_in_background(ex, timeout=60) as base:
        yield base, ex


def test_explain_answers_while_a_training_job_runs(served, gate):
    base, ex = served
    status, answer = _http(base, "/api/training", {"prompt": "It is a truth", "completion": " universally", "top": 3})
    assert status == 202  # not run on the request path: a job, with what it does and the fast path
    job = answer["job"]
    assert "prism attribute-cache" in job["message"] and "minutes" in job["message"]
    running = _until(base, job["id"], lambda j: j["state"] == "running" and j["stage"] is not None, "started")
    assert running["total"] == LIMITS.full_attribution_sequences and running["unit"] == "seq"
    status, expl = _http(base, "/api/explain", {"text": TEXT, "alternatives": 2})
    assert status == 200 and expl["positions"]  # answered while the training job is held mid-build
    assert _http(base, f"/api/jobs/{job['id']}")[1]["state"] == "running"
    gate.set()
    done = _until(base, job["id"], lambda j: j["state"] in ("done", "failed", "cancelled"), "ended")
    assert done["state"] == "done", done
    assert len(done["result"]["items"]) == 3 and done["result"]["seconds"] > 0
    assert not ex.training_is_slow()  # built once: the next request is answered directly
    status, again = _http(base, "/api/training", {"prompt": "It is a truth", "completion": " universally", "top": 3})
    assert status == 200 and [i["sequence"] for i in again["items"]] == [i["sequence"] for i in done["result"]["items"]]


def test_a_cancelled_training_job_stops_and_builds_nothing(served, gate):
    base, ex = served
    _, answer = _http(base, "/api/training", {"prompt": "It is a truth", "top": 3})
    job_id = answer["job"]["id"]
    _until(base, job_id, lambda j: j["state"] == "running" and j["stage"] is not None, "started")
    status, _ = _http(base, f"/api/jobs/{job_id}", method="DELETE")
    assert status == 200
    gate.set()
    end = _until(base, job_id, lambda j: j["state"] in ("done", "failed", "cancelled"), "ended")
    assert end["state"] == "cancelled" and end["result"] is None
    assert ex.training_is_slow()  # nothing half-built was kept
    assert _http(base, "/api/jobs/nope")[0] == 404


def test_the_job_queue_is_bounded():
    jobs, release = Jobs(max_queued=1), threading.Event()
    first = jobs.submit("slow", lambda progress: {"ok": release.wait(DEADLINE)}, "waits")
    with pytest.raises(JobsFullError, match="limit is 1"):
        jobs.submit("slow", lambda progress: {}, "refused")
    release.set()
    t0 = time.monotonic()
    while not jobs.get(first.id).over:
        assert time.monotonic() - t0 < DEADLINE
        time.sleep(0.01)
    assert jobs.get(first.id).result == {"ok": True}
    jobs.submit("quick", lambda progress: {}, "room again")


def test_the_model_lock_is_granted_in_the_order_asked():
    """A job that re-takes the lock in a loop cannot starve a request waiting beside it."""
    lock, order, asked = FairLock(), [], threading.Event()
    lock.acquire()

    def waiter() -> None:
        asked.set()
        with lock:
            order.append("request")

    t = threading.Thread(target=waiter)
    t.start()
    asked.wait(DEADLINE)
    t0 = time.monotonic()
    while lock._next < 2:  # the waiter holds ticket 1
        assert time.monotonic() - t0 < DEADLINE
        time.sleep(0.001)
    lock.release()
    with lock:  # the job asks again at once: it gets the lock only after the request
        order.append("job")
    t.join(DEADLINE)
    assert order == ["request", "job"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/api/steer?job=true", {"prompt": TEXT, "tokens": 4, "temperature": 0, "steering": {"suppress": [1, 2]}}),
        ("/api/explain?job=true", {"text": TEXT, "generate": 4, "steering": {"suppress": [3]}}),
    ],
)
def test_a_generation_job_gives_the_model_back_between_tokens(served, gate, path, body):
    """A generation (Steer, or an explained generation) holds the model one token at a time: held mid-answer,
    it lets an Explain through, then finishes with the same answer as a direct request."""
    base, ex = served
    status, answer = _http(base, path, body)
    assert status == 202
    job = answer["job"]
    _until(base, job["id"], lambda j: j["state"] == "running" and j["stage"] == "generate", "started generating")
    status, expl = _http(base, "/api/explain", {"text": "The sea was calm", "alternatives": 1})
    assert status == 200 and expl["positions"]
    assert _http(base, f"/api/jobs/{job['id']}")[1]["state"] == "running"
    gate.set()
    done = _until(base, job["id"], lambda j: j["state"] in ("done", "failed", "cancelled"), "ended")
    assert done["state"] == "done", done
    direct = _http(base, path.split("?")[0], body)[1]
    same = "steered" if "steer" in path else "token_ids"
    assert done["result"][same] == direct[same]
