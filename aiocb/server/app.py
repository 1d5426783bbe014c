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
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aiocb.engine.turns import release, release_slices
from aiocb.errors import InvalidConfigError
from aiocb.server.bodies import JSONBody, encode
from aiocb.server.chat import ChatCompletion, PreparedChat, constrain_answer, prepare_chat
from aiocb.server.completions import Completion, PreparedCompletion, prepare_completion
from aiocb.server.context import ServerContext
from aiocb.server.edge import OPEN_PATHS, EdgeMiddleware, access_record
from aiocb.server.harmony import REASONING_PARSER, TOOL_CALL_PARSER, is_harmony_template
from aiocb.server.limits import ServerLimits, parse_json, read_body
from aiocb.server.metrics import CLIENT_GONE, ServerMetrics
from aiocb.server.protocol import (
    CHAT_PARAMS,
    COMPLETION_PARAMS,
    APIError,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    error_from_exception,
    parse_detokenize_request,
    parse_tokenize_request,
)
from aiocb.server.reasoning import ReasoningSplitter
from aiocb.server.remote import RemoteManager, ServedEngine
from aiocb.server.sse import EventStreamResponse, events
from aiocb.server.tool_parsers import PARSERS, ToolCallParser, detect_parser
from aiocb.server.tools import parse_tools, template_messages

logger = logging.getLogger(__name__)

T = TypeVar("T")


def api_key_problem(api_key: object, name: str) -> str | None:
    """What makes ``api_key`` no key requests could give (None: it is one, or None for none).

    An empty one is refused (taken as none, an empty ``$AIOCB_API_KEY`` would leave the
    server open without a word), and so is one that no ``Authorization`` header can carry:
    space at its ends (HTTP strips it, say the ``\\r`` of an env file's CRLF) or a character
    outside printable ASCII.
    """
    if api_key is None:
        return None
    if not isinstance(api_key, str) or not api_key.strip():
        given = "an empty string" if isinstance(api_key, str) else type(api_key).__name__
        return f"{name} must be a key that is not empty, or None for no key; got {given}"
    if api_key != api_key.strip():
        return f"{name} has space at its start or end, which no request's Authorization header can carry"
    if not all(" " <= character <= "~" for character in api_key):
        return f"{name} has characters outside printable ASCII, which no request's Authorization header can carry"
    return None


def check_api_key(api_key: object, name: str = "api_key") -> None:
    """InvalidConfigError unless ``api_key`` is a key requests can give, or None for none
    (see :func:`api_key_problem`)."""
    problem = api_key_problem(api_key, name)
    if problem is not None:
        raise InvalidConfigError(problem)


def build_app(
    manager: ServedEngine,
    tokenizer: Any,
    model_name: str,
    api_key: str | None = None,
    *,
    shutdown_timeout: float = 10.0,
    limits: ServerLimits | None = None,
    tool_call_parser: str | None = "auto",
    reasoning_parser: str | None = None,
    replica: str | None = None,
) -> Starlette:
    """An OpenAI-compatible ASGI app serving ``manager``'s model as ``model_name``.

    The app's lifespan starts the manager on the server's event loop unless it already
    runs, and stops the manager it started on shutdown (requests still running after
    ``shutdown_timeout`` seconds are aborted). With ``api_key`` every route but
    ``/health``, ``/ready`` and ``/metrics`` needs ``Authorization: Bearer <api_key>``.
    ``limits`` bound what one request may cost (:class:`ServerLimits`' defaults when None).
    Output constraints and enforced tools compile against the vocabulary of the manager's
    ``grammar_tokenizer`` (or ``tokenizer``): build it with ``tokenizer``'s, as ``aiocb
    serve`` does.

    ``tool_call_parser`` names the format chat outputs' tool calls are found in
    (``hermes``, ``llama3_json``, ``mistral``; ``"auto"``: the one the chat template
    writes; None: requests with tools are refused). ``reasoning_parser`` (``qwen3`` or
    ``deepseek_r1``, both the ``<think>`` format) splits reasoning into
    ``reasoning_content``; None leaves it in the content. A model whose chat template
    writes gpt-oss's harmony format has its outputs' channels read as what they are
    (:mod:`aiocb.server.harmony`; the parsers' names for it, ``openai_gptoss`` and
    ``openai``, may be given), with tool calls unless ``tool_call_parser`` is None.
    ``replica`` labels every ``/metrics`` series (one of several replicas of the model
    behind one route).
    """
    check_api_key(api_key)
    limits = limits or ServerLimits()
    tool_parser, reasoning, harmony = chat_parsers_of(tokenizer, tool_call_parser, reasoning_parser)
    metrics = ServerMetrics(manager, model_name, replica)
    ctx = ServerContext(
        manager,
        tokenizer,
        model_name,
        metrics,
        limits,
        tool_parser=tool_parser,
        reasoning=reasoning,
        harmony=harmony,
        harmony_calls=harmony and tool_call_parser is not None,
    )
    api = _Api(ctx)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started_here = not manager.is_running
        if started_here:
            manager.start()
            await manager.wait_started()  # (its runner and cache built; under tensor parallelism, the ranks reached)
        stops = started_here or ctx.stops_engine
        ctx.draining = False
        try:
            yield
        finally:
            ctx.draining = True
            if stops and manager.is_running:
                await manager.stop(timeout=shutdown_timeout)
            ctx.close()

    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/ready", api.ready, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/tokenizer_info", api.tokenizer_info, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    middleware = [Middleware(EdgeMiddleware, limits=limits, metrics=metrics)]
    if api_key:
        middleware.append(Middleware(_ApiKeyMiddleware, api_key=api_key, metrics=metrics))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={HTTPException: api.http_error},
    )
    app.state.aiocb = ctx
    return app


