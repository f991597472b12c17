"""The partition plan: a DAG of groups owned by ranks, the boundary routes between them with their wire schemas,
and the order in which a step's active groups run (its waves). The coordinator makes it (planner.py); every rank
gets the same plan at Install (stage.proto PartitionPlan) and derives from it where its bundles go, what each one
it receives must look like, and which waves it takes part in.

A group is a contiguous range of decoder layers or an encoder. An optional group is a root that runs only for the
steps that activate it (the seed's `request_group_active`: an encoder used only by requests that carry its input);
every other group always runs. The step request names the active optional groups, so every rank agrees on them.
Waves: the active groups in dependency order, the lowest id first among those ready, numbered from 0.

A route is one directed boundary: a group's output to a group that depends on it (a DAG edge), or a feedback route,
which carries the input of a decode run's next iteration back up the pipeline (it closes no cycle within one
iteration). Its schema lists the tensors a bundle holds, by role, with dtype and shape in symbolic dimensions
(`resolve` fixes them for one invocation); both ends check a bundle against it, and its identity, a hash of the
declaration, travels with each bundle so a sender working from another plan is caught at once.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from graphmesh import dtypes
from graphmesh.errors import InvalidArgument
from graphmesh.v1 import stage_pb2

DECODER, ENCODER = "decoder", "encoder"
# The symbolic dimensions of a schema's shapes, fixed per invocation: the step's token rows, its rows (sessions),
# and the rows its encoder input holds.
TOKENS, ROWS, ENCODED = "tokens", "rows", "encoded"
# Roles: the hidden state, a decode run's input tokens, an encoder's output rows.
ACTIVATION, RUN_TOKENS, ENCODED_ROWS = "activation", "tokens", "encoded"
_ROLES = {ACTIVATION: stage_pb2.BOUNDARY_ROLE_ACTIVATION, RUN_TOKENS: stage_pb2.BOUNDARY_ROLE_TOKENS,
          ENCODED_ROWS: stage_pb2.BOUNDARY_ROLE_ENCODED}
_ROLE_NAMES = {v: k for k, v in _ROLES.items()}
_KINDS = {DECODER: stage_pb2.GROUP_KIND_DECODER, ENCODER: stage_pb2.GROUP_KIND_ENCODER}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}


@dataclass(frozen=True)
class Group:
    id: int
    kind: str  # DECODER | ENCODER
    rank: int  # the owner: the only rank that computes it
    layer_start: int = 0  # decoder layers [layer_start, layer_end)
    layer_end: int = 0
    optional: bool = False  # an optional root: runs only in the steps that activate it
    depends_on: tuple[int, ...] = ()


@dataclass(frozen=True)
class BoundaryRole:
    role: str
    dtype: str  # "f32" | "i64"
    shape: tuple[int | str, ...]  # sizes, or symbolic dimensions (TOKENS, ROWS, ENCODED)
    run_only: bool = False  # present only in the iterations after the first of a decode run


class Shaped(Protocol):
    """What a schema reads of a bundle's value: a host array, or a value that stays on a device described as one."""

    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def ndim(self) -> int: ...


