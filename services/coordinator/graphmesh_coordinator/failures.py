"""What a failed request tells its caller: one mapping of whatever a request raised to the public error that gRPC
(servicer.as_status), KServe and the OpenAI HTTP API (openai_protocol.api_error) answer with.

A step that failed for the request's own rows (ROLL_BACK: the executors refused them) answers with the executors'
cause, which names what was wrong with the request; any other invocation failure cost the mesh an executor, which
the caller sees as UNAVAILABLE (retry) rather than as its own mistake; any other error goes through
errors.refusal, as the executors' do: malformed input (a tensor or dtype that does not parse) is INVALID_ARGUMENT,
running out of memory RESOURCE_EXHAUSTED, and the rest a bug, logged once with its traceback and answered as
INTERNAL without it.
"""

from __future__ import annotations

from graphmesh.errors import GraphmeshError, Unavailable, refusal
from graphmesh.protocol import Action
from graphmesh_coordinator.pipeline import InvocationFailed


def public_error(error: BaseException) -> GraphmeshError:
    """The typed error a caller is answered with for `error`."""
    if isinstance(error, InvocationFailed):
        if error.action is Action.ROLL_BACK:  # its rows were refused: the cause is the request's
            return error.cause
        return Unavailable(f"the mesh lost an executor: {error}", "MESH_FENCED")
    if isinstance(error, GraphmeshError):
        return error
    return refusal(error, "coordinator")
