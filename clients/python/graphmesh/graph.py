"""The graph IR in Python: GraphBuilder to write graphs, parse() to validate them.

parse() is the one validator: it decodes a graph proto, re-infers every
node's type from the op specs, sorts the nodes topologically and rejects
cycles, dangling references and type disagreements.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphmesh import dtypes, ops, tensors
from graphmesh.ops import OpError, TensorType
from graphmesh.v1 import graph_pb2


class GraphError(ValueError):
    """A graph that cannot be compiled; the message names the node and the problem."""


@dataclass(frozen=True)
class Value:
    """A value in a graph under construction."""

    name: str
    type: TensorType

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    inputs: tuple[str, ...]
    attrs: dict[str, Any]
    type: TensorType


@dataclass(frozen=True)
class Graph:
    """A validated graph: nodes in topological order."""

    name: str
    inputs: dict[str, TensorType]
    params: dict[str, TensorType]
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]

    def type_of(self, name: str) -> TensorType:
        if name in self.inputs:
            return self.inputs[name]
        if name in self.params:
            return self.params[name]
        for node in self.nodes:
            if node.name == name:
                return node.type
        raise KeyError(name)

    def last_uses(self) -> dict[str, int]:
        """For each value, the index of the last node that reads it (outputs live to the end)."""
        last: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            for name in node.inputs:
                last[name] = i
        for name in self.outputs:
            last[name] = len(self.nodes)
        return last


def _attr_to_proto(kind: str, value: Any) -> graph_pb2.AttrValue:
    if kind == "int":
        return graph_pb2.AttrValue(i=value)
    if kind == "float":
        return graph_pb2.AttrValue(f=value)
    if kind == "bool":
        return graph_pb2.AttrValue(b=value)
    if kind == "str":
        return graph_pb2.AttrValue(s=value)
    if kind == "ints":
        return graph_pb2.AttrValue(ints=graph_pb2.IntList(values=value))
    if kind == "floats":
        return graph_pb2.AttrValue(floats=graph_pb2.FloatList(values=value))
    if kind == "dtype":
        return graph_pb2.AttrValue(dtype=dtypes.to_proto(value))
    return graph_pb2.AttrValue(tensor=tensors.to_proto(value))


def _attr_from_proto(op: str, name: str, attr: graph_pb2.AttrValue) -> Any:
    spec = ops.SPECS[op].attrs.get(name)
    if spec is None:
        raise OpError(f"op {op!r} has no attribute {name!r}; it takes {sorted(ops.SPECS[op].attrs) or 'none'}")
    which = attr.WhichOneof("value")
    want = {"int": "i", "float": "f", "bool": "b", "str": "s", "ints": "ints", "floats": "floats",
            "dtype": "dtype", "tensor": "tensor"}[spec.kind]
    if which != want and not (want == "f" and which == "i"):
        raise OpError(f"op {op!r} attribute {name!r} must be {spec.kind}, got {which or 'nothing'}")
    if which == "ints":
        return tuple(attr.ints.values)
    if which == "floats":
        return tuple(attr.floats.values)
    if which == "dtype":
        return dtypes.from_proto(attr.dtype)
    if which == "tensor":
        return tensors.from_proto(attr.tensor).copy()
    if which == "i" and want == "f":
        return float(attr.i)
    return getattr(attr, which)


def _type_from_proto(t: graph_pb2.TensorType, what: str) -> TensorType:
    try:
        return TensorType(dtypes.from_proto(t.dtype), tensors.check_shape(t.shape))
    except ValueError as e:
        raise GraphError(f"{what}: {e}") from e


def _type_to_proto(t: TensorType) -> graph_pb2.TensorType:
    return graph_pb2.TensorType(dtype=dtypes.to_proto(t.dtype), shape=t.shape)


def parse(proto: graph_pb2.Graph) -> Graph:
    """Validates a graph proto and returns it in topological order."""
    seen: dict[str, TensorType] = {}

    def declare(name: str, t: TensorType, what: str) -> None:
        if not name:
            raise GraphError(f"{what} with an empty name")
        if name in seen:
            raise GraphError(f"name {name!r} is defined twice")
        seen[name] = t

    inputs = {}
    for vi in proto.inputs:
        inputs[vi.name] = _type_from_proto(vi.type, f"input {vi.name!r}")
        declare(vi.name, inputs[vi.name], "input")
    params = {}
    for vi in proto.params:
        params[vi.name] = _type_from_proto(vi.type, f"param {vi.name!r}")
        declare(vi.name, params[vi.name], "param")
    pending: dict[str, graph_pb2.Node] = {}
    for node in proto.nodes:
        if not node.name:
            raise GraphError(f"a {node.op!r} node has an empty name")
        if node.name in seen or node.name in pending:
            raise GraphError(f"name {node.name!r} is defined twice")
        pending[node.name] = node
    for node in pending.values():
        for ref in node.inputs:
            if ref not in seen and ref not in pending:
                raise GraphError(f"node {node.name!r} ({node.op}) reads {ref!r}, which is not defined (dangling input)")
    order: list[Node] = []
    # Kahn's algorithm, always taking the earliest declared of the ready nodes: a graph declared in a valid order
    # keeps it, so nodes its builder placed side by side stay side by side (a layer's two KV scatters, which the
    # torch backend fuses on CUDA only when nothing runs between them), and the plan is deterministic.
    declared = {name: i for i, name in enumerate(pending)}
    waiting = {name: sum(1 for r in n.inputs if r in pending) for name, n in pending.items()}
    readers: dict[str, list[str]] = {}
    for name, n in pending.items():
        for r in n.inputs:
            if r in pending:
                readers.setdefault(r, []).append(name)
    ready = [declared[name] for name, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    names = list(pending)
    while ready:
        name = names[heapq.heappop(ready)]
        order.append(_check_node(pending[name], seen))
        seen[name] = order[-1].type
        for reader in readers.get(name, ()):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, declared[reader])
    if len(order) != len(pending):
        stuck = sorted(name for name in pending if name not in seen)
        raise GraphError(f"graph {proto.name!r} has a cycle through {stuck}")
    if not proto.outputs:
        raise GraphError(f"graph {proto.name!r} has no outputs")
    for out in proto.outputs:
        if out not in seen:
            raise GraphError(f"output {out!r} is not defined")
    return Graph(proto.name, inputs, params, tuple(order), tuple(proto.outputs))


def _check_node(node: graph_pb2.Node, seen: dict[str, TensorType]) -> Node:
    try:
        if node.op not in ops.SPECS:
            raise OpError(f"unknown op {node.op!r}")
        raw = {k: _attr_from_proto(node.op, k, v) for k, v in node.attrs.items()}
        attrs = ops.resolve_attrs(node.op, raw)
        inferred = ops.infer(node.op, [seen[r] for r in node.inputs], attrs)
    except (OpError, ValueError) as e:
        raise GraphError(f"node {node.name!r} ({node.op}): {e}") from e
    if node.HasField("type"):
        declared = _type_from_proto(node.type, f"node {node.name!r}")
        if declared != inferred:
            raise GraphError(f"node {node.name!r} ({node.op}) declares {declared} but its inputs give {inferred}")
    return Node(node.name, node.op, tuple(node.inputs), attrs, inferred)


Operand = Value | float | int


def _window_softcap(window: int, softcap: float) -> dict[str, Any]:
    """An attention node's window and softcap attributes only where set: a plain node stays as it was."""
    return ({"window": window} if window else {}) | ({"softcap": softcap} if softcap else {})