@dataclass(frozen=True)
class BoundarySchema:
    roles: tuple[BoundaryRole, ...]  # the primary role first, then the auxiliaries in transport order

    @functools.cached_property  # every bundle sent and received carries or checks it
    def identity(self) -> str:
        """A hash of the declaration: equal on both ends of a route exactly when they declare the same bundle."""
        text = ";".join(f"{r.role}:{r.dtype}[{','.join(map(str, r.shape))}]{'@run' if r.run_only else ''}"
                        for r in self.roles)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def resolve(self, dims: Mapping[str, int], iteration: int = 0) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The bundle one invocation carries: role -> (dtype, exact shape)."""
        return {r.role: (r.dtype, tuple(d if isinstance(d, int) else dims[d] for d in r.shape))
                for r in self.roles if iteration or not r.run_only}

    def check(self, bundle: Mapping[str, Shaped], dims: Mapping[str, int], iteration: int = 0) -> str:
        """Why `bundle` breaks this schema for the invocation, or "" when it keeps it."""
        expected = self.resolve(dims, iteration)
        if set(bundle) != set(expected):
            return f"bundle holds roles {sorted(bundle)}, the schema wants {sorted(expected)}"
        for role, (dtype, shape) in expected.items():
            value = bundle[role]
            if value.dtype != dtypes.to_numpy(dtype) or tuple(value.shape) != shape:
                return f"{role} is {value.dtype}{list(value.shape)}, the schema wants {dtype}{list(shape)}"
        return ""

    def admits(self, bundle: Mapping[str, Shaped]) -> str:
        """Why `bundle` cannot be one of this schema's in any invocation (a role it does not declare, another dtype
        or rank, another fixed size), or "": what a receiver can check before it knows the step's dimensions."""
        declared = {r.role: r for r in self.roles}
        for role, value in bundle.items():
            spec = declared.get(role)
            if spec is None:
                return f"the schema has no role {role!r}"
            fixed = all(d == v for d, v in zip(spec.shape, value.shape) if isinstance(d, int))
            if value.dtype != dtypes.to_numpy(spec.dtype) or value.ndim != len(spec.shape) or not fixed:
                return (f"{role} {value.dtype}{list(value.shape)} breaks schema "
                        f"{spec.dtype}[{', '.join(map(str, spec.shape))}]")
        return ""


@dataclass(frozen=True)
class Route:
    id: int
    source_group: int
    destination_group: int
    source_rank: int
    destination_rank: int
    schema: BoundarySchema
    feedback: bool = False  # the next iteration's input, back up the pipeline (not a DAG edge)


@dataclass(frozen=True)
class Wave:
    ordinal: int
    group: Group


