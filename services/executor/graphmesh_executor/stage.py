"""One rank of the partitioned pipeline: its layers, its paged KV, the protocol's phases per step.

A step is one invocation of the protocol over rows of many sessions (decode tokens and prompt chunks mixed).
Every session's KV lives in the stage's pools (kv_pool.KvPool lends their blocks); compiled stage graphs are
shared by every step of the same bucketed shape (tokens, sequences, blocks per sequence) and write new K/V
rows into the pools in place (kv_scatter), so no KV is ever copied on the hot path. All device work runs on
the executor's one engine thread (engine.Engine): handler threads begin and commit the rows' epochs, and each
iteration of a step (one, or a decode run's several) is an engine task posted by whoever brings its input, its
boundary pushed on (stage_servicer.BoundaryPusher). While a decode run waits for its next boundary, the engine
builds that iteration's inputs (_prepare), so the boundary's arrival starts the run at once.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from graphmesh import models, telemetry
from graphmesh import plan as dag
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
    ResourceExhausted,
)
from graphmesh.graph import parse
from graphmesh.kvkeys import blocks_for
from graphmesh.models.config import ModelConfig
from graphmesh.models.moe import read_param
from graphmesh.protocol import ACTIONS, METADATA_KEY, Action, ErrorClass, ProtocolError
from graphmesh.serving import available_memory_bytes
from graphmesh_executor.backends import compile_graph
from graphmesh_executor.encoder_group import EncoderGroup
from graphmesh_executor.engine import Engine
from graphmesh_executor.executable import Executable, RngOptions
from graphmesh_executor.fencing import Authority, AuthorityState, Outcome, SessionPhase, SessionTxn
from graphmesh_executor.kv_pool import SCRATCH_BLOCK, KvPool
from graphmesh_executor.logprobs import RowLogprobs, RowSampling, sample_with_logprobs
from graphmesh_executor.weights import load_params, resolve_under_root

log = logging.getLogger("graphmesh.executor.stage")

MIN_PREFILL_ROWS = 16
DEFAULT_KV_CACHE_BYTES = 512 << 20  # the CPU pool's cap when --kv-cache-bytes is not given
NUMPY_KV_CACHE_BYTES = 16 << 20
WARM_SHAPES = 4  # executables a re-plan compiles up front: the old stage's most recently used shapes


def bucket(n: int, minimum: int) -> int:
    """Power-of-two ladder: at most 2x padding."""
    size = minimum
    while size < n:
        size *= 2
    return size


_SEED_MASK = (1 << 63) - 1


def seed_for(session_seed: int, position: int) -> int:
    """The sample op's seed for the token at `position`: a replay of the same session draws the same."""
    return (session_seed * 1_000_003 + position) & _SEED_MASK


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


@dataclass(frozen=True)
class Boundary:
    """A bundle one group hands another over a plan route, for a step or one iteration of a decode run
    (stage.proto PushBoundaryRequest)."""

    step_id: int
    iteration: int = 0  # the decode run's iteration this is the input of
    route_id: int = 0
    values: dict[str, np.ndarray] = field(default_factory=dict)  # by role (graphmesh.plan), in the schema's order
    schema_identity: str = ""  # the sender's identity of the route's schema
    wave: int = 0  # the wave that produced it


# (address, incarnation, boundary, timeout_s, delivered): may return before delivery; calls delivered(None) once the
# next rank took the bundle, or delivered(error) once it cannot (exactly once, from any thread).
Pusher = Callable[[str, int, Boundary, float, Callable[[Exception | None], None]], None]


@dataclass(eq=False)
class _InFlight:
    """A step in flight on this rank. Each iteration is an engine task posted by whoever brings its input: the
    step's handler (the first stage's first iteration), the PushBoundary handler that delivered its boundary, or
    the engine itself (a stage feeding itself). No handler thread sits between an input arriving and its compute,
    and pushes go out without waiting: the step is done once every iteration ran and every push was taken."""

    incarnation: int
    step_id: int
    rows: list[StepRow]  # the rows of the iteration running or next to run
    want_logits: bool
    steps: int  # iterations: a decode run's length, else 1
    timeout_s: float  # how long it may wait for an input
    waves: list[dag.Wave]  # the step's waves, every rank's (the plan's schedule of its active groups)
    result: StepResult = field(default_factory=StepResult)
    sampled: list[list[int]] = field(default_factory=list)  # per row, the tokens a decode run sampled (last stage)
    iteration: int = 0  # the iteration running or next to run
    waiting_since: float | None = None  # monotonic time it began waiting for its next input; None while not
    pushes: int = 0  # pushes sent and not yet taken
    computed: bool = False  # every iteration ran
    done: Future[StepResult] = field(default_factory=Future)
    prepared: _Prepared | None = None  # the next iteration's run, built while its boundary was on the way
    last_run: _Prepared | None = None  # the run of the iteration that ran last: a decode run's next one follows it


