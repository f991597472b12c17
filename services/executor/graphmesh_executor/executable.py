"""The ExecutableGraph trait in Python, and the state every backend shares.

`Executable` mirrors the seed trait method for method. It owns what is the
same on every backend (params, handles, feeds, active extent, RNG policy,
MoE residency accounting, the interpreter loop with buffer liveness); a
backend subclass supplies the kernel table and host<->device conversion in
one short file (backends/<name>_backend.py).

Values inside an executable are backend-native arrays; everything crossing
the public methods is numpy. Methods raise graphmesh.errors types, which the
servicer maps to gRPC statuses.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import numpy as np

from graphmesh import dtypes
from graphmesh.dtypes import FLOAT_DTYPES
from graphmesh.errors import FailedPrecondition, InvalidArgument, NotFound, OutOfRange
from graphmesh.graph import Graph, Node
from graphmesh.ops import OpError, TensorType, infer

T = TypeVar("T")


@dataclass(frozen=True)
class Capabilities:
    clone: bool = True
    moe: bool = True
    persistent_handles: bool = True
    resident_handles: bool = False
    kv_resident: bool = True
    typed_io: bool = True
    async_pipeline: bool = False
    active_extent: bool = False


@dataclass(frozen=True)
class RngOptions:
    seed: int = 42
    backend: str = "splitmix"  # "splitmix" | "zero"


@dataclass
class MoeStats:
    resident_expert_calls: int = 0
    offloaded_expert_calls: int = 0
    resident_tokens: int = 0
    offloaded_tokens: int = 0


@dataclass
class RunContext:
    """What kernels may read besides their inputs."""

    rng: RngOptions
    extent: tuple[int, int] | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    light: bool = False  # a run of a step of few sessions: its products may borrow an idle core (cpu_kernels)
    # Where a backend tallies experts on its device: [grouped products, 2, experts], tokens then calls (runs that
    # gave the expert rows), added to by each grouped product (see Executable._tally_experts)
    tally: Any = None


class HostOutput:
    """An output on its way to the host: `result()` returns it once the device has made it. A run on the host
    is one already (`wait` None); on CUDA the copy is queued behind the run and `wait` blocks for it, so whoever
    launched the run need not be the thread that waits."""

    def __init__(self, value: np.ndarray | None = None, wait: Callable[[], np.ndarray] | None = None) -> None:
        self._value, self._wait = value, wait

    @property
    def ready(self) -> bool:
        return self._wait is None

    def result(self) -> np.ndarray:
        if self._wait is not None:
            self._value, self._wait = self._wait(), None
        assert self._value is not None
        return self._value


class Arrival(Protocol):
    """How a device value that is not here yet arrives: a bundle of a run queued on the device (transport.py)."""

    def arrive(self, stream: Any) -> None:
        """Queues its arrival on `stream` (None off CUDA: waits for it here); once, for every value of its bundle."""

    def release(self) -> None:
        """Its step fails: lets every stream of this process that waits for the run's bundles go on."""


@dataclass(eq=False)
class DeviceValue:
    """A boundary value that stays on the device (a backend tensor): described as the host array it stands for
    (numpy dtype and shape), so a route's schema checks it as one, and with the event (or None) that a stream must
    wait for before it reads the tensor: a copy another process or stream still has in flight. A value with an
    `arrival` is not here yet: its tensor is that of the first stream that reads it (`on`)."""

    tensor: Any
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    ready: Any = None
    arrival: Arrival | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def head(self, rows: int) -> DeviceValue:
        """Its first `rows` rows (a view)."""
        return DeviceValue(self.tensor[:rows], self.dtype, (rows, *self.shape[1:]), self.ready)

    def on(self, stream: Any) -> Any:
        """Its tensor, for `stream` to read (None: the host, off CUDA): once it has arrived, after its event."""
        if self.arrival is not None:
            self.arrival.arrive(stream)
        if self.ready is not None and stream is not None:
            stream.wait_event(self.ready)
        return self.tensor


_MASK64 = (1 << 64) - 1
MAX_CUTS = 64  # graphs cut to an active extent, kept per executable


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(rng: RngOptions, seed: int, row: int) -> float:
    """The draw of a sample op: the same on every backend for the same policy, seed and row."""
    if rng.backend == "zero":
        return 0.0
    x = splitmix64(splitmix64(splitmix64(rng.seed & _MASK64) ^ (seed & _MASK64)) ^ row)
    return (x >> 11) * 2.0**-53


def sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """Seeded sampling of one row, in float64 so every backend picks the same token."""
    x = logits.astype(np.float64)
    if temperature <= 0.0:
        return int(np.argmax(x))
    x = x / temperature
    order = np.argsort(-x, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(x[order] - x[order[0]])
    p /= p.sum()
    if 0.0 < top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
        p = p[:keep] / p[:keep].sum()
    cum = np.cumsum(p)
    return int(order[min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(cum) - 1)])


