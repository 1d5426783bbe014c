"""The engine behind a process boundary, for ``aiocb serve --api-workers N``.

One process owns the model, the KV cache and the :class:`~aiocb.Manager`, whose event loop
runs the steps; N API worker processes each parse HTTP, tokenize, detokenize and write the
SSE events of their own connections. On a fast device that keeps the engine's loop free
of the per-token work that grows with the number of streams: a write system call per
event per client, above all.

The two sides speak over a Unix socket, in length-prefixed pickled frames (both ends are
this package in processes of one user; the socket lives in a private directory):

- worker to engine: ``("add", keys, input_ids, max_new_tokens, params)`` queues a request
  (``add_request_nowait``; with many samples, an output constraint, large controls or a
  long prompt ``add_request(wait=False)``, which compiles the constraint and checks the
  ids off the loop and makes the samples and their streams a slice of the loop at a
  time) with ``len(keys)`` samples, one key each;
  ``("cancel", key)`` cancels one; ``("statistics",)`` asks for the statistics now;
- engine to worker: ``("hello", EngineInfo)`` once, then ``("batch", [(key, event), ...])``
  with everything that happened to that worker's requests in one turn of the engine's
  loop (so a step's tokens for all of a worker's streams cost one frame and one write),
  and ``("stats", ManagerStatistics, is_dead)`` a few times a second, and in answer to
  ``("statistics",)``, ``("statistics", ManagerStatistics, is_dead)``.

An event is ``("added",)``, ``("refused", error)``, ``("output", tuple(OutputDelta))``,
``("prompt", values, alternatives)`` (a long prompt's scores, a slice a frame, ahead of the
output that completes them) or ``("failed", error)``. :class:`EngineService` is the
engine's side; :class:`RemoteManager` is the worker's, with the part of the
:class:`~aiocb.Manager` interface the app uses.
A worker whose connection drops has its requests cancelled; an engine that goes away
fails every open stream of every worker with :class:`~aiocb.EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from transformers import GenerationConfig

from aiocb.config import ContinuousBatchingConfig
from aiocb.engine.manager import Manager, ManagerStatistics
from aiocb.engine.requests import has_large_controls, sample_ids
from aiocb.engine.stream import RequestStream
from aiocb.engine.turns import LoopTurn, Waker
from aiocb.errors import (
    AiocbError,
    EngineDeadError,
    InvalidRequestError,
    ManagerClosedError,
    RequestAbortedError,
    WouldBlock,
)
from aiocb.outputs import FinishReason, GenerationOutput, RequestStatus
from aiocb.params import asks_for_structure
from aiocb.sampling import is_long_id_prompt

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
#: How often the engine sends its statistics to each worker (for /health).
STATS_INTERVAL_S = 0.2
#: How long a worker waits for the statistics it asked for before it uses the last sent.
FRESH_STATISTICS_TIMEOUT_S = 1.0
#: How long the engine may send nothing (its statistics come every ``STATS_INTERVAL_S``)
#: before a worker takes it for hung: ``/health`` and ``/ready`` answer 503, its open
#: streams fail and new requests are refused until the engine is heard from again.
ENGINE_SILENCE_S = 10.0
#: Bytes written to a worker and not yet read by it beyond which the engine gives up on
#: it (a stuck worker must not grow the engine's memory without bound).
MAX_UNREAD_BYTES = 256 * 2**20
#: Requests with at least this many samples are added a slice of the engine's loop at a time.
_SLICED_SAMPLES = 16
#: Prompt log-probabilities (a position's, and each of its alternatives) sent in one frame
#: at most: about 0.7 ms of a worker's loop to read (16,384 took 1.2-2.3 ms), and less of
#: the engine's to pickle.
PROMPT_ENTRIES_PER_FRAME = 8_192
#: The errors a refusal or a failure is sent as; anything else becomes EngineDeadError.
_ERRORS: dict[str, type[AiocbError]] = {
    cls.__name__: cls
    for cls in (InvalidRequestError, WouldBlock, ManagerClosedError, RequestAbortedError, EngineDeadError)
}


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a worker learns of the engine when it connects."""

    config: ContinuousBatchingConfig
    statistics: ManagerStatistics
    is_dead: bool
    #: the requests' defaults (:attr:`aiocb.Manager.generation_config`)
    generation_config: GenerationConfig


