"""ServerMetrics: the Prometheus series /metrics exposes (one registry per app).

With several API processes (`--api-server-count N`) the launcher sets PROMETHEUS_MULTIPROC_DIR before it
starts them; every process then writes its series to files there and /metrics, whichever process
answers, sums the counters and histograms of all of them (prometheus_client's multiprocess mode).
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS_S = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                  0.1, 0.2, 0.4, 0.8, 1.6)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# EngineStats attribute -> gauge name and help; attributes a given EngineStats lacks stay at 0.
STATS_GAUGES = {
    "num_running": ("tandem_num_requests_running", "Requests the scheduler is running."),
    "num_waiting": ("tandem_num_requests_waiting", "Requests waiting for admission."),
    "kv_cache_usage": ("tandem_kv_cache_usage_ratio", "Fraction of KV-cache blocks held by requests."),
    "prefix_cache_hit_rate": ("tandem_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up."),
    "spec_draft_tokens": ("tandem_spec_decode_num_draft_tokens",
                          "Speculative decoding: draft tokens proposed and verified since the engine started."),
    "spec_accepted_tokens": ("tandem_spec_decode_num_accepted_tokens",
                             "Speculative decoding: draft tokens accepted since the engine started."),
    "spec_verified_rows": ("tandem_spec_decode_num_drafts",
                           "Speculative decoding: runs of drafts verified (one per request per verify step)."),
    "lora_page_ins": ("tandem_lora_page_ins", "LoRA: adapters copied into a device slot since the engine started."),
    "lora_host_copies": ("tandem_lora_host_copies",
                         "LoRA: adapters read from their folder into host memory since the engine started."),
}


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Every API process holds the same engine stats: report the freshest, not their sum.
        self.stats_gauges = {attr: Gauge(name, doc, registry=r, multiprocess_mode="mostrecent")
                             for attr, (name, doc) in STATS_GAUGES.items()}
        self.requests_in_server = Gauge(
            "tandem_num_requests_in_server", "Engine requests accepted by the server and not finished.", registry=r,
            multiprocess_mode="livesum")
        self.spec_accepted_per_position = Gauge(
            "tandem_spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: verified runs whose draft at "
            "this position (0 = first) was accepted.", ["position"], registry=r, multiprocess_mode="mostrecent")
        self.lora_requests = {
            state: Gauge(f"tandem_lora_requests_{state}", f"LoRA: requests {state} per adapter (0 once it has none).",
                         ["adapter"], registry=r, multiprocess_mode="mostrecent") for state in ("running", "waiting")}
        self._adapters_seen: set[str] = set()
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "Output tokens streamed to clients.", registry=r)
        self.request_success = Counter(
            "tandem_request_success", "Finished engine requests by finish reason (stop, length, abort).",
            ["finished_reason"], registry=r)
        self.request_failure = Counter(
            "tandem_request_failure", "Engine requests failed by an engine error.", registry=r)
        self.requests_rejected = Counter(
            "tandem_requests_rejected", "HTTP requests answered with an error, by status.", ["status"], registry=r)
        self.kv_blocks_in_use = Gauge("tandem_kv_blocks_in_use", "KV-cache blocks held by requests or "
                                      "being filled (0 when idle; cached prefixes of finished requests are free).",
                                      registry=r, multiprocess_mode="mostrecent")
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Request arrival to first output token.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("tandem_time_per_output_token_seconds", "(latency - TTFT) / (output tokens - 1).",
                              buckets=TPOT_BUCKETS_S, registry=r)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Request arrival to last output token.",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        # Each API process sees every replica itself: across processes, report the answering process's view of
        # the live replicas and the most failures any process saw, not sums. The restart count comes from the
        # launcher at an API process's start.
        self.replicas_live = Gauge(
            "tandem_engine_replicas_live", "Engine replicas taking requests (not dead, not hung).", registry=r,
            multiprocess_mode="livemostrecent")
        self.replica_failures = Gauge(
            "tandem_engine_replica_failures", "Engine replicas taken out so far: deaths and hangs (silent past "
            "--engine-timeout).", registry=r, multiprocess_mode="max")
        self.api_server_restarts = Gauge(
            "tandem_api_server_restarts", "API processes the launcher replaced after they died.", registry=r,
            multiprocess_mode="max")
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(finished_reason=reason)

    def _set_adapter_requests(self, stats: Any) -> None:
        """Running and waiting requests per adapter; an adapter seen before and without requests now reads 0."""
        per_state = {state: getattr(stats, f"lora_{state}", None) or {} for state in self.lora_requests}
        self._adapters_seen.update(*per_state.values())
        for state, gauge in self.lora_requests.items():
            for adapter in self._adapters_seen:
                gauge.labels(adapter=adapter).set(per_state[state].get(adapter, 0))

    def count_rejected(self, status: int) -> None:
        self.requests_rejected.labels(status=str(status)).inc()

    def observe_finished(self, reason: str, arrival: float, first_token: float | None, finish: float,
                         num_output_tokens: int) -> None:
        """One engine request (one choice) finished with the given reason."""
        self.request_success.labels(finished_reason=reason).inc()
        if first_token is None:
            return
        self.ttft.observe(first_token - arrival)
        self.e2e.observe(finish - arrival)
        if num_output_tokens > 1:
            self.tpot.observe((finish - first_token) / (num_output_tokens - 1))

    def render(self, stats: Any, num_requests_in_server: int, replicas_live: int | None = None,
               replica_failures: int | None = None) -> bytes:
        if replicas_live is not None:
            self.replicas_live.set(replicas_live)
        if replica_failures is not None:
            self.replica_failures.set(replica_failures)
        for attr, gauge in self.stats_gauges.items():
            value = getattr(stats, attr, None) if stats is not None else None
            gauge.set(float(value) if value is not None else 0.0)
        for position, count in enumerate(getattr(stats, "spec_accepted_per_position", ()) or ()):
            self.spec_accepted_per_position.labels(position=str(position)).set(count)
        self._set_adapter_requests(stats)
        if stats is not None:  # exact for one replica (block 0 is reserved); within a block per replica over several
            self.kv_blocks_in_use.set(round(stats.kv_cache_usage * max(stats.num_blocks - 1, 0)))
        self.requests_in_server.set(num_requests_in_server)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)
