"""OpenTelemetry traces and Prometheus metrics for the services.

Traces are configured only by the standard OTEL_* variables: OTEL_TRACES_EXPORTER (otlp, console, none;
default none), OTEL_EXPORTER_OTLP_ENDPOINT / _PROTOCOL / _HEADERS, OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER, OTEL_BSP_*. With no exporter nothing is installed: spans
are the API's no-op spans and channels and servers get no tracing interceptors. With one, every server
gets the opentelemetry-instrumentation-grpc server interceptor and every channel one service opens to
another gets a client interceptor that injects the W3C traceparent, so one client request is one trace
across the coordinator, the executors and the kvstore.

Metrics: serve_metrics(port) starts prometheus_client's HTTP endpoint; server_interceptors(metrics=True)
times every RPC into graphmesh_rpc_server_seconds{method, code}; expose() publishes values read from the
services' plain objects at scrape time, so the hot path does not update them.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context as Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span as Span
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue
from prometheus_client import REGISTRY, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from graphmesh.channels import CallDetails, ForwardingClientInterceptor
from graphmesh_server.interceptors import Behavior, Continuation, Handler, wrap_handler
from graphmesh_server.policy import OPEN_SERVICES

log = logging.getLogger("graphmesh.telemetry")
_tracer = trace.get_tracer("graphmesh")
_provider: TracerProvider | None = None
# With tracing off a span is this shared no-op (the API's own no-op spans cost ~15 us each, per phase per token).
_NO_SPAN: AbstractContextManager[Span] = contextlib.nullcontext(trace.INVALID_SPAN)

RPC_SECONDS = Histogram("graphmesh_rpc_server_seconds", "Server-side gRPC latency, to the last response message",
                        ["method", "code"],
                        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                                 120))


def observe_many(histogram: Histogram, amount: float, count: int) -> None:
    """`count` observations of `amount`, leaving `histogram` as `count` calls of observe(amount) would (one bucket,
    the sum): a decode run's tokens reach a session together, and prometheus_client observes one value a call, each
    taking a lock. tests/test_metrics.py holds the exposition to that of single observations."""
    if count <= 0:
        return
    histogram._sum.inc(amount * count)
    histogram._buckets[bisect.bisect_left(histogram._upper_bounds, amount)].inc(count)


def _exporter(name: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER {name!r} is not supported here; use otlp, console or none")
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, _HEADERS, _INSECURE, ... itself
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found]
            OTLPSpanExporter as HttpExporter,
        )
    except ImportError as e:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol} needs opentelemetry-exporter-otlp-proto-http; "
                         "install it or use grpc") from e
    return HttpExporter()


def setup(service_name: str) -> bool:
    """Installs the SDK tracer provider with the exporters OTEL_TRACES_EXPORTER names; True when tracing is on.
    OTEL_SERVICE_NAME, when set, names the service instead of `service_name`."""
    global _provider
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip() not in ("", "none")]
    if not names or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name}))
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing", extra={"exporters": names, "service_name": provider.resource.attributes.get(SERVICE_NAME)})
    return True


def enabled() -> bool:
    return _provider is not None


def shutdown() -> None:
    """Exports the spans still buffered."""
    if _provider is not None:
        _provider.shutdown()


def span(name: str, parent: Context | None = None, **attributes: AttributeValue) -> AbstractContextManager[Span]:
    """A span around a phase, current inside the block (gRPC calls made there are its children); a child
    of `parent` (a context captured with current_context() on another thread) or of the current span."""
    if _provider is None:
        return _NO_SPAN
    return _tracer.start_as_current_span(name, context=parent, attributes=attributes)


def current_context() -> Context:
    """The trace context here, for work handed to another thread."""
    return otel_context.get_current()


def carrier(context: Context) -> dict[str, str]:
    """`context` as W3C trace headers (traceparent, tracestate), for a hop that is not a gRPC call; {} when
    tracing is off."""
    headers: dict[str, str] = {}
    if _provider is not None:
        propagate.inject(headers, context=context)
    return headers


def context_of(headers: dict[str, str]) -> Context | None:
    """The trace context `carrier` wrote into `headers`; None (the current one) when there is none."""
    return propagate.extract(headers) if _provider is not None and headers else None


def start_span(name: str, **attributes: AttributeValue) -> Span:
    """A child of the current span that the caller ends, for work that finishes in a callback."""
    if _provider is None:
        return trace.INVALID_SPAN
    return _tracer.start_span(name, attributes=attributes)


def start_request_span(name: str, headers: dict[str, str], attributes: dict[str, AttributeValue]) -> Span:
    """A span that the caller ends, around a request that did not come through gRPC (the HTTP API): a child of
    the current span where the web framework traces requests itself (FastAPI's HTTP server span, which took the
    caller's W3C traceparent), else a SERVER span under the traceparent in `headers`; either way it joins the
    caller's trace."""
    if _provider is None:
        return trace.INVALID_SPAN
    if trace.get_current_span().get_span_context().is_valid:
        return _tracer.start_span(name, attributes=attributes)
    return _tracer.start_span(name, context=propagate.extract(headers), kind=SpanKind.SERVER, attributes=attributes)


def start_rpc_span(method: str, headers: Mapping[str, str]) -> Span:
    """A SERVER span that the caller ends (finish_rpc_span), for a call that reached this process inside another
    (GenerateStreams' calls): named and described as the gRPC instrumentation names a call, under the W3C trace
    context in `headers`."""
    service, _, name = method.lstrip("/").partition("/")
    return start_request_span(method, dict(headers), {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})


def finish_rpc_span(span_: Span, code: grpc.StatusCode, details: str = "") -> None:
    """Ends a call's span with its status (marked failed unless OK)."""
    span_.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span_.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))
    span_.end()


