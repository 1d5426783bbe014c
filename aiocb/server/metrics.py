"""Prometheus metrics of the server and its manager, on a registry of their own.

Queue lengths, cache use and the engine's counters are read from
:meth:`aiocb.Manager.statistics` when ``/metrics`` is scraped; latencies and token counts
are observed by the request handlers as tokens reach clients.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from aiocb.server.remote import RemoteManager, ServedEngine

#: Status of a response to a client that has gone (nginx's "client closed request").
CLIENT_GONE = 499

#: Latency buckets in seconds, from sub-millisecond (loopback, tiny models) to a minute.
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 60.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _ManagerCollector(Collector):
    """Reads the manager's statistics at scrape time."""

    def __init__(self, manager: ServedEngine, labels: dict[str, str]) -> None:
        self._manager = manager
        self._labels = labels
        #: whether the counters are collected: not from an API worker's copy of an engine
        #: that did not answer (another worker may have served later values, and a counter
        #: that goes back reads as a reset: left out, it reads as a gap)
        self.counters = True

    def collect(self) -> Iterable[Metric]:
        stats = self._manager.statistics()
        labels = list(self._labels)
        value = list(self._labels.values())

        def gauge(name: str, doc: str, number: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(value, number)
            return family

        def counter(name: str, doc: str, number: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(value, number)
            return family

        yield gauge("aiocb_num_requests_running", "Requests in the running batch.", stats.running_requests)
        yield gauge("aiocb_num_requests_waiting", "Requests waiting for admission.", stats.waiting_requests)
        yield gauge(
            "aiocb_kv_cache_usage_perc",
            "Share of KV cache blocks in use (0 to 1), of the tightest cache group (a hybrid model's full layers).",
            stats.cache_usage,
        )
        yield gauge("aiocb_kv_cache_free_blocks", "Free KV cache blocks (all cache groups).", stats.free_blocks)
        yield gauge("aiocb_kv_cache_total_blocks", "KV cache blocks in all (all cache groups).", stats.total_blocks)
        # (the manager's own word: an API worker's statistics may be a copy from before a hang)
        running = self._manager.is_running
        yield gauge("aiocb_engine_running", "1 while the step loop runs.", 1.0 if running else 0.0)
        if not self.counters:
            return
        yield counter("aiocb_engine_steps", "Forward steps run.", stats.steps)
        yield counter("aiocb_engine_computed_tokens", "Tokens run through the model.", stats.tokens_computed)
        yield counter("aiocb_engine_generated_tokens", "Tokens sampled by the engine.", stats.tokens_generated)
        yield counter("aiocb_prefix_cache_hit_tokens", "Prompt tokens read from the cache.", stats.prefix_hit_tokens)
        yield counter("aiocb_num_preemptions", "Requests preempted for lack of cache blocks.", stats.preemptions)
        yield counter("aiocb_recomputed_tokens", "Tokens recomputed after preemption.", stats.recomputed_tokens)
        yield counter(
            "aiocb_kv_offloaded_blocks", "Preempted requests' KV blocks copied to host.", stats.offloaded_blocks
        )
        yield counter("aiocb_kv_restored_blocks", "KV blocks copied back from host memory.", stats.restored_blocks)
        yield counter("aiocb_spec_decode_draft_tokens", "Tokens proposed by speculative decoding.", stats.draft_tokens)
        yield counter(
            "aiocb_spec_decode_accepted_tokens", "Proposed tokens the model agreed with.", stats.accepted_draft_tokens
        )
        rate = stats.acceptance_rate
        yield gauge(
            "aiocb_spec_decode_acceptance_rate",
            "Share of proposed tokens accepted since the start (0 before any proposal).",
            0.0 if rate is None else rate,
        )


class ServerMetrics:
    """The server's metrics; :meth:`render` is the body of ``GET /metrics``.

    Every series is labelled ``model_name``, and ``replica`` when one is given (one of the
    replicas that serve a model behind one route: their series stay apart). In an API
    worker of ``aiocb serve --api-workers N`` (``PROMETHEUS_MULTIPROC_DIR`` set before
    prometheus_client was imported), the request metrics of every worker are kept in that
    directory and :meth:`render` adds them up, and the engine's are fetched fresh for each
    scrape, so that scrapes answered by different workers never see a counter go back.
    """

    def __init__(self, manager: ServedEngine, model_name: str, replica: str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._manager = manager
        constant = {"model_name": model_name} if replica is None else {"model_name": model_name, "replica": replica}
        self._engine = _ManagerCollector(manager, constant)
        self.registry.register(self._engine)
        labels = list(constant)
        self._values = list(constant.values())
        self.time_to_first_token = Histogram(
            "aiocb_time_to_first_token_seconds",
            "Seconds from receiving a request to a choice's first generated token (each of n choices).",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(*self._values)
        self.inter_token_latency = Histogram(
            "aiocb_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a choice.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        ).labels(*self._values)
        self.e2e_latency = Histogram(
            "aiocb_e2e_request_latency_seconds",
            "Seconds from receiving a request to a choice's last token (each of n choices).",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(*self._values)
        self.prompt_tokens = Counter(
            "aiocb_prompt_tokens",
            "Prompt tokens of the requests queued (a prompt once, whatever its choices).",
            labels,
            registry=self.registry,
        ).labels(*self._values)
        self.generation_tokens = Counter(
            "aiocb_generation_tokens",
            "Generated tokens of the responses' choices, as they come (none past a stop string).",
            labels,
            registry=self.registry,
        ).labels(*self._values)
        self._finished = Counter(
            "aiocb_request_success",
            "Finished choices, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._errors = Counter(
            "aiocb_http_errors", "Error responses, by HTTP status.", [*labels, "status"], registry=self.registry
        )

    def observe_finished(self, finish_reason: str) -> None:
        """Count one finished choice."""
        self._finished.labels(*self._values, finish_reason).inc()

    def observe_error(self, status: int) -> None:
        """Count one error response."""
        self._errors.labels(*self._values, str(status)).inc()

    def observe_client_gone(self) -> None:
        """Count one request whose client went away before its response was complete
        (status 499, as nginx logs it)."""
        self.observe_error(CLIENT_GONE)

    def observe_inter_token(self, count: int, interval: float) -> None:
        """``count`` tokens arrived together ``interval`` seconds after the previous ones."""
        if count <= 0:
            return
        share = interval / count
        for _ in range(count):
            self.inter_token_latency.observe(share)

    async def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        if isinstance(self._manager, RemoteManager):
            # (no await from here to the collection: a concurrent scrape cannot change it)
            self._engine.counters = await self._manager.fresh_statistics() is not None
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # registers itself
            registry.register(self._engine)
            return generate_latest(registry)
        return generate_latest(self.registry)
