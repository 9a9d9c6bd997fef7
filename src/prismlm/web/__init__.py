"""The explorer's web front end: the FastAPI server (``server.py``) and its static page (``static/``).

It only translates HTTP to the operations of ``prismlm.app.explorer`` and back; see docs/explorer.md."""
