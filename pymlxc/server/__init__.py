"""An OpenAI-compatible HTTP server for pymlxc models (`pymlxc serve`, `python -m pymlxc.server`).

Needs the `server` extra (FastAPI, uvicorn, sse-starlette, llguidance). `create_app` (in `app`)
builds the ASGI app for a loaded model; `main` parses the command line and runs it with uvicorn.
"""
from __future__ import annotations

from .main import configure, main, run

__all__ = ["configure", "main", "run"]