@dataclass(frozen=True)
class Plan:
    groups: tuple[Group, ...]  # by id: groups[i].id == i
    routes: tuple[Route, ...]  # by id
    addresses: tuple[str, ...]  # per rank: its executor's StageService address
    cross_stage_collective_waves: bool = False  # inactive ranks take their zero-work part of every wave

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuses a plan no rank could run: ids out of order, unknown or cyclic dependencies, an optional group
        that is not a root, a route off the DAG's edges or between ranks that do not own its ends."""
        def bad(why: str) -> InvalidArgument:
            return InvalidArgument(f"bad partition plan: {why}", "BAD_PLAN")
        if not self.groups:
            raise bad("no groups")
        for i, g in enumerate(self.groups):
            if g.id != i:
                raise bad(f"group {i} has id {g.id}")
            if not 0 <= g.rank < len(self.addresses):
                raise bad(f"group {g.id} is owned by rank {g.rank}; the plan has {len(self.addresses)} ranks")
            if any(not 0 <= d < len(self.groups) or d == g.id for d in g.depends_on):
                raise bad(f"group {g.id} depends on {list(g.depends_on)}")
            if g.optional and g.depends_on:
                raise bad(f"optional group {g.id} is not a root")
            if g.kind == DECODER and not 0 <= g.layer_start < g.layer_end:
                raise bad(f"decoder group {g.id} has layers [{g.layer_start}, {g.layer_end})")
            if g.kind not in (DECODER, ENCODER):
                raise bad(f"group {g.id} is of unknown kind {g.kind!r}")
        self.schedule(range(len(self.groups)))  # every group reachable in some order: no cycle
        for i, r in enumerate(self.routes):
            if r.id != i:
                raise bad(f"route {i} has id {r.id}")
            if not (0 <= r.source_group < len(self.groups) and 0 <= r.destination_group < len(self.groups)):
                raise bad(f"route {r.id} joins unknown groups")
            src, dst = self.groups[r.source_group], self.groups[r.destination_group]
            if (src.rank, dst.rank) != (r.source_rank, r.destination_rank):
                raise bad(f"route {r.id} runs rank {r.source_rank} -> {r.destination_rank}, its groups are owned by "
                          f"ranks {src.rank} -> {dst.rank}")
            if not r.feedback and src.id not in dst.depends_on:
                raise bad(f"route {r.id} ({src.id} -> {dst.id}) is not on a dependency edge")
            if not r.schema.roles:
                raise bad(f"route {r.id} has an empty schema")

    def schedule(self, active_optional: Collection[int]) -> list[Wave]:
        """The waves of a step that activates the optional groups `active_optional`: every active group once, when
        every active group it depends on ran, the lowest id first."""
        active = [g for g in self.groups if not g.optional or g.id in active_optional]
        done: set[int] = set()
        ids = {g.id for g in active}
        waves: list[Wave] = []
        while len(waves) < len(active):
            ready = [g for g in active if g.id not in done and all(d in done or d not in ids for d in g.depends_on)]
            if not ready:
                raise InvalidArgument("bad partition plan: its groups depend on each other in a cycle", "BAD_PLAN")
            waves.append(Wave(len(waves), ready[0]))
            done.add(ready[0].id)
        return waves

    def owned(self, rank: int) -> list[Group]:
        return [g for g in self.groups if g.rank == rank]

    def decoder(self, rank: int) -> Group:
        """The decoder group `rank` owns (a rank owns exactly one)."""
        groups = [g for g in self.owned(rank) if g.kind == DECODER]
        if len(groups) != 1:
            raise InvalidArgument(f"rank {rank} owns {len(groups)} decoder groups; it must own one", "BAD_PLAN")
        return groups[0]

    def encoder(self) -> Group | None:
        return next((g for g in self.groups if g.kind == ENCODER), None)

    def routes_from(self, group: int, feedback: bool = False) -> list[Route]:
        return [r for r in self.routes if r.source_group == group and r.feedback == feedback]

    def routes_into(self, group: int, feedback: bool = False) -> list[Route]:
        return [r for r in self.routes if r.destination_group == group and r.feedback == feedback]

    def optional_ids(self) -> set[int]:
        return {g.id for g in self.groups if g.optional}


def activation_schema(hidden: int) -> BoundarySchema:
    """Between decoder groups: the hidden state of every token row, and in a decode run's later iterations the
    rows' input tokens (each rank keeps the tokens its KV rows hold)."""
    return BoundarySchema((BoundaryRole(ACTIVATION, "f32", (TOKENS, hidden)),
                           BoundaryRole(RUN_TOKENS, "i64", (ROWS,), run_only=True)))


def feedback_schema() -> BoundarySchema:
    """From the last decoder group to the first: the tokens a decode run's iteration sampled, one per row."""
    return BoundarySchema((BoundaryRole(RUN_TOKENS, "i64", (ROWS,)),))


def encoded_schema(hidden: int) -> BoundarySchema:
    """From an encoder to the first decoder group: its output rows, which replace the embeddings of the prompt's
    placeholder tokens."""
    return BoundarySchema((BoundaryRole(ENCODED_ROWS, "f32", (ENCODED, hidden)),))


def pipeline(layer_ranges: Iterable[tuple[int, int]], addresses: Iterable[str], hidden: int,
             encoder_rank: int | None = None) -> Plan:
    """The plan of a decoder split into contiguous layer ranges, rank i owning range i, with an optional encoder
    root owned by `encoder_rank` feeding the first range: groups are the encoder (id 0, when there is one) and the
    ranges in order; routes are the encoder's, the activations down the pipeline, and the decode runs' feedback."""
    ranges, addresses = list(layer_ranges), tuple(addresses)
    groups: list[Group] = []
    if encoder_rank is not None:
        groups.append(Group(0, ENCODER, encoder_rank, optional=True))
    first = len(groups)
    for rank, (start, end) in enumerate(ranges):
        deps = (groups[-1].id,) if rank else ((0,) if encoder_rank is not None else ())
        groups.append(Group(len(groups), DECODER, rank, start, end, depends_on=deps))
    routes: list[Route] = []

    def route(src: Group, dst: Group, schema: BoundarySchema, feedback: bool = False) -> None:
        routes.append(Route(len(routes), src.id, dst.id, src.rank, dst.rank, schema, feedback))
    if encoder_rank is not None:
        route(groups[0], groups[first], encoded_schema(hidden))
    for a, b in zip(groups[first:], groups[first + 1:]):
        route(a, b, activation_schema(hidden))
    if len(ranges) > 1:
        route(groups[-1], groups[first], feedback_schema(), feedback=True)
    return Plan(tuple(groups), tuple(routes), addresses)


