"""One rank of the partitioned pipeline: its layers, its sessions' KV, the protocol's phases.

Compiled stage graphs are shared by every session (one executable per (rows, KV capacity, output)
shape); each session owns its KV handles and swaps them into an executable for a run, so no KV is
ever copied on the hot path. A decode step is one graph run: rows are written into the KV handles
in-graph (kv_write) and fed back by the executable's handle feeds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from graphmesh import models, telemetry
from graphmesh.bundled import BUNDLED, resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    GraphmeshError,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
)
from graphmesh.graph import parse
from graphmesh.models.config import ModelConfig
from graphmesh_executor.backends import compile_graph
from graphmesh_executor.executable import Executable
from graphmesh_executor.fencing import Authority, AuthorityState, Outcome, SessionTxn
from graphmesh_executor.weights import load_params, resolve_under_root

log = logging.getLogger("graphmesh.executor.stage")

MIN_PREFILL_ROWS = 16
MIN_KV_ROWS = 64


def bucket(n: int, minimum: int) -> int:
    """Power-of-two ladder: at most 2x padding."""
    size = minimum
    while size < n:
        size *= 2
    return size


def seed_for(session_seed: int, position: int) -> int:
    """The sample op's seed for the token at `position`: a replay of the same session draws the same."""
    return (session_seed * 1_000_003 + position) & ((1 << 63) - 1)


@dataclass(frozen=True)
class StageConfig:
    model: str
    layer_start: int
    layer_end: int
    first: bool
    last: bool
    next_address: str
    weights: str = "f32"
    max_context_tokens: int = 0
    kvstore_address: str = ""
    kv_block_tokens: int = 16


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class StageSession:
    txn: SessionTxn = field(default_factory=SessionTxn)
    handles: dict[str, Any] = field(default_factory=dict)
    capacity: int = 0
    tokens: list[int] = field(default_factory=list)  # committed tokens, for KV store keys
    pending_tokens: list[int] = field(default_factory=list)  # tokens of the open epoch
    stored_tokens: int = 0  # tokens already written behind to the KV store


@dataclass
class ExecuteResult:
    token: int = 0
    logits: np.ndarray | None = None
    kv_length: int = 0
    compute_us: float = 0.0
    computed_tokens: int = 0


class ProtocolError(GraphmeshError):
    """A failure with its protocol error class (ARCH, COMM, CONTRACT): the status of its cause, with the class in
    the ErrorInfo metadata so the coordinator knows what it means for the protocol."""

    def __init__(self, error_class: str, cause: Exception) -> None:
        base = cause if isinstance(cause, GraphmeshError) else Internal(f"{type(cause).__name__}: {cause}")
        super().__init__(base.message, base.reason, {**base.metadata, "error_class": error_class})
        self.code = base.code
        self.error_class = error_class
        self.cause = cause


Pusher = Callable[[str, str, int, int, np.ndarray, float], None]
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


