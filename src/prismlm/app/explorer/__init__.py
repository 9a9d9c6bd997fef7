"""The explorer's operations (``prism serve``): explain, prototype, map, search, steer, training data.

Each view returns a dataclass whose ``to_dict()`` is JSON-ready, so any front end — the FastAPI app of
``prismlm.web.server``, a notebook, a test — gets the same values; nothing here prints or imports a web
framework. Every number a view shows is exact, not re-derived (``decompose`` of the model's own forward).
A request asks for at most ``Limits`` (more: ``RequestLimitError``, 4xx) and never names a file.
Modules: ``facade`` (``Explorer``), ``session`` (the opened run, its lock), ``limits``, ``jobs`` (slow work off the request path), one
per view (``info``, ``explain``, ``prototype``, ``bank``, ``steer`` (steering and its view), ``training``). See docs/explorer.md.
"""

from prismlm.app.explorer.facade import Explorer
from prismlm.app.explorer.jobs import Job, JobCancelled, JobsFullError, UnknownJobError
from prismlm.app.explorer.limits import Limits, RequestLimitError, UnknownDocumentError
from prismlm.app.explorer.steer import Steering

__all__ = [
    "Explorer",
    "Job",
    "JobCancelled",
    "JobsFullError",
    "Limits",
    "RequestLimitError",
    "Steering",
    "UnknownDocumentError",
    "UnknownJobError",
]
