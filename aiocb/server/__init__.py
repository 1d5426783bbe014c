"""OpenAI-compatible HTTP serving over a :class:`~aiocb.Manager` (the ``serve`` extra).

``build_app(manager, tokenizer, model_name)`` is an ASGI app (Starlette) whose handlers
and the manager's step coroutine share one event loop; ``aiocb serve MODEL`` runs it
under uvicorn.
"""

from aiocb.server.app import build_app

__all__ = ["build_app"]
