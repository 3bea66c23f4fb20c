"""Prometheus metrics, one ``CollectorRegistry`` per app, named as vLLM names them under ``specdec:``.

The speculative counters are read from the engine loop's ``snapshot()`` at scrape time (a custom
collector): with the loop in a thread they always equal what ``LLM.get_metrics()`` reports; with it
in a process of its own, they are as of its last round. Counters are exposed with the ``_total``
suffix, as prometheus-client and vLLM write them: ``specdec:spec_decode_num_drafts_total``.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specdec.server.async_engine import Finished

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0)


prometheus_client.disable_created_metrics()  # no *_created series (vLLM does the same)


class _EngineCollector:
    """Speculative-decoding counters, queue and KV-budget gauges, and whether the engine is up, read
    from the engine loop when scraped."""

    def __init__(self, loop):
        self.loop = loop  # AsyncEngine or EngineProcess: anything with snapshot()

    def collect(self):
        s = self.loop.snapshot()
        for name, value, doc in (
            ("spec_decode_num_drafts", s.num_drafts, "(sequence, round) pairs that proposed at least one token."),
            ("spec_decode_num_draft_tokens", s.num_draft_tokens, "Draft tokens proposed."),
            ("spec_decode_num_accepted_tokens", s.num_accepted_tokens, "Draft tokens accepted."),
            ("spec_decode_num_emitted_tokens", s.num_emitted_tokens,
             "Tokens emitted by verification, before stop conditions: accepted + recovered + bonus."),
        ):
            yield CounterMetricFamily(f"specdec:{name}", doc, value=value)
        per_pos = CounterMetricFamily("specdec:spec_decode_num_accepted_tokens_per_pos",
                                      "Rounds whose draft position i was accepted.", labels=["position"])
        for i, v in enumerate(list(s.num_accepted_tokens_per_pos)):
            per_pos.add_metric([str(i)], v)
        yield per_pos
        # vLLM has no per-method counters: these carry the method as a label ("none": rows without drafts)
        for name, values, doc in (
            ("spec_decode_num_rounds_per_method", s.num_rounds_per_method,
             "(sequence, round) pairs by the method that drafted them; none: verified without drafts."),
            ("spec_decode_num_draft_tokens_per_method", s.num_draft_tokens_per_method,
             "Draft tokens proposed, by method."),
            ("spec_decode_num_accepted_tokens_per_method", s.num_accepted_tokens_per_method,
             "Draft tokens accepted, by method."),
        ):
            family = CounterMetricFamily(f"specdec:{name}", doc, labels=["method"])
            for method, v in sorted(values.items()):
                family.add_metric([method], v)
            yield family
        yield GaugeMetricFamily("specdec:num_requests_running", "Sequences in the running batch.",
                                value=s.running)
        yield GaugeMetricFamily("specdec:num_requests_waiting", "Requests waiting for a batch slot or KV memory.",
                                value=s.waiting)
        yield GaugeMetricFamily("specdec:kv_cache_budget_bytes", "KV cache memory the server may use.",
                                value=s.kv_budget_bytes)
        yield GaugeMetricFamily("specdec:kv_cache_reserved_bytes",
                                "KV cache memory the admitted requests may hold (the caches' peak shape).",
                                value=s.kv_reserved_bytes)
        yield GaugeMetricFamily("specdec:engine_up", "1 while the engine serves requests; 0 while its process "
                                "restarts, after restarts failed, or once stopped.", value=int(self.loop.alive))
        yield CounterMetricFamily("specdec:engine_restarts", "Engine processes started again after one died "
                                  "(killed, out of memory); the counters above carry over.",
                                  value=getattr(self.loop, "restarts", 0))


class ServerMetrics:
    def __init__(self, loop):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(loop))
        r = self.registry
        self.ttft = Histogram("specdec:time_to_first_token_seconds",
                              "Arrival of the request to its first generated token.", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("specdec:time_per_output_token_seconds",
                              "Per request: (last token - first token) / (output tokens - 1).",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("specdec:e2e_request_latency_seconds", "Arrival of the request to its last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter("specdec:request_success", "Requests finished, by finish reason "
                                "(stop, length, abort = the client went away).", ["finished_reason"], registry=r)
        self.errors = Counter("specdec:request_errors", "Requests answered with an error, by HTTP status.",
                              ["status"], registry=r)
        self.prompt_tokens = Counter("specdec:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("specdec:generation_tokens", "Generated tokens.", registry=r)
        self.engine_failures = Counter("specdec:engine_step_failures", "Engine rounds that raised (the request "
                                       "that made one fail is found and failed alone).", registry=r)
        self.loop_failures = Counter("specdec:engine_loop_failures", "Errors in the engine thread outside a "
                                     "round (admission, detokenizing); the loop carries on.", registry=r)

    # hooks called on the engine thread (or the thread reading the engine process's pipe)
    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_finish(self, f: Finished) -> None:
        self.requests.labels(f.finish_reason).inc()
        self.prompt_tokens.inc(f.prompt_tokens)
        self.generation_tokens.inc(f.output_tokens)
        if f.finish_reason == "abort":
            return
        self.e2e.observe(f.end - f.arrival)
        if f.first_token is not None and f.output_tokens > 1:
            self.tpot.observe((f.end - f.first_token) / (f.output_tokens - 1))

    def on_error(self, error: BaseException) -> None:
        self.engine_failures.inc()

    def on_loop_error(self, error: BaseException) -> None:
        self.loop_failures.inc()
