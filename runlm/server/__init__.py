"""The OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from runlm.server.app import create_app, serve

__all__ = ["create_app", "serve"]
