"""What a failed request tells its caller: one mapping of whatever a request raised to the public error that gRPC
(servicer.as_status), KServe and the OpenAI HTTP API (openai_protocol.api_error) answer with.

A step that failed for the request's own rows (ROLL_BACK: the executors refused them) answers with the executors'
cause, which names what was wrong with the request; any other invocation failure cost the mesh an executor, which
the caller sees as UNAVAILABLE (retry) rather than as its own mistake; an error that is not a typed one is a bug,
logged here once with its traceback and answered as INTERNAL without it.
"""

from __future__ import annotations

import logging

from graphmesh.errors import GraphmeshError, Internal, Unavailable
from graphmesh.protocol import Action
from graphmesh_coordinator.pipeline import InvocationFailed

log = logging.getLogger("graphmesh.coordinator")


def public_error(error: BaseException) -> GraphmeshError:
    """The typed error a caller is answered with for `error`."""
    if isinstance(error, InvocationFailed):
        if error.action is Action.ROLL_BACK:  # its rows were refused: the cause is the request's
            return error.cause
        return Unavailable(f"the mesh lost an executor: {error}", "MESH_FENCED")
    if isinstance(error, GraphmeshError):
        return error
    log.error("request failed", exc_info=error)
    return Internal(f"{type(error).__name__}: {error}")
