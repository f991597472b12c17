"""Who may call what: the mesh roles, how a certificate name carries one, and the method table (POLICY)."""

from __future__ import annotations

import re
from enum import Enum

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
# Never counted by admission control: a probe must get its answer however loaded the service is. Watch is a
# stream that lives as long as its client, so it is counted like any other call.
UNCOUNTED = frozenset({"/grpc.health.v1.Health/Check",
                       # admin: an operator must see the coordinator's state whatever its load (quick, read-only)
                       "/graphmesh.v1.CoordinatorService/Status",
                       "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                       "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"})
# Not counted either: the serving code queues these itself, in order, with a bound of its own (the coordinator's
# --max-waiting-requests), and they hold no thread while they wait. Counting them refused the 65th concurrent
# Generate of a coordinator whose KV cache had room for far more.
GENERATE = "/graphmesh.v1.CoordinatorService/Generate"
QUEUED = frozenset({GENERATE})


class Role(Enum):
    COORDINATOR = "coordinator"
    EXECUTOR = "executor"
    KVSTORE = "kvstore"
    CLIENT = "client"


MESH = frozenset({Role.COORDINATOR, Role.EXECUTOR, Role.KVSTORE})
ANYONE = frozenset(Role)
_ROLE_NAME = re.compile(r"(coordinator|executor|kvstore)(-\d+)?\.graphmesh\.internal")


def role_of(name: str) -> Role | None:
    """The mesh role a certificate name carries (`executor-0.graphmesh.internal` -> EXECUTOR); None for any other name."""
    match = _ROLE_NAME.fullmatch(name)
    return Role(match.group(1)) if match else None


def _methods(service: str, roles: frozenset[Role], *names: str) -> dict[str, frozenset[Role]]:
    return {f"/graphmesh.v1.{service}/{name}": roles for name in names}


_COORDINATOR, _KVSTORE_OR_COORDINATOR = frozenset({Role.COORDINATOR}), frozenset({Role.COORDINATOR, Role.KVSTORE})
_EXECUTOR_OR_COORDINATOR = frozenset({Role.COORDINATOR, Role.EXECUTOR})
# Method -> the roles that may call it; a key ending in "/" is the default of a whole service. A method found in
# neither is open to mesh roles only (fail closed). The rationale for each line is in docs/security.md (threat model).
POLICY: dict[str, frozenset[Role]] = {
    # the pipeline protocol is the coordinator's alone: whoever drives it decides every user's tokens
    "/graphmesh.v1.StageService/": _COORDINATOR,
    **_methods("StageService", _COORDINATOR, "Install", "Fence", "ExecuteStep", "AbortStep", "ExecuteGroup", "Commit",
               "Abort", "ResolveEpoch", "ReleaseSession", "ShareSessionKv", "InjectFault"),
    **_methods("StageService", frozenset({Role.EXECUTOR}), "PushBoundary"),  # the previous stage
    # a link carries boundaries from the previous stage and row copies (what WriteSessionKv takes) from an executor or
    # the store's seeds; the listener takes a boundary from any link, which grants the store nothing: links are plain
    # TCP, so they exist only without TLS, where the mesh token gives every member every role
    **_methods("StageService", frozenset({Role.EXECUTOR, Role.KVSTORE}), "OpenBoundaryLink"),
    **_methods("StageService", _KVSTORE_OR_COORDINATOR, "ReadSessionKv", "PushSessionKv"),  # seeds and copies
    # a copy's source executor writes the rows into the destination itself (one hop); an executor already sees,
    # and could alter, every session's activations that pass through its stage, so this grants it nothing new
    **_methods("StageService", _KVSTORE_OR_COORDINATOR | {Role.EXECUTOR}, "WriteSessionKv"),
    **_methods("StageService", MESH, "Status"),
    # KV rows are users' prompts in another form: reading or writing them is for the mesh only
    "/graphmesh.v1.KvStoreService/": _COORDINATOR,
    **_methods("KvStoreService", _EXECUTOR_OR_COORDINATOR, "PutBlocks", "Lookup", "GetBlocks"),
    # the store calls executors with its own identity for these: only the coordinator may name them
    **_methods("KvStoreService", _COORDINATOR, "SeedExecutor", "CopyRows", "Evict"),
    # the roster is what SeedExecutor and CopyRows may name: whoever sets it picks where KV rows go
    **_methods("KvStoreService", _COORDINATOR, "RegisterExecutors"),
    **_methods("KvStoreService", MESH, "Stats"),
    "/graphmesh.v1.ExecutorService/": MESH,  # plus clients with --expose-executor-service
    "/graphmesh.v1.CoordinatorService/": ANYONE,  # the public APIs; the bearer token guards them
    "/inference.GRPCInferenceService/": ANYONE,
}


def allowed_roles(method: str, expose_executor_service: bool = False) -> frozenset[Role]:
    """The roles that may call `method` (a fully-qualified name, "/package.Service/Method")."""
    service = method[:method.rfind("/") + 1]
    roles = POLICY.get(method, POLICY.get(service, MESH))
    if expose_executor_service and service == "/graphmesh.v1.ExecutorService/":
        roles |= {Role.CLIENT}
    return roles


def is_open(method: str) -> bool:
    """Health and reflection: never behind a token, a role or the peer list (orchestrators and grpcurl reach them)."""
    return method.startswith(OPEN_SERVICES)