def resolve_tool_parser(name: str | None, chat_template: Any) -> type[ToolCallParser] | None:
    """The tool-call parser ``name`` stands for (``"auto"``: detected from ``chat_template``,
    or from a tokenizer's named templates, the one transformers renders tools with first)."""
    if name is None:
        return None
    if name == "auto":
        templates = [chat_template]
        if isinstance(chat_template, dict):
            templates = [chat_template.get("tool_use"), chat_template.get("default"), *chat_template.values()]
        for template in templates:
            detected = detect_parser(template) if isinstance(template, str) else None
            if detected is not None:
                return detected
        logger.info(
            "no tool-call format found in the chat template: requests with tools are refused "
            "(--tool-call-parser names one: %s)",
            ", ".join(PARSERS),
        )
        return None
    parser = PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: auto, {', '.join(PARSERS)}")
    return parser


def chat_parsers_of(
    tokenizer: Any, tool_call_parser: str | None, reasoning_parser: str | None
) -> tuple[type[ToolCallParser] | None, bool, bool]:
    """What a server of ``tokenizer``'s chat template reads chat outputs with: the tool-call
    parser, whether ``<think>`` blocks are reasoning, and whether outputs are harmony.

    Raises:
        ValueError: naming a parser that is unknown, or of another format than the template's.
    """
    template = getattr(tokenizer, "chat_template", None)
    if _harmony(template, tool_call_parser, reasoning_parser):
        return None, False, True
    return resolve_tool_parser(tool_call_parser, template), _reasoning(reasoning_parser), False


def _harmony(chat_template: Any, tool_call_parser: str | None, reasoning_parser: str | None) -> bool:
    """Whether chat outputs are harmony (the chat template writes it); parsers of another
    format for it, or its parsers for another, are refused."""
    if not is_harmony_template(chat_template):
        for given, name in ((reasoning_parser, REASONING_PARSER), (tool_call_parser, TOOL_CALL_PARSER)):
            if given == name:
                raise ValueError(
                    f"the {name!r} parser reads gpt-oss's harmony format, which this model's chat template does "
                    "not write"
                )
        return False
    for given, name, kind in (
        (reasoning_parser, REASONING_PARSER, "reasoning"),
        (tool_call_parser, TOOL_CALL_PARSER, "tool-call"),
    ):
        if given not in (None, "auto", name):
            raise ValueError(
                f"this model's chat template writes gpt-oss's harmony format, whose {kind} parser is {name!r} (used "
                f"without being named), not {given!r}"
            )
    return True


def _reasoning(name: str | None) -> bool:
    if name is not None and name not in ReasoningSplitter.names:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(ReasoningSplitter.names)}")
    return name is not None


def begin_drain(app: Starlette, timeout: float) -> asyncio.Task[None] | None:
    """Start shutting the app down gracefully (on ``SIGTERM``): ``/ready`` answers 503, new
    generations are refused with 503, and running ones finish, or are aborted once
    ``timeout`` seconds have passed. Call it on the app's event loop."""
    ctx: ServerContext = app.state.aiocb
    ctx.draining = True
    if not ctx.manager.is_running:
        return None
    logger.info("draining: no new requests; running ones get %s s to finish", timeout)
    return asyncio.get_running_loop().create_task(ctx.manager.stop(timeout=timeout), name="aiocb-drain")