def span_carrier(span_: Span) -> dict[str, str]:
    """carrier() of the context in which `span_` is current: what a hop that is not a gRPC call sends on."""
    return carrier(trace.set_span_in_context(span_))


def use(span_: Span) -> AbstractContextManager[Span]:
    """Makes `span_` current inside the block without ending it there."""
    if _provider is None:
        return _NO_SPAN
    return trace.use_span(span_, end_on_exit=False)


def end_when_done(span_: Span, future: grpc.Future[Any]) -> None:
    if _provider is not None:
        future.add_done_callback(lambda _: span_.end())


# -- client side -----------------------------------------------------------------------------------------
def _end_client_span(span_: Span, call: Any) -> None:
    code = call.code()
    if code is None:
        span_.end()
    else:
        finish_rpc_span(span_, code, call.details())


class _ClientTracing(ForwardingClientInterceptor):
    """A CLIENT span per call, its context injected into the metadata (W3C traceparent). Unlike the
    instrumentation package's client interceptor, this returns grpc's own call objects, so futures,
    cancel() (the coordinator's health watch, the kvstore's row copies) and streams behave as without it."""

    def intercept(self, continuation: Callable[[Any, Any], Any], details: grpc.ClientCallDetails, request: Any) -> Any:
        if details.method.startswith(OPEN_SERVICES):  # the health watch polls 4x a second: not worth a trace each
            return continuation(details, request)
        service, _, method = details.method.lstrip("/").partition("/")
        span_ = _tracer.start_span(details.method, kind=SpanKind.CLIENT,
                                   attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method})
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span_))
        metadata = [*(details.metadata or ()), *carrier.items()]
        call = continuation(CallDetails(details.method, details.timeout, metadata, details.credentials,
                                     details.wait_for_ready, details.compression), request)
        call.add_done_callback(lambda done: _end_client_span(span_, done))
        return call


def client_interceptors() -> list[ForwardingClientInterceptor]:
    """Trace propagation for a channel to another service: none when tracing is off."""
    return [_ClientTracing()] if enabled() else []


