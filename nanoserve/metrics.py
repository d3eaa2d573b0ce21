"""`/metrics` (day 42): Prometheus metrics in the server's own registry.

Two kinds. Histograms and counters the engine loop updates as tokens come out (time to first
token, inter-token latency, end-to-end latency, tokens, requests by finish reason), and the
engine's state read at scrape time by a collector (requests running and waiting, KV blocks,
preemptions, graphs recorded and the bytes they hold, cold captures, decode steps that ran
without a graph). Nothing here touches the engine from the scrape's thread but reading counts.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class Metrics:
    def __init__(self, state):
        self.registry = CollectorRegistry()
        self.state = state  # the server's state: .engine, once built
        r = self.registry
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = Histogram(
            "nanoserve_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            buckets=latency_buckets,
            registry=r,
        )
        self.itl = Histogram(
            "nanoserve_inter_token_latency_seconds",
            "Time between two consecutive tokens of one request.",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.e2e = Histogram(
            "nanoserve_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            buckets=latency_buckets,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "nanoserve_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter("nanoserve_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "nanoserve_requests", "Requests that ended, by finish reason.", ["finish_reason"], registry=r
        )
        r.register(_EngineCollector(state))

    def token(self, stream, now: float, n: int = 1) -> None:
        """A step gave stream n new tokens (0 for an output that only ends it)."""
        if n == 0:
            return
        if stream.last is None:
            self.ttft.observe(now - stream.arrival)
        else:
            self.itl.observe(now - stream.last)
        self.generation_tokens.inc(n)

    def finished(self, stream, reason: str) -> None:
        self.e2e.observe(time.perf_counter() - stream.arrival)
        self.prompt_tokens.inc(stream.prompt_tokens)
        self.requests.labels(finish_reason=reason).inc()


class _EngineCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        engine = self.state.engine
        if engine is None:
            return
        sched, alloc, runner = engine.scheduler, engine.allocator, engine.runner
        warm = engine.warm_report.graphs if engine.warm_report is not None else 0
        values = [
            ("nanoserve_requests_running", "Requests in the running set.", len(sched.running)),
            ("nanoserve_requests_waiting", "Requests waiting for admission.", len(sched.waiting)),
            ("nanoserve_kv_blocks_used", "KV blocks held by requests.", alloc.num_used),
            ("nanoserve_kv_blocks_total", "KV blocks in the pool.", alloc.num_blocks),
            ("nanoserve_warm_graphs", "Graphs recorded by the warm-up.", warm),
            ("nanoserve_graphs", "Decode graphs recorded in all.", len(runner.graphs)),
            ("nanoserve_graph_bytes", "Bytes the recorded decode graphs hold.", runner.graph_bytes),
            ("nanoserve_graph_budget_bytes", "Bytes lazy recording may hold.", runner.graph_budget),
        ]
        for name, doc, value in values:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("nanoserve_preemptions", "Requests preempted.", value=sched.num_preemptions)
        if engine.proposer is not None:  # speculative decoding (speculative.py)
            spec = engine.spec_stats
            for name, doc, value in [
                ("nanoserve_spec_verifications", "Rows that ran with a draft.", spec.verifications),
                ("nanoserve_spec_draft_tokens", "Draft tokens proposed and verified.", spec.draft_tokens),
                ("nanoserve_spec_accepted_tokens", "Draft tokens kept.", spec.accepted_tokens),
                ("nanoserve_spec_emitted_tokens", "Tokens the verifying rows produced.", spec.emitted_tokens),
            ]:
                yield CounterMetricFamily(name, doc, value=value)
            yield GaugeMetricFamily(
                "nanoserve_spec_mean_accepted_length",
                "Tokens a verifying row produced on average (kept drafts and one more).",
                value=spec.mean_accepted_length,
            )
        yield CounterMetricFamily(
            "nanoserve_cold_captures", "Graphs recorded mid-run.", value=runner.cold_captures
        )
        yield CounterMetricFamily(
            "nanoserve_eager_decode_steps",
            "Decode steps of a shape with no graph (past the warm list or the graph budget).",
            value=runner.eager_steps,
        )