class OutputDelta(NamedTuple):
    """What one request's output gained since the last delta sent for it.

    It travels as a plain tuple, with the enums as their values: pickling a batch of a
    step's deltas then costs about a fifth of what instances and enum members cost
    (0.07 ms against 0.58 ms, median, for 256 streams), on the engine's loop.
    """

    tokens: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    #: sent once, with the first delta after the prompt was computed
    prompt_logprobs: list[float | None] | None
    prompt_top_logprobs: list[dict[int, float] | None] | None
    #: a RequestStatus value
    status: int
    #: a FinishReason value
    finish_reason: str | None
    error: str | None
    created_time: float
    scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    stop_reason: int | str | None
    num_cached_tokens: int


#: where an OutputDelta's tuple holds the prompt's scores (their alternatives follow)
_PROMPT_LOGPROBS = OutputDelta._fields.index("prompt_logprobs")
assert OutputDelta._fields[_PROMPT_LOGPROBS + 1] == "prompt_top_logprobs"


def _width(tops: list[dict[int, float] | None] | None) -> int:
    """Entries a prompt position's scores make: its own and its alternatives' (the first
    position has none)."""
    return 1 + max((len(top) for top in (tops or [])[:2] if top), default=0)


def _prompt_entries(event: tuple[Any, ...]) -> int:
    """The prompt scores an outgoing event carries (at least 1: each event weighs)."""
    if event[0] == "prompt":
        values, tops = event[1], event[2]
    elif event[0] == "output":
        values, tops = event[1][_PROMPT_LOGPROBS], event[1][_PROMPT_LOGPROBS + 1]
    else:
        return 1
    return max(1, len(values or ()) * _width(tops))


def encode_frame(message: object) -> bytes:
    """One frame: the pickled ``message`` after its length."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; ``asyncio.IncompleteReadError`` when the peer closed the connection."""
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(size))


def error_to_wire(error: BaseException) -> tuple[str, str, str | None]:
    """An exception as ``(class name, message, parameter at fault)``: the nearest of the
    classes a worker knows that it is one of (an ``InvalidConfigError`` is a bad request);
    one outside aiocb's own tree becomes a dead engine."""
    known = next((cls for cls in type(error).__mro__ if _ERRORS.get(cls.__name__) is cls), EngineDeadError)
    return known.__name__, str(error) or repr(error), getattr(error, "param", None)


def error_from_wire(wire: tuple[str, str, str | None]) -> AiocbError:
    """The exception that :func:`error_to_wire` described."""
    name, message, param = wire
    cls = _ERRORS.get(name, EngineDeadError)
    if issubclass(cls, InvalidRequestError):
        return cls(message, param=param)
    return cls(message)


# --------------------------------------------------------------------------- the engine's side