def sample_rows(rng: RngOptions, logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                seed: np.ndarray) -> np.ndarray:
    """The sample op on host arrays. Each setting is one for every row (scalar or [1]) or one per row ([B]). With one
    seed, row b draws with that seed and row index b; with a seed per row, row b draws with its own seed and row
    index 0, so each session of a batch draws exactly what it draws alone (a batch of one is both)."""
    per_row = seed.size == logits.shape[0] > 1

    def setting(x: np.ndarray, b: int) -> Any:
        return x.reshape(-1)[b if x.size > 1 else 0].item()

    return np.array([sample_row(row, float(setting(temperature, b)), int(setting(top_k, b)), float(setting(top_p, b)),
                                uniform(rng, int(setting(seed, b)), 0 if per_row else b))
                     for b, row in enumerate(logits)], np.int64)


def _convertible(have: str, want: str) -> bool:
    if have == want:
        return True
    ints = ("i64", "i32")
    return (have in FLOAT_DTYPES and want in FLOAT_DTYPES) or (have in ints and want in ints)


def conform(array: np.ndarray, want: TensorType, what: str) -> np.ndarray:
    """Checks an incoming array against its declared type; casts within float or within int."""
    have = dtypes.from_numpy(array.dtype)
    if tuple(array.shape) != want.shape:
        raise InvalidArgument(f"{what} must have shape {list(want.shape)}, got {list(array.shape)}", "SHAPE_MISMATCH")
    if not _convertible(have, want.dtype):
        raise InvalidArgument(f"{what} must be {want.dtype}, got {have}", "DTYPE_MISMATCH")
    return array if have == want.dtype else array.astype(dtypes.to_numpy(want.dtype))


Kernel = Callable[[RunContext, list[Any], dict[str, Any]], Any]


@dataclass
class ExtentCut:
    """A graph computing only the first `actual` of the `upper` rows of its bucket axis."""

    graph: Graph
    actual: int
    inputs: frozenset[str]  # the inputs cut to `actual` rows
    padded: tuple[int, ...]  # output indices cut too: padded back to `upper` rows after the run
    plan: Any = None  # what a backend makes of `graph` at its first run, kept with it (and dropped with it)


def cut_to_extent(graph: Graph, fed: Sequence[str], actual: int, upper: int) -> ExtentCut | None:
    """`graph` over `actual` rows of its bucket axis: axis 0 of the fed inputs declared with `upper` rows, and of
    every value computed from them, reshapes keeping that axis cut. None when no fed input has the axis, or when
    the cut graph does not type-check (an op mixes the axis with a fixed extent): such a graph runs whole."""
    cut = frozenset(name for name in fed if graph.inputs[name].shape[:1] == (upper,))
    if not cut or actual >= upper:
        return None
    seen = {**graph.params, **{name: replace(t, shape=(actual, *t.shape[1:])) if name in cut else t
                               for name, t in graph.inputs.items()}}
    nodes = []
    for node in graph.nodes:
        attrs = node.attrs
        if node.op == "reshape" and tuple(attrs["shape"][:1]) == (upper,) and seen[node.inputs[0]].shape[:1] == (actual,):
            attrs = {**attrs, "shape": (actual, *attrs["shape"][1:])}
        try:
            t = infer(node.op, [seen[name] for name in node.inputs], attrs)
        except (OpError, ValueError):
            return None
        seen[node.name] = t
        nodes.append(replace(node, attrs=attrs, type=t))
    inputs = {name: seen[name] for name in graph.inputs}
    padded = tuple(i for i, name in enumerate(graph.outputs) if seen[name] != graph.type_of(name))
    if any(graph.type_of(graph.outputs[i]).shape[:1] != (upper,) or
           seen[graph.outputs[i]].shape[1:] != graph.type_of(graph.outputs[i]).shape[1:] for i in padded):
        return None  # an output whose other axes changed cannot be padded back along axis 0
    return ExtentCut(Graph(graph.name, inputs, graph.params, tuple(nodes), graph.outputs), actual, cut, padded)


def _checked_extent(extent: tuple[int, int]) -> tuple[int, int]:
    actual, upper = extent
    if not 1 <= actual <= upper:
        raise InvalidArgument(f"active extent ({actual}, {upper}) must satisfy 1 <= actual <= upper", "BAD_EXTENT")
    return extent


