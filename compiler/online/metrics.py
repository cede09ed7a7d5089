"""``GET /metrics``: the server's Prometheus metrics (prometheus_client, a registry per server).

Counters and histograms are fed by the HTTP process as requests come and go
(``compiler.online.engine_client``); the engine's gauges (running and waiting requests, slots, KV,
the prefix cache, the ledger's outstanding tickets, speculative acceptance) are the last ``Stats``
the engine process sent, at most one engine step or idle tick old. With several engine processes
(``batchc serve --dp``) they are the sums over the replicas, and the ``batchc_replica_*`` gauges,
labelled ``replica``, give each replica's own.

A request of ``n`` completions is one request (its outcome, latencies and time to first token: its
first token of any completion; an inter-token latency per delivery of its tokens, whichever
completions they are of) and its generated tokens are those of all its completions.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from compiler.online.messages import Stats

__all__ = ["OUTCOMES", "Metrics"]

OUTCOMES: Final = ("finished", "cancelled", "timeout", "aborted", "refused", "error")
"""``batchc_requests_total``'s ``outcome`` label: finished (a stop or the length), cancelled (the
client went away), timeout (the request's deadline), aborted (the server's drain), refused (the
engine refused it), error (a failed forward, non-finite logits, or the engine process gone)."""

_LATENCY: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """One server's Prometheus metrics, in a registry of their own (see the module): the request
    counters and latency histograms the HTTP side feeds, and the engine's gauges, set from its
    ``Stats`` by ``engine``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("batchc_requests", "Requests ended, by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.rejected = Counter("batchc_rejected_requests", "Requests answered with an error before the engine, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("batchc_prompt_tokens", "Prompt tokens of the requests submitted", registry=r)
        self.generation_tokens = Counter("batchc_generation_tokens", "Tokens generated (of every completion)", registry=r)
        self.ttft = Histogram("batchc_time_to_first_token_seconds", "From the request's arrival to its first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("batchc_inter_token_latency_seconds", "Between two deliveries of a request's tokens", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("batchc_e2e_request_latency_seconds", "From the request's arrival to its end", buckets=_LATENCY, registry=r)
        self.in_flight = Gauge("batchc_requests_in_flight", "Requests submitted to the engine and not ended", registry=r)
        self.running = Gauge("batchc_requests_running", "Requests decoding in the engine", registry=r)
        self.waiting = Gauge("batchc_requests_waiting", "Requests waiting for a place or their prefill", registry=r)
        self.slots_live = Gauge("batchc_state_slots_live", "State-pool slots in use (requests and prefix cache)", registry=r)
        self.slots_capacity = Gauge("batchc_state_slots_capacity", "State-pool slots", registry=r)
        self.request_slots = Gauge("batchc_request_slots_live", "State-pool slots held by live requests", registry=r)
        self.slot_occupancy = Gauge("batchc_state_pool_occupancy", "Fraction of the state-pool slots in use", registry=r)
        self.kv_live = Gauge("batchc_kv_locations_live", "KV cache locations in use", registry=r)
        self.kv_occupancy = Gauge("batchc_kv_cache_occupancy", "Fraction of the KV cache locations in use", registry=r)
        self.cache_entries = Gauge("batchc_prefix_cache_entries", "Prefix-cache entries", registry=r)
        self.outstanding = Gauge("batchc_ledger_outstanding_tickets", "One-shot tickets registered and not yet consumed", registry=r)
        self.proposed = Gauge("batchc_spec_proposed_tokens", "Draft tokens proposed since the start", registry=r)
        self.accepted = Gauge("batchc_spec_accepted_tokens", "Draft tokens accepted since the start", registry=r)
        self.acceptance = Gauge("batchc_spec_acceptance_rate", "Accepted over proposed draft tokens since the start", registry=r)
        self.steps = Gauge("batchc_engine_steps", "Engine steps since the start", registry=r)
        self.engine_up = Gauge("batchc_engine_up", "1 while the engine process can take work", registry=r)
        # each replica's own (batchc serve --dp: the gauges above are their sums)
        self.replica_up = Gauge("batchc_replica_up", "1 while the replica's engine process can take work", ["replica"], registry=r)
        self.replica_requests = Counter("batchc_replica_requests", "Requests submitted to the replica", ["replica"], registry=r)
        self.replica_in_flight = Gauge("batchc_replica_requests_in_flight", "Requests submitted to the replica and not ended", ["replica"],
                                       registry=r)
        self.replica_running = Gauge("batchc_replica_requests_running", "Requests decoding in the replica", ["replica"], registry=r)
        self.replica_outstanding = Gauge("batchc_replica_ledger_outstanding_tickets", "The replica's one-shot tickets not yet consumed",
                                         ["replica"], registry=r)

    def engine(self, s: Stats) -> None:
        """Set the engine's gauges from ``s`` (occupancies and acceptance rate derived, 0.0 when their
        denominator is 0)."""
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.slots_live.set(s.slots_live)
        self.slots_capacity.set(s.slots_capacity)
        self.request_slots.set(s.request_slots)
        self.slot_occupancy.set(s.slots_live / s.slots_capacity if s.slots_capacity else 0.0)
        self.kv_live.set(s.kv_live)
        self.kv_occupancy.set(s.kv_live / s.kv_capacity if s.kv_capacity else 0.0)
        self.cache_entries.set(s.cache_entries)
        self.outstanding.set(s.outstanding_tickets)
        self.proposed.set(s.proposed)
        self.accepted.set(s.accepted)
        self.acceptance.set(s.accepted / s.proposed if s.proposed else 0.0)
        self.steps.set(s.steps)

    def render(self) -> bytes:
        """Every metric in the Prometheus text format, as ``GET /metrics`` answers."""
        return generate_latest(self.registry)