def role_of(value: stage_pb2.BoundaryRole.ValueType) -> str:
    """A stage.proto BoundaryRole as a schema's role name ("" for one no schema has)."""
    return _ROLE_NAMES.get(value, "")


def role_proto(role: str) -> stage_pb2.BoundaryRole.ValueType:
    return _ROLES[role]


def to_proto(plan: Plan) -> stage_pb2.PartitionPlan:
    out = stage_pb2.PartitionPlan(rank_addresses=plan.addresses,
                                  cross_stage_collective_waves=plan.cross_stage_collective_waves)
    for g in plan.groups:
        out.groups.add(id=g.id, kind=_KINDS[g.kind], rank=g.rank, layer_start=g.layer_start, layer_end=g.layer_end,
                       optional=g.optional, depends_on=g.depends_on)
    for r in plan.routes:
        schema = stage_pb2.BoundarySchema(identity=r.schema.identity, roles=[stage_pb2.BoundaryRoleSpec(
            role=_ROLES[x.role], dtype=dtypes.to_proto(x.dtype), shape=[str(d) for d in x.shape], run_only=x.run_only)
            for x in r.schema.roles])
        out.routes.add(id=r.id, source_group=r.source_group, destination_group=r.destination_group,
                       source_rank=r.source_rank, destination_rank=r.destination_rank, schema=schema,
                       feedback=r.feedback)
    return out


def from_proto(message: stage_pb2.PartitionPlan) -> Plan:
    """The plan a rank was sent, validated; a schema whose identity is not its declaration's is refused (the sender
    hashes differently: a bundle from it would never be accepted)."""
    def bad(why: str) -> InvalidArgument:
        return InvalidArgument(f"bad partition plan: {why}", "BAD_PLAN")
    groups = []
    for g in message.groups:
        if g.kind not in _KIND_NAMES:
            raise bad(f"group {g.id} has no kind")
        groups.append(Group(g.id, _KIND_NAMES[g.kind], g.rank, g.layer_start, g.layer_end, g.optional,
                            tuple(g.depends_on)))
    routes = []
    for r in message.routes:
        roles = []
        for x in r.schema.roles:
            if x.role not in _ROLE_NAMES:
                raise bad(f"route {r.id} has a role without a name")
            roles.append(BoundaryRole(_ROLE_NAMES[x.role], dtypes.from_proto(x.dtype),
                                      tuple(int(d) if d.isdigit() else _dimension(d, r.id) for d in x.shape),
                                      x.run_only))
        schema = BoundarySchema(tuple(roles))
        if schema.identity != r.schema.identity:
            raise bad(f"route {r.id}'s schema identity {r.schema.identity!r} is not its declaration's "
                      f"{schema.identity!r}")
        routes.append(Route(r.id, r.source_group, r.destination_group, r.source_rank, r.destination_rank, schema,
                            r.feedback))
    return Plan(tuple(groups), tuple(routes), tuple(message.rank_addresses), message.cross_stage_collective_waves)


def _dimension(name: str, route: int) -> str:
    if name not in (TOKENS, ROWS, ENCODED):
        raise InvalidArgument(f"bad partition plan: route {route} has an unknown dimension {name!r}", "BAD_PLAN")
    return name
