"""Telemetry in the OpenTelemetry GenAI semantic conventions' vocabulary, so dashboards and tracing backends made
for any LLM server read graphmesh's too.

Spans: `{gen_ai.operation.name} {gen_ai.request.model}` ("chat smollm2-135m") with the gen_ai.request.*,
gen_ai.response.* and gen_ai.usage.* attributes. Metrics: the conventions' histograms under the names the
OpenTelemetry-to-Prometheus mapping gives them (dots become underscores, the unit "s" becomes _seconds, "{token}"
adds nothing): gen_ai_server_time_to_first_token_seconds, gen_ai_server_time_per_output_token_seconds,
gen_ai_server_request_duration_seconds and gen_ai_client_token_usage, labelled by gen_ai_operation_name and
gen_ai_request_model (and gen_ai_token_type, error_type). Buckets are the conventions' advice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.util.types import AttributeValue
from prometheus_client import Histogram

PROVIDER = "graphmesh"
_LABELS = ("gen_ai_operation_name", "gen_ai_request_model")

TIME_TO_FIRST_TOKEN = Histogram(
    "gen_ai_server_time_to_first_token_seconds", "Time from a request's arrival to its first output token",
    _LABELS, buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0))
TIME_PER_OUTPUT_TOKEN = Histogram(
    "gen_ai_server_time_per_output_token_seconds", "Mean time per output token after the first, per choice",
    _LABELS, buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5))
REQUEST_DURATION = Histogram(
    "gen_ai_server_request_duration_seconds", "Time from a request's arrival to its last output (or its error)",
    (*_LABELS, "error_type"),
    buckets=(0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92))
TOKEN_USAGE = Histogram(
    "gen_ai_client_token_usage", "Tokens per request: the prompt's (input) and the generated ones (output)",
    (*_LABELS, "gen_ai_token_type"),
    buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864))


@dataclass
class Usage:
    """What one request used, filled in as its choices finish."""

    input_tokens: int = 0
    output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)  # per choice, in index order once all have finished


def request_attributes(operation: str, model: str, *, max_tokens: int | None, temperature: float, top_p: float,
                       top_k: int, seed: int | None, stop: Sequence[str], choices: int,
                       server_address: str, server_port: int) -> dict[str, AttributeValue]:
    """The gen_ai.request.* attributes of a span (the ones a request set; unset ones are left out)."""
    out: dict[str, AttributeValue] = {
        "gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER, "gen_ai.request.model": model,
        "gen_ai.request.temperature": temperature, "gen_ai.request.top_p": top_p,
        "server.address": server_address, "server.port": server_port}
    if max_tokens is not None:
        out["gen_ai.request.max_tokens"] = max_tokens
    if top_k:
        out["gen_ai.request.top_k"] = float(top_k)  # the conventions type it as a double
    if seed is not None:
        out["gen_ai.request.seed"] = seed
    if stop:
        out["gen_ai.request.stop_sequences"] = list(stop)
    if choices != 1:
        out["gen_ai.request.choice.count"] = choices
    return out


def span_name(operation: str, model: str) -> str:
    return f"{operation} {model}"


def record(operation: str, model: str, usage: Usage, duration_s: float, error_type: str = "") -> None:
    """The per-request metrics (time to first token and per output token are recorded as they happen)."""
    REQUEST_DURATION.labels(operation, model, error_type).observe(duration_s)
    if not error_type:
        TOKEN_USAGE.labels(operation, model, "input").observe(usage.input_tokens)
        TOKEN_USAGE.labels(operation, model, "output").observe(usage.output_tokens)


def finish_span(span: Span, response_id: str, model: str, usage: Usage, error_type: str = "") -> None:
    span.set_attribute("gen_ai.response.id", response_id)
    span.set_attribute("gen_ai.response.model", model)
    span.set_attribute("gen_ai.usage.input_tokens", usage.input_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
    if usage.finish_reasons:
        span.set_attribute("gen_ai.response.finish_reasons", usage.finish_reasons)
    if error_type:
        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, error_type))
    span.end()
