"""One client Generate is one trace across the coordinator, both executors and the kvstore: the services
export OTLP (configured only by OTEL_* variables) to a TraceService receiver inside this test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from tests.model_fixtures import make_tiny_llama

PROMPT = list(range(300, 340))  # longer than a KV block: the coordinator asks the kvstore for a stored prefix
GENERATE = "/graphmesh.v1.CoordinatorService/Generate"


@dataclass(frozen=True)
class Exported:
    service: str  # service.name
    instance: str  # service.instance.id (one per process)
    span: trace_pb2.Span


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Exported] = []
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [Exported(attrs.get("service.name", ""), attrs.get("service.instance.id", ""), s)
                                   for s in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> list[Exported]:
        with self.lock:
            return [e for e in self.spans if e.span.trace_id == trace_id]

    def roots(self, name: str) -> list[trace_pb2.Span]:
        with self.lock:
            return [e.span for e in self.spans if e.span.name == name and not e.span.parent_span_id]


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(grace=None)


@pytest.fixture(scope="module")
def mesh(receiver: tuple[Receiver, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    path = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver[1]}",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": "", "OTEL_TRACES_SAMPLER": "always_on"}
    with LocalMesh(2, "numpy", str(path), env=env) as m:
        yield m


def _complete(spans: list[Exported]) -> str:
    """Why the trace is not yet what one Generate must give ('' when it is)."""
    processes = {(e.service, e.instance) for e in spans}
    services = {e.service for e in spans}
    if services != {"graphmesh-coordinator", "graphmesh-executor", "graphmesh-kvstore"}:
        return f"services {sorted(services)}"
    if len(processes) != 4:
        return f"processes {sorted(processes)}"
    ids = {e.span.span_id for e in spans}
    roots = [e.span.name for e in spans if not e.span.parent_span_id]
    orphans = [(e.service, e.span.name) for e in spans if e.span.parent_span_id and e.span.parent_span_id not in ids]
    if roots != [GENERATE] or orphans:
        return f"roots {roots}, spans whose parent is missing {orphans}"
    return ""


def test_one_generate_is_one_trace_across_every_service(mesh: LocalMesh, receiver: tuple[Receiver, int]) -> None:
    spans = receiver[0]
    with CoordinatorClient(mesh.coordinator_address) as client:
        chunks = list(client.generate(prompt_token_ids=PROMPT, max_tokens=3, ignore_eos=True))
    assert sum(len(c.token_ids) for c in chunks) == 3
    deadline = time.monotonic() + 30
    while True:
        roots = spans.roots(GENERATE)
        trace = spans.trace(roots[0].trace_id) if len(roots) == 1 else []
        why = _complete(trace) if trace else f"{len(roots)} Generate root spans"
        if not why:
            break
        assert time.monotonic() < deadline, why
        time.sleep(0.2)
    names = {(e.service, e.span.name) for e in trace}
    # the phases, each under the request's trace
    for service, name in [("graphmesh-coordinator", "generate"), ("graphmesh-coordinator", "mesh.invoke"),
                          ("graphmesh-coordinator", "mesh.execute_group"),
                          ("graphmesh-executor", "/graphmesh.v1.StageService/ExecuteGroup"),
                          ("graphmesh-executor", "stage.execute"), ("graphmesh-executor", "stage.compute"),
                          ("graphmesh-executor", "stage.push_boundary"), ("graphmesh-executor", "stage.finish"),
                          ("graphmesh-executor", "/graphmesh.v1.StageService/PushBoundary"),
                          ("graphmesh-executor", "stage.commit"),
                          ("graphmesh-kvstore", "/graphmesh.v1.KvStoreService/Lookup")]:
        assert (service, name) in names, (service, name)
    invokes = [e.span for e in trace if e.span.name == "mesh.invoke"]
    assert len(invokes) == 3  # the prefill and two decode steps
    attrs = {a.key: a.value for a in invokes[0].attributes}
    assert {"session", "epoch", "incarnation", "tokens"} <= attrs.keys()
    ranks = {a.value.int_value for e in trace if e.span.name == "stage.execute" for a in e.span.attributes
             if a.key == "rank"}
    assert ranks == {0, 1}


def test_write_behind_joins_the_trace_of_the_commit(mesh: LocalMesh, receiver: tuple[Receiver, int]) -> None:
    """The blocks committed during a Generate are written behind on another thread; the put, and the
    kvstore's PutBlocks, still belong to that Generate's trace."""
    spans = receiver[0]
    earlier = {r.trace_id for r in spans.roots(GENERATE)}
    with CoordinatorClient(mesh.coordinator_address) as client:
        list(client.generate(prompt_token_ids=[7, *PROMPT], max_tokens=2, ignore_eos=True))
    deadline = time.monotonic() + 30
    while True:
        roots = [r for r in spans.roots(GENERATE) if r.trace_id not in earlier]
        trace = spans.trace(roots[0].trace_id) if roots else []
        puts = [e for e in trace if e.service == "graphmesh-kvstore" and
                e.span.name == "/graphmesh.v1.KvStoreService/PutBlocks"]
        if len(puts) == 2 and not _complete(trace):  # one put per stage
            break
        assert time.monotonic() < deadline, f"{len(puts)} PutBlocks spans in the trace; {_complete(trace)}"
        time.sleep(0.2)
    writes = [e.span for e in trace if e.span.name == "stage.kv_write_behind"]
    commits = {e.span.span_id for e in trace if e.span.name == "stage.commit"}
    assert len(writes) == 2 and all(w.parent_span_id in commits for w in writes)
