"""OpenAI-compatible HTTP serving over a :class:`~aiocb.Manager` (the ``serve`` extra).

``build_app(manager, tokenizer, model_name)`` is an ASGI app (Starlette) whose handlers
and the manager's step coroutine share one event loop; ``aiocb serve MODEL`` runs it
under uvicorn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiocb.server.app import build_app

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that the command line can read the server's limits (to
    # make its flags) without the 'serve' extra installed.
    if name == "build_app":
        from aiocb.server.app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