def traced(channel: grpc.Channel) -> grpc.Channel:
    """The channel with trace context propagation when tracing is on; the channel itself otherwise."""
    return grpc.intercept_channel(channel, *client_interceptors())


# -- server side -----------------------------------------------------------------------------------------
class _Observe(grpc.ServerInterceptor):
    """Times every RPC into RPC_SECONDS and marks the current span failed on a non-OK status (the
    instrumentation's server interceptor misses abort_with_status, which every servicer here uses)."""

    def __init__(self, metrics: bool) -> None:
        self.metrics = metrics

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        method = details.method

        def done(context: grpc.ServicerContext, ok: bool, started: float) -> None:
            code = context.code()  # type: ignore[attr-defined]  # grpcio has code() and details(); the stubs lack them
            if not isinstance(code, grpc.StatusCode):  # no status set: returned, raised, or the client went away
                code = grpc.StatusCode.OK if ok else grpc.StatusCode.UNKNOWN if context.is_active() \
                    else grpc.StatusCode.CANCELLED
            if self.metrics:
                RPC_SECONDS.labels(method, code.name).observe(time.perf_counter() - started)
            if code is not grpc.StatusCode.OK:
                details = context.details() or b""  # type: ignore[attr-defined]
                text = details.decode(errors="replace") if isinstance(details, bytes) else str(details)
                current = trace.get_current_span()
                current.set_attribute("rpc.grpc.status_code", code.value[0])
                current.set_status(Status(StatusCode.ERROR, f"{code.name}: {text}"))

        def around(behavior: Behavior, streaming: bool) -> Behavior:
            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                started, ok = time.perf_counter(), False
                try:
                    result = behavior(request, context)
                    ok = True
                    return result
                finally:
                    done(context, ok, started)

            def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                started, ok = time.perf_counter(), False
                try:
                    yield from behavior(request, context)
                    ok = True
                finally:
                    done(context, ok, started)

            return stream if streaming else unary

        return wrap_handler(continuation(details), around)


def server_interceptors(metrics: bool) -> list[grpc.ServerInterceptor]:
    """Tracing (when on) and RPC timing (when `metrics`), to go before the security interceptors so that
    refused calls are traced and counted too."""
    out: list[grpc.ServerInterceptor] = []
    if enabled():
        from opentelemetry.instrumentation.grpc import server_interceptor
        from opentelemetry.instrumentation.grpc.filters import negate, service_prefix

        # not health, not reflection
        out.append(server_interceptor(filter_=negate(service_prefix("grpc."))))  # type: ignore[no-untyped-call]
    if metrics or enabled():
        out.append(_Observe(metrics))
    return out


# -- metrics endpoint ------------------------------------------------------------------------------------
def serve_metrics(port: int, addr: str = "0.0.0.0") -> None:
    """Serves /metrics on `port` (0: off)."""
    if port:
        try:
            start_http_server(port, addr=addr)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {addr}:{port}: {e.strerror or e}; pass another --metrics-port, "
                          "or 0 for none") from e
        log.info("metrics", extra={"port": port})


# (name, "gauge" | "counter", help, read): read gives one value, or one per value of the label `kind`
StateMetric = tuple[str, str, str, Callable[[], float | Mapping[str, float]]]


class _StateCollector(Collector):
    def __init__(self, metrics: Sequence[StateMetric]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterator[Metric]:
        for name, kind, doc, read in self.metrics:
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            value = read()
            if isinstance(value, Mapping):
                labelled = family(name, doc, labels=["kind"])
                for label, v in value.items():
                    labelled.add_metric([label], float(v))
                yield labelled
            else:
                yield family(name, doc, value=float(value))


def expose(*metrics: StateMetric) -> None:
    """Publishes values read at scrape time from the services' own state (counts they keep anyway)."""
    REGISTRY.register(_StateCollector(metrics))
