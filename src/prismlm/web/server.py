"""``prism serve``: the explorer web app — a JSON API over ``prismlm.app.explorer`` and a static front end
(plain HTML/JS/CSS from ``prismlm/web/static``, nothing from a CDN), served by FastAPI and uvicorn.

Invariant: the app serves the one run it was created with and no request ever names a file; bodies, queue
and every operation are bounded (``Limits``), the ``Host`` header is checked, and prismlm errors become
JSON ``{"error", "message", "fix"}`` with a 4xx status. The rules and their statuses: docs/explorer.md
("Limits and safety").
"""

from __future__ import annotations

import json
import mimetypes
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from prismlm.app.explorer import (
    Explorer,
    JobsFullError,
    Limits,
    RequestLimitError,
    Steering,
    UnknownDocumentError,
    UnknownJobError,
)
from prismlm.app.explorer.plain import JSONDict
from prismlm.app.run import check_unicode
from prismlm.artifacts import encodable
from prismlm.errors import (
    ArtifactError,
    ArtifactMismatch,
    ConfigError,
    DataError,
    ModelError,
    PrismError,
    SuppressionError,
    UnknownPrototypeError,
)
from prismlm.model.generation import GREEDY, TEXT_SAMPLING, Sampling
from prismlm.progress import ProgressFn
from prismlm.render.report import SHARED_ASSETS

__all__ = ["STATIC_DIR", "create_app", "serve", "serve_in_background"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
DENIED_QUERY_KEYS = frozenset(
    {"path", "file", "filename", "dir", "folder", "run", "index", "cache", "shards", "out", "checkpoint"}
)
"""Query parameters that would name a file: refused with 404 on every route (none of ours takes one)."""
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def _status(e: PrismError) -> int:
    """The HTTP status of a prismlm error: whose fault, in HTTP's words."""
    if isinstance(e, (UnknownPrototypeError, UnknownDocumentError, UnknownJobError)):
        return 404
    if isinstance(e, JobsFullError):
        return 503
    if isinstance(e, ArtifactMismatch):
        return 409
    if isinstance(e, ArtifactError):
        return 404  # a missing index or cache: the resource is not there
    if isinstance(e, (RequestLimitError, ConfigError, DataError, ModelError, SuppressionError)):
        return 422
    return 400


def _json(data: object, status: int = 200) -> Response:
    """JSON without FastAPI's per-value encoder (the values are plain already; an explanation of 128
    tokens is ~10k numbers)."""
    # encodable: a lone surrogate that reached an answer anyway is sent as U+FFFD, never a 500
    return Response(
        encodable(json.dumps(data, ensure_ascii=False, separators=(",", ":"))),
        status_code=status,
        media_type="application/json",
    )


# ----- request bodies ----------------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def checked(self) -> _Body:
        """This body, after refusing any string in it that holds a lone surrogate (valid JSON — ``\\udcff``
        — but not Unicode: an answer quoting it could not be encoded): ``ConfigError`` naming the field."""

        def walk(value: object, where: str) -> None:
            if isinstance(value, str):
                check_unicode(value, where)
            elif isinstance(value, dict):
                for k, v in value.items():
                    walk(k, f"{where} key")
                    walk(v, f"{where}.{k}")
            elif isinstance(value, (list, tuple)):
                for v in value:
                    walk(v, where)

        for name, value in self.model_dump().items():
            walk(value, name)
        return self


class SteeringBody(_Body):
    suppress: list[int] = Field(default_factory=list)
    scale: dict[int, float] = Field(default_factory=dict)
    """prototype id → factor."""
    concept: str | None = None

    def value(self) -> Steering:
        return Steering(suppress=tuple(self.suppress), scale=tuple(self.scale.items()), concept=self.concept)


class ExplainBody(_Body):
    text: str = ""
    chat: bool = False  # text is a chat message: its answer is generated (greedy) and explained
    system: str | None = None  # with chat: the system prompt
    generate: int = 0
    alternatives: int = 5
    neighbours: int = 3
    temperature: float = GREEDY.temperature  # an explanation's generation is greedy unless asked otherwise
    top_tokens: int | None = GREEDY.top_tokens  # sample among the N most likely tokens (null: all)
    seed: int = 0
    steering: SteeringBody = Field(default_factory=SteeringBody)


class SteerBody(_Body):
    prompt: str = ""
    chat: bool = False  # prompt is a chat message, written with the run's chat template
    system: str | None = None
    tokens: int = 30
    temperature: float = TEXT_SAMPLING.temperature
    top_tokens: int | None = TEXT_SAMPLING.top_tokens
    seed: int = 0
    steering: SteeringBody = Field(default_factory=SteeringBody)


class ContrastBody(_Body):
    token_ids: list[int]
    token_index: int
    token: str
    steering: SteeringBody = Field(default_factory=SteeringBody)


class ResidualBody(_Body):
    token_ids: list[int]
    token_index: int
    answer_from: int = 1
    top: int = 8


class TrainingBody(_Body):
    prompt: str
    completion: str = ""
    token: int | None = None
    top: int = 10


def encodable_dict(value: Mapping[str, object]) -> JSONDict:
    """A view's ``to_dict()`` as the job's result (it is JSON-ready already: ``prismlm.app.explorer.plain``)."""
    return cast(JSONDict, dict(value))


def _static_table(*folders: Path) -> dict[str, tuple[bytes, str]]:
    """Every file of the static folders, read once: the only files the app can ever send."""
    table = {}
    for f in sorted(f for folder in folders for f in folder.iterdir()):
        if f.is_file() and not f.name.startswith("."):
            kind = mimetypes.guess_type(f.name)[0] or "application/octet-stream"
            if kind.startswith("text/") or kind in ("application/javascript", "text/javascript"):
                kind += "; charset=utf-8"
            table[f.name] = (f.read_bytes(), kind)
    return table


SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    "script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
}


