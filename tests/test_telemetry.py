"""One client Generate is one trace across the coordinator, both executors and the kvstore: the services
export OTLP (configured only by OTEL_* variables) to a TraceService receiver inside this test."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh, free_port
from tests.model_fixtures import make_tiny_llama

PROMPT = list(range(300, 340))  # longer than a KV block: the coordinator asks the kvstore for a stored prefix
# Each test puts its own first token before PROMPT, so no test finds blocks another one wrote behind.
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
    # a pool of a few hundred blocks: the default (up to 512 MiB) costs the numpy backend a copy of it every step
    with LocalMesh(2, "numpy", str(path), env=env, extra_executor_args=("--kv-cache-bytes", "4Mi"),
                   http_listen=f"127.0.0.1:{free_port()}", frontend=True) as m:
        yield m


def _complete(spans: list[Exported], root: str, services: set[str], processes: int) -> str:
    """Why the trace is not yet one rooted at `root` over `services` in `processes` processes ('' when it is)."""
    return _covers(spans, services, processes) or _connected(spans, root)


def _covers(spans: list[Exported], services: set[str], processes: int) -> str:
    found = {e.service for e in spans}
    if found != services:
        return f"services {sorted(found)}"
    if len({(e.service, e.instance) for e in spans}) != processes:
        return f"processes {sorted({(e.service, e.instance) for e in spans})}"
    return ""


def _connected(spans: list[Exported], root: str = "") -> str:
    """Why the spans are not one tree (under a root named `root`, when given)."""
    ids = {e.span.span_id for e in spans}
    roots = [e.span.name for e in spans if not e.span.parent_span_id]
    orphans = [(e.service, e.span.name) for e in spans if e.span.parent_span_id and e.span.parent_span_id not in ids]
    if len(roots) != 1 or (root and roots != [root]) or orphans:
        return f"roots {roots}, spans whose parent is missing {orphans}"
    return ""


def _subtree(spans: list[Exported], top: Exported) -> list[Exported]:
    """`top` and every span below it."""
    below, out, grown = {top.span.span_id}, [top], True
    while grown:  # spans come in any order (processes export on their own schedules)
        grown = False
        for e in spans:
            if e.span.parent_span_id in below and e.span.span_id not in below:
                below.add(e.span.span_id)
                out.append(e)
                grown = True
    return out


EVERY_SERVICE = {"graphmesh-coordinator", "graphmesh-executor", "graphmesh-kvstore"}
# What one step of a two-stage mesh does, each phase under the step's trace.
STEP_PHASES = [("graphmesh-coordinator", "mesh.step"), ("graphmesh-coordinator", "mesh.execute_step"),
               ("graphmesh-executor", "/graphmesh.v1.StageService/ExecuteStep"),
               ("graphmesh-executor", "stage.execute"), ("graphmesh-executor", "stage.compute"),
               ("graphmesh-executor", "stage.run"), ("graphmesh-executor", "stage.push_boundary"),
               # the next rank took the bundle (over its boundary link: the trace context travels in the frame)
               ("graphmesh-executor", "stage.accept_boundary")]


def _attrs(span: trace_pb2.Span) -> dict[str, Any]:
    return {a.key: a.value.int_value or a.value.string_value or a.value.bool_value for a in span.attributes}


def _wait_for(what: Callable[[], str], timeout_s: float = 30.0) -> None:
    """Polls `what` (why the spans are not there yet, '' once they are) until it passes."""
    deadline = time.monotonic() + timeout_s
    while why := what():
        assert time.monotonic() < deadline, why
        time.sleep(0.2)


def test_one_generate_is_one_trace_across_every_service(mesh: LocalMesh, receiver: tuple[Receiver, int]) -> None:
    # A session alone in the mesh: every step carries only its rows, so nothing stops its steps from joining its
    # trace (a step of many sessions belongs to one of them at most; see test_every_step_is_one_trace...).
    spans = receiver[0]
    with CoordinatorClient(mesh.coordinator_address) as client:
        chunks = list(client.generate(prompt_token_ids=[3, *PROMPT], max_tokens=3, ignore_eos=True))
    assert sum(len(c.token_ids) for c in chunks) == 3
    trace: list[Exported] = []

    def why() -> str:
        nonlocal trace
        roots = spans.roots(GENERATE)
        trace = spans.trace(roots[0].trace_id) if len(roots) == 1 else []
        return _complete(trace, GENERATE, EVERY_SERVICE, 4) if trace else f"{len(roots)} Generate root spans"

    _wait_for(why)
    names = {(e.service, e.span.name) for e in trace}
    for service, name in [("graphmesh-coordinator", "generate"), *STEP_PHASES, ("graphmesh-executor", "stage.commit"),
                          ("graphmesh-kvstore", "/graphmesh.v1.KvStoreService/SeedStages")]:
        assert (service, name) in names, (service, name)
    steps = sorted((e.span for e in trace if e.span.name == "mesh.step"), key=lambda span: span.start_time_unix_nano)
    assert [_attrs(span)["decode_steps"] for span in steps] == [1, 2]  # the prefill, then a decode run of two tokens


def test_a_generate_through_the_front_end_is_one_trace_under_the_callers(
        mesh: LocalMesh, receiver: tuple[Receiver, int]) -> None:
    """The front end's span of the call is the caller's child, and the coordinator's (relayed over GenerateStreams)
    the front end's, with everything the coordinator does for the call below it."""
    spans = receiver[0]
    trace_id, parent = "5ce92f3577b34da6a3ce929d0e0e4736", "10f067aa0ba902b7"
    with CoordinatorClient(mesh.frontend_address, metadata=[("traceparent", f"00-{trace_id}-{parent}-01")]) as client:
        chunks = list(client.generate(prompt_token_ids=[11, *PROMPT], max_tokens=3, ignore_eos=True))
    assert sum(len(c.token_ids) for c in chunks) == 3
    trace: list[Exported] = []

    def why() -> str:
        nonlocal trace
        trace = spans.trace(bytes.fromhex(trace_id))
        ids = {e.span.span_id for e in trace}
        tops = [(e.service, e.span.name, e.span.parent_span_id.hex()) for e in trace if e.span.parent_span_id not in ids]
        if tops != [("graphmesh-frontend", GENERATE, parent)]:
            return f"spans not under the caller's: {tops}"
        return _covers(trace, EVERY_SERVICE | {"graphmesh-frontend"}, 5)

    _wait_for(why)
    front = next(e.span for e in trace if e.service == "graphmesh-frontend")
    relayed = [e.span for e in trace if e.service == "graphmesh-coordinator" and e.span.name == GENERATE]
    assert [span.parent_span_id for span in relayed] == [front.span_id]
    assert relayed[0].kind == trace_pb2.Span.SPAN_KIND_SERVER
    below = {e.span.name for e in _subtree(trace, next(e for e in trace if e.span is relayed[0]))}
    assert {"generate", "mesh.step", "stage.execute"} <= below, below


