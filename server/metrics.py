"""Prometheus metrics of one server, in their own registry (several servers may share a process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# Accepted draft tokens per step: 0 (none accepted) up to a whole forced span or tree path.
_ACCEPT_BUCKETS = (0, 0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
_COMPILE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30)


def _queue_depth(stats: Mapping[str, Any]) -> float:
    return float(stats.get("waiting", 0)) + float(stats.get("compiling", 0))


def _hit_rate(stats: Mapping[str, Any]) -> float:
    queried = float(stats.get("prefix_queried_tokens", 0))
    return float(stats.get("prefix_hit_tokens", 0)) / queried if queried else 0.0


def _blocks_used(stats: Mapping[str, Any]) -> float:
    return float(stats.get("total_blocks", 0)) - float(stats.get("free_blocks", 0))


class ServerMetrics:
    """Counters, gauges and histograms the servicer updates; ``engine_stats`` feeds the gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "espalier_requests", "RPCs by method and status code", ["method", "code"], registry=r
        )
        self.prompt_tokens = Counter("espalier_prompt_tokens", "Prompt tokens", registry=r)
        self.generated_tokens = Counter("espalier_generated_tokens", "Emitted tokens", registry=r)
        self.ttft = Histogram(
            "espalier_time_to_first_token_seconds",
            "Arrival to first emitted token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "espalier_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "espalier_request_duration_seconds",
            "Generation RPC duration",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.compile_time = Histogram(
            "espalier_grammar_compile_seconds",
            "CompileGrammar calls that missed the compile cache: compile seconds",
            buckets=_COMPILE_BUCKETS,
            registry=r,
        )
        self.grammar_wait = Histogram(
            "espalier_request_grammar_wait_seconds",
            "Constrained generations: seconds until the grammar was ready (cache hits included)",
            buckets=_COMPILE_BUCKETS,
            registry=r,
        )
        self.mask_time = Histogram(
            "espalier_tree_mask_seconds",
            "Per-request time building grammar (tree) masks",
            buckets=_COMPILE_BUCKETS,
            registry=r,
        )
        self.accept_length = Histogram(
            "espalier_speculative_accept_length",
            "Mean accepted tokens per speculative step, per request",
            buckets=_ACCEPT_BUCKETS,
            registry=r,
        )
        self.active = Gauge("espalier_active_requests", "Generations in flight", registry=r)
        self.aborted = Counter(
            "espalier_aborted_requests",
            "Generations aborted in the engine (cancel, deadline, error after admission)",
            registry=r,
        )
        self.engine_restarts = Counter(
            "espalier_engine_restarts",
            "Engine processes replaced after a death (server/engine_supervisor.py)",
            registry=r,
        )
        self._engine_stats: Callable[[], Mapping[str, Any]] | None = None
        self._cache_collector: _CompileCacheCollector | None = None
        gauges = {
            "queue_depth": ("Requests waiting in the engine (compiling included)", _queue_depth),
            "running": ("Requests running in the engine", lambda st: st.get("running", 0)),
            "kv_blocks_used": ("KV cache blocks in use", _blocks_used),
            "kv_blocks_free": ("KV cache blocks free", lambda st: st.get("free_blocks", 0)),
            "prefix_cache_hit_rate": ("Prompt tokens found in the prefix cache", _hit_rate),
            "prefix_cache_blocks": (
                "KV blocks in the prefix cache",
                lambda st: st.get("prefix_cached_blocks", 0),
            ),
            "prefix_cache_evictions": (
                "Prefix cache blocks evicted since start",
                lambda st: st.get("prefix_evictions", 0),
            ),
        }
        for name, (doc, read) in gauges.items():
            gauge = Gauge(f"espalier_engine_{name}", doc, registry=r)
            gauge.set_function(self._stat_reader(read))
        r.register(_EngineCounterCollector(self._stats_now))

    def _stats_now(self) -> Mapping[str, Any]:
        """The engine's stats at this scrape (``{}`` before an engine is bound)."""
        source = self._engine_stats
        return source() if source is not None else {}

    def _stat_reader(self, read: Callable[[Mapping[str, Any]], float]) -> Callable[[], float]:
        def value() -> float:
            try:
                return float(read(self._stats_now()))
            except Exception:  # a metrics scrape must never fail on engine state
                return float("nan")

        return value

    def bind_engine(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._engine_stats = stats

    def bind_compile_cache(self, stats: Callable[[], Any]) -> None:
        """Export the compile cache counters (``constrained.cache.CacheStats``), read at scrape."""
        if self._cache_collector is None:
            self._cache_collector = _CompileCacheCollector(stats)
            self.registry.register(self._cache_collector)
        else:
            self._cache_collector.stats = stats

    def serve_http(self, host: str, port: int) -> tuple[Any, int]:
        """Start the /metrics HTTP endpoint on a daemon thread; returns (server, bound port)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, int(server.server_port)


class _EngineCounterCollector(Collector):
    """The engine's running totals, read at scrape: steps (tokens per step = generated tokens /
    steps: how full the batches ran) and preemptions."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            values = self.stats()
        except Exception:  # a metrics scrape must never fail on engine state
            values = {}
        yield CounterMetricFamily(
            "espalier_engine_steps", "Engine steps taken", value=values.get("steps", 0)
        )
        yield CounterMetricFamily(
            "espalier_engine_preemptions",
            "Requests preempted (KV blocks taken back, recomputed later)",
            value=values.get("preemptions", 0),
        )


class _CompileCacheCollector(Collector):
    """Lookups by result (hit, miss, negative hit, joined in flight), timeouts, compile seconds
    waiting and running, compiles running and abandoned, entries, bytes."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        lookups = CounterMetricFamily(
            "espalier_grammar_cache_lookups", "Compile cache lookups by result", labels=["result"]
        )
        for result, value in (
            ("hit", s.hits),
            ("miss", s.misses),
            ("negative_hit", s.negative_hits),
            ("joined_in_flight", s.joined_in_flight),
        ):
            lookups.add_metric([result], value)
        yield lookups
        yield CounterMetricFamily(
            "espalier_grammar_compile_timeouts", "Compiles over the time limit", value=s.timeouts
        )
        seconds = CounterMetricFamily(
            "espalier_grammar_compile_phase_seconds",
            "Compile time by phase: waiting (queue, a backend's child or slot) and running",
            labels=["phase"],
        )
        seconds.add_metric(["queued"], s.queue_seconds_total)
        seconds.add_metric(["running"], s.compile_seconds_total)
        yield seconds
        yield GaugeMetricFamily(
            "espalier_grammar_compiles_running", "Compiles running now", s.running
        )
        yield GaugeMetricFamily(
            "espalier_grammar_compiles_abandoned",
            "Compiles past their deadline or cancelled whose in-process call still runs",
            s.abandoned_running,
        )
        yield GaugeMetricFamily("espalier_grammar_cache_entries", "Cached grammars", s.entries)
        yield GaugeMetricFamily("espalier_grammar_cache_bytes", "Cached grammar bytes", s.bytes)