def create_app(
    run: str | Path | Explorer,
    index: Path | None = None,
    cache: Path | None = None,
    limits: Limits = Limits(),
    *,
    device: str = "auto",
    suppress: str | Path | None = "auto",
    suppress_residual: str = "auto",
    concepts: Sequence[Path] = (),
    allowed_hosts: Sequence[str] | None = LOCAL_HOSTS,
) -> FastAPI:
    """The explorer app for one run (a run folder, or an opened ``Explorer`` to share one between apps).

    ``index``/``cache``: the prototype index and attribution cache (default RUN/index, RUN/attribution-cache
    when present); ``concepts``: suppression-set files a Steer request may name; ``allowed_hosts``: the
    ``Host`` names accepted (None: any — only for tests behind another guard)."""
    ex = (
        run
        if isinstance(run, Explorer)
        else Explorer.open(
            run,
            index=index,
            cache=cache,
            device=device,
            suppress=suppress,
            suppress_residual=suppress_residual,
            concepts=concepts,
            limits=limits,
        )
    )
    api = FastAPI(title="prismlm explorer", docs_url=None, redoc_url=None, openapi_url="/api/openapi.json")
    api.state.explorer = ex
    add_guard(api, ex.limits, None if allowed_hosts is None else {h.lower() for h in allowed_hosts})
    api.exception_handler(PrismError)(prism_error)
    Routes(ex).register(api)
    return api


def add_guard(api: FastAPI, limits: Limits, hosts: set[str] | None) -> None:
    """The middleware every request passes first: a ``Host`` in ``hosts`` (None: any; else 421), no
    file-naming query parameter (404), a body within ``limits.max_body_bytes`` (413); and the security
    headers on every answer."""

    @api.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if hosts is not None:
            host = (request.headers.get("host") or "").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in hosts:
                return _json({"error": "HostNotAllowed", "message": f"host {host!r} is not served"}, 421)
        if any(k.lower() in DENIED_QUERY_KEYS for k in request.query_params):
            return _json({"error": "NotFound", "message": "this server takes no file paths"}, 404)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limits.max_body_bytes):
            return _json(
                {"error": "RequestLimitError", "message": f"request body is limited to {limits.max_body_bytes} bytes"},
                413,
            )
        response = await call_next(request)
        for k, v in SECURITY_HEADERS.items():
            response.headers.setdefault(k, v)
        return response


async def prism_error(request: Request, e: PrismError) -> Response:
    """An error of prismlm's hierarchy as JSON with its HTTP status."""
    return _json({"error": type(e).__name__, "message": e.message, "fix": e.fix}, _status(e))


