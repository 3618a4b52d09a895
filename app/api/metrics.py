"""/metrics in the Prometheus text format: raw counters and gauges only (rates are derived by
whoever queries them, with the formulas of adaflash/metrics.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from app.service import Service


class EngineCollector:
    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        s = self.service
        b = s.backend
        c, st = b.counters, b.stats

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"adaflash_{name}", doc, value=value)

        yield counter("rounds", "speculative rounds (one per request per step)", c.rounds)
        yield counter("draft_tokens", "draft tokens proposed by the drafter", c.drafted)
        yield counter("verified_draft_tokens", "draft tokens sent to the target", c.verified)
        yield counter("accepted_draft_tokens", "draft tokens accepted", c.accepted)
        for name, values, doc in (
            ("slot_verified", c.slot_verified, "verifications per slot"),
            ("slot_accepted", c.slot_accepted, "acceptances per slot"),
        ):
            fam = CounterMetricFamily(f"adaflash_{name}", doc, labels=["slot"])
            for i, v in enumerate(values, start=1):
                fam.add_metric([str(i)], v)
            yield fam
        for name, doc, field in (
            ("source_rounds", "rounds that verified drafts, by their source", "rounds"),
            ("source_verified_draft_tokens", "draft tokens verified, by source", "verified"),
            ("source_accepted_draft_tokens", "draft tokens accepted, by source", "accepted"),
        ):
            fam = CounterMetricFamily(f"adaflash_{name}", doc, labels=["source"])
            for source, sc in b.source_counters.items():
                fam.add_metric([source], getattr(sc, field))
            yield fam
        yield counter("output_tokens", "tokens streamed to clients", st.output_tokens)
        yield counter("prompt_tokens", "prompt tokens prefilled", st.prompt_tokens)
        yield counter("requests", "requests finished (any reason)", st.requests_finished)
        yield counter("steps", "engine steps", st.steps)
        yield counter("draft_seconds", "time spent drafting", st.draft_s)
        yield counter("verify_seconds", "time spent in target passes", st.verify_s)
        yield counter("swaps", "drafter hot swaps", st.swaps)
        yield counter("records_offered", "records offered to the buffer queue", s.sink.offered)
        yield counter(
            "records_dropped", "records dropped because the queue was full", s.sink.dropped
        )
        yield counter(
            "buffer_write_errors", "failed database writes (retried)", s.writer.stats.write_errors
        )
        yield counter("engine_step_errors", "engine steps that raised", b.step_errors)
        yield GaugeMetricFamily(
            "adaflash_queue_depth",
            "records waiting for the writer",
            value=s.sink.queue.qsize() + s.writer.stats.pending,
        )
        yield GaugeMetricFamily(
            "adaflash_running_requests", "requests holding a slot", value=b.running_count
        )
        yield GaugeMetricFamily(
            "adaflash_waiting_requests", "requests waiting for a slot", value=b.waiting_count
        )
        yield GaugeMetricFamily(
            "adaflash_trainer_up",
            "1 when the trainer process runs",
            value=1.0 if s.trainer_alive() else 0.0,
        )
        info = GaugeMetricFamily(
            "adaflash_active_version",
            "the drafter version being served",
            labels=["version", "policy"],
        )
        info.add_metric([b.version, b.policy], 1.0)
        yield info
        yield GaugeMetricFamily(
            "adaflash_gamma", "load-scaling factor γ of the length head", value=b.gamma
        )
        status, steps = b.compiled_decode()
        compiled = GaugeMetricFamily(
            "adaflash_compiled_decode",
            "the compiled batch-1 decode step (1 on the current status) and steps it ran",
            labels=["status"],
        )
        compiled.add_metric([status], 1.0)
        yield compiled
        yield CounterMetricFamily(
            "adaflash_compiled_decode_steps", "decode steps run by the compiled graph", value=steps
        )
        cost = b.cost_snapshot()
        if cost is not None:
            yield by_term(
                GaugeMetricFamily(
                    "adaflash_cost_estimate",
                    "online cost model: target pass = base + per_token·tokens + per_request·"
                    "requests, drafter pass = base + per_request·requests (milliseconds)",
                    labels=["term"],
                ),
                cost,
            )
        check = b.policy_check()
        if check is not None:
            yield by_term(
                CounterMetricFamily(
                    "adaflash_policy_check",
                    "the cost policy's plans against what happened, summed over steps: "
                    "predicted and measured seconds of drafting and plain steps, expected and "
                    "realised tokens of drafting steps, its probes (shadow drafts) and the draft "
                    "slots they compared and found accepted",
                    labels=["term"],
                ),
                check,
            )


def by_term(
    family: GaugeMetricFamily | CounterMetricFamily, values: dict[str, float]
) -> GaugeMetricFamily | CounterMetricFamily:
    """``family`` (labelled by ``term``) with one sample per entry of ``values``."""
    for term, value in values.items():
        family.add_metric([term], value)
    return family


def render(service: Service) -> bytes:
    registry = CollectorRegistry()
    registry.register(EngineCollector(service))
    return generate_latest(registry)
