"""The attribution cache (moved from ``tda/cache.py``; split into modules by the next commit)."""

from prismlm.tda.cache.store import *  # noqa: F403
from prismlm.tda.cache.store import KIND, __all__  # noqa: F401