@dataclass(eq=False)
class _Prepared:
    """A run with every input but those a boundary brings (the first stage's token ids, another's activation):
    a decode run's next iteration, built on the engine while it waited for that boundary. Within a run a row's
    positions, slots and block table are known ahead (its blocks were reserved when the run began), and building
    them and the rows was ~30% of a stage iteration's host work, on the path from one stage to the next."""

    iteration: int
    rows: list[StepRow]  # the iteration's rows, each token_ids a one-element list its token is written into
    sample: bool  # sampled in the graph (the last stage), as _compute is asked to
    exe: Executable[Any]
    inputs: dict[str, np.ndarray]
    tokens: int  # token rows of the run (a bucket)
    seqs: int  # sequences of the run (a bucket)
    blocks: int  # blocks per sequence of its block table (a rung of the ladder)
    extent: tuple[int, int] | None


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
                 faults_enabled: bool = False, kv_cache_bytes: int = 0, standby_weights: bool | None = None) -> None:
        self.backend = backend
        self.device = device
        self.model_root = model_root
        self.authority = Authority()
        self.rank = 0
        self.world_size = 0
        self.spec: StageSpec | None = None
        self.plan: dag.Plan | None = None
        self.group: dag.Group | None = None  # this rank's decoder group of the plan
        self.config: ModelConfig | None = None
        self.model_identity = ""
        self.param_bytes = 0
        self.dtype = "f32"
        self._pusher = pusher
        self._block_writer = block_writer
        self.faults_enabled = faults_enabled
        self.kv_cache_bytes = kv_cache_bytes  # 0: default_kv_cache_bytes()
        # Standby weights: after install, the rest of the model is read in the background, so that a re-plan
        # after losing a peer (which hands this rank new layers) costs no checkpoint reads. Memory for speed;
        # None: on when the whole model's f32 weights take at most a quarter of the available memory.
        self.standby_weights = standby_weights
        self._standby: dict[str, np.ndarray] = {}
        self._weights_path: Path | None = None  # the checkpoint the loaded stage and _standby hold weights of
        self.standby_ready = threading.Event()  # set once the whole model is held
        self._faults: dict[str, int] = {}
        self._lock = threading.Condition()
        self._sessions: dict[str, StageSession] = {}
        self._mailbox: dict[tuple[int, int, int], Boundary] = {}  # (step id, iteration, route id) -> its bundle
        self._in_flight: dict[int, _InFlight] = {}  # step id -> the step, while its handler waits for it
        self._aborted: set[int] = set()
        self.engine = Engine(f"engine-{backend}")
        # Everything below is touched on the engine thread only.
        self._executables: dict[tuple[int, int, int, bool, bool, bool], Executable[Any]] = {}
        self._holder: Executable[Any] | None = None
        self._encoder: EncoderGroup | None = None  # the plan's encoder group, when this rank owns it
        self._pools: dict[str, Any] = {}
        self.pool = KvPool(2, 16)
        self._loaded_key: StageSpec | None = None
        self._packed_schemes: dict[str, str] = {}
        self._packed = False  # the installed stage keeps packed blocks (see install)

    # -- install ---------------------------------------------------------------------------------------
    def install(self, incarnation: int, rank: int, world_size: int, spec: StageSpec,
                plan: dag.Plan | None = None) -> float:
        """Loads weights and compiles (reusing both when the stage is unchanged), then activates `incarnation`.
        `plan` is the incarnation's DAG, in which `spec` is rank `rank`'s decoder group; a single rank may go
        without one (its plan is then that group alone)."""
        if plan is None:
            if world_size != 1:
                raise InvalidArgument(f"rank {rank} of {world_size} needs the partition plan", "NO_PLAN")
            plan = dag.pipeline([(spec.layer_start, spec.layer_end)], [""], 0)  # no route: no schema needs the width
        group = plan.decoder(rank)
        if len(plan.addresses) != world_size or (group.layer_start, group.layer_end) != (spec.layer_start,
                                                                                          spec.layer_end):
            raise InvalidArgument(f"the plan gives rank {rank} of {len(plan.addresses)} layers [{group.layer_start}, "
                                  f"{group.layer_end}); the stage is rank {rank} of {world_size} with layers "
                                  f"[{spec.layer_start}, {spec.layer_end})", "BAD_PLAN")
        with self._lock:
            self.authority.check_install(incarnation)  # refuses before any work: stale or out of range
        t0 = time.perf_counter()
        if spec != self._loaded_key:
            with telemetry.span("stage.load_weights", model=spec.model, layer_start=spec.layer_start,
                                layer_end=spec.layer_end, weights=spec.weights):
                self.engine.run("stage.load", lambda: self._load(spec))
        encoder = plan.encoder()
        self.engine.run("stage.load_encoder", lambda: self._load_encoder(spec, encoder is not None and
                                                                        encoder.rank == rank))
        with self._lock:
            self.authority.install(incarnation)
            self.rank, self.world_size, self.spec, self.plan, self.group = rank, world_size, spec, plan, group
            # Sessions of an older incarnation are not trusted: the coordinator restores them.
            self._sessions.clear()
            self._mailbox.clear()
            self._aborted.clear()
            for step in self._in_flight.values():  # of an older incarnation: it must not go on under the new one
                self._fail(step, ProtocolError(ErrorClass.COMM, FailedPrecondition(
                    "a new incarnation was installed", "POISONED")))
            self.pool.clear()
            self._lock.notify_all()
        return (time.perf_counter() - t0) * 1000.0

    def _load(self, spec: StageSpec) -> None:
        path = self._model_path(spec.model)
        same_model = path == self._weights_path
        if not same_model:  # another model: its params may have the same names, never the same values
            self._standby, self._weights_path = {}, path
            self.standby_ready.clear()
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
        dtype = spec.dtype or ("bf16" if self.device.startswith("cuda") else "f32")
        if dtype not in ("f32", "bf16", "f16"):
            raise InvalidArgument(f"dtype must be 'f32', 'bf16' or 'f16', got {dtype!r}", "BAD_DTYPE")
        self.config, self.spec, self.dtype = config, spec, dtype
        self._packed_schemes = ckpt.packed_schemes()
        # "packed" (the default) keeps a GGUF's quantized blocks packed where the family's stages consume them; a
        # checkpoint with none, or another family (GPT-2), is read as f32 then, so the default serves every model.
        self._packed = spec.weights in ("packed", "packed-bf16") and bool(self._packed_schemes) and \
            models.quantizable(config)
        recent = list(self._executables)[-WARM_SHAPES:]  # most recently used last
        self._executables.clear()
        block = spec.kv_block_tokens or 16
        layers = spec.layer_end - spec.layer_start
        row_bytes = 2 * layers * config.kv_dim * (4 if dtype == "f32" else 2)  # K and V of every layer, per token
        budget = self.kv_cache_bytes or default_kv_cache_bytes(self.device, self.backend)
        pool = KvPool(max(2, budget // (row_bytes * block)), block)
        previous, self._holder, self.pool, self._pools = self._holder, None, pool, {}
        holder = self._compile(1, 1, 1, True, True, weights=path, reuse=previous if same_model else None)
        self._holder = holder
        self._pools = dict(zip(self._pool_names(), holder.zeros_like_inputs(self._pool_names())))
        # What KV keys are rooted in: the checkpoint and how this stage computes with it, since rows computed in
        # bf16 or from packed weights differ from f32 ones for the same tokens, and a shared store must never hand
        # one to the other (a wrong hit changes tokens).
        self.model_identity = f"{ckpt.identity()}|weights={spec.weights}|dtype={dtype}"
        self.param_bytes = sum(int(np.prod(t.shape)) * (1 if t.dtype == "u8" else 4) for t in holder.graph.params.values())
        self._loaded_key = spec
        # A re-plan (recovery) compiles the shapes the old stage ran most recently now, on every rank at once:
        # left to the restore's first steps they would be compiled one rank after another, on its critical path.
        for key in recent:
            self._executable(*key)
        log.info("stage loaded", extra={"layers": f"{spec.layer_start}-{spec.layer_end}", "dtype": dtype,
                                        "kv_pool_blocks": pool.lendable, "kv_block_tokens": block,
                                        "warmed_shapes": len(recent)})
        if not self._packed and not self.standby_ready.is_set() and self._wants_standby(config):
            threading.Thread(target=self._read_standby, args=(path, config, set(holder.graph.params)), daemon=True,
                             name="standby-weights").start()

    def _load_encoder(self, spec: StageSpec, owned: bool) -> None:
        """Holds the model's encoder when this rank owns the plan's encoder group (engine thread)."""
        if not owned:
            self._encoder = None
            return
        assert self.config is not None
        if self.config.encoder is None:
            raise InvalidArgument(f"the plan gives this rank an encoder group; {spec.model} has no encoder",
                                  "BAD_PLAN")
        path = self._model_path(spec.model)
        if self._encoder is None or self._encoder.weights != path or self._encoder.dtype != self.dtype:
            self._encoder = EncoderGroup(self.config.encoder, path, self.backend, self.device, self.dtype)

    def preload(self, model: str) -> None:
        """Reads the whole of `model`'s weights now, as standby weights (f32), so the first Install of any layer
        range reads no checkpoint: what an executor that joins a live mesh does before it registers, since the
        roster it joins waits for its Install."""
        path = self._model_path(model)
        config = open_checkpoint(path).config
        if config is None:
            raise InvalidArgument(f"{path} has no model config", "NO_MODEL_CONFIG")
        t0 = time.perf_counter()

        def read() -> None:  # on the engine, as an Install is: the two never touch the weights at once
            self._standby, self._weights_path = {}, path
            self.standby_ready.clear()
            self._read_standby(path, config, set())

        self.engine.run("stage.preload", read)
        log.info("model preloaded", extra={"model": model, "ms": round((time.perf_counter() - t0) * 1e3, 1)})

    def _wants_standby(self, config: ModelConfig) -> bool:
        if self.standby_weights is not None:
            return self.standby_weights
        every = models.stage_params(config, range(0, config.n_layers), first=True, last=True)
        model_bytes = 4 * sum(math.prod(t.shape) for t in every.values())
        available = available_memory_bytes()
        return available is not None and model_bytes <= available // 4

    def _read_standby(self, path: Path, config: ModelConfig, held: set[str]) -> None:
        ckpt = open_checkpoint(path)
        every = models.stage_params(config, range(0, config.n_layers), first=True, last=True)
        standby = self._standby
        available = set(ckpt.names())
        for name, t in every.items():
            if self._standby is not standby:
                return  # another model was installed meanwhile
            if name not in held and name not in standby:
                standby[name] = read_param(ckpt, name, t.dtype, available)  # MoE experts: stacked
        if self._standby is standby:
            self.standby_ready.set()
        log.info("standby weights read", extra={"params": len(self._standby)})

    def _model_path(self, model: str) -> Path:
        """A bundled name, or a path confined to --model-root when the executor has one."""
        if model in BUNDLED or self.model_root is None:
            return resolve_model(model)
        return resolve_under_root(Path(self.model_root), model)

    def _pool_names(self) -> list[str]:
        assert self.spec is not None
        return [f"past_{kind}_{i}" for i in range(self.spec.layer_end - self.spec.layer_start) for kind in ("k", "v")]

    @property
    def max_blocks(self) -> int:
        """Blocks of the longest session this stage holds."""
        assert self.spec is not None and self.config is not None
        return blocks_for(self.spec.max_context_tokens or self.config.max_position, self.pool.block_tokens)

    def _compile(self, tokens: int, seqs: int, blocks: int, decode: bool, sample: bool, encoded: bool = False,
                 weights: Path | None = None, reuse: Executable[Any] | None = None) -> Executable[Any]:
        assert self.config is not None and self.spec is not None
        spec = self.spec
        # "packed": GGUF blocks stay packed, consumed by dequant_matmul (exact); "packed-bf16" also runs those
        # matmuls on bf16 activations, which torch's int4 kernel needs to be fast (not token-exact).
        packed = self._packed
        layout = models.PagedLayout(seqs, blocks, self.pool.block_tokens, self.pool.blocks, decode)
        proto = models.build_stage(self.config, range(spec.layer_start, spec.layer_end), seq_len=tokens, cache_len=0,
                                   first=spec.first, last=spec.last, sample=sample, quantized=packed,
                                   packed_schemes=self._packed_schemes if packed else None,
                                   packed_activations="bf16" if spec.weights == "packed-bf16" else "f32",
                                   dtype=self.dtype, paged=layout, encoded=encoded)
        exe = compile_graph(parse(proto), self.backend, self.device)
        if weights is not None:
            # A re-plan (recovery, rebalancing) keeps the layers this rank already holds and reads only the new ones.
            kept = set(exe.copy_params_from(reuse) if reuse is not None else [])
            for name in exe.graph.params.keys() - kept:
                # standby weights are f32 (dequantized): a packed stage's blocks come from the checkpoint
                if name in self._standby and exe.graph.params[name].dtype != "u8":
                    exe.set_param_typed(name, self._standby[name])
                    kept.add(name)
            load_params(exe, weights, {}, skip=kept)
            exe.finalize_params()
        elif self._holder is not None:
            exe.copy_params_from(self._holder)
        for j, name in enumerate(self._pool_names()):
            exe.set_handle_feed(name, 1 + j)  # the updated pool replaces the handle: kv_scatter writes in place
        return exe

    def _executable(self, tokens: int, seqs: int, blocks: int, decode: bool, sample: bool,
                    encoded: bool = False) -> Executable[Any]:
        key = (tokens, seqs, blocks, decode, sample, encoded)
        exe = self._executables.pop(key, None)
        if exe is None:
            t0 = time.perf_counter()
            exe = self._compile(*key)
            # a step that waits for this is slower by that much: a shape bucket worth knowing about
            log.info("stage executable compiled", extra={"tokens": tokens, "seqs": seqs, "blocks": blocks,
                                                         "decode": decode, "ms": round((time.perf_counter() - t0) * 1e3, 1)})
        self._executables[key] = exe  # (re)inserted last: the dict is in order of use, for a re-plan's warm-up
        return exe

    # -- protocol --------------------------------------------------------------------------------------
    def _session(self, session_id: str) -> StageSession:
        return self._sessions.setdefault(session_id, StageSession())

    def execute_step(self, incarnation: int, step_id: int, rows: list[StepRow], logits: bool,
                     timeout_s: float, decode_steps: int = 1, active_groups: frozenset[int] = frozenset()) -> StepResult:
        """Begin every row (after its folded commit), take this rank's part of each of the step's waves (run its
        groups for all rows, push their bundles on), finish. `active_groups` are the optional groups the step
        activates. A decode run (`decode_steps` > 1) runs the decoder groups that many times, each row's epoch
        spanning every token."""
        decode_steps = max(1, decode_steps)
        with self._lock:
            self.authority.check(incarnation)
            plan = self.plan
            assert plan is not None
            self._check_rows(rows, logits, decode_steps, active_groups)
            waves = plan.schedule(active_groups)
            self._begin(incarnation, rows, decode_steps)
        ends = [row.start + len(row.token_ids) + decode_steps - 1 for row in rows]
        # A prediction-target row runs as one single-token row per position (same session, same block table): each is
        # computed, and sampled with its own seed, exactly as a plain decode of that position would be.
        run_rows = [p for row in rows for p in _positions(row)] if any(r.proposed for r in rows) else rows
        try:
            result = self._run_step(incarnation, step_id, run_rows, logits, timeout_s, decode_steps, waves)
        except ProtocolError as e:
            if plan.cross_stage_collective_waves and e.error_class is ErrorClass.ARCH:
                # peers may wait inside a wave's collective this rank never joined: nothing is provable any more
                e = ProtocolError(ErrorClass.COMM, e.cause)
            with self._lock:
                self._forget_step(step_id)
                if ACTIONS[e.error_class] is Action.FENCE:
                    self._poison(incarnation, f"{e.error_class}: {e}")
                for row in rows:
                    session = self._sessions.get(row.session_id)
                    if session is not None and session.txn.epoch == row.epoch:
                        session.txn.abort(row.epoch)
            raise e
        result.waves = [(w.ordinal, w.group.id, w.group.rank == self.rank) for w in waves
                        if w.group.rank == self.rank or plan.cross_stage_collective_waves]
        if run_rows is not rows and result.tokens:
            _verify(rows, result)
        with self._lock:
            for row, end in zip(rows, ends):
                self._sessions[row.session_id].txn.advance(row.epoch, end)
            if self.authority.state is not AuthorityState.ACTIVE:
                self._mark_undecided()  # fenced while this step ran: its decision can no longer come
            result.kv_lengths = ends
        return result

    def _poison(self, incarnation: int, reason: str, terminal: bool = False) -> None:
        """Poisons `incarnation` here (under the lock) and, if that lost the authority, marks the voted epochs
        undecided: every loss of the authority goes through this."""
        self.authority.poison(incarnation, reason, terminal)
        if self.authority.state is not AuthorityState.ACTIVE:
            self._mark_undecided()
            for step in self._in_flight.values():
                if step.waiting_since is not None:
                    self._fail(step, self._fenced())

    def _mark_undecided(self) -> None:
        """The authority is lost (under the lock): no step of its incarnation will run again, so no folded commit
        can reach an epoch that voted here and waits for its decision. Those turn INDETERMINATE: the coordinator
        (restarted, its log read back) resolves them before it fences and replaces the incarnation."""
        for session in self._sessions.values():
            if session.txn.phase is SessionPhase.IN_TXN and session.txn.voted:
                session.txn.mark_indeterminate(session.txn.epoch)

    def _check_rows(self, rows: list[StepRow], logits: bool, decode_steps: int, active_groups: frozenset[int]) -> None:
        """What makes a step impossible, refused before any row begins (ARCH: nothing changed anywhere)."""
        assert self.spec is not None and self.config is not None and self.plan is not None
        limit = self.spec.max_context_tokens or self.config.max_position
        self._check_activity(rows, decode_steps, active_groups)
        if not rows:
            raise ProtocolError(ErrorClass.ARCH, InvalidArgument("a step needs at least one row", "EMPTY_STEP"))
        if len({row.session_id for row in rows}) != len(rows):
            raise ProtocolError(ErrorClass.ARCH, InvalidArgument("a session appears twice in one step",
                                                                 "DUPLICATE_SESSION"))
        if decode_steps > 1 and (logits or any(len(r.token_ids) != 1 or r.sampling.logprobs or r.allowed_tokens
                                               for r in rows)):
            raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                "a decode run takes rows of one token each, sampled in the graph (no logits, no logprobs, no "
                "allowed_tokens)", "BAD_DECODE_RUN"))
        for row in rows:
            if row.proposed and (decode_steps > 1 or logits or row.sampling.logprobs or row.allowed_tokens
                                 or row.proposed >= len(row.token_ids)):
                raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                    f"row of session {row.session_id!r} proposes {row.proposed} of its {len(row.token_ids)} tokens; "
                    "a prediction target takes fewer proposals than tokens, sampled in the graph (no decode run, "
                    "logits, logprobs or allowed_tokens)", "BAD_PREDICTION_TARGET"))
            if row.commit_length and row.commit_length != row.start:
                raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                    f"row of session {row.session_id!r} commits to {row.commit_length} rows but starts at {row.start}",
                    "BAD_COMMIT_LENGTH"))
        words = -(-self.config.vocab_size // 32)
        for row in rows:
            if row.allowed_tokens and len(row.allowed_tokens) != 4 * words:
                raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                    f"row of session {row.session_id!r}: allowed_tokens holds {len(row.allowed_tokens)} bytes; the "
                    f"vocabulary of {self.config.vocab_size} takes {4 * words}", "BAD_ALLOWED_TOKENS"))
            n = len(row.token_ids)
            if n == 0:
                raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                    f"row of session {row.session_id!r} has no tokens", "EMPTY_INPUT"))
            n += decode_steps - 1  # the KV rows the step writes
            if row.start + n > limit:
                raise ProtocolError(ErrorClass.ARCH, OutOfRange(
                    f"{row.start + n} tokens exceed the context of {limit}", "CONTEXT_EXCEEDED"))
            if self.spec.first and (max(row.token_ids) >= self.config.vocab_size or min(row.token_ids) < 0):
                raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                    f"token id outside the vocabulary of {self.config.vocab_size}", "BAD_TOKEN_ID"))
        if self._take_fault("arch"):
            raise ProtocolError(ErrorClass.ARCH, InvalidArgument("injected deterministic failure", "INJECTED_FAULT"))

    def _check_activity(self, rows: list[StepRow], decode_steps: int, active_groups: frozenset[int]) -> None:
        """request_group_active, checked: the step activates the plan's encoder exactly when a row brings encoder
        input, and every such row is well formed (every rank checks the same request, so all agree)."""
        assert self.plan is not None and self.config is not None and self.spec is not None
        encoder, enc = self.plan.encoder(), self.config.encoder

        def refuse(why: str, reason: str = "BAD_ENCODER_INPUT") -> ProtocolError:
            return ProtocolError(ErrorClass.ARCH, InvalidArgument(why, reason))
        if not active_groups <= self.plan.optional_ids():
            raise refuse(f"the step activates groups {sorted(active_groups)}; the plan's optional groups are "
                         f"{sorted(self.plan.optional_ids())}", "BAD_ACTIVE_GROUPS")
        encoding = any(r.encoded_offsets for r in rows)
        if encoding != (encoder is not None and encoder.id in active_groups):
            raise refuse("the step's active groups and its rows disagree on running the encoder", "BAD_ACTIVE_GROUPS")
        if not encoding:
            return
        if enc is None:
            raise refuse("rows bring encoder input; the model has no encoder")
        if decode_steps > 1:
            raise refuse("a decode run takes no encoder input")
        for r in rows:
            offsets, features = r.encoded_offsets, r.encoder_input
            n = len(offsets)
            if not n:
                continue
            if features is None or features.dtype != np.float32 or features.shape != (n, enc.input_dim):
                shape = None if features is None else f"{features.dtype}{list(features.shape)}"
                raise refuse(f"row of session {r.session_id!r} places {n} encoded rows; its encoder input is {shape}, "
                             f"not f32[{n}, {enc.input_dim}]")
            if list(offsets) != sorted(set(offsets)) or offsets[0] < 0 or offsets[-1] >= len(r.token_ids):
                raise refuse(f"row of session {r.session_id!r} has encoded offsets {list(offsets)} outside its "
                             f"{len(r.token_ids)} tokens or out of order")
            if any(r.token_ids[o] != enc.token_id for o in offsets):
                raise refuse(f"row of session {r.session_id!r} places encoded rows on tokens other than the "
                             f"placeholder {enc.token_id}")

    def _begin(self, incarnation: int, rows: list[StepRow], decode_steps: int) -> None:
        """Commits each row's folded epoch and begins its epoch with its KV blocks reserved; a row that cannot
        begin rolls back the rows already begun, so the step changes nothing but the folded commits."""
        begun: list[tuple[StageSession, int]] = []
        try:
            for row in rows:
                session = self._session(row.session_id)
                if row.commit_epoch:
                    self._commit(incarnation, row.session_id, session, row.commit_epoch)
                    if row.commit_length:
                        self._truncate(session, row.commit_length)
                try:
                    # before the length check: an undecided epoch explains a mismatch, and is what to resolve
                    session.txn.check_decided(row.epoch)
                except FailedPrecondition as e:
                    raise FailedPrecondition(e.message, e.reason, {**e.metadata, "session_id": row.session_id}) from e
                if row.start != session.txn.kv_length:
                    raise FailedPrecondition(f"session {row.session_id!r} has {session.txn.kv_length} committed "
                                             f"tokens here, the row starts at {row.start}", "KV_LENGTH_MISMATCH")
                session.txn.begin(row.epoch)
                begun.append((session, row.epoch))
                session.pending_tokens = list(row.token_ids)
                if row.encoded_offsets:
                    # its KV rows depend on the encoder input as well as the tokens: no token key may name them
                    session.untokened = True
                try:
                    self.pool.reserve(row.session_id, row.start + len(row.token_ids) + decode_steps - 1)
                except ResourceExhausted as e:
                    raise ProtocolError(ErrorClass.ARCH, e) from e
        except Exception:
            for session, epoch in begun:
                session.txn.abort(epoch)
            raise

    def _run_step(self, incarnation: int, step_id: int, rows: list[StepRow], want_logits: bool,
                  timeout_s: float, decode_steps: int, waves: list[dag.Wave]) -> StepResult:
        """This rank's part of a step: its encoder wave when it owns an active one, then its decoder group once, or
        `decode_steps` times in a decode run. Iteration i > 0 of a run feeds each row the token iteration i - 1
        sampled: the last stage pushes those back to the first over the feedback route, and every stage hands them
        on beside its activation, so each rank knows the tokens its KV rows hold."""
        step = _InFlight(incarnation, step_id, rows, want_logits, decode_steps, timeout_s, waves,
                         sampled=[[] for _ in rows])
        with self._lock:
            self._in_flight[step_id] = step
            encoder = next((w for w in waves if w.group.kind == dag.ENCODER and w.group.rank == self.rank), None)
            if encoder is not None:  # posted first: the engine runs it before this rank's decoder wave
                self.engine.post("stage.encode", lambda: self._encode(step, encoder))
            self._next_input(step)
        try:
            while True:
                try:
                    return step.done.result(timeout=min(timeout_s, 1.0))
                except FutureTimeout:
                    with self._lock:
                        since = step.waiting_since
                        if since is not None and time.monotonic() - since >= timeout_s:
                            self._fail(step, ProtocolError(ErrorClass.COMM, DeadlineExceeded(
                                f"no boundary for step {step_id} (iteration {step.iteration}) within {timeout_s:.1f} s",
                                "BOUNDARY_TIMEOUT")))
        finally:
            with self._lock:
                del self._in_flight[step_id]

    def _inputs(self, step: _InFlight) -> list[dag.Route]:
        """The routes whose bundles the decoder group's next iteration of `step` consumes: in the first, those from
        the step's active groups it depends on; in a decode run's later ones, the previous decoder group's (its
        activation and the tokens) or, on the first decoder group, the feedback of the last."""
        assert self.plan is not None and self.group is not None
        plan, group = self.plan, self.group
        if step.iteration == 0:
            active = {w.group.id for w in step.waves}
            return [r for r in plan.routes_into(group.id) if r.source_group in active]
        return [r for r in plan.routes_into(group.id) if plan.groups[r.source_group].kind == dag.DECODER] + \
            plan.routes_into(group.id, feedback=True)

    def _next_input(self, step: _InFlight) -> None:
        """Posts the step's next iteration when its inputs are here (or it needs none), else leaves it waiting for
        them (under the lock)."""
        i = step.iteration
        if self.authority.state is not AuthorityState.ACTIVE:
            self._fail(step, self._fenced())
            return
        if step.step_id in self._aborted:
            self._fail(step, ProtocolError(ErrorClass.ARCH, FailedPrecondition(
                f"step {step.step_id} was aborted", "EPOCH_ABORTED")))
            return
        keys = [(step.step_id, i, r.id) for r in self._inputs(step)]
        if any(k not in self._mailbox for k in keys):
            if i and step.waiting_since is None:  # queued behind what the engine has to do now, never before it
                self.engine.post("stage.prepare", lambda: self._prepare(step, i))
            step.waiting_since = time.monotonic()
            return
        bundles = {k[2]: self._mailbox.pop(k) for k in keys}
        step.waiting_since = None
        self.engine.post("stage.iteration", lambda: self._advance(step, bundles))

    def _fenced(self) -> ProtocolError:
        return ProtocolError(ErrorClass.COMM, FailedPrecondition(
            f"fenced while waiting for a boundary: {self.authority.cause}", "POISONED"))

    def _fail(self, step: _InFlight, error: ProtocolError) -> None:
        if not step.done.done():
            step.done.set_exception(error)

    def _finish(self, step: _InFlight) -> None:
        """Completes the step once every iteration ran and every push was taken (under the lock)."""
        if step.computed and not step.pushes and not step.done.done():
            step.done.set_result(step.result)

    def _wave(self, step: _InFlight, group: dag.Group) -> int:
        return next(w.ordinal for w in step.waves if w.group.id == group.id)

    def _dims(self, step: _InFlight, encoded: int = 0) -> dict[str, int]:
        """The symbolic dimensions of the step's bundles (graphmesh.plan) in its current iteration."""
        return {dag.TOKENS: sum(len(r.token_ids) for r in step.rows), dag.ROWS: len(step.rows), dag.ENCODED: encoded}

    def _encode(self, step: _InFlight, wave: dag.Wave) -> None:
        """The encoder wave (engine thread): every row's encoder input, in row order, through the encoder, pushed to
        the group that consumes it."""
        assert self.plan is not None and self._encoder is not None
        if step.done.done():
            return
        try:
            features = np.concatenate([r.encoder_input for r in step.rows if r.encoder_input is not None])
            encoder, t0 = self._encoder, time.perf_counter()
            with telemetry.span("stage.encode", step=step.step_id, rows=features.shape[0]):
                encoded = self._guarded(lambda: encoder.run(features))
            step.result.compute_us += (time.perf_counter() - t0) * 1e6
            for route in self.plan.routes_from(wave.group.id):
                self._send(step, route, {dag.ENCODED_ROWS: encoded}, self._dims(step, len(features)), wave.ordinal)
        except Exception as e:
            with self._lock:
                self._fail(step, e if isinstance(e, ProtocolError) else ProtocolError(ErrorClass.COMM, e))

    def _advance(self, step: _InFlight, bundles: dict[int, Boundary]) -> None:
        """Runs the step's next iteration (engine thread), then posts or awaits the one after it."""
        assert self.spec is not None and self.plan is not None and self.group is not None
        spec, i = self.spec, step.iteration
        if step.done.done():
            return  # aborted or fenced while it was queued
        try:
            if i:
                fed = next((b.values.get(dag.RUN_TOKENS) for b in bundles.values()), None) if bundles else \
                    np.array([t[-1] for t in step.sampled], np.int64)
                if fed is None or fed.shape != (len(step.rows),):
                    raise ProtocolError(ErrorClass.CONTRACT, InvalidArgument(
                        f"iteration {i} of decode run {step.step_id} came without its {len(step.rows)} tokens",
                        "SCHEMA_MISMATCH"))
                prepared = step.prepared if step.prepared is not None and step.prepared.iteration == i else None
                if prepared is None:
                    step.rows = self._next_rows(step.rows)
                else:
                    step.rows = prepared.rows
                for r, t in zip(step.rows, fed):
                    r.token_ids[0] = int(t)
                with self._lock:
                    for r in step.rows:
                        session = self._sessions.get(r.session_id)
                        if session is not None:
                            session.pending_tokens += r.token_ids
            out = self._iteration(step, bundles)
            if step.steps > 1 and spec.last:
                for t, token in zip(step.sampled, out):
                    t.append(int(token))
                if i + 1 < step.steps:
                    tokens = np.asarray([t[-1] for t in step.sampled], np.int64)
                    for route in self.plan.routes_from(self.group.id, feedback=True):
                        self._send(step, route, {dag.RUN_TOKENS: tokens}, self._dims(step), self._wave(step, self.group),
                                   iteration=i + 1)
        except Exception as e:
            with self._lock:
                self._fail(step, e if isinstance(e, ProtocolError) else ProtocolError(ErrorClass.COMM, e))
            return
        with self._lock:
            step.iteration += 1
            if step.iteration < step.steps:
                self._next_input(step)
                return
            if step.steps > 1 and spec.last:
                step.result.tokens, step.result.run_tokens = [t[0] for t in step.sampled], step.sampled
            step.computed = True
            self._finish(step)

    @staticmethod
    def _next_rows(rows: list[StepRow]) -> list[StepRow]:
        """The rows of a decode run's next iteration, one position on, each with a token to be written in. Made
        by copying each row's fields, not through dataclasses.replace: that re-ran __init__ for every row of every
        iteration, the largest host cost of a 256-row decode iteration (profile_stage.py)."""
        out = []
        for r in rows:
            nxt = object.__new__(StepRow)
            fields = nxt.__dict__
            fields.update(r.__dict__)
            fields.update(start=r.start + 1, token_ids=[0], encoder_input=None, encoded_offsets=())
            out.append(nxt)
        return out

    def _prepare(self, step: _InFlight, iteration: int) -> None:
        """Builds `iteration`'s run ahead of its boundary (engine thread), unless the step is over or that
        iteration already ran (a boundary that came meanwhile posted it behind this task: it runs what was built
        here). A run that cannot be built now is built when the boundary comes, where its error counts."""
        assert self.spec is not None
        if step.done.done() or step.iteration != iteration or step.prepared is not None:
            return
        try:
            rows = self._next_rows(step.rows)
            step.prepared = self._inputs_for(step, rows, self._samples(step, rows), iteration)
        except Exception as e:
            log.debug("iteration not prepared", extra={"step": step.step_id, "error": repr(e)})

    def _received(self, step: _InFlight, bundles: dict[int, Boundary]) -> dict[str, np.ndarray]:
        """The values of this iteration's bundles by role, each bundle checked whole against its route's schema
        resolved for the step (CONTRACT: a bundle its sender should never have sent)."""
        assert self.plan is not None
        dims = self._dims(step, sum(len(r.encoded_offsets) for r in step.rows))
        values: dict[str, np.ndarray] = {}
        for route_id, b in bundles.items():
            why = self.plan.routes[route_id].schema.check(b.values, dims, step.iteration)
            if why:
                raise ProtocolError(ErrorClass.CONTRACT, InvalidArgument(
                    f"route {route_id} bundle for step {step.step_id}: {why}", "SCHEMA_MISMATCH"))
            values.update(b.values)
        return values

    def _iteration(self, step: _InFlight, bundles: dict[int, Boundary]) -> np.ndarray:
        """Runs the decoder group once over the step's rows (engine thread) and pushes its boundary on (with the rows'
        tokens after a decode run's first iteration: the next ranks know those from the request), or, on the last
        stage, fills the step's result; returns the group's output."""
        assert self.spec is not None and self.config is not None and self.plan is not None and self.group is not None
        spec, rows, result = self.spec, step.rows, step.result
        total = sum(len(row.token_ids) for row in rows)
        received = self._received(step, bundles)
        hidden, encoded = received.get(dag.ACTIVATION), received.get(dag.ENCODED_ROWS)
        if not spec.first and hidden is None:
            raise ProtocolError(ErrorClass.CONTRACT, InvalidArgument(
                f"step {step.step_id} reached rank {self.rank} without an activation", "SCHEMA_MISMATCH"))
        sample = self._samples(step, rows)
        host = spec.last and not step.want_logits and not sample  # logprobs, guided: sampled on the host
        t0 = time.perf_counter()
        with telemetry.span("stage.compute", step=step.step_id, iteration=step.iteration, rows=len(rows)):
            prepared = step.prepared
            run = prepared if prepared is not None and prepared.rows is rows and prepared.sample == sample and \
                encoded is None else self._inputs_for(step, rows, sample, step.iteration, encoded is not None)
            out = self._guarded(lambda: self._compute(rows, hidden, encoded, run))
        step.prepared, step.last_run = None, run
        result.compute_us += (time.perf_counter() - t0) * 1e6
        result.computed_tokens += total
        if not spec.last:
            values = {dag.ACTIVATION: out[:total]}
            if step.iteration:
                values[dag.RUN_TOKENS] = np.asarray([r.token_ids[0] for r in rows], np.int64)
            for route in self.plan.routes_from(self.group.id):
                self._send(step, route, values, self._dims(step), self._wave(step, self.group))
        elif step.want_logits:
            result.logits = out[: len(rows)].astype(np.float32)
        elif host:
            # Stage executables draw with the default RngOptions (they never set_rng), as sample_with_logprobs does.
            result.tokens, result.logprobs = sample_with_logprobs(RngOptions(), out[: len(rows)], [
                RowSampling(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p,
                            seed_for(r.sampling.seed, r.start + len(r.token_ids)), r.sampling.logprobs,
                            r.sampling.top_logprobs, r.allowed_tokens) for r in rows])
        else:
            result.tokens = [int(t) for t in out[: len(rows)]]
        return out

    def _samples(self, step: _InFlight, rows: list[StepRow]) -> bool:
        """Whether the run samples in the graph: a step for tokens, unless a row wants logprobs or is guided (then the
        last stage runs the logits graph and samples on the host)."""
        assert self.spec is not None
        return not step.want_logits and not (self.spec.last and any(r.sampling.logprobs or r.allowed_tokens
                                                                    for r in rows))

    def _guarded(self, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """Runs a group's compute, its failure classified: a bad shape or input is ARCH, a device error COMM."""
        try:
            return compute()
        except (InvalidArgument, OutOfRange, NotFound, FailedPrecondition, ResourceExhausted) as e:
            raise ProtocolError(ErrorClass.ARCH, e) from e
        except GraphmeshError:
            raise
        except Exception as e:
            raise self._device_failure(e) from e

    def _send(self, step: _InFlight, route: dag.Route, values: dict[str, np.ndarray], dims: dict[str, int], wave: int,
              iteration: int | None = None) -> None:
        """Validates a bundle against `route`'s schema resolved for the step, then sends it (ARCH when it breaks the
        schema: nothing has left the rank)."""
        iteration = step.iteration if iteration is None else iteration
        why = route.schema.check(values, dims, iteration)
        if why:
            raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                f"rank {self.rank} produced a bundle for route {route.id} that breaks its schema: {why}",
                "SCHEMA_MISMATCH"))
        if dag.ACTIVATION in values and self._take_fault("corrupt"):  # corrupted in transit: the receiver must refuse
            values = {**values, dag.ACTIVATION: values[dag.ACTIVATION][:, :-1]}
        boundary = Boundary(step.step_id, iteration, route.id, values, route.schema.identity, wave)
        if route.destination_rank == self.rank:  # a route within this rank: delivered in place
            self.accept_boundary(step.incarnation, boundary)
            return
        assert self.plan is not None
        self._push(step, self.plan.addresses[route.destination_rank], boundary)

    def _push(self, step: _InFlight, address: str, boundary: Boundary) -> None:
        """Sends `boundary` without waiting for it: a bundle that cannot be delivered fails the step as COMM (it
        leaves the order unprovable), and the step is not done before every bundle it sent was taken."""
        assert self._pusher is not None
        with self._lock:
            step.pushes += 1

        def delivered(error: Exception | None) -> None:
            with self._lock:
                step.pushes -= 1
                if error is not None:
                    self._fail(step, ProtocolError(ErrorClass.COMM, error))
                self._finish(step)
        try:
            self._pusher(address, step.incarnation, boundary, step.timeout_s, delivered)
        except Exception as e:
            delivered(e)

    def _device_failure(self, e: Exception) -> ProtocolError:
        """What a compute that raised something other than a graphmesh error means: the device ran out of
        memory (ARCH: the rows are retried alone, this rank stays usable) or failed (a CUDA error: COMM, so the
        incarnation is fenced and rebuilt, with its own reason: the link did nothing wrong)."""
        what = f"{type(e).__name__}: {e}"
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError
            return ProtocolError(ErrorClass.ARCH, ResourceExhausted(
                f"device {self.device} out of memory: {what}", "DEVICE_OUT_OF_MEMORY"))
        log.error("device failure", extra={"device": self.device, "error": what})
        return ProtocolError(ErrorClass.COMM, Internal(f"device {self.device} failed: {what}", "DEVICE_FAILURE"))

    def _compute(self, rows: list[StepRow], hidden: np.ndarray | None, encoded: np.ndarray | None,
                 run: _Prepared) -> np.ndarray:
        """One run over every row, on the engine thread, with `run`'s executable and inputs. `encoded`: the
        encoder's rows for the rows' placeholder tokens, in order (first stage), which replace those tokens'
        embeddings."""
        assert self.spec is not None and self.config is not None
        if self._take_fault("device"):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        spec, config = self.spec, self.config
        inputs, tokens = dict(run.inputs), run.tokens
        counts = [len(row.token_ids) for row in rows]
        total = sum(counts)
        if spec.first:
            ids = np.zeros(tokens, np.int64)
            ids[:total] = [t for row in rows for t in row.token_ids]
            inputs["input_ids"] = ids
            if encoded is not None:
                at_rows = np.cumsum([0, *counts[:-1]])
                where = np.array([a + o for a, row in zip(at_rows, rows) for o in row.encoded_offsets], np.int64)
                inputs["encoded"] = np.zeros((tokens, config.hidden_size), np.float32)
                inputs["encoded"][where] = encoded
                inputs["encoded_mask"] = np.zeros(tokens, np.float32)
                inputs["encoded_mask"][where] = 1.0
        else:
            assert hidden is not None
            padded = np.zeros((tokens, config.hidden_size), np.float32)
            padded[:total] = hidden
            inputs["hidden_in"] = padded
        exe = run.exe
        with telemetry.span("stage.run", tokens=tokens, seqs=run.seqs, blocks=run.blocks, rows=len(rows)):
            own = exe.swap_handles(self._pools)
            try:
                return exe.run(inputs, read_indices=[0], typed=True, extent=run.extent)[0]
            finally:
                self._pools = exe.swap_handles(own)

    def _inputs_for(self, step: _InFlight, rows: list[StepRow], sample: bool, iteration: int,
                    encoded: bool = False) -> _Prepared:
        """`iteration`'s run: from the run before it where that was the same decode run's (each row one position
        on: array operations over all rows), else built row by row."""
        prev = step.last_run
        if (prev is not None and not encoded and iteration == prev.iteration + 1 and prev.sample == sample
                and len(prev.rows) == len(rows) and prev.tokens == prev.seqs):
            run = self._next_run(prev, rows, iteration)
            if run is not None:
                return run
        return self._run_inputs(rows, sample, iteration, encoded)

    def _next_run(self, prev: _Prepared, rows: list[StepRow], iteration: int) -> _Prepared | None:
        """The run of a decode run's next iteration from the run of the one before: the same executable, block
        tables and sampling, each real row one position on (its slot from its table, its seed seed_for's next).
        None where a row's next position is in no block of its table (the row-by-row build reports it)."""
        n, block = len(rows), self.pool.block_tokens
        positions = prev.inputs["positions"].copy()
        positions[:n] += 1
        table = prev.inputs["block_table"]
        at = positions[:n] // block
        if (at >= table.shape[1]).any():
            return None
        owned = table[np.arange(n), at]
        if (owned == SCRATCH_BLOCK).any():
            return None
        slots = prev.inputs["slots"].copy()
        slots[:n] = owned * block + positions[:n] % block
        inputs = {**prev.inputs, "positions": positions, "slots": slots}
        if "seed" in inputs:  # seed_for(s, p + 1) == (seed_for(s, p) + 1) mod 2^63
            seed = inputs["seed"].copy()
            seed[:n] = (seed[:n] + 1) & _SEED_MASK
            inputs["seed"] = seed
        return _Prepared(iteration, rows, prev.sample, prev.exe, inputs, prev.tokens, prev.seqs, prev.blocks,
                         prev.extent)

    def _run_inputs(self, rows: list[StepRow], sample: bool, iteration: int, encoded: bool = False) -> _Prepared:
        """A run's executable and every input but those a boundary brings. Shapes are bucketed (powers of two) so
        a handful of executables serve every step: padded token rows write the scratch block, padded sequences
        read it, and the run's active extent skips them where it can."""
        assert self.spec is not None
        spec, pool = self.spec, self.pool
        counts = [len(row.token_ids) for row in rows]
        total, decode = sum(counts), all(n == 1 for n in counts)
        seqs = bucket(len(rows), 1)
        tokens = seqs if decode else bucket(total, MIN_PREFILL_ROWS)
        tables = [pool.table(row.session_id) for row in rows]
        longest = max(len(t) for t in tables)
        blocks = min(bucket(longest, 1), max(self.max_blocks, longest))  # a rung of the ladder, never past the context
        positions = np.zeros(tokens, np.int64)
        slots = np.full(tokens, SCRATCH_BLOCK * pool.block_tokens, np.int64)
        token_seq = np.arange(tokens, dtype=np.int64) if decode else np.zeros(tokens, np.int64)
        block_table = np.full((seqs, blocks), SCRATCH_BLOCK, np.int64)
        last_index = np.zeros(seqs, np.int64)
        at = 0
        for b, (row, n, table) in enumerate(zip(rows, counts, tables)):
            positions[at:at + n] = row.start + np.arange(n)
            slots[at:at + n] = pool.slots(row.session_id, row.start, row.start + n)
            token_seq[at:at + n] = b
            block_table[b, :len(table)] = table
            last_index[b] = at + n - 1
            at += n
        inputs: dict[str, np.ndarray] = {"positions": positions, "slots": slots, "token_seq": token_seq,
                                         "block_table": block_table}
        if spec.last:
            inputs["last_index"] = last_index
            if sample:
                pad = seqs - len(rows)
                inputs.update(
                    temperature=np.array([r.sampling.temperature for r in rows] + [0.0] * pad, np.float32),
                    top_k=np.array([r.sampling.top_k for r in rows] + [0] * pad, np.int64),
                    top_p=np.array([r.sampling.top_p for r in rows] + [1.0] * pad, np.float32),
                    seed=np.array([seed_for(r.sampling.seed, r.start + n) for r, n in zip(rows, counts)] + [0] * pad,
                                  np.int64))
        exe = self._executable(tokens, seqs, blocks, decode, sample or not spec.last, encoded)
        # Only the real rows are computed (the padding is a bucket's, for a handful of executables), except in a CUDA
        # decode: that replays a captured graph of the whole bucket, far cheaper than an eager run of fewer rows.
        extent = (total, tokens) if total < tokens and not (decode and self.device.startswith("cuda")) else None
        return _Prepared(iteration, rows, sample, exe, inputs, tokens, seqs, blocks, extent)

    def _forget_step(self, step_id: int) -> None:
        """Drops what was pushed for `step_id` and not taken (under the lock): a run that failed part-way."""
        for key in [k for k in self._mailbox if k[0] == step_id]:
            del self._mailbox[key]

    def accept_boundary(self, incarnation: int, boundary: Boundary) -> None:
        """Validates a pushed bundle against its route before accepting it: the route is the plan's and ends here,
        the sender's schema identity is this rank's, and every value has a role of the schema with its dtype and
        fixed sizes (the sizes fixed per step are checked when the step consumes it). A bad bundle poisons: it
        breaks the contract."""
        with self._lock:
            self.authority.check(incarnation)
            cause = self._breach(boundary)
            if cause:
                self._poison(incarnation, f"CONTRACT: {cause}")
                raise InvalidArgument(cause, "SCHEMA_MISMATCH", {METADATA_KEY: ErrorClass.CONTRACT})
            if boundary.step_id in self._aborted:
                return  # a late push for a step already rolled back
            self._mailbox[(boundary.step_id, boundary.iteration, boundary.route_id)] = boundary
            step = self._in_flight.get(boundary.step_id)
            if step is not None and step.waiting_since is not None and step.iteration == boundary.iteration:
                self._next_input(step)

    def _breach(self, boundary: Boundary) -> str:
        """Why `boundary` cannot be a bundle of its route to this rank, or ""."""
        assert self.plan is not None
        routes = self.plan.routes
        if not 0 <= boundary.route_id < len(routes) or routes[boundary.route_id].destination_rank != self.rank:
            return f"route {boundary.route_id} does not lead to rank {self.rank}"
        schema = routes[boundary.route_id].schema
        if boundary.schema_identity != schema.identity:
            return (f"route {boundary.route_id} bundle has schema {boundary.schema_identity!r}, this rank's is "
                    f"{schema.identity!r}")
        if not boundary.values:
            return f"route {boundary.route_id} bundle holds no tensors"
        why = schema.admits(boundary.values)
        return f"route {boundary.route_id} bundle: {why}" if why else ""

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
            self._committed(incarnation, session_id, session, epoch)

    def _truncate(self, session: StageSession, length: int) -> None:
        """Rolls a committed verified chunk back to its accepted rows (under the lock; idempotent): the rows past
        `length` are no longer the session's. Its blocks stay lent to it (the coordinator counts them until it ends,
        and its next chunk writes them again); blocks already written behind hold the tokens they were keyed by,
        whatever was accepted, so only the count of stored tokens moves back."""
        txn = session.txn
        if txn.phase is not SessionPhase.IDLE or length >= txn.kv_length:
            return
        txn.kv_length = txn.pending_length = length
        del session.tokens[length:]
        block = self.pool.block_tokens
        session.stored_tokens = min(session.stored_tokens, length // block * block)

    def _committed(self, incarnation: int, session_id: str, session: StageSession, epoch: int) -> None:
        """What follows a commit of `epoch` (folded, or resolved): its tokens are recorded, its blocks written behind."""
        session.tokens += session.pending_tokens
        session.pending_tokens = []
        self._write_behind(incarnation, session_id, session, epoch)

    def _write_behind(self, incarnation: int, session_id: str, session: StageSession, epoch: int) -> None:
        spec = self.spec
        if self._block_writer is None or spec is None or not spec.kvstore_address:
            return
        block = spec.kv_block_tokens or 16
        whole = session.txn.kv_length // block * block
        if whole <= session.stored_tokens or len(session.tokens) < whole or session.untokened:
            return
        # Read on the engine thread after the step that wrote the rows, without holding up this commit (the caller
        # holds the lock): the slots are taken now, so a release and reuse of the blocks later cannot race it.
        writer, slots, tokens, first = self._block_writer, self.pool.slots(session_id, session.stored_tokens, whole), \
            session.tokens[:whole], session.stored_tokens // block
        self.engine.post("stage.kv_write_behind", lambda: writer(KvBlocks(
            spec.kvstore_address, self.model_identity, spec.layer_start, spec.layer_end, self.kv_dim, block, tokens,
            first, self._take(slots), incarnation, epoch)))
        session.stored_tokens = whole

    @property
    def kv_dim(self) -> int:
        return self.config.kv_dim if self.config is not None else 0

    def _take(self, slots: np.ndarray) -> np.ndarray:
        """Pool rows `slots` as f32 [rows, layers, 2, kv_dim], moved off the device row by row (engine thread)."""
        assert self._holder is not None
        names = self._pool_names()
        rows = np.empty((len(slots), len(names) // 2, 2, self.kv_dim), np.float32)
        for j, name in enumerate(names):
            rows[:, j // 2, j % 2] = self._holder._take_rows(self._pools[name], slots)
        return rows

    def _committed_slots(self, incarnation: int, session_id: str, from_row: int, to_row: int) -> np.ndarray:
        with self._lock:
            self.authority.check(incarnation)
            session = self._session_or_404(session_id)
            if not 0 <= from_row <= to_row <= session.txn.kv_length:
                raise OutOfRange(f"rows [{from_row}, {to_row}) outside the {session.txn.kv_length} committed rows of "
                                 f"session {session_id!r}", "ROW_OUT_OF_RANGE")
            return self.pool.slots(session_id, from_row, to_row)

    def read_kv(self, incarnation: int, session_id: str, from_row: int, to_row: int) -> np.ndarray:
        """Committed rows [from_row, to_row) as f32 [rows, layers, 2, kv_dim]."""
        slots = self._committed_slots(incarnation, session_id, from_row, to_row)
        return self.engine.run("stage.read_kv", lambda: self._take(slots))

    def read_kv_pieces(self, incarnation: int, session_id: str, from_row: int, to_row: int) -> Iterator[list[memoryview]]:
        """The same rows a pool at a time (K, then V, of each layer in order), each piece f32 [rows, kv_dim] as the
        byte buffers that hold it in order. Where the pools are host memory these are views of the session's
        blocks in place (nothing is copied, nor does the engine take part: the rows are committed, nothing writes
        them); elsewhere each piece is an engine task of its own, the next one queued before a piece is handed out,
        so a row copy sends one piece while the engine reads the next and steps run between them."""
        slots = self._committed_slots(incarnation, session_id, from_row, to_row)  # checked now, not at first next()
        names = self._pool_names()
        holder = self._holder
        assert holder is not None
        views = [v for v in (holder._host_view(self._pools[name]) for name in names) if v is not None]
        if len(views) == len(names):
            runs = _runs(slots)
            return iter([[view[a:b].reshape(-1).view(np.uint8).data for a, b in runs] for view in views])

        def take(name: str) -> list[memoryview]:
            assert self._holder is not None
            piece = np.asarray(self._holder._take_rows(self._pools[name], slots), np.float32)
            return [piece.reshape(-1).view(np.uint8).data]

        def pieces() -> Iterator[list[memoryview]]:
            ahead = self.engine.submit("stage.read_kv", partial(take, names[0]))
            for j in range(len(names)):
                piece = ahead.result()
                if j + 1 < len(names):
                    ahead = self.engine.submit("stage.read_kv", partial(take, names[j + 1]))
                yield piece
        return pieces()

    def committed_tokens(self, incarnation: int, session_id: str, from_row: int, to_row: int) -> list[int]:
        """The token ids of committed rows [from_row, to_row), or [] when this rank does not know them all (rows
        that came without their tokens): a copy then carries none rather than wrong ones."""
        with self._lock:
            self.authority.check(incarnation)
            session = self._session_or_404(session_id)
            if session.untokened or to_row > len(session.tokens):
                return []
            return session.tokens[from_row:to_row]

    def write_kv(self, incarnation: int, session_id: str, start: int, rows: np.ndarray, token_ids: list[int]) -> int:
        """Appends committed rows to an idle session (a seeded prefix or a migration); returns the KV length."""
        self.check_kv_rows(str(rows.dtype), rows.shape)
        write = self.begin_write_kv(incarnation, session_id, start, rows.shape[0], token_ids)

        def put_all() -> None:
            for j in range(write.pieces):
                write.put_now(j, rows[:, j // 2, j % 2])
        self.engine.run("stage.write_kv", put_all)  # outside the lock: the engine may be busy with another step
        return write.finish()

    def check_kv_rows(self, dtype: str, shape: tuple[int, ...]) -> None:
        """Refuses KV rows that are not this stage's f32 [n, layers, 2, kv_dim] (`dtype` as numpy or the wire
        spells it)."""
        if dtype not in ("float32", "f32") or len(shape) != 4 or shape[1:] != (self.layers, 2, self.kv_dim):
            raise InvalidArgument(f"KV rows {dtype}{list(shape)} do not match this stage's "
                                  f"f32[n, {self.layers}, 2, {self.kv_dim}]", "BAD_KV_ROWS")

    @property
    def layers(self) -> int:
        assert self.spec is not None
        return self.spec.layer_end - self.spec.layer_start

    def begin_write_kv(self, incarnation: int, session_id: str, start: int, n: int, token_ids: list[int]) -> KvRowsWrite:
        """Checks an append of `n` committed rows to an idle session and reserves their blocks; the rows are then
        put a pool at a time (KvRowsWrite.put) and committed by KvRowsWrite.finish."""
        assert self.spec is not None
        if token_ids and len(token_ids) != n:
            raise InvalidArgument(f"{len(token_ids)} token ids for {n} rows", "BAD_KV_ROWS")
        limit = self.spec.max_context_tokens or (self.config.max_position if self.config else 0)
        if start + n > limit:
            raise OutOfRange(f"{start + n} rows exceed the context of {limit}", "CONTEXT_EXCEEDED")
        with self._lock:
            self.authority.check(incarnation)
            session = self._session(session_id)
            session.txn.append_committed(start, 0)  # refuses an open epoch or a gap before touching anything
            self.pool.reserve(session_id, start + n)
            slots = self.pool.slots(session_id, start, start + n)
        return KvRowsWrite(self, incarnation, session, start, n, token_ids, slots)

    def share_kv(self, incarnation: int, session_id: str, donor_id: str, token_ids: list[int]) -> int:
        """Starts a new session with the KV of a prompt prefix that `donor_id` holds here: its first whole blocks,
        shared (kv_pool.KvPool.share), committed at once. Refused unless the donor's committed tokens begin with
        exactly `token_ids`: a shared block must hold what the new session would have computed itself."""
        block = self.pool.block_tokens
        n = len(token_ids)
        if n == 0 or n % block:
            raise InvalidArgument(f"a shared prefix is whole blocks of {block} tokens, not {n} tokens",
                                  "BAD_SHARED_PREFIX")
        with self._lock:
            self.authority.check(incarnation)
            donor = self._sessions.get(donor_id)
            if donor is None or donor.untokened or donor.txn.kv_length < n or donor.tokens[:n] != token_ids:
                raise FailedPrecondition(f"session {donor_id!r} holds no committed prefix of these {n} tokens here",
                                         "PREFIX_NOT_HELD")
            if session_id in self._sessions:
                raise FailedPrecondition(f"session {session_id!r} already exists here", "SESSION_NOT_NEW")
            self.pool.share(session_id, donor_id, n // block)
            session = self._session(session_id)
            session.txn.append_committed(0, n)
            # the donor wrote (or writes) these blocks behind: this session starts past them
            session.tokens, session.stored_tokens = list(token_ids), n
            return n

    def abort_step(self, incarnation: int, step_id: int, rows: list[StepRow]) -> None:
        """Rolls back every row of a step and wakes a wait for its boundary; allowed under poison."""
        with self._lock:
            if incarnation != self.authority.incarnation:
                self.authority.check(incarnation)
            self._aborted.add(step_id)
            self._forget_step(step_id)
            step = self._in_flight.get(step_id)
            if step is not None:
                self._fail(step, ProtocolError(ErrorClass.ARCH, FailedPrecondition(
                    f"step {step_id} was aborted", "EPOCH_ABORTED")))
        for row in rows:
            self.abort(incarnation, row.session_id, row.epoch, row.commit_epoch, row.commit_length)

    def abort(self, incarnation: int, session_id: str, epoch: int, commit_epoch: int = 0, commit_length: int = 0) -> int:
        """Local rollback of one session's epoch; allowed under poison (but not for an older incarnation)."""
        with self._lock:
            if incarnation != self.authority.incarnation:
                self.authority.check(incarnation)
            session = self._sessions.get(session_id)
            if session is None:
                return 0
            if commit_epoch and session.txn.epoch == commit_epoch:
                self._commit(incarnation, session_id, session, commit_epoch)  # tokens recorded, blocks written behind
                if commit_length:
                    self._truncate(session, commit_length)
            session.txn.abort(epoch)
            return session.txn.kv_length

    def resolve(self, incarnation: int, session_id: str, epoch: int, outcome: Outcome) -> int:
        """Settles an INDETERMINATE epoch with the coordinator's logged decision. Allowed under poison (not for an
        older incarnation), as a rollback is: a restarted coordinator resolves its predecessor's epochs after
        fencing it, so that a committed epoch's blocks are still written behind."""
        with self._lock:
            if incarnation != self.authority.incarnation:
                self.authority.check(incarnation)
            session = self._session_or_404(session_id)
            with telemetry.span("stage.resolve", session=session_id, epoch=epoch, outcome=outcome.name):
                session.txn.resolve(epoch, outcome)
                if outcome is Outcome.COMMITTED:
                    self._committed(incarnation, session_id, session, epoch)
            log.info("epoch resolved", extra={"session": session_id, "epoch": epoch, "outcome": outcome.name})
            return session.txn.kv_length

    def release(self, incarnation: int, session_id: str) -> bool:
        with self._lock:
            self.authority.check(incarnation)
            self.pool.release(session_id)
            return self._sessions.pop(session_id, None) is not None

    def fence(self, incarnation: int, reason: str, terminal: bool) -> None:
        with self._lock:
            self._poison(incarnation, reason or "fenced by the coordinator", terminal)
            self._lock.notify_all()

    def inject_fault(self, kind: str, count: int) -> None:
        if not self.faults_enabled:
            raise FailedPrecondition("fault injection is off; start the executor with --enable-fault-injection",
                                     "FAULT_INJECTION_DISABLED")
        if count < 1 or kind not in ("arch", "corrupt", "device"):
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



def _positions(row: StepRow) -> list[StepRow]:
    """A prediction-target row as the single-token rows of its positions; any other row as itself."""
    if not row.proposed:
        return [row]
    return [StepRow(row.session_id, row.epoch, row.commit_epoch, row.start + i, [t], row.sampling)
            for i, t in enumerate(row.token_ids)]


def _verify(rows: list[StepRow], result: StepResult) -> None:
    """The prediction-only operation on the owner rank: regroups the samples of each row's positions and keeps a
    prediction-target row's proposals while each equals the sample drawn before it. Greedy, that is the target's
    argmax; sampled, the proposal is accepted with the target's probability of it and otherwise the sample is a
    draw from the rest of the distribution: speculative sampling's rule for a deterministic proposer, and the
    very token plain decoding would have drawn there with the same seed."""
    samples = iter(result.tokens)
    tokens: list[int] = []
    runs: list[list[int]] = []
    accepted: list[int] = []
    for row in rows:
        if not row.proposed:
            tokens.append(next(samples))
            runs.append([])
            accepted.append(0)
            continue
        drawn = [next(samples) for _ in row.token_ids]
        base = len(row.token_ids) - row.proposed  # drawn[base - 1] follows the last real token
        a = 0
        while a < row.proposed and drawn[base - 1 + a] == row.token_ids[base + a]:
            a += 1
        kept = drawn[base - 1: base + a]
        tokens.append(kept[0])
        runs.append(kept)
        accepted.append(a)
    result.tokens, result.run_tokens, result.accepted = tokens, runs, accepted


def _runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """`slots` as runs of consecutive pool rows [a, b), in order."""
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(slots)]])
    return [(int(slots[a]), int(slots[b - 1]) + 1) for a, b in zip(starts, ends)]


class KvRowsWrite:
    """Committed rows being appended to an idle session (StageRuntime.begin_write_kv): their blocks are reserved, a
    pool's piece (f32 [n, kv_dim]) is written by an engine task, and finish commits them all."""

    def __init__(self, runtime: StageRuntime, incarnation: int, session: StageSession, start: int, n: int,
                 token_ids: list[int], slots: np.ndarray) -> None:
        self._rt, self._incarnation, self._session = runtime, incarnation, session
        self.start, self.n, self._token_ids, self._slots = start, n, token_ids, slots
        self._names = runtime._pool_names()

    @property
    def pieces(self) -> int:
        return len(self._names)

    def put(self, j: int, piece: np.ndarray) -> Future[None]:
        """Writes piece `j` (K, then V, of each layer in order) on the engine; `piece` must not change until the
        future is done."""
        if piece.shape != (self.n, self._rt.kv_dim) or piece.dtype != np.float32:
            raise InvalidArgument(f"KV piece {piece.dtype}{list(piece.shape)}, expected f32[{self.n}, "
                                  f"{self._rt.kv_dim}]", "BAD_KV_ROWS")
        return self._rt.engine.submit("stage.write_kv", lambda: self.put_now(j, piece))

    def put_now(self, j: int, piece: np.ndarray) -> None:
        """put, on the engine thread itself."""
        rt = self._rt
        assert rt._holder is not None
        name = self._names[j]
        rt._pools[name] = rt._holder._put_rows(rt._pools[name], self._slots, piece)

    def finish(self) -> int:
        """Commits the rows (every piece written); returns the session's KV length."""
        rt, session, start = self._rt, self._session, self.start
        with rt._lock:
            rt.authority.check(self._incarnation)
            session.txn.append_committed(start, self.n)
            if not self._token_ids or len(session.tokens) != start:
                session.untokened = True  # the tokens would no longer line up with the rows they key
            elif not session.untokened:
                session.tokens += self._token_ids
                if session.stored_tokens == start:
                    # These rows came from the store or a peer: their whole blocks are not written behind again. A
                    # partial last block is, once the session completes it (its rows are all here by then).
                    assert rt.spec is not None
                    block = rt.spec.kv_block_tokens or 16
                    session.stored_tokens = session.txn.kv_length // block * block
            return session.txn.kv_length


def default_kv_cache_bytes(device: str, backend: str = "torch") -> int:
    """The KV pool's size when --kv-cache-bytes is not given: a quarter of the free device memory on CUDA (after
    the weights), else a tenth of the available host memory up to DEFAULT_KV_CACHE_BYTES (NUMPY_KV_CACHE_BYTES for
    the numpy reference, whose functional kv_scatter copies the pool on every step)."""
    if backend == "numpy":
        return NUMPY_KV_CACHE_BYTES
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free // 4)
    available = available_memory_bytes()
    return DEFAULT_KV_CACHE_BYTES if available is None else min(DEFAULT_KV_CACHE_BYTES, available // 10)