class Routes:
    """The app's endpoints over one ``Explorer``: the static front end and the JSON API. Model calls go
    through ``call``: at most ``Limits.max_waiting`` may wait (503 beyond), the explorer's lock runs them
    one at a time. Slow work is a job (``prismlm.app.explorer.jobs``): a training request without an
    attribution cache, and explain/steer asked with ``?job=true``, answer 202 with the job at once; the page
    polls ``GET /api/jobs/ID`` (progress, then the result) and may ``DELETE`` it."""

    def __init__(self, ex: Explorer) -> None:
        self.ex = ex
        self.static = _static_table(STATIC_DIR, SHARED_ASSETS)  # the stylesheet and waterfall are shared with render/
        self.waiting = threading.BoundedSemaphore(ex.limits.max_waiting)
        self.map_json: bytes | None = None
        """The map's answer, computed once (the bank does not change while serving)."""

    def register(self, api: FastAPI) -> None:
        get, post = ["GET"], ["POST"]
        api.add_api_route("/", self.root, methods=get, include_in_schema=False)
        api.add_api_route("/static/{name}", self.static_file, methods=get, include_in_schema=False)
        api.add_api_route("/api/info", self.info, methods=get)
        api.add_api_route("/api/explain", self.explain, methods=post)
        api.add_api_route("/api/prototype/{pid}", self.prototype, methods=get)
        api.add_api_route("/api/map", self.bank_map, methods=get)
        api.add_api_route("/api/search", self.search, methods=get)
        api.add_api_route("/api/steer", self.steer, methods=post)
        api.add_api_route("/api/training", self.training, methods=post)
        api.add_api_route("/api/contrast", self.contrast, methods=post)
        api.add_api_route("/api/residual", self.residual, methods=post)
        api.add_api_route("/api/document/{doc_index}", self.document, methods=get)
        api.add_api_route("/api/jobs/{job_id}", self.job, methods=get)
        api.add_api_route("/api/jobs/{job_id}", self.cancel, methods=["DELETE"])

    def queued(self, kind: str, work: Callable[[ProgressFn], Mapping[str, object]], message: str) -> Response:
        """``work`` as a background job: 202 with the job (poll ``/api/jobs/ID``), 503 when the queue is full."""
        job = self.ex.submit(kind, lambda progress: encodable_dict(work(progress)), message)
        return _json({"job": job.to_dict()}, 202)

    def job(self, job_id: str) -> Response:
        return _json(self.ex.job(job_id).to_dict())

    def cancel(self, job_id: str) -> Response:
        return _json(self.ex.cancel(job_id).to_dict())

    def call(self, fn: Callable[[], Mapping[str, object]]) -> Response:
        """Run an operation if the queue has room (503 otherwise); the explorer's lock serialises them."""
        if not self.waiting.acquire(blocking=False):
            busy = f"more than {self.ex.limits.max_waiting} requests are waiting; try again"
            return _json({"error": "Busy", "message": busy}, 503)
        try:
            return _json(fn())
        finally:
            self.waiting.release()

    # ----- static front end ---------------------------------------------------------------------------------
    def root(self) -> Response:
        body, kind = self.static["index.html"]
        return Response(body, media_type=kind)

    def static_file(self, name: str) -> Response:
        hit = self.static.get(name)
        if hit is None:
            return _json({"error": "NotFound", "message": "no such file"}, 404)
        return Response(hit[0], media_type=hit[1], headers={"Cache-Control": "no-cache"})

    # ----- API ------------------------------------------------------------------------------------------------
    def info(self) -> Response:
        return _json(self.ex.info().to_dict())

    def explain(self, body: ExplainBody, job: bool = False) -> Response:
        """An explanation; ``job``: as a background job (a chat answer takes seconds on a real model)."""
        body.checked()

        def work(progress: ProgressFn | None = None) -> Mapping[str, object]:
            return self.ex.explain(
                body.text,
                generate=body.generate,
                alternatives=body.alternatives,
                neighbours=body.neighbours,
                steering=body.steering.value(),
                sampling=Sampling(body.temperature, body.top_tokens, body.seed),
                chat=body.chat,
                system=body.system,
                progress=progress,
            ).to_dict()

        return self.queued("explain", work, "generating and explaining") if job else self.call(work)

    def prototype(self, pid: int, text: str | None = None, neighbours: int = 8, similar: int = 8) -> Response:
        return self.call(lambda: self.ex.prototype(pid, text=text, neighbours=neighbours, similar=similar).to_dict())

    def bank_map(self) -> Response:
        if self.map_json is None:
            self.map_json = json.dumps(self.ex.map().to_dict(), separators=(",", ":")).encode()
        return Response(self.map_json, media_type="application/json")

    def search(self, q: str = "", token: str | None = None, limit: int = 20) -> Response:
        return self.call(lambda: self.ex.search(q, token=token, limit=limit).to_dict())

    def steer(self, body: SteerBody, job: bool = False) -> Response:
        body.checked()

        def work(progress: ProgressFn | None = None) -> Mapping[str, object]:
            return self.ex.steer(
                body.prompt,
                steering=body.steering.value(),
                tokens=body.tokens,
                sampling=Sampling(body.temperature, body.top_tokens, body.seed),
                chat=body.chat,
                system=body.system,
                progress=progress,
            ).to_dict()

        return self.queued("steer", work, "generating with and without the steering") if job else self.call(work)

    def contrast(self, body: ContrastBody) -> Response:
        body.checked()
        return self.call(
            lambda: self.ex.contrast(
                body.token_ids, body.token_index, body.token, steering=body.steering.value()
            ).to_dict()
        )

    def residual(self, body: ResidualBody) -> Response:
        return self.call(
            lambda: self.ex.residual(
                body.token_ids, body.token_index, answer_from=body.answer_from, top=body.top
            ).to_dict()
        )

    def training(self, body: TrainingBody, job: bool = False) -> Response:
        """The training data of a text; without an attribution cache (gradients not built yet) a job that says
        how long it takes and the fast path, whatever ``job`` says."""
        body.checked()

        def work(progress: ProgressFn | None = None) -> Mapping[str, object]:
            return self.ex.training(
                body.prompt, body.completion, token=body.token, top=body.top, progress=progress
            ).to_dict()

        self.ex.check_training(body.prompt, body.completion, token=body.token, top=body.top)  # refused at once
        if self.ex.training_is_slow():
            return self.queued("training", work, self.ex.slow_training_message())
        return self.queued("training", work, "attributing") if job else self.call(work)

    def document(self, doc_index: int, position: int | None = None) -> Response:
        return self.call(lambda: self.ex.document(doc_index, position=position).to_dict())