def test_every_step_is_one_span_tree_across_the_coordinator_and_both_executors(
        mesh: LocalMesh, receiver: tuple[Receiver, int]) -> None:
    # Each step's mesh.step span holds everything the step did in every process; whether that span is a root or
    # sits in a request's trace is up to the scheduler (see the test above).
    spans = receiver[0]
    with spans.lock:
        earlier = {e.span.span_id for e in spans.spans if e.span.name == "mesh.step"}
    with CoordinatorClient(mesh.coordinator_address) as client:
        chunks = list(client.generate(prompt_token_ids=[5, *PROMPT], max_tokens=3, ignore_eos=True))
    assert sum(len(c.token_ids) for c in chunks) == 3
    steps: list[list[Exported]] = []

    def why() -> str:
        nonlocal steps
        with spans.lock:
            tops = sorted((e for e in spans.spans if e.span.name == "mesh.step" and e.span.span_id not in earlier),
                          key=lambda e: e.span.start_time_unix_nano)
        if len(tops) != 2:
            return f"{len(tops)} new mesh.step spans"  # the prefill, then a decode run of two tokens
        traces = [spans.trace(e.span.trace_id) for e in tops]
        steps = [_subtree(t, top) for t, top in zip(traces, tops)]
        # the second step's folded commit makes the prompt's two blocks whole: their write-behind is part of it
        return next(filter(None, (_connected(t) or (_covers(s, EVERY_SERVICE, 4) if i == 1 else
                                                     _covers(s, EVERY_SERVICE - {"graphmesh-kvstore"}, 3))
                                  for i, (t, s) in enumerate(zip(traces, steps)))), "")

    _wait_for(why)
    for i, step_spans in enumerate(steps):
        names = {(e.service, e.span.name) for e in step_spans}
        for service, name in STEP_PHASES + ([("graphmesh-executor", "stage.commit")] if i else []):
            assert (service, name) in names, (i, service, name)  # a decode step commits the previous epoch, folded
        step = _attrs(step_spans[0].span)
        assert {"step", "incarnation", "rows", "tokens"} <= step.keys() and step["rows"] == 1
        assert step["tokens"] == (len(PROMPT) + 1 if i == 0 else 1)
        executes = [e for e in step_spans if e.span.name == "stage.execute"]
        assert sorted(_attrs(e.span)["rank"] for e in executes) == [0, 1]
        assert {_attrs(e.span)["step"] for e in executes} == {step["step"]}
        assert len({e.instance for e in executes}) == 2  # one per executor process


