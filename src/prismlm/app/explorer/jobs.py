"""Slow explorer work off the request path: ``Jobs`` runs it on one background thread, from a bounded queue,
and a request polls a ``Job`` for its progress and result, or cancels it; and ``FairLock``, the model lock
that grants turns in the order they were asked for.

Invariant: a job never holds the model lock for more than one batch or one generated token at a time (it
passes ``FairLock`` as the batch guard of its passes), so an Explain asked for while a job runs waits at
most one batch — never the job. A cancelled job stops at its next progress report.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from prismlm.app.explorer.plain import JSONDict
from prismlm.errors import PrismError
from prismlm.progress import ProgressEvent, ProgressFn

__all__ = ["FairLock", "Job", "JobCancelled", "Jobs", "JobsFullError", "UnknownJobError", "Work"]

Work = Callable[[ProgressFn], JSONDict]
"""What a job runs: called with the progress callback it must report through (each report may raise
``JobCancelled``), returns the JSON-ready result."""


class JobCancelled(PrismError):
    """The job was cancelled (raised from its progress callback; the job ends in state ``cancelled``)."""


class UnknownJobError(PrismError, KeyError):
    """No job with this id (never made, or forgotten: only the latest ``Jobs.keep`` are kept)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return PrismError.__str__(self)


class JobsFullError(PrismError):
    """The job queue is full."""


class FairLock:
    """A non-reentrant lock granted first come, first served. Why not ``threading.Lock``: a job that takes it
    for each batch releases and re-takes it in a loop, and a plain lock may go straight back to it — an
    Explain waiting beside it could starve. Here the next turn goes to whoever asked first."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0
        self._serving = 0

    def acquire(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while self._serving != ticket:
                self._cond.wait()

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


@dataclass
class Job:
    """One piece of slow work: its state, latest progress and, once over, its result or error."""

    id: str
    kind: str
    """What it computes: ``training``, ``steer``, ``explain``."""
    message: str
    """Said when it was queued: what it does and how long it may take (and the fast path, if there is one)."""
    state: str = "queued"
    """``queued``, ``running``, ``done``, ``failed`` or ``cancelled``."""
    stage: str | None = None
    done: int = 0
    total: int | None = None
    unit: str = ""
    result: JSONDict | None = None
    error: JSONDict | None = None
    """``{"error", "message", "fix"}`` of a failed job."""
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    ended_at: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def over(self) -> bool:
        return self.state in ("done", "failed", "cancelled")

    def report(self, e: ProgressEvent) -> None:
        """The progress callback the job's work gets: records ``e``; ``JobCancelled`` once cancelled."""
        if self.cancel.is_set():
            raise JobCancelled(f"job {self.id} ({self.kind}) was cancelled")
        self.stage, self.done, self.total, self.unit = e.stage, e.done, e.total, e.unit

    def to_dict(self) -> JSONDict:
        """The job as JSON: state, progress, wall seconds (queued → now or end), result or error."""
        end = self.ended_at if self.ended_at is not None else time.monotonic()
        return {
            "id": self.id,
            "kind": self.kind,
            "state": self.state,
            "message": self.message,
            "stage": self.stage,
            "done": self.done,
            "total": self.total,
            "unit": self.unit,
            "seconds": round(end - self.queued_at, 3),
            "result": self.result,
            "error": self.error,
        }


class Jobs:
    """A bounded queue of slow work and the one thread that runs it (started on the first ``submit``)."""

    def __init__(self, max_queued: int = 4, keep: int = 64) -> None:
        self.max_queued, self.keep = max_queued, keep
        self._queue: queue.Queue[tuple[Job, Work]] = queue.Queue()
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None

    def submit(self, kind: str, work: Work, message: str) -> Job:
        """Queue ``work``; ``JobsFullError`` when ``max_queued`` jobs are already waiting or running."""
        with self._lock:
            pending = sum(not j.over for j in self._jobs.values())
            if pending >= self.max_queued:
                raise JobsFullError(
                    f"{pending} slow jobs are queued or running (the limit is {self.max_queued})",
                    fix="wait for one to end, or cancel one (DELETE /api/jobs/ID)",
                )
            job = Job(id=str(next(self._ids)), kind=kind, message=message)
            self._jobs[job.id] = job
            while len(self._jobs) > self.keep:  # forget the oldest finished jobs
                old = next((k for k, j in self._jobs.items() if j.over), None)
                if old is None:
                    break
                del self._jobs[old]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prism-explorer-jobs", daemon=True)
                self._thread.start()
        self._queue.put((job, work))
        return job

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise UnknownJobError(f"no job {job_id!r}", fix="submit the request again (old jobs are forgotten)")
        return job

    def cancel(self, job_id: str) -> Job:
        """Ask job ``job_id`` to stop: a queued one never starts, a running one stops at its next report."""
        job = self.get(job_id)
        job.cancel.set()
        if job.state == "queued":
            job.state, job.ended_at = "cancelled", time.monotonic()
        return job

    def _run(self) -> None:
        while True:
            job, work = self._queue.get()
            if job.cancel.is_set():
                continue
            job.state, job.started_at = "running", time.monotonic()
            try:
                job.result = work(job.report)
                job.state = "done"
            except JobCancelled:
                job.state = "cancelled"
            except PrismError as e:
                job.error, job.state = {"error": type(e).__name__, "message": e.message, "fix": e.fix}, "failed"
            except Exception as e:  # the job's failure is its answer; the worker lives on for the next one
                job.error, job.state = {"error": type(e).__name__, "message": str(e), "fix": None}, "failed"
            job.ended_at = time.monotonic()