class GraphBuilder:
    """Builds a graph one op at a time; types are inferred as you go.

    g = GraphBuilder("mlp"); x = g.input("x", (4, 8)); w = g.param("w", (8, 3))
    g.output(g.relu(g.matmul(x, w))); proto = g.build()
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._proto = graph_pb2.Graph(name=name)
        self._names: set[str] = set()
        self._counter = 0

    def _declare(self, name: str) -> str:
        if name in self._names:
            raise GraphError(f"name {name!r} is defined twice")
        self._names.add(name)
        return name

    def input(self, name: str, shape: Sequence[int], dtype: str = "f32") -> Value:
        t = TensorType(dtypes.check(dtype), tensors.check_shape(shape))
        self._proto.inputs.add(name=self._declare(name), type=_type_to_proto(t))
        return Value(name, t)

    def param(self, name: str, shape: Sequence[int], dtype: str = "f32") -> Value:
        t = TensorType(dtypes.check(dtype), tensors.check_shape(shape))
        self._proto.params.add(name=self._declare(name), type=_type_to_proto(t))
        return Value(name, t)

    def output(self, *values: Value) -> None:
        self._proto.outputs.extend(v.name for v in values)

    def build(self) -> graph_pb2.Graph:
        # Fail here, at the author's line, not on the executor. Every node was type-checked as it was added, so
        # what is left is a Value of another builder: a name this graph never defined. A full parse() would redo
        # the whole inference, a third of the cost of each stage executable a re-plan compiles.
        for node in self._proto.nodes:
            for ref in node.inputs:
                if ref not in self._names:
                    raise GraphError(f"node {node.name!r} ({node.op}) reads {ref!r}, which is not defined here")
        if not self._proto.outputs:
            raise GraphError(f"graph {self.name!r} has no outputs")
        for out in self._proto.outputs:
            if out not in self._names:
                raise GraphError(f"output {out!r} is not defined")
        return self._proto

    def node(self, op: str, inputs: Sequence[Operand], name: str | None = None, **attrs: Any) -> Value:
        """Adds one node of any op; the typed methods below call this."""
        values = [self._lift(v, inputs) for v in inputs]
        resolved = ops.resolve_attrs(op, attrs)
        t = ops.infer(op, [v.type for v in values], resolved)
        if name is None:
            self._counter += 1
            name = f"{op}_{self._counter}"
        spec = ops.SPECS[op]
        node = self._proto.nodes.add(name=self._declare(name), op=op, inputs=[v.name for v in values],
                                     type=_type_to_proto(t))
        for key, value in attrs.items():
            node.attrs[key].CopyFrom(_attr_to_proto(spec.attrs[key].kind, value))
        return Value(name, t)

    def _lift(self, v: Operand, others: Sequence[Operand]) -> Value:
        if isinstance(v, Value):
            return v
        like = next((o for o in others if isinstance(o, Value)), None)
        dtype = like.dtype if like is not None else "f32"
        return self.constant(np.array(v, dtype=dtypes.to_numpy(dtype)))

    # One method per op, in the order of graphmesh.ops.
    def neg(self, x: Value) -> Value: return self.node("neg", [x])
    def exp(self, x: Value) -> Value: return self.node("exp", [x])
    def log(self, x: Value) -> Value: return self.node("log", [x])
    def sqrt(self, x: Value) -> Value: return self.node("sqrt", [x])
    def rsqrt(self, x: Value) -> Value: return self.node("rsqrt", [x])
    def tanh(self, x: Value) -> Value: return self.node("tanh", [x])
    def sigmoid(self, x: Value) -> Value: return self.node("sigmoid", [x])
    def relu(self, x: Value) -> Value: return self.node("relu", [x])
    def silu(self, x: Value) -> Value: return self.node("silu", [x])
    def gelu(self, x: Value, approximate: str = "none") -> Value: return self.node("gelu", [x], approximate=approximate)
    def add(self, a: Operand, b: Operand) -> Value: return self.node("add", [a, b])
    def sub(self, a: Operand, b: Operand) -> Value: return self.node("sub", [a, b])
    def mul(self, a: Operand, b: Operand) -> Value: return self.node("mul", [a, b])
    def div(self, a: Operand, b: Operand) -> Value: return self.node("div", [a, b])
    def pow(self, a: Operand, b: Operand) -> Value: return self.node("pow", [a, b])

    def matmul(self, a: Value, b: Value, transpose_a: bool = False, transpose_b: bool = False) -> Value:
        return self.node("matmul", [a, b], transpose_a=transpose_a, transpose_b=transpose_b)

    def sum(self, x: Value, axes: Sequence[int] = (), keepdims: bool = False) -> Value:
        return self.node("sum", [x], axes=tuple(axes), keepdims=keepdims)

    def mean(self, x: Value, axes: Sequence[int] = (), keepdims: bool = False) -> Value:
        return self.node("mean", [x], axes=tuple(axes), keepdims=keepdims)

    def max(self, x: Value, axes: Sequence[int] = (), keepdims: bool = False) -> Value:
        return self.node("max", [x], axes=tuple(axes), keepdims=keepdims)

    def softmax(self, x: Value, axis: int = -1) -> Value: return self.node("softmax", [x], axis=axis)

    def layer_norm(self, x: Value, gamma: Value, beta: Value, eps: float = 1e-5) -> Value:
        return self.node("layer_norm", [x, gamma, beta], eps=eps)

    def rms_norm(self, x: Value, gamma: Value, eps: float = 1e-6) -> Value:
        return self.node("rms_norm", [x, gamma], eps=eps)

    def gather(self, table: Value, indices: Value, axis: int = 0) -> Value:
        return self.node("gather", [table, indices], axis=axis)

    def reshape(self, x: Value, shape: Sequence[int]) -> Value: return self.node("reshape", [x], shape=tuple(shape))
    def transpose(self, x: Value, perm: Sequence[int]) -> Value: return self.node("transpose", [x], perm=tuple(perm))
    def concat(self, xs: Sequence[Value], axis: int = 0) -> Value: return self.node("concat", list(xs), axis=axis)

    def slice(self, x: Value, axis: int, start: int, end: int) -> Value:
        return self.node("slice", [x], axis=axis, start=start, end=end)

    def cast(self, x: Value, dtype: str) -> Value: return self.node("cast", [x], dtype=dtype)
    def constant(self, value: np.ndarray, name: str | None = None) -> Value:
        return self.node("constant", [], name=name, value=np.asarray(value))

    def rope(self, x: Value, positions: Value, theta: float = 10000.0, style: str = "half",
             rotary_dim: int = 0, inv_freq: tuple[float, ...] = (), scale: float = 1.0) -> Value:
        # the scaled variants' attributes only where set: an unscaled rope's node stays as it was
        extra: dict[str, Any] = ({"inv_freq": inv_freq} if inv_freq else {}) | ({"scale": scale} if scale != 1.0 else {})
        return self.node("rope", [x, positions], theta=theta, style=style, rotary_dim=rotary_dim, **extra)

    def attention(self, q: Value, k: Value, v: Value, q_positions: Value | None = None, causal: bool = True,
                  scale: float = 0.0, window: int = 0, softcap: float = 0.0) -> Value:
        ins = [q, k, v] + ([q_positions] if q_positions is not None else [])
        return self.node("attention", ins, causal=causal, scale=scale, **_window_softcap(window, softcap))

    def kv_write(self, cache: Value, rows: Value, position: Value) -> Value:
        return self.node("kv_write", [cache, rows, position])

    def kv_scatter(self, pool: Value, rows: Value, slots: Value) -> Value:
        return self.node("kv_scatter", [pool, rows, slots])

    def paged_attention(self, q: Value, k_pool: Value, v_pool: Value, block_table: Value, token_seq: Value,
                        q_positions: Value, block_size: int, decode: bool = False, scale: float = 0.0,
                        window: int = 0, softcap: float = 0.0) -> Value:
        return self.node("paged_attention", [q, k_pool, v_pool, block_table, token_seq, q_positions],
                         block_size=block_size, decode=decode, scale=scale, **_window_softcap(window, softcap))

    def top_k(self, x: Value, k: int) -> Value: return self.node("top_k", [x], k=k)

    def take_along_axis(self, x: Value, indices: Value, axis: int = -1) -> Value:
        return self.node("take_along_axis", [x, indices], axis=axis)

    def grouped_matmul(self, x: Value, w: Value, expert_ids: Value) -> Value:
        return self.node("grouped_matmul", [x, w, expert_ids])

    def argmax(self, x: Value, axis: int = -1) -> Value: return self.node("argmax", [x], axis=axis)

    def sample(self, logits: Value, temperature: Value, top_k: Value, top_p: Value, seed: Value) -> Value:
        return self.node("sample", [logits, temperature, top_k, top_p, seed])

    def dequant_matmul(self, x: Value, packed: Value, scheme: str, n: int, k: int, activations: str = "f32") -> Value:
        return self.node("dequant_matmul", [x, packed], scheme=scheme, n=n, k=k, activations=activations)