def test_write_behind_joins_the_trace_of_the_commit(mesh: LocalMesh, receiver: tuple[Receiver, int]) -> None:
    """The blocks committed by a step are written behind on other threads; the put, and the kvstore's PutBlocks,
    still belong to the step whose folded commit made them whole, under its stage.commit."""
    spans = receiver[0]
    puts = "/graphmesh.v1.KvStoreService/PutBlocks"
    with spans.lock:
        earlier = {e.span.span_id for e in spans.spans if e.span.name == puts and e.service == "graphmesh-kvstore"}
    with CoordinatorClient(mesh.coordinator_address) as client:
        list(client.generate(prompt_token_ids=[7, *PROMPT], max_tokens=2, ignore_eos=True))
    new: list[Exported] = []

    def why() -> str:
        nonlocal new
        with spans.lock:
            new = [e for e in spans.spans if e.span.name == puts and e.service == "graphmesh-kvstore" and
                   e.span.span_id not in earlier]
        if len(new) != 2:  # one put per stage
            return f"{len(new)} new PutBlocks spans"
        return next(filter(None, (_connected(spans.trace(e.span.trace_id)) for e in new)), "")

    _wait_for(why)
    assert len({e.span.trace_id for e in new}) == 1  # both stages commit in the same step
    trace = {e.span.span_id: e for e in spans.trace(new[0].span.trace_id)}
    steps = set()
    for put in new:
        chain, at = [], put
        while at.span.parent_span_id:
            at = trace[at.span.parent_span_id]
            chain.append(at)
        names = [e.span.name for e in chain]
        assert "stage.kv_write_behind" in names and "stage.commit" in names[names.index("stage.kv_write_behind"):], names
        steps |= {e.span.span_id for e in chain if e.span.name == "mesh.step"}
    assert len(steps) == 1, steps  # one step's commit, on both stages


def _value(value: Any) -> Any:
    """An OTLP AnyValue as Python (the kinds GenAI attributes use)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def test_an_http_completion_has_genai_attributes_and_joins_the_callers_trace(
        mesh: LocalMesh, receiver: tuple[Receiver, int]) -> None:
    spans = receiver[0]
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    prompt = [9, *PROMPT]
    body = {"model": mesh.model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "seed": 5, "stop": ["zz"],
            "ignore_eos": True}
    request = urllib.request.Request(mesh.http_url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{parent}-01"})
    with urllib.request.urlopen(request, timeout=60) as r:
        reply = json.loads(r.read())
    assert reply["usage"]["completion_tokens"] == 3
    name = f"text_completion {mesh.model}"
    trace: list[Exported] = []

    def why() -> str:
        nonlocal trace
        trace = spans.trace(bytes.fromhex(trace_id))
        mine = [e for e in trace if e.span.name == name]
        if len(mine) != 1:
            return f"{len(mine)} {name!r} spans"
        # The caller's span is not exported here: one span (the HTTP server span, FastAPI's or ours) hangs below
        # it, and every other span of the trace below that one.
        ids = {e.span.span_id for e in trace}
        tops = [(e.service, e.span.name) for e in trace if e.span.parent_span_id not in ids]
        if len(tops) != 1 or not any(e.span.parent_span_id == bytes.fromhex(parent) for e in trace):
            return f"spans not under the caller's: {tops}"
        return _covers(trace, EVERY_SERVICE | {"graphmesh-frontend"}, 5)  # the front end serves the API

    _wait_for(why)
    top = next(e.span for e in trace if e.span.name == name)
    http = top
    while http.parent_span_id != bytes.fromhex(parent):  # up through FastAPI's spans, where it traces requests
        http = next(e.span for e in trace if e.span.span_id == http.parent_span_id)
    assert http.kind == trace_pb2.Span.SPAN_KIND_SERVER  # the request's entry: FastAPI's HTTP span, or ours
    attrs = {a.key: _value(a.value) for a in top.attributes}
    assert attrs["gen_ai.operation.name"] == "text_completion" and attrs["gen_ai.request.model"] == mesh.model
    assert attrs["gen_ai.request.max_tokens"] == 3 and attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.request.seed"] == 5 and attrs["gen_ai.request.stop_sequences"] == ["zz"]
    assert attrs["gen_ai.usage.input_tokens"] == len(prompt) and attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.response.finish_reasons"] == ["length"] and attrs["gen_ai.response.id"] == reply["id"]
    assert attrs["gen_ai.provider.name"] == "graphmesh"
    names = {e.span.name for e in trace}
    assert {"generate", "mesh.step", "stage.execute"} <= names, names