class Executable(Generic[T]):
    """One compiled graph on one backend. Not thread-safe: callers serialise calls."""

    backend: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities()
    kernels: ClassVar[dict[str, Kernel]]

    @classmethod
    def capabilities_on(cls, device: str) -> Capabilities:
        """What this backend really does on `device` (the class's capabilities, where the device changes nothing)."""
        return cls.capabilities

    def __init__(self, graph: Graph, device: str = "cpu") -> None:
        missing = sorted({n.op for n in graph.nodes} - set(self.kernels))
        if missing:
            raise InvalidArgument(f"backend {self.backend} does not lower op(s) {missing}", "UNSUPPORTED_OP")
        self.graph = graph
        self.device = device
        self.input_names = list(graph.inputs)
        self.output_types = [graph.type_of(name) for name in graph.outputs]
        self._last_use = graph.last_uses()
        self._params: dict[str, T] = {}
        self._handles: dict[str, T] = {}
        self._resident: set[str] = set()
        self._prefix_feeds: dict[str, int] = {}
        self._row_feeds: dict[str, int] = {}
        self._last_outputs: list[T] | None = None
        self._extent: tuple[int, int] | None = None
        self._light = False  # run()'s light, for the run in progress
        self._cuts: dict[tuple[Any, ...], ExtentCut | None] = {}
        self._rng = RngOptions()
        self._pending = 0
        self._moe_masks: list[list[bool]] | None = None
        self._moe_stats = MoeStats()
        self._topk_capture_width: int | None = None
        self._topk_captured: list[list[int]] = []
        self._constants = {n.name: self._from_host(n.attrs["value"]) for n in graph.nodes if n.op == "constant"}

    # -- backend hooks ---------------------------------------------------------------------------------
    def _from_host(self, array: np.ndarray) -> T:
        raise NotImplementedError("need _from_host")

    def _to_host(self, value: T) -> np.ndarray:
        raise NotImplementedError("need _to_host")

    def _zeros(self, t: TensorType) -> T:
        return self._from_host(np.zeros(t.shape, dtypes.to_numpy(t.dtype)))

    def _copy_rows(self, dst: T, dst_start: int, src: T, src_start: int, n: int) -> T:
        """dst[dst_start:dst_start+n] = src[src_start:src_start+n] along axis 0; may update dst in place."""
        raise NotImplementedError("need _copy_rows")

    def _cast(self, value: T, dtype: str) -> T:
        raise NotImplementedError("need _cast")

    def _pad_rows(self, value: T, rows: int) -> T:
        """value with zero rows appended along axis 0 up to `rows` (an output of a run cut to its active extent)."""
        host = self._to_host(value)
        return self._from_host(np.concatenate([host, np.zeros((rows - host.shape[0], *host.shape[1:]), host.dtype)]))

    # -- pool rows: the stage reads and writes its KV pools' rows through these -------------------------
    def take_rows(self, value: T, rows: np.ndarray) -> np.ndarray:
        """value[rows] on the host (axis 0); backends move only those rows."""
        return self._to_host(value)[rows]

    def host_view(self, value: T) -> np.ndarray | None:
        """value's own memory as an f32 host array, no copy; None where it is not (a device's, another dtype)."""
        return None

    def put_rows(self, value: T, rows: np.ndarray, data: np.ndarray) -> T:
        """value[rows] = data (axis 0, cast to value's dtype); backends may write in place."""
        host = self._to_host(value).copy()
        host[rows] = data
        return self._from_host(host)

    def replays_rows(self, rows: int) -> bool:
        """Whether a run whose sequences have at most `rows` rows each may replay a captured graph of its whole bucket,
        far cheaper than an eager run of its real rows alone. False where the backend captures nothing."""
        return False

    def reads_own_blocks(self) -> bool:
        """Whether every paged attention of the graph reads each row's own blocks only, up to its position, so that a
        block table's width costs nothing and one width may serve every run. False where the backend does not say
        so."""
        return False

    # -- params ----------------------------------------------------------------------------------------
    def _param_type(self, name: str) -> TensorType:
        if name not in self.graph.params:
            raise NotFound(f"graph {self.graph.name!r} has no param {name!r}", "UNKNOWN_PARAM")
        return self.graph.params[name]

    def set_param(self, name: str, data: np.ndarray) -> None:
        """f32 data, cast to the param's dtype (the trait's set_param)."""
        want = self._param_type(name)
        if want.dtype == "u8":
            raise InvalidArgument(f"param {name!r} holds packed u8 blocks: use set_param_typed", "DTYPE_MISMATCH")
        self._params[name] = self._from_host(conform(np.asarray(data), want, f"param {name!r}"))

    def set_param_typed(self, name: str, data: np.ndarray) -> None:
        want = self._param_type(name)
        self._params[name] = self._from_host(conform(data, want, f"param {name!r}"))

    def finalize_params(self) -> list[str]:
        """Names of params never set; they read as zeros."""
        return [name for name in self.graph.params if name not in self._params]

    def copy_params_from(self, src: Executable[Any]) -> list[str]:
        if type(src) is not type(self) or src.device != self.device:
            return []
        copied = [n for n, t in self.graph.params.items() if n in src._params and src.graph.params.get(n) == t]
        for name in copied:
            self._params[name] = src._params[name]  # params are never mutated in place: sharing is safe
        return copied

    def clone(self) -> Executable[T]:
        twin = copy.copy(self)
        twin._params = dict(self._params)
        twin._handles = {k: self._from_host(self._to_host(v).copy()) for k, v in self._handles.items()}
        twin._resident = set(self._resident)
        twin._prefix_feeds = dict(self._prefix_feeds)
        twin._row_feeds = dict(self._row_feeds)
        twin._last_outputs = None
        twin._cuts = {}
        twin._moe_stats = MoeStats()
        twin._topk_captured = []
        return twin

    # -- running ---------------------------------------------------------------------------------------
    def _check_input_names(self, inputs: dict[str, np.ndarray]) -> None:
        for name in inputs:
            if name not in self.graph.inputs:
                raise NotFound(f"graph {self.graph.name!r} has no input {name!r}; inputs are {self.input_names}",
                               "UNKNOWN_INPUT")

    def _gather_inputs(self, inputs: dict[str, np.ndarray]) -> dict[str, T]:
        self._check_input_names(inputs)
        env: dict[str, T] = {}
        for name, t in self.graph.inputs.items():
            if name in inputs:
                env[name] = self._from_host(conform(inputs[name], t, f"input {name!r}"))
            elif name in self._handles:
                env[name] = self._handles[name]
            else:
                env[name] = self._zeros(t)
        return env

    def _execute(self, env: dict[str, T], cut: ExtentCut | None = None) -> list[T]:
        """Interprets this graph, or `cut` (this one cut to the active extent: the same nodes), in topological
        order, dropping buffers after their last reader."""
        ctx = RunContext(self._rng, self._extent, light=self._light)
        for name, t in self.graph.params.items():
            env[name] = self._params[name] if name in self._params else self._zeros(t)
        outputs = set(self.graph.outputs)
        gmm_ordinal = 0
        for i, node in enumerate((cut.graph if cut else self.graph).nodes):
            if node.op == "constant":
                env[node.name] = self._constants[node.name]
            else:
                env[node.name] = self.kernels[node.op](ctx, [env[n] for n in node.inputs], node.attrs)
            if node.op == "top_k" and self._topk_capture_width == self.graph.type_of(node.inputs[0]).shape[-1]:
                self._topk_captured.append([int(v) for v in self._to_host(env[node.name]).reshape(-1)])
            if node.op == "grouped_matmul":
                tokens = np.bincount(self._to_host(env[node.inputs[2]]).reshape(-1),
                                     minlength=self.graph.type_of(node.inputs[1]).shape[0])
                self._tally_experts(gmm_ordinal, tokens, tokens > 0)
                gmm_ordinal += 1
            for name in node.inputs:
                if self._last_use.get(name) == i and name not in outputs and name not in self.graph.params:
                    env.pop(name, None)
        return [env[name] for name in self.graph.outputs]

    def run(self, inputs: dict[str, np.ndarray], read_indices: Sequence[int] | None = None,
            typed: bool = False, extent: tuple[int, int] | None = None, light: bool = False) -> list[np.ndarray]:
        """Runs once; returns the outputs at read_indices (all when None, none when empty), f32 unless typed.
        `light`: the run is a step of few sessions, whose host is likely idle besides it (RunContext.light)."""
        indices = list(range(len(self.graph.outputs))) if read_indices is None else list(read_indices)
        for i in indices:
            self._check_output_index(i)
        self._run_env(self._gather_inputs(inputs), list(inputs), extent, light)
        return [self.read_output(i, typed) for i in indices]

    def _check_output_index(self, i: int) -> None:
        if not 0 <= i < len(self.graph.outputs):
            raise OutOfRange(f"output index {i} out of range: the graph has {len(self.graph.outputs)} outputs",
                             "OUTPUT_INDEX_OUT_OF_RANGE")

    def run_async(self, inputs: dict[str, np.ndarray], index: int, extent: tuple[int, int] | None = None,
                  light: bool = False) -> HostOutput:
        """run() reading output `index` typed, without waiting for the device: here the run is done on return;
        TorchExecutable on CUDA queues the copy to the host behind it and returns before either ends."""
        return HostOutput(self.run(inputs, [index], typed=True, extent=extent, light=light)[0])

    def _run_env(self, env: dict[str, T], fed: list[str], extent: tuple[int, int] | None, light: bool) -> None:
        """Runs once over gathered inputs (`fed`: the names the caller gave); its outputs become _last_outputs."""
        saved = self._extent
        if extent is not None:
            self._extent = _checked_extent(extent)
        self._light = light
        try:
            cut = self._cut(fed)
            if cut is None:
                outs = self._execute(env)
            else:
                for name in cut.inputs:
                    env[name] = env[name][:cut.actual]  # type: ignore[index]  # every backend's array slices
                outs = self._execute(env, cut)
                for i in cut.padded:
                    outs[i] = self._pad_rows(outs[i], self.output_types[i].shape[0])
        finally:
            self._extent, self._light = saved, False
        self._last_outputs = outs
        for handle, index in self._prefix_feeds.items():
            self._handles[handle] = outs[index]

    def run_fed(self, input_sets: Sequence[dict[str, np.ndarray]], feed: str, rows: int,
                extent: tuple[int, int] | None = None, light: bool = False) -> np.ndarray:
        """Runs each input set in turn, the first `rows` values of input `feed` of every run after the first taken
        from output 0 of the run before (a decode run's sampled tokens are its next iteration's ids; the rest, a
        bucket's padding, keep the set's values: what a padded row samples is never fed); returns output 0 of
        every run, stacked. Here the runs go one after another through the host; TorchExecutable queues them on
        the GPU with one wait for them all."""
        outs: list[np.ndarray] = []
        for inputs in input_sets:
            if outs:
                fed = inputs[feed].copy()
                fed[:rows] = outs[-1][:rows]
                inputs = {**inputs, feed: fed}
            outs.append(self.run(inputs, [0], typed=True, extent=extent, light=light)[0])
        return np.stack(outs)

    def keeps_on_device(self) -> bool:
        """Whether run_on_device serves here: outputs that stay on a GPU for the next rank (TorchExecutable on
        CUDA)."""
        return False

    def run_on_device(self, inputs: dict[str, np.ndarray], index: int, fed: dict[str, DeviceValue],
                      extent: tuple[int, int] | None = None, light: bool = False,
                      host: bool = False) -> tuple[DeviceValue, HostOutput | None]:
        """run_async whose output `index` stays on the device (a copy that later runs do not overwrite) and is read
        to the host too where `host`; each of `fed` is an input given on the device, copied into that input's
        first rows once its ready event has fired. Only where keeps_on_device()."""
        raise FailedPrecondition(f"{type(self).__name__} on {self.device} keeps no output on a device",
                                 "NO_DEVICE_OUTPUTS")

    def host_async(self, values: list[DeviceValue]) -> HostOutput:
        """`values` (device values of one shape, run_on_device's) stacked and on their way to the host."""
        raise FailedPrecondition(f"{type(self).__name__} on {self.device} keeps no output on a device",
                                 "NO_DEVICE_OUTPUTS")

    def read_output(self, index: int, typed: bool = False) -> np.ndarray:
        if self._last_outputs is None:
            raise FailedPrecondition("no run has happened yet on this executable", "NO_OUTPUTS")
        if not 0 <= index < len(self._last_outputs):
            raise OutOfRange(f"output index {index} out of range ({len(self._last_outputs)} outputs)",
                             "OUTPUT_INDEX_OUT_OF_RANGE")
        out = self._to_host(self._last_outputs[index])
        return out if typed else out.astype(np.float32, copy=False)

    def run_slots(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        if len(inputs) > len(self.input_names):
            raise InvalidArgument(f"{len(inputs)} slot inputs for a graph of {len(self.input_names)} inputs",
                                  "TOO_MANY_INPUTS")
        return self.run(dict(zip(self.input_names, inputs)))

    def read_output_row(self, index: int, row: int, row_inner: int) -> np.ndarray:
        """One row of a row-major output, f32; only that row leaves the device."""
        if self._last_outputs is None:
            raise FailedPrecondition("no run has happened yet on this executable", "NO_OUTPUTS")
        if not 0 <= index < len(self._last_outputs):
            raise OutOfRange(f"output index {index} out of range ({len(self._last_outputs)} outputs)",
                             "OUTPUT_INDEX_OUT_OF_RANGE")
        size = int(np.prod(self.output_types[index].shape))
        if row_inner <= 0 or row < 0 or (row + 1) * row_inner > size:
            raise OutOfRange(f"row {row} of width {row_inner} is outside output {index} ({size} elements)",
                             "ROW_OUT_OF_RANGE")
        flat = self._last_outputs[index].reshape(-1)  # type: ignore[attr-defined]  # every backend's array
        return self._to_host(flat[row * row_inner:(row + 1) * row_inner]).astype(np.float32, copy=False)

    def commit_no_wait(self, inputs: dict[str, np.ndarray]) -> None:
        """Runs without reading any output back; on a device that queues work, without waiting for it either."""
        self.run(inputs, read_indices=[])
        self._pending += 1

    def sync_pending(self) -> int:
        done, self._pending = self._pending, 0
        return done

    def run_pipelined(self, input_sets: Sequence[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
        return [self.run(inputs) for inputs in input_sets]

    def _cut(self, fed: list[str]) -> ExtentCut | None:
        """The graph cut to the active extent for a run fed `fed`, when this backend honours extents (memoised: a
        stage's steps come in a few shapes)."""
        if self._extent is None or not self.capabilities.active_extent:
            return None
        key = (*self._extent, *sorted(fed))
        if key not in self._cuts:
            if len(self._cuts) >= MAX_CUTS:
                self._cuts.pop(next(iter(self._cuts)))
            self._cuts[key] = cut_to_extent(self.graph, fed, *self._extent)
        return self._cuts[key]

    def set_active_extent(self, extent: tuple[int, int] | None) -> bool:
        self._extent = None if extent is None else _checked_extent(extent)
        if extent is None or not self.capabilities.active_extent:
            return self.capabilities.active_extent
        # Honoured when a run fed every input that is not a bound handle could be cut to it.
        return self._cut([name for name in self.graph.inputs if name not in self._handles]) is not None

    def set_rng(self, rng: RngOptions) -> None:
        if rng.backend not in ("splitmix", "zero"):
            raise InvalidArgument(f"unknown rng backend {rng.backend!r}", "BAD_RNG")
        self._rng = rng

    def rng(self) -> RngOptions:
        return self._rng

    # -- handles ---------------------------------------------------------------------------------------
    def _handle_type(self, name: str) -> TensorType:
        if name not in self.graph.inputs:
            raise NotFound(f"handle {name!r} is not an input of graph {self.graph.name!r}", "UNKNOWN_HANDLE")
        return self.graph.inputs[name]

    def bind_handle(self, name: str, data: np.ndarray, resident: bool = False) -> bool:
        """Binds a persistent buffer; with `resident`, answers whether it lives on the device (a backend without
        one binds it all the same, on the host, and says no)."""
        value = self._from_host(conform(data, self._handle_type(name), f"handle {name!r}"))
        self._handles[name] = value
        self._resident.discard(name)
        if resident:
            self._mark_resident(name)
        return not resident or self.capabilities.resident_handles

    def _mark_resident(self, name: str) -> None:
        """`name` now lives on the device, where the backend has one apart from the host."""
        if self.capabilities.resident_handles:
            self._resident.add(name)

    def prepare_resident_handle(self, name: str) -> bool:
        """Makes input `name` a handle that lives on the device with no host copy (prepare_resident_gpu_handle):
        zeros until a run's feed or a row write fills it, unless already bound. False, changing nothing, where
        the backend has no device apart from the host."""
        t = self._handle_type(name)
        if not self.capabilities.resident_handles:
            return False
        if name not in self._handles:
            self._handles[name] = self._zeros(t)
        self._mark_resident(name)
        return True

    def stage_bound_handles(self) -> list[str] | None:
        """Moves every bound handle that is not resident onto the device (stage_bound_gpu_handles_to_arena) and
        returns their names; None where the backend has no device. Backends with one upload a handle when it is
        bound, so this moves no bytes: it makes them the device's, as resident ones are."""
        if not self.capabilities.resident_handles:
            return None
        staged = sorted(name for name in self._handles if name not in self._resident)
        for name in staged:
            self._mark_resident(name)
        return staged

    def run_feed_handle(self, inputs: dict[str, np.ndarray], handle: str, output_index: int) -> np.ndarray:
        """Runs, stores output `output_index` as `handle` (one prefix feed, on the device), and returns that
        output as f32 (run_feed_gpu_handle)."""
        self._check_feed(handle, output_index, rows_only=False)
        (out,) = self.run(inputs, read_indices=[output_index])
        assert self._last_outputs is not None
        self._handles[handle] = self._last_outputs[output_index]
        self._mark_resident(handle)
        return out

    def _bound(self, name: str) -> T:
        self._handle_type(name)
        if name not in self._handles:
            raise NotFound(f"handle {name!r} is not bound", "UNBOUND_HANDLE")
        return self._handles[name]

    def read_handle(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The handle, or its rows [start, end) along axis 0: only those leave the device."""
        value = self._bound(name)
        if rows is None:
            return self._to_host(value)
        start, end = rows
        extent = self.graph.inputs[name].shape[:1] or (0,)
        if not 0 <= start <= end <= extent[0]:
            raise OutOfRange(f"rows [{start}, {end}) outside handle {name!r} of {extent[0]} rows", "ROW_OUT_OF_RANGE")
        return self._to_host(value[start:end])  # type: ignore[index]  # every backend's array slices on axis 0

    def write_handle_rows(self, name: str, start: int, rows: np.ndarray) -> bool:
        t = self._handle_type(name)
        if name not in self._handles:
            self._handles[name] = self._zeros(t)
        if not t.shape or rows.ndim != len(t.shape) or tuple(rows.shape[1:]) != t.shape[1:]:
            raise InvalidArgument(f"rows of shape {list(rows.shape)} do not fit handle {name!r} {t}", "SHAPE_MISMATCH")
        if start < 0 or start + rows.shape[0] > t.shape[0]:
            raise OutOfRange(f"rows [{start}, {start + rows.shape[0]}) outside handle {name!r} of {t.shape[0]} rows",
                             "ROW_OUT_OF_RANGE")
        row_type = replace(t, shape=tuple(rows.shape))
        src = self._from_host(conform(rows, row_type, f"rows for {name!r}"))
        self._handles[name] = self._copy_rows(self._handles[name], start, src, 0, rows.shape[0])
        return True

    def swap_handles(self, handles: dict[str, T]) -> dict[str, T]:
        """Installs another handle set and returns the current one, in O(1).

        The stage runtime keeps each session's KV handles outside the executable and swaps them in
        for a run, so one compiled executable per shape serves every session without copying KV.
        """
        previous, self._handles = self._handles, handles
        return previous

    def zeros_like_inputs(self, names: Sequence[str]) -> list[T]:
        """Zero-filled buffers shaped like these handles (a stage's KV pool, one per layer and kind)."""
        return [self._zeros(self._handle_type(name)) for name in names]

    def has_handle(self, name: str) -> tuple[bool, bool]:
        return name in self._handles, name in self._resident

    def _check_feed(self, handle: str, output_index: int, rows_only: bool) -> None:
        t = self._handle_type(handle)
        if not 0 <= output_index < len(self.output_types):
            raise OutOfRange(f"output index {output_index} out of range ({len(self.output_types)} outputs)",
                             "OUTPUT_INDEX_OUT_OF_RANGE")
        out = self.output_types[output_index]
        if out.dtype != t.dtype or (not rows_only and out.shape != t.shape):
            raise InvalidArgument(f"output {output_index} {out} cannot feed handle {handle!r} {t}", "SHAPE_MISMATCH")

    def set_handle_feed(self, handle: str, output_index: int) -> bool:
        self._check_feed(handle, output_index, rows_only=False)
        self._prefix_feeds[handle] = output_index
        self._mark_resident(handle)
        return True

    def register_kv_row_feed(self, handle: str, output_index: int) -> bool:
        self._check_feed(handle, output_index, rows_only=True)
        self._prefix_feeds.pop(handle, None)
        self._row_feeds[handle] = output_index
        return True

    def feed_kv_row(self, src_row: int, dst_row: int, row_elems: int) -> bool:
        """Folds row src_row of each fed output into row dst_row of its handle, all or nothing."""
        if self._last_outputs is None:
            raise FailedPrecondition("feed_kv_row before any run", "NO_OUTPUTS")
        if row_elems <= 0:
            raise InvalidArgument(f"row_elems must be positive, got {row_elems}", "BAD_ROW")
        for handle, index in self._row_feeds.items():
            sizes = (int(np.prod(self.output_types[index].shape)), int(np.prod(self.graph.inputs[handle].shape)))
            if any(size % row_elems for size in sizes):
                raise InvalidArgument(f"row_elems {row_elems} does not divide output {index} or handle {handle!r} "
                                      f"({sizes[0]} and {sizes[1]} elements)", "BAD_ROW")
        plan = []
        for handle, index in self._row_feeds.items():
            t = self.graph.inputs[handle]
            out_rows = int(np.prod(self.output_types[index].shape)) // row_elems
            handle_rows = int(np.prod(t.shape)) // row_elems
            if not 0 <= src_row < out_rows or not 0 <= dst_row < handle_rows:
                raise OutOfRange(f"feed of row {src_row} into row {dst_row} of {handle!r}: output has {out_rows} "
                                 f"rows and the handle {handle_rows} of {row_elems} elements", "ROW_OUT_OF_RANGE")
            plan.append((handle, index, t))
        for handle, index, t in plan:
            if handle not in self._handles:
                self._handles[handle] = self._zeros(t)
            row = self._to_host(self._last_outputs[index]).reshape(-1, row_elems)[src_row:src_row + 1]
            current = self._to_host(self._handles[handle]).reshape(-1, row_elems).copy()
            current[dst_row] = row[0]
            self._handles[handle] = self._from_host(current.reshape(t.shape))
            self._mark_resident(handle)
        return True

    def copy_resident_kv_rows_from(self, src: Executable[Any], from_row: int, to_row: int, outgoing_upper: int,
                                   kv_dim: int, n_layers: int) -> bool:
        """Copies rows [from_row, to_row) of past_k_{i}/past_v_{i} from src; rows from to_row on are zeroed."""
        if from_row >= to_row or n_layers == 0 or kv_dim == 0:
            return True
        if type(src) is not type(self) or src.device != self.device:
            return False
        if from_row < 0:
            raise OutOfRange(f"from_row {from_row} is negative", "ROW_OUT_OF_RANGE")
        staged: dict[str, np.ndarray] = {}
        for i in range(n_layers):
            for j, kind in enumerate(("k", "v")):
                name = f"past_{kind}_{i}"
                t = self._handle_type(name)
                dst_rows = int(np.prod(t.shape)) // kv_dim
                if to_row > dst_rows:
                    raise OutOfRange(f"rows up to {to_row} do not fit {name!r} of {dst_rows} rows", "ROW_OUT_OF_RANGE")
                source = src._to_host(src._bound(name)).reshape(-1, kv_dim)
                out = np.zeros((dst_rows, kv_dim), dtypes.to_numpy(t.dtype))
                if name in self._handles:
                    out[:from_row] = self._to_host(self._handles[name]).reshape(-1, kv_dim)[:from_row]
                direct = min(to_row, source.shape[0])
                out[from_row:direct] = source[from_row:direct]
                for g in range(max(direct, from_row), to_row):
                    if g != outgoing_upper or src._last_outputs is None:
                        raise OutOfRange(f"row {g} is outside the source's {name!r} ({source.shape[0]} rows)",
                                         "ROW_OUT_OF_RANGE")
                    out[g] = src._to_host(src._last_outputs[1 + 2 * i + j]).reshape(-1, kv_dim)[g]
                staged[name] = out.reshape(t.shape)
        for name, value in staged.items():
            self._handles[name] = self._from_host(value)
            self._mark_resident(name)
        return True

    def seed_resident_kv_prefix_from(self, src: Executable[Any], prefix_tokens: int, outgoing_upper: int,
                                     kv_dim: int, n_layers: int) -> bool:
        return self.copy_resident_kv_rows_from(src, 0, prefix_tokens, outgoing_upper, kv_dim, n_layers)

    # -- MoE -------------------------------------------------------------------------------------------
    def _moe_layers(self) -> list[Node]:
        return [n for n in self.graph.nodes if n.op == "grouped_matmul"][::3]

    def _num_experts(self) -> int:
        layers = self._moe_layers()
        return self.graph.type_of(layers[0].inputs[1]).shape[0] if layers else 0

    def set_moe_resident_experts(self, mask: Sequence[bool]) -> bool:
        n_layers, n_experts = len(self._moe_layers()), self._num_experts()
        if len(mask) != n_experts:
            raise InvalidArgument(f"residency mask has {len(mask)} entries; the graph has {n_experts} experts",
                                  "BAD_MASK")
        self._flush_expert_tally()
        self._moe_masks = [list(mask)] * n_layers
        return True

    def set_moe_resident_experts_per_layer(self, masks: Sequence[Sequence[bool]]) -> bool:
        n_layers, n_experts = len(self._moe_layers()), self._num_experts()
        if len(masks) != n_layers or any(len(m) != n_experts for m in masks):
            raise InvalidArgument(f"per-layer masks must be {n_layers} x {n_experts}, got "
                                  f"{len(masks)} x {[len(m) for m in masks]}", "BAD_MASK")
        self._flush_expert_tally()
        self._moe_masks = [list(m) for m in masks]
        return True

    def _tally_experts(self, ordinal: int, tokens: np.ndarray, calls: np.ndarray) -> None:
        """Adds grouped product `ordinal`'s rows per expert and calls per expert (runs that gave it rows) to the
        residency stats, each expert resident or offloaded by its layer's mask (a layer's gate, up and down are
        three products)."""
        layer = ordinal // 3
        mask = self._moe_masks[layer] if self._moe_masks and layer < len(self._moe_masks) else None
        resident = np.array([mask is None or (e < len(mask) and mask[e]) for e in range(len(tokens))], bool)
        stats = self._moe_stats
        stats.resident_expert_calls += int(calls[resident].sum())
        stats.resident_tokens += int(tokens[resident].sum())
        stats.offloaded_expert_calls += int(calls[~resident].sum())
        stats.offloaded_tokens += int(tokens[~resident].sum())

    def _flush_expert_tally(self) -> None:
        """Hands counts a backend keeps on its device to _tally_experts: before the stats are read or a mask
        changes. The interpreter tallies on the host as it runs: nothing waits here."""

    def enable_moe_topk_capture(self, num_experts: int) -> bool:
        self._topk_capture_width = num_experts
        return True

    def take_moe_topk_capture(self) -> list[list[int]] | None:
        captured, self._topk_captured = self._topk_captured, []
        return captured or None

    def take_moe_residency_stats(self) -> MoeStats:
        self._flush_expert_tally()
        stats, self._moe_stats = self._moe_stats, MoeStats()
        return stats