class EngineService:
    """Serves a running :class:`~aiocb.Manager` to API workers over a Unix socket, on the manager's loop."""

    def __init__(self, manager: Manager) -> None:
        self.manager = manager
        self._server: asyncio.Server | None = None
        self._connections: set[_WorkerConnection] = set()

    async def start(self, path: str) -> None:
        """Listen on the Unix socket ``path``."""
        self._server = await asyncio.start_unix_server(self._serve, path=path)

    @property
    def connections(self) -> int:
        """Workers connected now."""
        return len(self._connections)

    async def close(self) -> None:
        """Stop listening and drop every connection (their requests are cancelled)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _WorkerConnection(self.manager, writer)
        self._connections.add(connection)
        turn = LoopTurn()
        try:
            connection.send_hello()
            while True:
                connection.handle(await read_frame(reader))
                # (frames already buffered are read without a wait: a burst of a thousand
                # adds was handled in one go, holding the loop for a tenth of a second)
                await turn.give()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker went away
        except Exception:
            logger.exception("an API worker sent a message the engine cannot read; dropping it")
        finally:
            self._connections.discard(connection)
            connection.close()


class _WorkerConnection:
    """One worker's requests on the engine: a pump task per request, one frame per loop turn."""

    def __init__(self, manager: Manager, writer: asyncio.StreamWriter) -> None:
        self.manager = manager
        self.writer = writer
        self._loop = asyncio.get_running_loop()
        self._pumps: dict[int, asyncio.Task[None]] = {}
        #: requests with many samples being added: their keys, and the tasks adding them
        self._adding: set[int] = set()
        self._adders: set[asyncio.Task[None]] = set()
        #: keys cancelled while being added
        self._cancelled: set[int] = set()
        self._outbox: list[tuple[int, tuple[Any, ...]]] = []
        self._flush_scheduled = False
        self._closed = False
        self._stats_task = self._loop.create_task(self._send_statistics(), name="aiocb-engine-stats")

    def send_hello(self) -> None:
        manager = self.manager
        info = EngineInfo(manager.config, manager.statistics(), manager.is_dead, manager.generation_config)
        self.writer.write(encode_frame(("hello", info)))

    def handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "add":
            _, keys, input_ids, max_new_tokens, params = message
            sampling_params = params.get("sampling_params")
            if (
                len(keys) < _SLICED_SAMPLES
                and not asks_for_structure(sampling_params, params)
                and not has_large_controls(sampling_params, params)
                and not is_long_id_prompt(input_ids)
            ):
                self._add(keys, input_ids, max_new_tokens, params)
            else:
                self._adding.update(keys)
                adder = self._loop.create_task(self._add_awaited(keys, input_ids, max_new_tokens, params))
                self._adders.add(adder)
                adder.add_done_callback(self._adders.discard)
        elif kind == "statistics":
            self.writer.write(encode_frame(("statistics", self.manager.statistics(), self.manager.is_dead)))
        elif kind == "cancel":
            pump = self._pumps.pop(message[1], None)
            if pump is not None:
                pump.cancel()  # closing its stream cancels the request
            elif message[1] in self._adding:
                self._cancelled.add(message[1])
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def close(self) -> None:
        """Cancel every request of this worker and stop writing to it."""
        if self._closed:
            return
        self._closed = True
        self._stats_task.cancel()
        for adder in self._adders:
            adder.cancel()
        for pump in self._pumps.values():
            pump.cancel()
        self._pumps.clear()
        self.writer.close()

    def _add(self, keys: list[int], input_ids: list[int], max_new_tokens: int | None, params: dict[str, Any]) -> None:
        try:
            params = {**params, "n": len(keys)}  # (a model's generation config may give num_return_sequences)
            request_id = self.manager.add_request_nowait(input_ids, max_new_tokens=max_new_tokens, **params)
            streams = [self.manager.stream(rid) for rid in sample_ids(request_id, len(keys))]
        except Exception as exc:
            for key in keys:
                self._queue(key, ("refused", error_to_wire(exc)))
            return
        for key, stream in zip(keys, streams, strict=True):
            self._queue(key, ("added",))
            self._pumps[key] = self._loop.create_task(self._pump(key, stream))

    async def _add_awaited(
        self, keys: list[int], input_ids: list[int], max_new_tokens: int | None, params: dict[str, Any]
    ) -> None:
        """:meth:`_add` for a request with many samples, an output constraint, controls
        over thousands of ids or a prompt of tens of thousands: its constraint compiles,
        and the ids are checked, off the loop (a large constraint takes seconds, 4,096
        ids of each control 4-5 ms, a 200,000-id prompt 8 ms), and a thousand samples,
        their streams and pumps (tens of milliseconds to make) are made a slice of the
        loop at a time."""
        ids: list[str] = []
        started = 0  # (the samples whose pumps run: they own their requests)
        try:
            try:
                request_id = await self.manager.add_request(
                    input_ids, max_new_tokens=max_new_tokens, wait=False, **{**params, "n": len(keys)}
                )
            except Exception as exc:
                for key in keys:
                    self._queue(key, ("refused", error_to_wire(exc)))
                return
            ids = sample_ids(request_id, len(keys))
            turn = LoopTurn()
            for key, rid in zip(keys, ids, strict=True):
                if key in self._cancelled:
                    await self._abandon(rid)
                else:
                    stream = self.manager.stream(rid)
                    self._queue(key, ("added",))
                    self._pumps[key] = self._loop.create_task(self._pump(key, stream))
                started += 1
                await turn.give()
        except asyncio.CancelledError:
            for rid in ids[started:]:  # (the connection closed)
                await self._abandon(rid)
            raise
        finally:
            self._adding.difference_update(keys)
            self._cancelled.difference_update(keys)

    async def _abandon(self, request_id: str) -> None:
        """End one sample this connection added but will not stream, that sample alone, and
        let go of it: its output would wait in the engine's shared results, which nobody
        here reads (a cancel_request() kept it there, and ended its siblings too)."""
        await self.manager.stream(request_id).aclose()

    async def _pump(self, key: int, stream: RequestStream) -> None:
        tokens = 0
        logprobs = 0
        prompt_sent = False
        try:
            async with stream:
                async for output in stream:
                    prompt = output.prompt_logprobs if not prompt_sent else None
                    prompt_top = output.prompt_top_logprobs if prompt is not None else None
                    if prompt is not None:
                        prompt_sent = True
                        prompt, prompt_top = await self._send_prompt_head(key, prompt, prompt_top)
                    new_tokens = output.tokens_since(tokens)
                    delta = OutputDelta(
                        new_tokens,
                        None if output.logprobs is None else output.logprobs[logprobs:],
                        None if output.top_logprobs is None else output.top_logprobs[logprobs:],
                        prompt,
                        prompt_top,
                        output.status.value,
                        None if output.finish_reason is None else output.finish_reason.value,
                        output.error,
                        output.created_time,
                        output.scheduled_time,
                        output.first_token_time,
                        output.finished_time,
                        output.stop_reason,
                        output.num_cached_tokens,
                    )
                    tokens += len(new_tokens)
                    logprobs = len(output.logprobs) if output.logprobs is not None else 0
                    self._queue(key, ("output", tuple(delta)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._queue(key, ("failed", error_to_wire(exc)))
        finally:
            if self._pumps.get(key) is asyncio.current_task():
                del self._pumps[key]

    async def _send_prompt_head(
        self, key: int, values: list[float | None], tops: list[dict[int, float] | None] | None
    ) -> tuple[list[float | None], list[dict[int, float] | None] | None]:
        """Send a long prompt's scores but their last slice as ``("prompt", ...)`` events, a
        frame each (one echoed 40,000-token prompt with 20 alternatives a position was a
        9.8 MB frame whose pickling held this loop 57 ms); returns the last slice, which the
        output delta carries."""
        per_frame = max(1, PROMPT_ENTRIES_PER_FRAME // _width(tops))
        sent = 0
        while len(values) - sent > per_frame:
            end = sent + per_frame
            self._queue(key, ("prompt", values[sent:end], None if tops is None else tops[sent:end]))
            sent = end
            await asyncio.sleep(0)  # (the flush already due runs first: this slice leaves alone)
        return values[sent:], None if tops is None else tops[sent:]

    def _queue(self, key: int, event: tuple[Any, ...]) -> None:
        if self._closed:
            return
        self._outbox.append((key, event))
        if not self._flush_scheduled:
            # Runs after every callback already due in this turn of the loop: after a step,
            # all the pumps it woke, so their tokens leave together.
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Send the events queued in this turn of the loop, in frames of at most
        ``PROMPT_ENTRIES_PER_FRAME`` prompt scores (several pumps' slices in one frame held
        the worker's loop 5 ms as it read them)."""
        self._flush_scheduled = False
        if self._closed or not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        frame: list[tuple[int, tuple[Any, ...]]] = []
        entries = 0
        for item in batch:
            weight = _prompt_entries(item[1])
            if frame and entries + weight > PROMPT_ENTRIES_PER_FRAME:
                self.writer.write(encode_frame(("batch", frame)))
                frame, entries = [], 0
            frame.append(item)
            entries += weight
        self.writer.write(encode_frame(("batch", frame)))
        unread = self.writer.transport.get_write_buffer_size()
        if unread > MAX_UNREAD_BYTES:
            logger.error("an API worker left %d bytes unread; dropping it and cancelling its requests", unread)
            self.close()
            self.writer.transport.abort()  # close() would wait for the unread bytes to drain

    async def _send_statistics(self) -> None:
        with contextlib.suppress(ConnectionError):
            while not self._closed:
                await asyncio.sleep(STATS_INTERVAL_S)
                manager = self.manager
                self.writer.write(encode_frame(("stats", manager.statistics(), manager.is_dead)))


# --------------------------------------------------------------------------- the worker's side


class _ModelConfigOnly:
    """Stands for the model where the app reads only its config (the context length)."""

    def __init__(self, config: Any) -> None:
        self.config = config


@dataclass(slots=True)
class _StreamState:
    output: GenerationOutput
    #: the stream's consumer while it sleeps for the next output
    waiter: asyncio.Future[None] | None = None
    #: set once the engine said whether it queued the request
    added: asyncio.Future[None] | None = None
    error: AiocbError | None = None
    #: a long prompt's scores sent ahead of the output that completes them
    prompt_head: list[float | None] = dataclasses.field(default_factory=list)
    prompt_top_head: list[dict[int, float] | None] = dataclasses.field(default_factory=list)


class RemoteManager:
    """The part of :class:`~aiocb.Manager` that the app uses, for an engine in another process.

    Made by :meth:`connect`. Requests are queued with :meth:`open_stream` (one round trip:
    a refusal raises what ``add_request_nowait`` raised in the engine); their outputs
    arrive as the engine's loop produces them.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        info: EngineInfo,
        model_config: Any,
    ) -> None:
        self.config = info.config
        self.generation_config = info.generation_config
        self.model = _ModelConfigOnly(model_config)
        self._reader = reader
        self._writer = writer
        self._statistics = info.statistics
        self._engine_dead = info.is_dead
        self._lost: str | None = None
        #: set by stop(): requests opened from then on are refused
        self._stopping = False
        self._streams: dict[int, _StreamState] = {}
        #: callers of fresh_statistics, in the order their questions were sent
        self._asking: collections.deque[asyncio.Future[None]] = collections.deque()
        #: set whenever the last of this worker's requests ended
        self._idle = asyncio.Event()
        self._idle.set()
        self._keys = itertools.count()
        self._loop = asyncio.get_running_loop()
        # One frame can carry outputs for hundreds of streams, each of whose consumers
        # (detokenizing, formatting a chunk) takes tens of microseconds: woken at once they
        # would hold the loop for milliseconds.
        self._waker = Waker()
        #: when the engine was last heard from (loop time)
        self._heard = self._loop.time()
        self._receiver = self._loop.create_task(self._receive(), name="aiocb-remote-engine")
        self._watchdog = self._loop.create_task(self._watch_silence(), name="aiocb-remote-watchdog")

    @classmethod
    async def connect(cls, path: str, model_config: Any) -> RemoteManager:
        """Connect to the :class:`EngineService` listening on ``path``."""
        reader, writer = await asyncio.open_unix_connection(path)
        kind, info = await read_frame(reader)
        if kind != "hello":
            writer.close()
            raise ConnectionError(f"the engine answered {kind!r} instead of hello")
        return cls(reader, writer, info, model_config)

    # ------------------------------------------------------------------ what the app reads

    @property
    def is_running(self) -> bool:
        """Whether the engine is reachable, answers, and its step loop runs."""
        return self._lost is None and not self._engine_dead and self._statistics.is_running and self.silence() is None

    def silence(self) -> str | None:
        """Why the engine is taken for hung (nothing heard from it for ``ENGINE_SILENCE_S``), or None."""
        silent = self._loop.time() - self._heard
        return f"the engine has not answered for {silent:.0f} s" if silent > ENGINE_SILENCE_S else None

    @property
    def is_dead(self) -> bool:
        """Whether the engine failed or the connection to it was lost."""
        return self._lost is not None or self._engine_dead

    def statistics(self) -> ManagerStatistics:
        """The engine's statistics, as last sent (at most ``STATS_INTERVAL_S`` old)."""
        return self._statistics

    async def fresh_statistics(self) -> ManagerStatistics | None:
        """The engine's statistics as of now: taken after this call asked for them, so never
        older than what any earlier call got, in any worker; None if the engine does not
        answer within ``FRESH_STATISTICS_TIMEOUT_S``, or is gone, or is taken for hung (a
        scrape of a hung engine asks it nothing, or the questions would pile up), where
        :meth:`statistics` has the last sent, which another worker may have passed."""
        if self._lost is not None or self.silence() is not None:
            return None
        answered = self._loop.create_future()
        self._asking.append(answered)
        self._writer.write(encode_frame(("statistics",)))
        try:
            await asyncio.wait_for(asyncio.shield(answered), FRESH_STATISTICS_TIMEOUT_S)
        except TimeoutError:
            return None
        return self._statistics

    async def wait_lost(self) -> str:
        """Return, with the reason, once the connection to the engine is lost (the engine
        exited, or dropped this worker)."""
        await asyncio.wait([self._receiver])
        return self._lost or "the connection to the engine was closed"

    def start(self) -> None:
        """The engine's own process runs it: nothing to start here."""

    async def wait_started(self) -> None:
        """The engine's own process started it: nothing to wait for here."""

    async def stop(self, timeout: float | None = None) -> None:
        """Drain this worker's requests: wait ``timeout`` seconds (None: for ever) for them to end,
        then cancel the rest, whose streams raise :class:`~aiocb.RequestAbortedError` (as the
        manager's do after its own drain). The engine keeps running for the other workers.
        Requests opened from now on are refused with :class:`~aiocb.ManagerClosedError`."""
        self._stopping = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        for key, state in list(self._streams.items()):
            self._cancel(key)
            state.error = RequestAbortedError(f"its {timeout} s drain ran out")
            if state.added is not None and not state.added.done():  # (the engine still adding it)
                state.added.set_exception(state.error)
            self._notify(state)

    async def close(self) -> None:
        """Close the connection (the engine cancels whatever this worker still had)."""
        self._receiver.cancel()
        self._watchdog.cancel()
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._fail_all("the connection to the engine was closed")

    # ------------------------------------------------------------------ requests

    async def open_stream(self, input_ids: Sequence[int], max_new_tokens: int | None, **params: Any) -> RemoteStream:
        """Queue a request in the engine without waiting for room; its stream of outputs.

        Raises what the engine's ``add_request_nowait`` raised (``WouldBlock`` when its
        admission queue is full, ``InvalidRequestError`` for bad parameters).
        """
        (stream,) = await self.open_streams(input_ids, max_new_tokens, 1, **params)
        return stream

    async def open_streams(
        self, input_ids: Sequence[int], max_new_tokens: int | None, n: int, **params: Any
    ) -> list[RemoteStream]:
        """Like :meth:`open_stream` for a request with ``n`` samples (the prompt computed
        once in the engine): one stream per sample, the request's first."""
        if self._lost is not None:
            raise EngineDeadError(self._lost)
        if self._stopping:
            raise ManagerClosedError("the server is shutting down and accepts no new requests")
        silence = self.silence()
        if silence is not None:  # (503, as /health says: it may yet answer)
            raise ManagerClosedError(silence)
        keys = [next(self._keys) for _ in range(n)]
        states = [_StreamState(GenerationOutput(f"remote-{key}", list(input_ids))) for key in keys]
        loop = asyncio.get_running_loop()
        for key, state in zip(keys, states, strict=True):
            state.added = loop.create_future()
            self._streams[key] = state
        self._idle.clear()
        self._writer.write(encode_frame(("add", keys, list(input_ids), max_new_tokens, params)))
        try:
            for state in states:
                assert state.added is not None
                await state.added
        except BaseException:
            for key, state in zip(keys, states, strict=True):
                self._cancel(key)
                if state.added is not None and state.added.done() and not state.added.cancelled():
                    state.added.exception()  # the samples share one refusal: retrieved once is enough
            raise
        return [RemoteStream(self, key, state) for key, state in zip(keys, states, strict=True)]

    def _cancel(self, key: int) -> None:
        if self._forget(key) and self._lost is None:
            self._writer.write(encode_frame(("cancel", key)))

    def _forget(self, key: int) -> bool:
        """Stop tracking a request; whether it was tracked."""
        known = self._streams.pop(key, None) is not None
        if not self._streams:
            self._idle.set()
        return known

    async def _receive(self) -> None:
        reason = "the engine closed the connection"
        turn = LoopTurn()  # (a frame may carry hundreds of outputs; frames read back to back count too)
        try:
            while True:
                message = await read_frame(self._reader)
                self._heard = self._loop.time()
                await turn.give()
                if message[0] == "batch":
                    for key, event in message[1]:
                        self._dispatch(key, event)
                        await turn.give()
                elif message[0] == "stats":
                    _, self._statistics, self._engine_dead = message
                elif message[0] == "statistics":
                    _, self._statistics, self._engine_dead = message
                    answered = self._asking.popleft()
                    if not answered.done():
                        answered.set_result(None)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as exc:
            logger.exception("unreadable message from the engine")
            reason = f"unreadable message from the engine: {exc!r}"
        self._lost = reason
        self._fail_all(reason)

    async def _watch_silence(self) -> None:
        """Fail the open streams once the engine is silent for ``ENGINE_SILENCE_S`` (a hung
        engine would leave them waiting for ever); their requests are cancelled in the
        engine, should it wake."""
        while self._lost is None:
            await asyncio.sleep(ENGINE_SILENCE_S / 4)
            silence = self.silence()
            if silence is None or not self._streams:
                continue
            logger.error("%s: failing this worker's %d open streams", silence, len(self._streams))
            states = list(self._streams.items())
            for key, _ in states:
                self._cancel(key)
            for _, state in states:
                error = EngineDeadError(silence)
                state.error = error
                if state.added is not None and not state.added.done():
                    state.added.set_exception(error)
                self._notify(state)

    def _dispatch(self, key: int, event: tuple[Any, ...]) -> None:
        state = self._streams.get(key)
        if state is None:
            return  # cancelled here already
        kind = event[0]
        if kind == "added":
            if state.added is not None and not state.added.done():
                state.added.set_result(None)
            return
        if kind == "refused":
            self._forget(key)
            if state.added is not None and not state.added.done():
                state.added.set_exception(error_from_wire(event[1]))
            return
        if kind == "prompt":
            state.prompt_head += event[1]
            if event[2] is not None:
                state.prompt_top_head += event[2]
            return
        if kind == "failed":
            state.error = error_from_wire(event[1])
            self._forget(key)
        else:
            delta = OutputDelta(*event[1])
            if delta.prompt_logprobs is not None and state.prompt_head:
                head, top_head = state.prompt_head, state.prompt_top_head
                state.prompt_head, state.prompt_top_head = [], []
                delta = delta._replace(
                    prompt_logprobs=head + delta.prompt_logprobs,
                    prompt_top_logprobs=None
                    if delta.prompt_top_logprobs is None
                    else top_head + delta.prompt_top_logprobs,
                )
            _apply(state.output, delta)
            if state.output.is_finished():
                self._forget(key)
        self._notify(state)

    def _notify(self, state: _StreamState) -> None:
        """Wake the stream's consumer, if it sleeps, in the waker's next batch."""
        waiter = state.waiter
        if waiter is not None:
            state.waiter = None
            self._waker.wake(waiter)

    def _fail_all(self, reason: str) -> None:
        for answered in self._asking:
            if not answered.done():
                answered.set_result(None)
        self._asking.clear()
        for state in self._streams.values():
            state.error = EngineDeadError(reason)
            if state.added is not None and not state.added.done():
                state.added.set_exception(EngineDeadError(reason))
            self._notify(state)
        self._streams.clear()
        self._idle.set()


def _apply(output: GenerationOutput, delta: OutputDelta) -> None:
    output.generated_tokens += delta.tokens
    if delta.logprobs is not None:
        output.logprobs = (output.logprobs or []) + delta.logprobs
    if delta.top_logprobs is not None:
        output.top_logprobs = (output.top_logprobs or []) + delta.top_logprobs
    if delta.prompt_logprobs is not None:
        output.prompt_logprobs = delta.prompt_logprobs
        output.prompt_top_logprobs = delta.prompt_top_logprobs
    output.status = RequestStatus(delta.status)
    output.finish_reason = None if delta.finish_reason is None else FinishReason(delta.finish_reason)
    output.error = delta.error
    output.created_time = delta.created_time
    output.scheduled_time = delta.scheduled_time
    output.first_token_time = delta.first_token_time
    output.finished_time = delta.finished_time
    output.stop_reason = delta.stop_reason
    output.num_cached_tokens = delta.num_cached_tokens


class RemoteStream:
    """Async iterator over one remote request's outputs, like :class:`~aiocb.engine.stream.RequestStream`.

    Each output is a snapshot with every token so far. Leaving it (or :meth:`aclose`)
    before the final output cancels the request.
    """

    def __init__(self, manager: RemoteManager, key: int, state: _StreamState) -> None:
        self._manager = manager
        self._key = key
        self._state = state
        self._delivered = -1
        self._done = False

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self._done:
            raise StopAsyncIteration
        state = self._state
        output = state.output
        try:
            while (
                state.error is None
                and not output.is_finished()
                and len(output.generated_tokens) <= max(self._delivered, 0)
            ):
                waiter = state.waiter = self._manager._loop.create_future()
                await waiter
        except asyncio.CancelledError:
            self._close()
            raise
        if state.error is not None:
            self._done = True
            raise state.error
        self._delivered = len(output.generated_tokens)
        if output.is_finished():
            self._done = True
        return _snapshot(output)

    async def aclose(self) -> None:
        """Stop streaming; cancels the request if it has not finished."""
        self._close()

    async def __aenter__(self) -> RemoteStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._close()

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._manager._cancel(self._key)

    def __del__(self) -> None:
        # An `async for` left with break drops the iterator without closing it.
        loop = self._manager._loop
        if not self._done and not loop.is_closed():
            loop.call_soon_threadsafe(self._manager._cancel, self._key)


def _snapshot(output: GenerationOutput) -> GenerationOutput:
    """A copy whose lists later deltas do not extend."""
    return dataclasses.replace(
        output,
        generated_tokens=list(output.generated_tokens),
        logprobs=None if output.logprobs is None else list(output.logprobs),
        top_logprobs=None if output.top_logprobs is None else list(output.top_logprobs),
    )


#: What the app serves: a manager on its own loop, or one in the engine process.
ServedEngine = Manager | RemoteManager
#: A request's outputs, from either.
OutputStream = RequestStream | RemoteStream
