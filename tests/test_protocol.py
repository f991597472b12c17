"""The protocol's failure classes: the one table from class to the coordinator's action, the classification of a
failure from its ErrorInfo (or, without one, its code and reason), and the names stage.proto gives the classes."""

from __future__ import annotations

import grpc
import pytest

from graphmesh.errors import FailedPrecondition, GraphmeshError, InvalidArgument, Unavailable
from graphmesh.protocol import ACTIONS, METADATA_KEY, Action, ErrorClass, ProtocolError, classify
from graphmesh.v1 import stage_pb2


def test_every_class_has_an_action_and_its_proto_name() -> None:
    assert set(ACTIONS) == set(ErrorClass)
    assert {f"ERROR_CLASS_{c.value}" for c in ErrorClass} == set(stage_pb2.ErrorClass.keys()) - {"ERROR_CLASS_UNSPECIFIED"}
    assert ACTIONS[ErrorClass.ARCH] is Action.ROLL_BACK and ACTIONS[ErrorClass.INDETERMINATE] is Action.RESOLVE
    assert ACTIONS[ErrorClass.COMM] is ACTIONS[ErrorClass.CONTRACT] is Action.FENCE


@pytest.mark.parametrize(("error", "expected"), [
    (InvalidArgument("bad token", "BAD_TOKEN_ID"), ErrorClass.ARCH),
    (InvalidArgument("schema", "SCHEMA_MISMATCH", {METADATA_KEY: "CONTRACT"}), ErrorClass.CONTRACT),
    (FailedPrecondition("stale", "STALE_INCARNATION"), ErrorClass.COMM),
    (FailedPrecondition("poisoned", "POISONED"), ErrorClass.COMM),
    (FailedPrecondition("epoch", "STALE_EPOCH"), ErrorClass.CONTRACT),
    (FailedPrecondition("waiting", "SESSION_INDETERMINATE"), ErrorClass.INDETERMINATE),
    (Unavailable("gone", "EXECUTOR_LOST"), ErrorClass.COMM),
    # the class a rank named wins over what its code would imply
    (Unavailable("oom", "DEVICE_OUT_OF_MEMORY", {METADATA_KEY: "ARCH"}), ErrorClass.ARCH),
    # a name that is no class is ignored
    (InvalidArgument("odd", "X", {METADATA_KEY: "MAYBE"}), ErrorClass.ARCH),
])
def test_classify(error: GraphmeshError, expected: ErrorClass) -> None:
    assert classify(error) is expected


def test_a_protocol_error_keeps_its_cause_status_and_names_its_class() -> None:
    e = ProtocolError(ErrorClass.COMM, Unavailable("link cut", "LINK_CUT", {"rank": "1"}))
    assert e.code == grpc.StatusCode.UNAVAILABLE and e.reason == "LINK_CUT"
    assert e.metadata == {"rank": "1", METADATA_KEY: "COMM"} and classify(e) is ErrorClass.COMM
    internal = ProtocolError(ErrorClass.ARCH, ValueError("boom"))
    assert internal.code == grpc.StatusCode.INTERNAL and "ValueError: boom" in internal.message
