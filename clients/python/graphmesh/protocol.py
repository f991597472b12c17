"""The partitioned protocol's failure classes, and what the coordinator does about each: the one table both sides
of a step share (stage.proto's ErrorClass).

A rank that fails a step says which class the failure is in the status it returns: ErrorInfo metadata
`error_class` = the class's name (ARCH, COMM, CONTRACT, INDETERMINATE). A failure that carries none (a transport
error, a refusal raised before the step began) is classified from its code and reason by `classify`, the same way on
every caller.
"""

from __future__ import annotations

from enum import Enum, StrEnum

import grpc

from graphmesh.errors import GraphmeshError, Internal

METADATA_KEY = "error_class"


class ErrorClass(StrEnum):
    """stage.proto ErrorClass, by the name after ERROR_CLASS_."""

    ARCH = "ARCH"  # deterministic, before any payload left the rank: every rank rolls back, the rows may be retried
    COMM = "COMM"  # the order of communication can no longer be proven: the incarnation is poisoned
    CONTRACT = "CONTRACT"  # a protocol contract was broken (schema, epoch, KV length): poisoned, like COMM
    INDETERMINATE = "INDETERMINATE"  # a rank never learned how a session's epoch ended: resolve it from the log


class Action(Enum):
    """What the coordinator does with a step that failed in a class."""

    ROLL_BACK = "roll back"  # abort the step on every rank (the incarnation stays ACTIVE) and retry its rows
    RESOLVE = "resolve"  # roll back, send the epoch's outcome from the decision log (ResolveEpoch), retry
    FENCE = "fence"  # poison the incarnation everywhere, re-plan, restore the sessions and replay them


ACTIONS = {ErrorClass.ARCH: Action.ROLL_BACK, ErrorClass.INDETERMINATE: Action.RESOLVE,
           ErrorClass.COMM: Action.FENCE, ErrorClass.CONTRACT: Action.FENCE}

# Refusals of a step that mean the rank is fenced or was rebuilt (the roster must be recovered), and ones that mean
# a broken contract, when the refusal itself carries no class (it came before the step began)
_FENCED_REASONS = {"STALE_INCARNATION", "POISONED", "NOT_INSTALLED"}
_CONTRACT_REASONS = {"KV_LENGTH_MISMATCH", "EPOCH_NOT_OPEN", "EPOCH_OPEN", "STALE_EPOCH", "UNKNOWN_SESSION",
                     "ALREADY_COMMITTED"}
# Codes of a call that may have been cut anywhere: nothing proves what the rank did
_COMM_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
               grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


def classify(error: GraphmeshError) -> ErrorClass:
    """The class a rank gave `error`, else the one its code and reason imply."""
    named = error.metadata.get(METADATA_KEY, "")
    if named in ErrorClass.__members__:
        return ErrorClass(named)
    if error.reason == "SESSION_INDETERMINATE":
        return ErrorClass.INDETERMINATE
    if error.reason in _FENCED_REASONS or error.code in _COMM_CODES:
        return ErrorClass.COMM
    return ErrorClass.CONTRACT if error.reason in _CONTRACT_REASONS else ErrorClass.ARCH


class ProtocolError(GraphmeshError):
    """A rank's failure with its class: the status of its cause, with the class in the ErrorInfo metadata so the
    coordinator knows what it means for the protocol."""

    def __init__(self, error_class: ErrorClass, cause: Exception) -> None:
        base = cause if isinstance(cause, GraphmeshError) else Internal(f"{type(cause).__name__}: {cause}")
        super().__init__(base.message, base.reason, {**base.metadata, METADATA_KEY: error_class.value})
        self.code = base.code
        self.error_class = error_class
        self.cause = cause