class _Api:
    """The route handlers."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    # ------------------------------------------------------------------ generation

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        received = time.perf_counter()
        prepared: PreparedCompletion | None = None
        try:
            prepared = await prepare_completion(self.ctx, await self._body(request))
            completion = Completion(self.ctx, prepared, received, access_record(request.scope))
            await completion.submit()
        except Exception as exc:
            said = {} if prepared is None else prepared.request.sampling.body_params()
            return self.error(exc, {**COMPLETION_PARAMS, **said})
        if prepared.request.sampling.stream:
            stream = events(completion.chunks(), self.ctx.metrics, access_record(request.scope))
            return EventStreamResponse(stream, self.ctx.metrics)
        return await self._respond(request, completion.response())

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        received = time.perf_counter()
        prepared: PreparedChat | None = None
        try:
            prepared = await self.ctx.prepare(await self._body(request), partial(prepare_chat, self.ctx))
            prepared = await constrain_answer(self.ctx, prepared)
            chat = ChatCompletion(self.ctx, prepared, received, access_record(request.scope))
            await chat.submit()
        except Exception as exc:
            said = {}
            if prepared is not None:
                said = prepared.request.sampling.body_params()
                if prepared.tools is not None and "structural_tag" in prepared.constraint:  # (built from them)
                    said["structural_tag"] = "tools"
                elif "structural_tag" in prepared.constraint and prepared.request.sampling.constraint_field:
                    said["structural_tag"] = prepared.request.sampling.constraint_field  # (around the thinking)
            return self.error(exc, {**CHAT_PARAMS, **said})
        if prepared.request.sampling.stream:
            stream = events(chat.chunks(), self.ctx.metrics, access_record(request.scope))
            return EventStreamResponse(stream, self.ctx.metrics)
        return await self._respond(request, chat.response())

    async def _body(self, request: Request) -> bytes:
        """The request's body, bounded in size (413) and in the time the client takes to send it (408).

        A server that drains takes no new work: 503 before anything is read.
        """
        if self.ctx.draining:
            raise APIError(503, "the server is shutting down; send the request elsewhere", type="service_unavailable")
        return await receive_body(request, self.ctx.limits)

    async def _respond(self, request: Request, work: Coroutine[Any, Any, dict[str, Any]]) -> Response:
        try:
            pieces = await _unless_disconnected(request, _encoded(work))
        except Exception as exc:
            return self.error(exc)
        if pieces is None:
            self.ctx.metrics.observe_client_gone()
            return Response(status_code=CLIENT_GONE)
        return JSONBody(pieces)

    # ------------------------------------------------------------------ model and server

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``."""
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``."""
        try:
            self.ctx.check_model(request.path_params["model"])
        except APIError as exc:
            return self.error(exc)
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        """``GET /health`` (liveness): 200 while the engine runs, draining included; 503 otherwise."""
        manager = self.ctx.manager
        if manager.is_running:
            return JSONResponse({"status": "ok"})
        silence = manager.silence() if isinstance(manager, RemoteManager) else None
        state = silence or f"the engine is {'dead' if manager.is_dead else 'stopped'}"
        return self._unavailable(state)

    async def ready(self, request: Request) -> Response:
        """``GET /ready`` (readiness): 200 while the model is loaded, the engine alive and the
        server not draining; 503 otherwise, saying which."""
        manager = self.ctx.manager
        silence = manager.silence() if isinstance(manager, RemoteManager) else None
        if manager.is_dead:
            reason = "the engine is dead"
        elif silence is not None:
            reason = silence
        elif self.ctx.draining:
            reason = "the server is shutting down"
        elif not manager.is_running:
            reason = "the engine is not running"
        else:
            return JSONResponse({"status": "ready"})
        return self._unavailable(reason)

    def _unavailable(self, reason: str) -> ErrorResponse:
        """A probe's 503: an answer, not an error of the server's (not counted in
        ``aiocb_http_errors_total``: a probe that polls a pod while it starts would be)."""
        return self.error(APIError(503, reason, type="service_unavailable"), counted=False)

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics`` in Prometheus' text format."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await self.ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ tokenizer

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``: ``{"prompt": text}`` or ``{"messages": [...]}`` to token ids."""
        try:
            answer = await self.ctx.prepare(await self._body(request), self._tokenize)
            # (written, then freed, a slice of the loop at a time: a long prompt's millions of
            # ids took a json.dumps of 186 ms, holding the GIL in whichever thread ran it)
            pieces = await encode(answer)
            await release_slices(answer["tokens"])
        except Exception as exc:
            return self.error(exc)
        return JSONBody(pieces)

    def _tokenize(self, body: bytes) -> dict[str, Any]:
        fields = parse_json(body, self.ctx.limits.max_json_depth)
        parsed: TokenizeRequest = parse_tokenize_request(fields)
        self.ctx.check_model(parsed.model)
        if parsed.prompt is not None:
            text = parsed.prompt
            self.ctx.check_prompt_chars(text, "prompt")
        else:
            assert parsed.messages is not None
            parser = self.ctx.tool_parser
            messages = template_messages(parsed.messages, None if parser is None else parser.template_id)
            tools = parse_tools(fields)  # (rendered as a chat with them renders them)
            text = self.ctx.render_chat(
                messages,
                add_generation_prompt=parsed.add_generation_prompt,
                kwargs=parsed.chat_template_kwargs,
                tools=None if tools is None else list(tools.tools),
            )
            self.ctx.check_prompt_chars(text, "messages", "the rendered conversation")
        param = "prompt" if parsed.prompt is not None else "messages"
        tokens = self.ctx.encode(text, add_special_tokens=parsed.add_special_tokens, param=param)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.ctx.max_model_len}

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``: token ids to text."""
        try:
            content = await self.ctx.prepare(await self._body(request), self._detokenize)
        except Exception as exc:
            return self.error(exc)
        return Response(content, media_type="application/json")

    def _detokenize(self, body: bytes) -> bytes:
        parsed: DetokenizeRequest = parse_detokenize_request(parse_json(body, self.ctx.limits.max_json_depth))
        self.ctx.check_model(parsed.model)
        vocab = len(self.ctx.tokenizer)
        if parsed.tokens and max(parsed.tokens) >= vocab:
            raise bad_request(f"'tokens' holds ids outside the vocabulary [0, {vocab})", "tokens")
        # As many ids as /tokenize gives for the longest text it takes (a character is at
        # most 4 UTF-8 bytes, and a byte at most a token): what one gives, the other takes.
        bound = None if self.ctx.max_prompt_chars is None else 4 * self.ctx.max_prompt_chars
        if bound is not None and len(parsed.tokens) > bound:
            raise bad_request(
                f"'tokens' has {len(parsed.tokens)} ids, more than /tokenize gives for the longest text it takes "
                f"({bound})",
                "tokens",
            )
        return _json_bytes({"prompt": self.ctx.decode(parsed.tokens)})

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

    def error(
        self, exc: BaseException, params: Mapping[str, str] | None = None, *, counted: bool = True
    ) -> ErrorResponse:
        """The OpenAI-shaped response for ``exc`` (logged when it is the server's fault);
        ``params`` renames the engine's parameter names to the endpoint's fields; with
        ``counted`` False it is not counted in ``aiocb_http_errors_total``."""
        error = error_from_exception(exc, params)
        if error.status >= 500 and error.status != 503:
            logger.error("request failed: %s", error.message, exc_info=exc if not isinstance(exc, APIError) else None)
        if counted:
            self.ctx.metrics.observe_error(error.status)
        headers = {"Retry-After": str(self.ctx.limits.retry_after)} if error.status in (429, 503) else None
        return ErrorResponse(error.to_dict(), status_code=error.status, headers=headers)

    async def http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        response = self.error(APIError(exc.status_code, message, type=kind))
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.ctx.model_name,
            "object": "model",
            "created": self.ctx.created,
            "owned_by": "aiocb",
            "root": self.ctx.model_name,
            "max_model_len": self.ctx.max_model_len,
        }


async def receive_body(request: Request, limits: ServerLimits) -> bytes:
    """``request``'s body, bounded in size (413) and in the time the client takes to send it
    (408); 499 when the client went away first (the Ray Serve ingress reads bodies so too)."""
    try:
        async with asyncio.timeout(limits.body_timeout):
            return await read_body(request.stream(), limits)
    except ClientDisconnect:
        # The client's to answer for, not the server's: counted, never logged as an error.
        raise APIError(
            CLIENT_GONE, "the client closed the connection before its body arrived", type="client_closed_request"
        ) from None
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {limits.body_timeout} s (--body-timeout)",
            code="request_timeout",
        ) from None


class ErrorResponse(JSONResponse):
    """An error body in JSON with every non-ASCII character escaped: a message may quote
    what the client sent, lone UTF-16 surrogates included, which UTF-8 cannot carry."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _json_bytes(value: Any) -> bytes:
    """``value`` as a JSONResponse would send it."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def _encoded(work: Awaitable[dict[str, Any]]) -> list[bytes]:
    """The body ``work`` makes, written a slice of the loop at a time (tens of megabytes
    with many choices' logprobs), then its choices freed a slice at a time too."""
    body = await work
    pieces = await encode(body)
    await release(body["choices"])
    return pieces


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
        error = api_key_refusal(scope["path"], Headers(scope=scope), self._key) if scope["type"] == "http" else None
        if error is None:
            await self.app(scope, receive, send)
            return
        self._metrics.observe_error(401)
        await ErrorResponse(error.to_dict(), status_code=401)(scope, receive, send)


def api_key_refusal(path: str, headers: Headers, key: bytes) -> APIError | None:
    """The 401 for a request to ``path`` (below the app's root) without ``Authorization:
    Bearer <key>``; None if it may pass (it has the key, or the route is open to all)."""
    if path in OPEN_PATHS:
        return None
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key):
        return None
    return APIError(401, "Incorrect or missing API key", code="invalid_api_key")