class StageRuntime:
    def __init__(self, backend: str, device: str = "cpu", model_root: str | None = None,
                 pusher: Pusher | None = None, block_writer: BlockWriter | None = None,
                 faults_enabled: bool = False, min_kv_rows: int = MIN_KV_ROWS, standby_weights: bool = False) -> None:
        self.backend = backend
        self.device = device
        self.model_root = model_root
        self.authority = Authority()
        self.rank = 0
        self.world_size = 0
        self.spec: StageConfig | None = None
        self.config: ModelConfig | None = None
        self.model_identity = ""
        self.param_bytes = 0
        self._pusher = pusher
        self._block_writer = block_writer
        self.faults_enabled = faults_enabled
        self.min_kv_rows = min_kv_rows  # the smallest rung of the KV capacity ladder
        # Standby weights: after install, the rest of the model is read in the background, so that a re-plan
        # after losing a peer (which hands this rank new layers) costs no checkpoint reads. Memory for speed.
        self.standby_weights = standby_weights
        self._standby: dict[str, np.ndarray] = {}
        self._faults: dict[str, int] = {}
        self._lock = threading.Condition()
        self._sessions: dict[str, StageSession] = {}
        self._mailbox: dict[tuple[str, int], np.ndarray] = {}
        self._aborted: set[tuple[str, int]] = set()
        self._executables: dict[tuple[int, int, bool], tuple[Executable[Any], threading.Lock]] = {}
        self._compile_lock = threading.Lock()
        self._holder: Executable[Any] | None = None
        self._loaded_key: StageConfig | None = None
        self._packed_schemes: dict[str, str] = {}

    # -- install ---------------------------------------------------------------------------------------
    def install(self, incarnation: int, rank: int, world_size: int, spec: StageConfig) -> float:
        """Loads weights and compiles (reusing both when the stage is unchanged), then activates `incarnation`."""
        with self._lock:
            if incarnation <= self.authority.highest_seen:
                self.authority.install(incarnation)  # refuses before any work: STALE_INCARNATION
        t0 = time.perf_counter()
        if spec != self._loaded_key:
            with telemetry.span("stage.load_weights", model=spec.model, layer_start=spec.layer_start,
                                layer_end=spec.layer_end, weights=spec.weights):
                self._load(spec)
        with self._lock:
            self.authority.install(incarnation)
            self.rank, self.world_size, self.spec = rank, world_size, spec
            # Sessions of an older incarnation are not trusted: the coordinator restores them.
            self._sessions.clear()
            self._mailbox.clear()
            self._aborted.clear()
            self._lock.notify_all()
        return (time.perf_counter() - t0) * 1000.0

    def _load(self, spec: StageConfig) -> None:
        path = self._model_path(spec.model)
        ckpt = open_checkpoint(path)
        if ckpt.config is None:
            raise InvalidArgument(f"{path} has no model config", "NO_MODEL_CONFIG")
        config = ckpt.config
        if not 0 <= spec.layer_start < spec.layer_end <= config.n_layers:
            raise InvalidArgument(f"layers [{spec.layer_start}, {spec.layer_end}) outside the model's "
                                  f"{config.n_layers} layers", "BAD_LAYER_RANGE")
        if spec.weights not in ("f32", "packed", "packed-bf16"):
            raise InvalidArgument(f"weights must be 'f32', 'packed' or 'packed-bf16', got {spec.weights!r}",
                                  "BAD_WEIGHTS")
        self.config, self.spec = config, spec
        self._packed_schemes = ckpt.packed_schemes()
        self._executables.clear()
        previous, self._holder = self._holder, None
        holder = self._compile(1, self.min_kv_rows, sample=True, weights=path, reuse=previous)
        self._holder = holder
        self.model_identity = ckpt.identity()
        self.param_bytes = sum(int(np.prod(t.shape)) * (1 if t.dtype == "u8" else 4) for t in holder.graph.params.values())
        self._loaded_key = spec
        if self.standby_weights and spec.weights == "f32":
            threading.Thread(target=self._read_standby, args=(path, config, set(holder.graph.params)), daemon=True,
                             name="standby-weights").start()

    def _read_standby(self, path: Path, config: ModelConfig, held: set[str]) -> None:
        ckpt = open_checkpoint(path)
        every = models.stage_params(config, range(0, config.n_layers), first=True, last=True)
        for name, t in every.items():
            if name not in held and name not in self._standby:
                self._standby[name] = ckpt.tensor(name, t.dtype)
        log.info("standby weights read", extra={"params": len(self._standby)})

    def _model_path(self, model: str) -> Path:
        """A bundled name, or a path confined to --model-root when the executor has one."""
        if model in BUNDLED or self.model_root is None:
            return resolve_model(model)
        return resolve_under_root(Path(self.model_root), model)

    def _compile(self, rows: int, capacity: int, sample: bool, weights: Path | None = None,
                 reuse: Executable[Any] | None = None) -> Executable[Any]:
        assert self.config is not None and self.spec is not None
        spec = self.spec
        # "packed": GGUF blocks stay packed, consumed by dequant_matmul (exact); "packed-bf16" also runs those
        # matmuls on bf16 activations, which torch's int4 kernel needs to be fast (not token-exact).
        packed = spec.weights in ("packed", "packed-bf16")
        proto = models.build_stage(self.config, range(spec.layer_start, spec.layer_end), seq_len=rows,
                                   cache_len=capacity, first=spec.first, last=spec.last, sample=sample,
                                   quantized=packed, packed_schemes=self._packed_schemes if packed else None,
                                   packed_activations="bf16" if spec.weights == "packed-bf16" else "f32")
        exe = compile_graph(parse(proto), self.backend, self.device)
        if weights is not None:
            # A re-plan (recovery, rebalancing) keeps the layers this rank already holds and reads only the new ones.
            kept = set(exe.copy_params_from(reuse) if reuse is not None else [])
            for name in exe.graph.params.keys() - kept:
                if name in self._standby:
                    exe.set_param_typed(name, self._standby[name])
                    kept.add(name)
            load_params(exe, weights, {}, skip=kept)
            exe.finalize_params()
        elif self._holder is not None:
            exe.copy_params_from(self._holder)
        n_layers = spec.layer_end - spec.layer_start
        for i in range(n_layers):
            exe.set_handle_feed(f"past_k_{i}", 1 + 2 * i)
            exe.set_handle_feed(f"past_v_{i}", 2 + 2 * i)
        return exe

    def _executable(self, rows: int, capacity: int, sample: bool) -> tuple[Executable[Any], threading.Lock]:
        key = (rows, capacity, sample)
        with self._compile_lock:
            if key not in self._executables:
                self._executables[key] = (self._compile(rows, capacity, sample), threading.Lock())
            return self._executables[key]

    # -- protocol --------------------------------------------------------------------------------------
    def _session(self, session_id: str) -> StageSession:
        return self._sessions.setdefault(session_id, StageSession())

    def execute(self, incarnation: int, session_id: str, epoch: int, commit_epoch: int, start: int,
                token_ids: list[int], sampling: Sampling, logits: bool, timeout_s: float) -> ExecuteResult:
        """Begin (after the folded commit), run this rank's group, push or finish."""
        with self._lock:
            self.authority.check(incarnation)
            session = self._session(session_id)
            if commit_epoch:
                self._commit(incarnation, session_id, session, commit_epoch)
            if start != session.txn.kv_length:
                raise FailedPrecondition(f"session {session_id!r} has {session.txn.kv_length} committed tokens "
                                         f"here, the invocation starts at {start}", "KV_LENGTH_MISMATCH")
            session.txn.begin(epoch)
            session.pending_tokens = list(token_ids)
        try:
            result = self._run_group(incarnation, session_id, session, epoch, start, token_ids, sampling, logits,
                                     timeout_s)
        except ProtocolError as e:
            with self._lock:
                if e.error_class != "ARCH":
                    self.authority.poison(incarnation, f"{e.error_class}: {e}")
                if session.txn.epoch == epoch:
                    session.txn.abort(epoch)
            raise
        with self._lock:
            session.txn.advance(epoch, start + len(token_ids))
        return result

    def _run_group(self, incarnation: int, session_id: str, session: StageSession, epoch: int, start: int,
                   token_ids: list[int], sampling: Sampling, want_logits: bool, timeout_s: float) -> ExecuteResult:
        assert self.spec is not None and self.config is not None
        spec, config, n = self.spec, self.config, len(token_ids)
        limit = spec.max_context_tokens or config.max_position
        if n == 0:
            raise ProtocolError("ARCH", InvalidArgument("an invocation needs at least one token", "EMPTY_INPUT"))
        if self._take_fault("arch"):
            raise ProtocolError("ARCH", InvalidArgument("injected deterministic failure", "INJECTED_FAULT"))
        if start + n > limit:
            raise ProtocolError("ARCH", OutOfRange(f"{start + n} tokens exceed the context of {limit}",
                                                   "CONTEXT_EXCEEDED"))
        rows = 1 if n == 1 else bucket(n, MIN_PREFILL_ROWS)
        capacity = bucket(start + rows, self.min_kv_rows)
        inputs: dict[str, np.ndarray] = {"positions": start + np.arange(rows, dtype=np.int64)}
        if spec.first:
            ids = np.zeros(rows, np.int64)
            ids[:n] = token_ids
            if ids.max() >= config.vocab_size or ids.min() < 0:
                raise ProtocolError("ARCH", InvalidArgument(f"token id outside the vocabulary of {config.vocab_size}",
                                                            "BAD_TOKEN_ID"))
            inputs["input_ids"] = ids
        else:
            hidden = self._await_boundary(session_id, epoch, timeout_s)
            if hidden.shape != (n, config.hidden_size):
                raise ProtocolError("CONTRACT", InvalidArgument(
                    f"boundary of shape {list(hidden.shape)}, expected [{n}, {config.hidden_size}]", "SCHEMA_MISMATCH"))
            padded = np.zeros((rows, config.hidden_size), np.float32)
            padded[:n] = hidden
            inputs["hidden_in"] = padded
        sample = not want_logits
        if spec.last:
            inputs["last_index"] = np.array([n - 1], np.int64)
            if sample:
                inputs.update(temperature=np.array([sampling.temperature], np.float32),
                              top_k=np.array([sampling.top_k], np.int64),
                              top_p=np.array([sampling.top_p], np.float32),
                              seed=np.array([seed_for(sampling.seed, start + n)], np.int64))
        exe, lock = self._executable(rows, capacity, sample or not spec.last)
        t0 = time.perf_counter()
        try:
            with lock, telemetry.span("stage.compute", rows=rows, kv_capacity=capacity):
                self._fit_handles(exe, session, capacity, start)
                own = exe.swap_handles(session.handles)
                try:
                    out = exe.run(inputs, read_indices=[0], typed=True)[0]
                finally:
                    session.handles = exe.swap_handles(own)
        except (InvalidArgument, OutOfRange, NotFound, FailedPrecondition) as e:
            raise ProtocolError("ARCH", e) from e
        result = ExecuteResult(kv_length=start + n, compute_us=(time.perf_counter() - t0) * 1e6, computed_tokens=n)
        if not spec.last:
            assert self._pusher is not None
            bundle = out[:n, :-1] if self._take_fault("corrupt") else out[:n]
            try:
                self._pusher(spec.next_address, session_id, incarnation, epoch, bundle, timeout_s)
            except Exception as e:  # any failure to deliver leaves the order unprovable
                raise ProtocolError("COMM", e) from e
        else:
            with telemetry.span("stage.finish", output="token" if sample else "logits"):
                if sample:
                    result.token = int(out[0])
                else:
                    result.logits = out.reshape(-1).astype(np.float32)
        return result

    def _fit_handles(self, exe: Executable[Any], session: StageSession, capacity: int, keep: int) -> None:
        """Bucket rollover: moves the committed rows into handles of the new capacity, on the executor."""
        if session.capacity == capacity:
            return
        assert self.spec is not None
        grown: dict[str, Any] = {}
        for i in range(self.spec.layer_end - self.spec.layer_start):
            for kind in ("k", "v"):
                name = f"past_{kind}_{i}"
                fresh = exe.zeros_like_input(name)
                if name in session.handles and keep:
                    fresh = exe._copy_rows(fresh, 0, session.handles[name], 0, min(keep, session.capacity))
                grown[name] = fresh
        session.handles, session.capacity = grown, capacity

    def _await_boundary(self, session_id: str, epoch: int, timeout_s: float) -> np.ndarray:
        key = (session_id, epoch)
        with self._lock:
            ready = self._lock.wait_for(lambda: key in self._mailbox or key in self._aborted or
                                        self.authority.state is not AuthorityState.ACTIVE, timeout=timeout_s)
            if self.authority.state is not AuthorityState.ACTIVE:
                raise ProtocolError("COMM", FailedPrecondition(f"fenced while waiting for a boundary: "
                                                               f"{self.authority.cause}", "POISONED"))
            if key in self._aborted:
                raise ProtocolError("ARCH", FailedPrecondition(f"epoch {epoch} was aborted", "EPOCH_ABORTED"))
            if not ready:
                raise ProtocolError("COMM", DeadlineExceeded(
                    f"no boundary for session {session_id!r} epoch {epoch} within {timeout_s:.1f} s",
                    "BOUNDARY_TIMEOUT"))
            return self._mailbox.pop(key)

    def accept_boundary(self, incarnation: int, session_id: str, epoch: int, hidden: np.ndarray) -> None:
        """Validates a pushed bundle before accepting it; a bad bundle poisons (it breaks the contract)."""
        with self._lock:
            self.authority.check(incarnation)
            assert self.config is not None
            if hidden.dtype != np.float32 or hidden.ndim != 2 or hidden.shape[1] != self.config.hidden_size:
                cause = f"boundary {hidden.dtype}{list(hidden.shape)} breaks schema f32[*, {self.config.hidden_size}]"
                self.authority.poison(incarnation, f"CONTRACT: {cause}")
                raise InvalidArgument(cause, "SCHEMA_MISMATCH", {"error_class": "CONTRACT"})
            if (session_id, epoch) in self._aborted:
                return  # a late push for an epoch already rolled back
            self._mailbox[(session_id, epoch)] = hidden
            self._lock.notify_all()

    def commit(self, incarnation: int, session_id: str, epoch: int) -> int:
        with self._lock:
            self.authority.check(incarnation)
            session = self._session_or_404(session_id)
            self._commit(incarnation, session_id, session, epoch)
            return session.txn.kv_length

    def _commit(self, incarnation: int, session_id: str, session: StageSession, epoch: int) -> None:
        """Commits under the lock, then hands whole new blocks to the write-behind."""
        if epoch <= session.txn.committed_epoch:
            return
        with telemetry.span("stage.commit", session=session_id, epoch=epoch, incarnation=incarnation):
            session.txn.commit(epoch)
            session.tokens += session.pending_tokens
            session.pending_tokens = []
            self._write_behind(incarnation, session, epoch)

    def _write_behind(self, incarnation: int, session: StageSession, epoch: int) -> None:
        spec = self.spec
        if self._block_writer is None or spec is None or not spec.kvstore_address:
            return
        block = spec.kv_block_tokens or 16
        whole = session.txn.kv_length // block * block
        if whole <= session.stored_tokens or len(session.tokens) < whole:
            return
        rows = self._read_rows(session, session.stored_tokens, whole)
        self._block_writer(KvBlocks(spec.kvstore_address, self.model_identity, spec.layer_start, spec.layer_end,
                                    self.kv_dim, block, session.tokens[:whole], session.stored_tokens // block, rows,
                                    incarnation, epoch))
        session.stored_tokens = whole

    @property
    def kv_dim(self) -> int:
        return self.config.kv_dim if self.config is not None else 0

    def _read_rows(self, session: StageSession, start: int, end: int) -> np.ndarray:
        assert self.spec is not None and self._holder is not None
        layers = self.spec.layer_end - self.spec.layer_start
        rows = np.empty((end - start, layers, 2, self.kv_dim), np.float32)
        for i in range(layers):
            for j, kind in enumerate(("k", "v")):
                rows[:, i, j] = self._holder._to_host(session.handles[f"past_{kind}_{i}"])[start:end]
        return rows

    def read_kv(self, incarnation: int, session_id: str, from_row: int, to_row: int) -> np.ndarray:
        """Committed rows [from_row, to_row) as f32 [rows, layers, 2, kv_dim]."""
        with self._lock:
            self.authority.check(incarnation)
            session = self._session_or_404(session_id)
            if not 0 <= from_row <= to_row <= session.txn.kv_length:
                raise OutOfRange(f"rows [{from_row}, {to_row}) outside the {session.txn.kv_length} committed rows of "
                                 f"session {session_id!r}", "ROW_OUT_OF_RANGE")
            return self._read_rows(session, from_row, to_row)

    def write_kv(self, incarnation: int, session_id: str, start: int, rows: np.ndarray, token_ids: list[int]) -> int:
        """Appends committed rows to an idle session (a seeded prefix or a migration); returns the KV length."""
        assert self.spec is not None
        layers = self.spec.layer_end - self.spec.layer_start
        if rows.dtype != np.float32 or rows.ndim != 4 or rows.shape[1:] != (layers, 2, self.kv_dim):
            raise InvalidArgument(f"KV rows {rows.dtype}{list(rows.shape)} do not match this stage's "
                                  f"f32[n, {layers}, 2, {self.kv_dim}]", "BAD_KV_ROWS")
        if token_ids and len(token_ids) != rows.shape[0]:
            raise InvalidArgument(f"{len(token_ids)} token ids for {rows.shape[0]} rows", "BAD_KV_ROWS")
        limit = self.spec.max_context_tokens or (self.config.max_position if self.config else 0)
        if start + rows.shape[0] > limit:
            raise OutOfRange(f"{start + rows.shape[0]} rows exceed the context of {limit}", "CONTEXT_EXCEEDED")
        with self._lock:
            self.authority.check(incarnation)
            session = self._session(session_id)
            session.txn.append_committed(start, 0)  # refuses an open epoch or a gap before touching anything
            capacity = bucket(start + rows.shape[0] + 1, self.min_kv_rows)
            exe, lock = self._executable(1, capacity, True)
            with lock:
                self._fit_handles(exe, session, capacity, start)
                for i in range(layers):
                    for j, kind in enumerate(("k", "v")):
                        name = f"past_{kind}_{i}"
                        block = exe._from_host(np.ascontiguousarray(rows[:, i, j]))
                        session.handles[name] = exe._copy_rows(session.handles[name], start, block, 0, rows.shape[0])
            session.txn.append_committed(start, rows.shape[0])
            if token_ids:
                session.tokens += token_ids
                if session.stored_tokens == start:
                    session.stored_tokens = session.txn.kv_length  # these rows came from the store or a peer
            return session.txn.kv_length

    def abort(self, incarnation: int, session_id: str, epoch: int, commit_epoch: int = 0) -> int:
        """Local rollback; allowed under poison (but not for an older incarnation's messages)."""
        with self._lock:
            if incarnation != self.authority.incarnation:
                self.authority.check(incarnation)
            self._aborted.add((session_id, epoch))
            self._mailbox.pop((session_id, epoch), None)
            self._lock.notify_all()
            session = self._sessions.get(session_id)
            if session is None:
                return 0
            if commit_epoch and session.txn.epoch == commit_epoch:
                session.txn.commit(commit_epoch)
            session.txn.abort(epoch)
            return session.txn.kv_length

    def resolve(self, incarnation: int, session_id: str, epoch: int, outcome: Outcome) -> int:
        with self._lock:
            self.authority.check(incarnation)
            session = self._session_or_404(session_id)
            session.txn.resolve(epoch, outcome)
            return session.txn.kv_length

    def release(self, incarnation: int, session_id: str) -> bool:
        with self._lock:
            self.authority.check(incarnation)
            return self._sessions.pop(session_id, None) is not None

    def fence(self, incarnation: int, reason: str, terminal: bool) -> None:
        with self._lock:
            self.authority.poison(incarnation, reason or "fenced by the coordinator", terminal)
            self._lock.notify_all()

    def inject_fault(self, kind: str, count: int) -> None:
        if not self.faults_enabled:
            raise FailedPrecondition("fault injection is off; start the executor with --enable-fault-injection",
                                     "FAULT_INJECTION_DISABLED")
        if count < 1 or kind not in ("arch", "corrupt"):
            raise InvalidArgument(f"bad fault {kind!r} x {count}", "BAD_FAULT")
        with self._lock:
            self._faults[kind] = self._faults.get(kind, 0) + count

    def _take_fault(self, kind: str) -> bool:
        if not self._faults.get(kind):
            return False
        with self._lock:
            if self._faults.get(kind, 0) <= 0:
                return False
            self._faults[kind] -= 1
            return True

    def _session_or_404(self, session_id: str) -> StageSession:
        if session_id not in self._sessions:
            raise NotFound(f"no session {session_id!r} on this rank", "UNKNOWN_SESSION")
        return self._sessions[session_id]

    def sessions(self) -> list[tuple[str, StageSession]]:
        with self._lock:
            return list(self._sessions.items())

