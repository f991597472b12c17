"""The stage runtime's state and the types it speaks: its spec, a step's rows and result, a session, a boundary's
bundle, committed KV blocks (the proto messages as the runtime holds them), and what every part of the runtime
(stage.py's protocol, stage_inputs.py's run inputs, stage_kv.py's KV import and export) reads of its state."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from graphmesh.errors import NotFound
from graphmesh.kvkeys import blocks_for
from graphmesh.models.config import ModelConfig
from graphmesh_executor.engine import Engine
from graphmesh_executor.executable import DeviceValue, Executable
from graphmesh_executor.fencing import Authority, SessionTxn
from graphmesh_executor.kv_pool import KvPool
from graphmesh_executor.logprobs import RowLogprobs


@dataclass(frozen=True)
class StageSpec:
    """The proto's StageSpec as the stage runtime holds it."""

    model: str
    layer_start: int
    layer_end: int
    first: bool
    last: bool
    weights: str = "f32"
    max_context_tokens: int = 0
    kvstore_address: str = ""
    kv_block_tokens: int = 16
    dtype: str = ""  # "" resolves to bf16 on CUDA, f32 on CPU


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logprobs: bool = False  # the last stage samples on the host and returns the token's logprob (logprobs.py)
    top_logprobs: int = 0


@dataclass(frozen=True)
class StepRow:
    """One session's part of a step (stage.proto StepRow)."""

    session_id: str
    epoch: int
    commit_epoch: int
    start: int
    token_ids: list[int]
    sampling: Sampling = Sampling()
    # The encoder group's input: features f32 [n, input_dim] of the n placeholder tokens at these offsets into
    # token_ids (stage.proto StepRow)
    encoder_input: np.ndarray | None = None
    encoded_offsets: tuple[int, ...] = ()
    # The guided-decoding mask of the token the row samples (stage.proto StepRow.allowed_tokens): a little-endian
    # uint32 bitmask over the vocabulary; empty: every token. Such a row is sampled on the host (logprobs.py).
    allowed_tokens: bytes = b""
    # Its last `proposed` token_ids are a proposer's guesses (stage.proto StepRow.prediction_target): the last stage
    # samples every position and keeps the proposals its samples agree with.
    proposed: int = 0
    # The folded commit keeps only this many KV rows (a verified chunk's rejected proposals roll back); 0: all.
    commit_length: int = 0
    # In a decode run, the run's tokens this row takes (stage.proto StepRow.decode_steps); 0: all of them.
    steps: int = 0


def copied(row: StepRow, **changes: Any) -> StepRow:
    """A copy of `row` with `changes`, made without dataclasses.replace: that re-runs __init__ for every row, the
    largest host cost of a 256-row decode iteration (profile_stage.py)."""
    out = object.__new__(StepRow)
    out.__dict__.update(row.__dict__)
    out.__dict__.update(changes)
    return out


@dataclass


class StageSession:
    txn: SessionTxn = field(default_factory=SessionTxn)
    tokens: list[int] = field(default_factory=list)  # committed tokens, for KV store keys
    pending_tokens: list[int] = field(default_factory=list)  # tokens of the open epoch
    stored_tokens: int = 0  # tokens already written behind to the KV store
    # Rows were written without their token ids (or out of line with them): `tokens` no longer says which token
    # each row holds, so this session never keys blocks with them (write-behind) nor hands them on (copies).
    untokened: bool = False


@dataclass


class StepResult:
    tokens: list[int] = field(default_factory=list)  # per row (last stage, sampling): a decode run's first
    run_tokens: list[list[int]] = field(default_factory=list)  # per row, every token a decode run sampled (last stage)
    logits: np.ndarray | None = None  # f32 [rows, vocab] (last stage, logits)
    logprobs: list[RowLogprobs | None] = field(default_factory=list)  # per row (last stage, rows that asked)
    kv_lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # per row, the proposals the last stage accepted
    compute_us: float = 0.0
    computed_tokens: int = 0
    waves: list[tuple[int, int, bool]] = field(default_factory=list)  # (wave, group, worked) this rank took part in