def serve(
    run: str | Path,
    *,
    index: Path | None = None,
    cache: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str = "auto",
    suppress: str | Path | None = "auto",
    suppress_residual: str = "auto",
    concepts: Sequence[Path] = (),
    limits: Limits = Limits(),
    log_level: str = "info",
) -> None:
    """Open the run and serve the explorer until interrupted. A host other than loopback is warned
    about on stderr: the explorer has no authentication."""
    import uvicorn

    if not 1 <= port <= 65535:  # checked before the run is opened (uvicorn would fail only at bind)
        raise ConfigError(f"`port` must be in [1, 65535], got {port}", fix="e.g. `port` 8000", param="port")
    if host not in LOCAL_HOSTS and host != "::1":
        print(
            f"warning: serving on {host}: anyone who can reach this address can use the explorer (it has no "
            f"authentication); the default 127.0.0.1 keeps it on this machine",
            file=sys.stderr,
        )
    allowed = None if host in ("0.0.0.0", "::") else (*LOCAL_HOSTS, host.lower())
    app = create_app(
        run,
        index=index,
        cache=cache,
        limits=limits,
        device=device,
        suppress=suppress,
        suppress_residual=suppress_residual,
        concepts=concepts,
        allowed_hosts=allowed,
    )
    for note in app.state.explorer.info().notes:  # e.g. a torn labels.json: served without labels, said here
        print(f"warning: {note}", file=sys.stderr)
    print(f"prism explorer: http://{host if ':' not in host else f'[{host}]'}:{port}/", file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


@contextmanager
def serve_in_background(explorer: Explorer, *, timeout: float = 60.0) -> Iterator[str]:
    """Serve an opened explorer on 127.0.0.1 at a free port from a background thread (a notebook, a browser
    test, a screenshot script); yields its base URL and stops the server when the block ends."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(create_app(explorer), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if not thread.is_alive() or time.monotonic() - t0 > timeout:
            server.should_exit = True
            raise PrismError(
                f"the explorer server on 127.0.0.1:{port} did not start within {timeout:g} s",
                fix="see the uvicorn messages above; a larger `timeout` on a loaded machine",
                param="timeout",
            )
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(10)
