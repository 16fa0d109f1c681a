"""Prometheus metrics for the server (one registry per app, served at GET /metrics).

Counters: HTTP requests by route and status, prompt / completion / drafted /
accepted tokens, generations by outcome, the acceptance-collapse guard's
engagements and plain steps (collapse.py), drafters switched off after an
error. Histograms: acceptance rate and time per output token per generation.
Gauges: requests waiting for the engine, requests in flight (waiting +
generating), whether the guard has speculation off now.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from specdecode.stats import SpecStats

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages",
          "/health", "/metrics")


PREFIX_STORE_GAUGES = {
    "entries": "Earlier conversations' caches the prefix store holds in memory",
    "bytes": "Memory of the prefix store's cache snapshots",
    "tokens": "Tokens of the prefix store's cache snapshots",
    "swaps": "Requests whose prefix was restored from the store (since start)",
    "restored_tokens": "Prompt tokens restored from the store instead of prefilled "
                       "(since start)",
}


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdecode_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.generations = Counter("specdecode_generations",
                                   "Generations by outcome (finished, cancelled, error)",
                                   ["outcome"], registry=r)
        self.prompt_tokens = Counter("specdecode_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.cached_tokens = Counter(
            "specdecode_prefix_cache_tokens",
            "Prompt tokens reused from the target's cache instead of prefilled", registry=r)
        self.prefix_hits = Counter("specdecode_prefix_cache_hits",
                                   "Generations that reused a cached prompt prefix", registry=r)
        self.completion_tokens = Counter("specdecode_completion_tokens",
                                         "Tokens generated", registry=r)
        self.drafted = Counter("specdecode_drafted_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specdecode_accepted_tokens", "Draft tokens accepted",
                                registry=r)
        self.guard_engagements = Counter(
            "specdecode_guard_engagements",
            "Times the acceptance-collapse guard switched speculation off", registry=r)
        self.guard_plain_steps = Counter(
            "specdecode_guard_plain_steps",
            "Steps decoded plain because the acceptance-collapse guard was engaged", registry=r)
        self.drafter_errors = Counter(
            "specdecode_drafter_errors",
            "Drafters that raised and were switched off for the rest of a request", registry=r)
        self.speculation_paused = Gauge(
            "specdecode_speculation_paused",
            "1 while the acceptance-collapse guard has speculation off, else 0", registry=r)
        self.acceptance = Histogram("specdecode_acceptance_rate",
                                    "Acceptance rate per generation (generations with drafts)",
                                    buckets=[i / 10 for i in range(1, 11)], registry=r)
        self.time_per_token = Histogram(
            "specdecode_time_per_output_token_seconds",
            "Decode time per output token per generation (prefill excluded)",
            buckets=[0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28], registry=r)
        self.queue_depth = Gauge("specdecode_queue_depth", "Requests waiting for the engine",
                                 registry=r)
        self.in_flight = Gauge("specdecode_requests_in_flight",
                               "Requests waiting or generating", registry=r)
        self.suffix_store_tokens = Gauge(
            "specdecode_suffix_store_tokens",
            "Tokens of earlier requests the suffix drafter's store holds", registry=r)
        self.suffix_store_bytes = Gauge(
            "specdecode_suffix_store_bytes",
            "Estimated memory of the suffix drafter's store (texts + index)", registry=r)
        self.prefix_store = {key: Gauge(f"specdecode_prefix_store_{key}", text, registry=r)
                             for key, text in PREFIX_STORE_GAUGES.items()}

    def watch_queue(self, waiting: Callable[[], float], in_flight: Callable[[], float]) -> None:
        self.queue_depth.set_function(waiting)
        self.in_flight.set_function(in_flight)

    def watch_suffix_store(self, drafters) -> None:
        """The size of the first suffix store among `drafters` (0 without one)."""
        store = next((d.store for d in drafters if getattr(d, "store", None) is not None), None)
        self.suffix_store_tokens.set_function(lambda: store.tokens if store else 0)
        self.suffix_store_bytes.set_function(lambda: store.stats()["bytes"] if store else 0)

    def watch_prefix_store(self, store) -> None:
        """The prefix store's stats (prefix_store.PrefixStore.stats; 0 without one)."""
        for key, gauge in self.prefix_store.items():
            gauge.set_function(lambda key=key: store.stats()[key] if store else 0)

    def watch_guard(self, controller) -> None:
        """The gauge reads the controller's guard (0 without a controller)."""
        guard = getattr(controller, "guard", None)
        self.speculation_paused.set_function(lambda: float(bool(guard and guard.engaged)))

    def observe_request(self, path: str, status: int) -> None:
        route = path.rstrip("/") or "/"
        self.requests.labels(route if route in ROUTES else "other", str(status)).inc()

    def observe_generation(self, outcome: str, prompt_tokens: int, completion_tokens: int,
                           stats: SpecStats | None) -> None:
        self.generations.labels(outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        if stats is None:
            return
        self.cached_tokens.inc(stats.cached_tokens)
        if stats.cached_tokens:
            self.prefix_hits.inc()
        self.drafted.inc(stats.drafted)
        self.guard_engagements.inc(stats.guard_engagements)
        self.guard_plain_steps.inc(stats.guard_plain_steps)
        self.drafter_errors.inc(stats.drafter_errors)
        self.accepted.inc(stats.accepted)
        if stats.drafted:
            self.acceptance.observe(stats.acceptance_rate)
        if stats.emitted and stats.decode_time > 0:
            self.time_per_token.observe(stats.decode_time / stats.emitted)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
