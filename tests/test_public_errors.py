"""failures.public_error is the one mapping of what a request raised to what its caller is told: gRPC (and KServe,
through servicer.as_status) and the OpenAI HTTP API (openai_protocol.api_error) give the same code, reason and
message for the same failure (issue 41 item 3)."""

from __future__ import annotations

import grpc
import pytest

from graphmesh.errors import GraphmeshError, InvalidArgument, ResourceExhausted, Unavailable
from graphmesh.protocol import ErrorClass
from graphmesh_coordinator.failures import public_error
from graphmesh_coordinator.openai_protocol import APIError, api_error
from graphmesh_coordinator.pipeline import InvocationFailed
from graphmesh_coordinator.servicer import as_status

CAUSE = InvalidArgument("token 70000 is outside the vocabulary of 49152", "BAD_TOKEN", {"parameter": "prompt"})


@pytest.mark.parametrize("error,code,reason,status", [
    # the executors refused the request's own rows: the caller is told why
    (InvocationFailed(ErrorClass.ARCH, 1, CAUSE), grpc.StatusCode.INVALID_ARGUMENT, "BAD_TOKEN", 400),
    # the mesh lost an executor: retry, not the caller's mistake
    (InvocationFailed(ErrorClass.COMM, 0, Unavailable("link broke", "LINK_BROKEN")), grpc.StatusCode.UNAVAILABLE,
     "MESH_FENCED", 503),
    (InvocationFailed(ErrorClass.CONTRACT, 2, Unavailable("bad epoch", "EPOCH_MISMATCH")),
     grpc.StatusCode.UNAVAILABLE, "MESH_FENCED", 503),
    (ResourceExhausted("the waiting queue is full", "QUEUE_FULL"), grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL",
     429),
    (ResourceExhausted("needs 900 blocks, the pool has 64", "KV_CAPACITY_EXCEEDED"),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "KV_CAPACITY_EXCEEDED", 400),  # never fits: retrying cannot help
    (KeyError("a bug"), grpc.StatusCode.INTERNAL, "INTERNAL", 500),
])
def test_one_failure_one_public_error_over_grpc_and_http(error: BaseException, code: grpc.StatusCode, reason: str,
                                                         status: int) -> None:
    public = public_error(error)
    assert isinstance(public, GraphmeshError) and public.code == code and public.reason == reason
    assert as_status(error).code == code
    http = api_error(error)
    assert isinstance(http, APIError) and http.status == status and http.message == public.message
    assert http.code == reason.lower()
    assert ("Retry-After" in http.headers) == (status in (429, 503))
    if reason == "BAD_TOKEN":
        assert http.param == "prompt" and public is CAUSE


def test_an_api_error_passes_through() -> None:
    error = APIError(413, "too big", "invalid_request_error", "body_too_large")
    assert api_error(error) is error