# A bundle's value: a host array, or (over a link that maps the sender's GPU) a value that stays on the device
BoundaryValue = np.ndarray | DeviceValue


@dataclass(frozen=True)
class Boundary:
    """A bundle one group hands another over a plan route, for a step or one iteration of a decode run
    (stage.proto PushBoundaryRequest)."""

    step_id: int
    iteration: int = 0  # the decode run's iteration this is the input of
    route_id: int = 0
    values: dict[str, BoundaryValue] = field(default_factory=dict)  # by role (graphmesh.plan), in the schema's order
    schema_identity: str = ""  # the sender's identity of the route's schema
    wave: int = 0  # the wave that produced it


# (address, incarnation, boundary, timeout_s, delivered): may return before delivery; calls delivered(None) once the


# next rank took the bundle, or delivered(error) once it cannot (exactly once, from any thread).


Pusher = Callable[[str, int, Boundary, float, Callable[[Exception | None], None]], None]


class Queue(Protocol):
    """A decode run's bundles over one route from its first queued one on, each written on the device when the
    run's stream gets there (transport.QueuedRun)."""

    def put(self, values: list[Any]) -> None:
        """The run's next bundle, on the caller's current stream."""

    def end(self) -> None:
        """The step is over on this rank, every bundle put and its stream past them."""

    def release(self) -> None:
        """The step fails: this rank's stream goes on past every wait of the run."""


# (address, incarnation, first bundle, bundles, timeout_s, delivered): a decode run's queue over a link, its first
# bundle sent (delivered as a push's), or None where it cannot be queued (nothing sent)
Queuer = Callable[[str, int, Boundary, int, float, Callable[[Exception | None], None]], Queue | None]


BlockWriter = Callable[["KvBlocks"], None]  # hands committed blocks to the write-behind (kv_writer.KvWriteBehind)


@dataclass(frozen=True)
class KvBlocks:
    """Committed whole blocks of a session, ready to be written behind to the KV store."""

    address: str
    model_identity: str
    layer_start: int
    layer_end: int
    kv_dim: int
    block_tokens: int
    token_ids: list[int]
    first_block: int
    rows: np.ndarray  # f32 [blocks * block_tokens, layers, 2, kv_dim]
    incarnation: int
    epoch: int


class StageState:
    """What the parts of a stage runtime share: set by StageRuntime.__init__ and install, read by every part."""

    backend: str
    device: str
    spec: StageSpec | None
    config: ModelConfig | None
    dtype: str
    authority: Authority
    engine: Engine
    pool: KvPool
    _lock: threading.Condition
    _sessions: dict[str, StageSession]
    # Touched on the engine thread only: the executables by shape, the one that holds the weights, the KV pools.
    _executables: dict[tuple[int, int, int, bool, bool, bool], Executable[Any]]
    _holder: Executable[Any] | None
    _pools: dict[str, Any]
    _standby: dict[str, np.ndarray]
    _packed: bool
    _packed_schemes: dict[str, str]
    _wide_tables: bool  # a block table's width costs nothing here (Executable.reads_own_blocks)
    compiles: int  # executables compiled for a step's shape (each one a step waited for), and their seconds
    compile_seconds: float

    def _pool_names(self) -> list[str]:
        assert self.spec is not None
        return [f"past_{kind}_{i}" for i in range(self.spec.layer_end - self.spec.layer_start) for kind in ("k", "v")]

    @property
    def max_blocks(self) -> int:
        """Blocks of the longest session this stage holds."""
        assert self.spec is not None and self.config is not None
        return blocks_for(self.spec.max_context_tokens or self.config.max_position, self.pool.block_tokens)

    def _session(self, session_id: str) -> StageSession:
        return self._sessions.setdefault(session_id, StageSession())

    def _session_or_404(self, session_id: str) -> StageSession:
        if session_id not in self._sessions:
            raise NotFound(f"no session {session_id!r} on this rank", "UNKNOWN_SESSION")
        return self._sessions[session_id]
