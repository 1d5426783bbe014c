"""The ASGI app: OpenAI-compatible routes over a :class:`~aiocb.Manager` on the same event loop.

The manager's step coroutine and the HTTP handlers share one loop (uvloop under
``aiocb serve`` when installed): a handler queues its requests with
``add_request_nowait`` and iterates their streams directly, with no thread or queue in
between. A client that goes away cancels its requests, whose blocks are free at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aiocb.engine.manager import Manager
from aiocb.server.chat import ChatCompletion
from aiocb.server.completions import Completion
from aiocb.server.context import ServerContext
from aiocb.server.metrics import ServerMetrics
from aiocb.server.protocol import (
    APIError,
    bad_request,
    error_from_exception,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
)
from aiocb.server.sse import EventStreamResponse, events

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Paths served without an API key (probes and scrapers).
_OPEN_PATHS = frozenset({"/health", "/metrics"})
#: Status of a response to a client that has gone (nginx's "client closed request").
_CLIENT_GONE = 499


def build_app(
    manager: Manager,
    tokenizer: Any,
    model_name: str,
    api_key: str | None = None,
    *,
    shutdown_timeout: float = 10.0,
) -> Starlette:
    """An OpenAI-compatible ASGI app serving ``manager``'s model as ``model_name``.

    The app's lifespan starts the manager on the server's event loop unless it already
    runs, and stops the manager it started on shutdown (requests still running after
    ``shutdown_timeout`` seconds are aborted). With ``api_key`` every route but
    ``/health`` and ``/metrics`` needs ``Authorization: Bearer <api_key>``.
    """
    metrics = ServerMetrics(manager, model_name)
    api = _Api(ServerContext(manager, tokenizer, model_name, metrics))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started_here = not manager.is_running
        if started_here:
            manager.start()
        try:
            yield
        finally:
            if started_here and manager.is_running:
                await manager.stop(timeout=shutdown_timeout)

    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/tokenizer_info", api.tokenizer_info, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    middleware = [Middleware(_ApiKeyMiddleware, api_key=api_key, metrics=metrics)] if api_key else []
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={HTTPException: api.http_error},
    )
    app.state.aiocb = api.ctx
    return app


class _Api:
    """The route handlers."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    # ------------------------------------------------------------------ generation

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        received = time.perf_counter()
        try:
            parsed = parse_completion_request(await _json(request))
            self._check_model(parsed.sampling.model)
            completion = Completion(self.ctx, parsed, received)
            await completion.submit()
        except Exception as exc:
            return self.error(exc)
        if parsed.sampling.stream:
            return EventStreamResponse(events(completion.chunks(), self.ctx.metrics))
        return await self._respond(request, completion.response())

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        received = time.perf_counter()
        try:
            parsed = parse_chat_request(await _json(request))
            self._check_model(parsed.sampling.model)
            chat = ChatCompletion(self.ctx, parsed, received)
            await chat.submit()
        except Exception as exc:
            return self.error(exc)
        if parsed.sampling.stream:
            return EventStreamResponse(events(chat.chunks(), self.ctx.metrics))
        return await self._respond(request, chat.response())

    async def _respond(self, request: Request, work: Coroutine[Any, Any, dict[str, Any]]) -> Response:
        try:
            body = await _unless_disconnected(request, work)
        except Exception as exc:
            return self.error(exc)
        if body is None:
            return Response(status_code=_CLIENT_GONE)
        return JSONResponse(body)

    # ------------------------------------------------------------------ model and server

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``."""
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``."""
        try:
            self._check_model(request.path_params["model"])
        except APIError as exc:
            return self.error(exc)
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 while the engine runs, 503 otherwise."""
        manager = self.ctx.manager
        if manager.is_running:
            return JSONResponse({"status": "ok"})
        state = "dead" if manager.is_dead else "stopped"
        return self.error(APIError(503, f"the engine is {state}", type="service_unavailable"))

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics`` in Prometheus' text format."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ tokenizer

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``: ``{"prompt": text}`` or ``{"messages": [...]}`` to token ids."""
        try:
            parsed = parse_tokenize_request(await _json(request))
            self._check_model(parsed.model)
            if parsed.prompt is not None:
                text = parsed.prompt
            else:
                assert parsed.messages is not None
                text = self.ctx.render_chat(
                    parsed.messages, add_generation_prompt=parsed.add_generation_prompt, kwargs={}
                )
            tokens = self.ctx.encode(text, add_special_tokens=parsed.add_special_tokens)
        except Exception as exc:
            return self.error(exc)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": self.ctx.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``: token ids to text."""
        try:
            parsed = parse_detokenize_request(await _json(request))
            self._check_model(parsed.model)
            vocab = len(self.ctx.tokenizer)
            if any(t >= vocab for t in parsed.tokens):
                raise bad_request(f"'tokens' holds ids outside the vocabulary [0, {vocab})", "tokens")
            text = self.ctx.decode(parsed.tokens)
        except Exception as exc:
            return self.error(exc)
        return JSONResponse({"prompt": text})

    async def tokenizer_info(self, request: Request) -> Response:
        """``GET /tokenizer_info``: special tokens, chat template and limits."""
        tokenizer = self.ctx.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        return JSONResponse(
            {
                "tokenizer_class": type(tokenizer).__name__,
                "vocab_size": len(tokenizer),
                "model_max_length": self.ctx.max_model_len,
                "eos_token": tokenizer.eos_token,
                "eos_token_id": tokenizer.eos_token_id,
                "bos_token": tokenizer.bos_token,
                "bos_token_id": tokenizer.bos_token_id,
                "pad_token": tokenizer.pad_token,
                "pad_token_id": tokenizer.pad_token_id,
                "unk_token": tokenizer.unk_token,
                "chat_template": template if isinstance(template, str) else None,
            }
        )

    # ------------------------------------------------------------------ errors

    def error(self, exc: BaseException) -> JSONResponse:
        """The OpenAI-shaped response for ``exc`` (logged when it is the server's fault)."""
        error = error_from_exception(exc)
        if error.status >= 500:
            logger.error("request failed: %s", error.message, exc_info=exc if not isinstance(exc, APIError) else None)
        self.ctx.metrics.observe_error(error.status)
        return JSONResponse(error.to_dict(), status_code=error.status)

    async def http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        response = self.error(APIError(exc.status_code, message, type=kind))
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.ctx.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.ctx.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.ctx.model_name,
            "object": "model",
            "created": self.ctx.created,
            "owned_by": "aiocb",
            "root": self.ctx.model_name,
            "max_model_len": self.ctx.max_model_len,
        }


async def _json(request: Request) -> Any:
    body = await request.body()
    if not body:
        raise bad_request("the request has no body; send a JSON object")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, unless the client disconnects first: then cancel it and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait((task,))
    return None


async def _disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _ApiKeyMiddleware:
    """Refuses requests without ``Authorization: Bearer <api_key>`` (pure ASGI: streams pass through)."""

    def __init__(self, app: ASGIApp, *, api_key: str, metrics: ServerMetrics) -> None:
        self.app = app
        self._key = api_key.encode()
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self._key):
            await self.app(scope, receive, send)
            return
        self._metrics.observe_error(401)
        error = APIError(401, "Incorrect or missing API key", code="invalid_api_key")
        await JSONResponse(error.to_dict(), status_code=401)(scope, receive, send)
