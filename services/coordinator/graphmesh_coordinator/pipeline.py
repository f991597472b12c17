"""The invocation driver: the roster of ranks, Install, and one step (an invocation over the rows of many
sessions) over every rank.

Per step the coordinator sends ExecuteStep to every rank at once. Ranks begin every row's epoch (after
committing each session's previous one, folded in), the first stage embeds the tokens, each stage pushes its
boundary straight to the next executor (the coordinator never relays activations), and the last stage
returns each row's sampled token or logits. One step costs one round trip from the coordinator plus one push
per stage boundary, whatever the number of sessions in it.

Failures are classified where they happen: ARCH (deterministic, nothing left the rank) rolls every
rank back and is raised to the caller; COMM / CONTRACT fence the incarnation on every rank. INDETERMINATE (a
rank refused a row because it never learned how the session's previous epoch ended) rolls the step back like
ARCH, and the rank is sent that epoch's outcome from the durable decision log (ResolveEpoch); the rows are then
retried, the roster untouched.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from graphmesh import channels, kvkeys, security
from graphmesh import plan as dag
from graphmesh.errors import GraphmeshError, Unavailable, from_rpc_error
from graphmesh.kvstore_client import CircuitBreaker, KvStoreClient
from graphmesh.models.config import ModelConfig
from graphmesh.protocol import ACTIONS, Action, ErrorClass, classify
from graphmesh.v1 import stage_pb2, stage_pb2_grpc
from graphmesh_coordinator.planner import StagePlan, partition, plan
from graphmesh_coordinator.state import Decision, DurableState
from graphmesh_server import telemetry

log = logging.getLogger("graphmesh.coordinator")

# Deadlines of the calls a new session makes to the KV store before its prefill (a cache: when it does not
# answer quickly, computing the prompt is the better answer), and of registering the roster there. A seed's
# deadline fits its work: a fixed second plus its rows at a rate any working store beats (loopback copies run at
# 300+ MiB/s), so a frozen store costs a session about a second, not the deadline of the largest seed. (The
# scheduler seeds under its lock, so this is also how long a frozen store can hold up everyone, once per back-off.)
KV_SEED_BASE_S = 1.0
KV_SEED_MIN_BYTES_PER_S = 100 << 20
KV_REGISTER_TIMEOUT_S = 5.0
SHARE_TIMEOUT_S = 2.0  # ShareSessionKv on every rank: bookkeeping, awaited under the scheduler's lock
REJOIN_CHECKS = 4  # health checks in a row an executor back from a failure must pass before the mesh re-plans
JOIN_CHECKS = 2  # and a new member (it registered itself once it served: no flapping to wait out)


class InvocationFailed(Exception):
    """An invocation failed on some rank; `error_class` says what that means (protocol.ACTIONS: what to do)."""

    def __init__(self, error_class: ErrorClass, rank: int, cause: GraphmeshError) -> None:
        super().__init__(f"rank {rank}: {cause.message}")
        self.error_class, self.rank, self.cause = error_class, rank, cause

    @property
    def action(self) -> Action:
        return ACTIONS[self.error_class]


@dataclass
class Rank:
    plan: StagePlan
    stub: stage_pb2_grpc.StageServiceStub
    backend: str = ""
    device: str = ""
    param_bytes: int = 0
    healthy: bool = True
    model_identity: str = ""
    kv_pool_blocks: int = 0
    gpu_uuid: str = ""  # the GPU it computes on; "" off CUDA
    queues_runs: bool = False  # queues a decode run sent alone whole on its GPU (InstallResponse.queues_runs)


class Mesh:
    def __init__(self, model: str, config: ModelConfig, addresses: Sequence[str], state: DurableState,
                 split: Sequence[int] | None = None, weights: str = "f32", rpc_timeout_s: float = 60.0,
                 install_timeout_s: float = 600.0, max_context_tokens: int = 0, dtype: str = "",
                 kvstore: str = "", kv_block_tokens: int = kvkeys.DEFAULT_BLOCK_TOKENS,
                 tls: security.Tls | None = None) -> None:
        self.model, self.config, self.state = model, config, state
        self.addresses = list(addresses)
        self.split = list(split) if split else None
        self.weights, self.max_context_tokens, self.dtype = weights, max_context_tokens, dtype
        self.kvstore = KvStoreClient(kvstore, credentials=tls.channel_credentials() if tls else None,
                                     interceptors=telemetry.client_interceptors()) if kvstore else None
        self.kv_breaker = CircuitBreaker(f"kvstore {kvstore}")
        self.kvstore_address, self.kv_block_tokens = kvstore, kv_block_tokens
        self.rpc_timeout_s, self.install_timeout_s = rpc_timeout_s, install_timeout_s
        self.tls = tls
        # One channel per executor ever a member, kept when it leaves (a StatefulSet brings it back at the same address)
        self.channels = {a: telemetry.traced(channels.channel(a, tls)) for a in self.addresses}
        self.ranks: list[Rank] = []
        self.plan: dag.Plan | None = None  # the roster's DAG (groups, routes, schemas), as every rank has it
        self.incarnation = 0
        self.recoveries = 0
        self.kv_pool_blocks = 0  # the smallest pool of the roster: what the scheduler may lend to sessions
        self.kv_window_tokens = 0  # the sliding window past which every rank drops a session's blocks; 0: none do
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._recover_lock = threading.Lock()
        self._in_flight: set[grpc.Future[stage_pb2.ExecuteStepResponse]] = set()
        self._step_ids = itertools.count(1)
        self._watch_stop = threading.Event()
        # Executors the health watch found not answering: recovery and fencing do not wait for them again
        self._lost: frozenset[str] = frozenset()
        # Per executor, a call kept open on its channel (see _hold_channel)
        self._held: dict[str, grpc.RpcContext] = {}

    def set_members(self, addresses: Sequence[str]) -> None:
        """The executors this mesh may plan over from now on (membership: the static list and the executors
        registered in etcd). One that joined is taken into the roster by the health watch once it has answered
        a few probes in a row, as an executor back from a failure is; a member of the roster that left makes the
        mesh re-plan without it at once. Either way the steps in flight are fenced and their sessions restored
        and replayed, as after a loss, so no token changes."""
        addresses = list(dict.fromkeys(addresses))
        with self._lock:
            if addresses == self.addresses:
                return
            for address in addresses:
                if address not in self.channels:
                    self.channels[address] = telemetry.traced(channels.channel(address, self.tls))
            joined = [a for a in addresses if a not in self.addresses]
            left = [a for a in self.addresses if a not in addresses]
            self.addresses = addresses  # replaced, never changed in place: readers hold a consistent list
        for address in joined:
            log.info("executor joined", extra={"address": address, "members": len(addresses)})
        for address in left:
            log.warning("executor left", extra={"address": address, "members": len(addresses)})
        self.register_with_kvstore()
        if self.ready and {r.plan.address for r in self.ranks} & set(left):
            log.warning("an executor of the roster left: re-planning without it", extra={"left": left,
                                                                                        "incarnation": self.incarnation})
            threading.Thread(target=self._rejoin, args=(self.incarnation,), name="replan", daemon=True).start()

    def _known(self) -> list[str]:
        """Every member and every rank of the roster (a rank that left stays until the re-plan that drops it)."""
        return list(dict.fromkeys([*self.addresses, *(r.plan.address for r in self.ranks)]))

    def install(self, addresses: Sequence[str] | None = None, replacing: int = 0) -> None:
        """_install, once more when an executor refused the incarnation as stale: its refusal names the highest
        incarnation it has seen (a Fence far ahead from a token holder, a counter lost with the state dir), the
        counter moves there and the next install issues the one above it, in one step rather than one
        incarnation per retry (~1M retries, 30 h, after a Fence 2^20 ahead)."""
        try:
            self._install(addresses, replacing)
        except Unavailable as e:
            highest = int(e.metadata.get("highest_seen", "0") or 0)
            if highest < self.state.incarnation:
                raise
            log.warning("an executor has seen a newer incarnation: issuing the next one above it",
                        extra={"incarnation": self.state.incarnation, "highest_seen": highest})
            self.state.advance_to(highest)
            self._install(addresses, replacing)

    def _install(self, addresses: Sequence[str] | None = None, replacing: int = 0) -> None:
        """Issues a new incarnation and installs the plan on the executors (they load their own weights).

        replacing: the incarnation of a roster that still serves, re-planned because membership changed. Executors
        outside it install first, while it goes on serving (a new executor reads its layers then, not during the
        pause); only then is it fenced and the rest installed, which costs them little (they hold the weights)."""
        addresses = list(addresses or self.addresses)
        if len(addresses) > self.config.n_layers:  # at least one layer a stage: the rest wait, idle, as spares
            log.warning("more executors than layers: the last ones are left out of the plan",
                        extra={"executors": len(addresses), "layers": self.config.n_layers,
                               "left_out": addresses[self.config.n_layers:]})
            addresses = addresses[: self.config.n_layers]
        split = self.split if self.split and len(self.split) == len(addresses) else None
        with telemetry.span("mesh.install", executors=len(addresses)) as span:
            incarnation = self.state.next_incarnation()
            span.set_attribute("incarnation", incarnation)
            with telemetry.span("mesh.plan", incarnation=incarnation):
                stages = plan(self.config, addresses, split, weights=self.weights)
                dag_plan = partition(self.config, stages)
            ranks = [Rank(p, stage_pb2_grpc.StageServiceStub(self.channels[p.address])) for p in stages]
            t0 = time.perf_counter()
            log.info("installing", extra={"incarnation": incarnation, "ranks": len(ranks),
                                          "layers": [(p.layer_start, p.layer_end) for p in stages]})
            serving = {r.plan.address for r in self.ranks}
            newcomers = [r for r in ranks if r.plan.address not in serving] if replacing else []
            if newcomers:  # outside the lock: the serving roster's steps go on meanwhile
                self._send_installs(newcomers, incarnation, stages, dag_plan)
                log.info("newcomers installed; switching the roster over", extra={
                    "incarnation": incarnation, "newcomers": [r.plan.address for r in newcomers],
                    "ms": round((time.perf_counter() - t0) * 1e3, 1)})
            with self._lock:
                if replacing:
                    self.fence(replacing, "re-plan: the members changed")
                self._send_installs([r for r in ranks if r not in newcomers], incarnation, stages, dag_plan)
                self.state.retire()  # before any step of the new roster records: no decision of the old one is needed
                self.ranks, self.plan, self.incarnation = ranks, dag_plan, incarnation
                self.kv_pool_blocks = min(r.kv_pool_blocks for r in ranks)
                self.kv_window_tokens = self._kv_window(stages)
                self.register_with_kvstore()
                self._ready.set()
                log.info("installed", extra={"incarnation": incarnation,
                                             "ms": round((time.perf_counter() - t0) * 1e3, 1)})

    def _kv_window(self, stages: Sequence[StagePlan]) -> int:
        """The window past which every rank drops a session's leading blocks (stage_kv): the widest of the stages'
        windows where every stage has one, else 0. With a KV store a rank keeps blocks not yet written behind to
        it, which the scheduler cannot see: 0, it counts every block as held."""
        windows = [self.config.kv_window(p.layer_start, p.layer_end) for p in stages]
        return max(windows) if windows and min(windows) > 0 and self.kvstore is None else 0

    def _send_installs(self, ranks: Sequence[Rank], incarnation: int, stages: Sequence[StagePlan],
                       dag_plan: dag.Plan) -> None:
        """Installs `ranks` of the plan `stages` (its DAG `dag_plan`) under `incarnation`, all at once; raises
        Unavailable naming the first that failed."""
        calls = []
        wire_plan = dag.to_proto(dag_plan)
        for rank in ranks:
            p = rank.plan
            spec = stage_pb2.StageSpec(model=self.model, layer_start=p.layer_start, layer_end=p.layer_end,
                                       first=p.rank == 0, last=p.rank == len(stages) - 1,
                                       weights=self.weights, max_context_tokens=self.max_context_tokens,
                                       kvstore_address=self.kvstore_address,
                                       kv_block_tokens=self.kv_block_tokens, dtype=self.dtype)
            request = stage_pb2.InstallRequest(incarnation=incarnation, rank=p.rank, world_size=len(stages), stage=spec,
                                               plan=wire_plan)
            calls.append(rank.stub.Install.future(request, timeout=self.install_timeout_s))
        for rank, call in zip(ranks, calls):
            try:
                reply = call.result()
            except grpc.RpcError as e:
                rank.healthy = False
                error = from_rpc_error(e)
                seen = error.metadata.get("highest_seen", "") if error.reason == "STALE_INCARNATION" else ""
                raise Unavailable(f"executor {rank.plan.address} (rank {rank.plan.rank}) failed to install: "
                                  f"{error.message}", "INSTALL_FAILED", {"highest_seen": seen} if seen else None) from e
            rank.backend, rank.device, rank.param_bytes = reply.backend, reply.device, reply.param_bytes
            rank.model_identity, rank.kv_pool_blocks = reply.model_identity, reply.kv_pool_blocks
            rank.gpu_uuid, rank.queues_runs = reply.gpu_uuid, reply.queues_runs

    def execute_step(self, rows: Sequence[stage_pb2.StepRow], output: stage_pb2.OutputKind.ValueType,
                     incarnation: int, decode_steps: int = 1, sent: Callable[[], None] | None = None,
                     alone: bool = False) -> stage_pb2.ExecuteStepResponse:
        """Runs one step, scheduled for the roster of `incarnation`, on every rank and returns the last stage's
        answer (one result per row, in order). `decode_steps` > 1: a decode run of that many tokens per row. A
        step of a roster already replaced fails as COMM at once (its rows are restored and replayed like any
        other after a recovery). `sent` is called once the step is on its way to every rank. `alone`: no other step
        is sent until this one is answered (ExecuteStepRequest.alone)."""
        ranks = self.ranks
        if incarnation != self.incarnation:
            raise InvocationFailed(ErrorClass.COMM, -1, Unavailable(
                f"step scheduled for incarnation {incarnation}, the mesh runs {self.incarnation}", "STALE_INCARNATION"))
        step_id = next(self._step_ids)
        tokens = sum(len(r.token_ids) for r in rows)
        # request_group_active, decided here once for every rank: the encoder runs when a row brings its input
        encoder = self.plan.encoder() if self.plan is not None else None
        active = [encoder.id] if encoder is not None and any(r.encoded_offsets for r in rows) else []
        request = stage_pb2.ExecuteStepRequest(
            incarnation=incarnation, step_id=step_id, rows=rows, output=output,
            boundary_timeout_ms=int(self.rpc_timeout_s * 1000), decode_steps=decode_steps, active_groups=active,
            alone=alone)
        with telemetry.span("mesh.step", step=step_id, incarnation=incarnation, rows=len(rows), tokens=tokens,
                            decode_steps=decode_steps):
            return self._execute(ranks, incarnation, request, sent)

    def _execute(self, ranks: Sequence[Rank], incarnation: int, request: stage_pb2.ExecuteStepRequest,
                 sent: Callable[[], None] | None = None) -> stage_pb2.ExecuteStepResponse:
        # Write-ahead: the step's folded commits are durable before any rank can apply one, so an epoch the log does
        # not hold committed was committed nowhere (a resolution presumes it aborted). One group commit a step.
        self.state.record(*(Decision(row.session_id, row.commit_epoch, "COMMITTED") for row in request.rows
                            if row.commit_epoch))
        calls = []
        # The first rank first: it alone can start the step. A later rank's first bundle that comes before the
        # step waits in its mailbox; the last rank first made every step start a call later (the first rank got its
        # step ~0.6 ms after the last on the H200 host).
        for r in ranks:
            span = telemetry.start_span("mesh.execute_step", rank=r.plan.rank, address=r.plan.address,
                                        last=r.plan.rank == len(ranks) - 1)
            with telemetry.use(span):
                call = r.stub.ExecuteStep.future(request, timeout=self.rpc_timeout_s * max(1, request.decode_steps) + 5.0)
            telemetry.end_when_done(span, call)
            calls.append(call)
        with self._lock:
            self._in_flight.update(calls)
        if sent is not None:
            sent()
        failures: list[InvocationFailed] = []
        replies: list[stage_pb2.ExecuteStepResponse] = []
        aborted = False
        for rank, call in zip(ranks, calls):
            try:
                replies.append(call.result())
            except grpc.FutureCancelledError:
                failures.append(InvocationFailed(ErrorClass.COMM, rank.plan.rank, Unavailable(
                    f"rank {rank.plan.rank} ({rank.plan.address}) stopped answering health checks", "EXECUTOR_LOST")))
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                failure = InvocationFailed(classify(error), rank.plan.rank, error)
                failures.append(failure)
                if aborted:
                    continue
                aborted = True  # wake the ranks still waiting for a boundary that will never come:
                if failure.action is not Action.FENCE:
                    self._abort_step(ranks, request)  # roll back, stay ACTIVE
                else:
                    self.fence(incarnation, f"{failure.error_class} on rank {rank.plan.rank} ({error.reason}): "
                                            f"{error.message}")
        with self._lock:
            self._in_flight.difference_update(calls)
        if not failures:
            return replies[-1]
        # What the step failed of: COMM outranks ARCH outranks INDETERMINATE, and a rank woken by the step's abort
        # (EPOCH_ABORTED) only reports the failure of another.
        causes = [f for f in failures if f.cause.reason != "EPOCH_ABORTED"] or failures
        first = min(causes, key=lambda f: (f.action is not Action.FENCE, f.action is Action.RESOLVE, f.rank))
        if first.action is not Action.FENCE:
            self.state.record(*(Decision(row.session_id, row.epoch, "ABORTED") for row in request.rows))
            for f in failures:
                if f.action is Action.RESOLVE:
                    self._resolve(ranks, incarnation, f)
        elif failures[0].action is not Action.FENCE:
            self.fence(incarnation, f"{first.error_class} on rank {first.rank} ({first.cause.reason}): {first.cause.message}")
        raise first

    def _resolve(self, ranks: Sequence[Rank], incarnation: int, refusal: InvocationFailed) -> None:
        """Answers a SESSION_INDETERMINATE refusal: the named epoch's outcome from the decision log, sent to the rank
        that refused. One that cannot be resolved (the log no longer knows the epoch, the rank does not answer) is
        fenced and rebuilt like a COMM failure: the session is restored from its delivered tokens either way."""
        session_id, epoch = refusal.cause.metadata.get("session_id", ""), int(refusal.cause.metadata.get("epoch", "0"))
        outcome = self.state.outcome(session_id, epoch) if session_id and epoch else None
        rank = next(r for r in ranks if r.plan.rank == refusal.rank)
        log.warning("resolving an indeterminate epoch", extra={"session": session_id, "epoch": epoch,
                                                               "rank": refusal.rank, "outcome": outcome})
        error: GraphmeshError | None = None
        if outcome is None:
            error = Unavailable(f"the decision log does not know epoch {epoch} of session {session_id!r}",
                                "UNRESOLVABLE_EPOCH")
        else:
            try:
                rank.stub.ResolveEpoch(_resolve_request(incarnation, session_id, epoch, outcome),
                                       timeout=self.rpc_timeout_s)
            except grpc.RpcError as e:
                error = from_rpc_error(e)
        if error is not None:
            self.fence(incarnation, f"could not resolve epoch {epoch} of session {session_id!r} on rank "
                                    f"{refusal.rank}: {error.message}")
            raise InvocationFailed(ErrorClass.COMM, refusal.rank, error)

    def resolve_indeterminate(self, incarnation: int) -> int:
        """Resolves, from the decision log, every epoch the executors hold INDETERMINATE under `incarnation`: what a
        restarted coordinator does with its predecessor's incarnation (its own log, read back from disk) after
        fencing it, which leaves every epoch that waited for its decision there INDETERMINATE. A committed epoch is
        then committed on every rank (its blocks written behind to the KV store, for the restored session to seed),
        an uncommitted one rolled back, before a new install drops them. Returns the epochs resolved."""
        stubs = {a: stage_pb2_grpc.StageServiceStub(ch) for a, ch in self.channels.items()}
        calls = [(a, stub.Status.future(stage_pb2.StageServiceStatusRequest(), timeout=2.0)) for a, stub in stubs.items()]
        resolved = 0
        for address, call in calls:
            try:
                status = call.result()
            except grpc.RpcError:
                continue  # dead or frozen: the install goes on without it
            if status.incarnation != incarnation:
                continue
            for s in status.sessions:
                outcome = self.state.outcome(s.session_id, s.epoch)
                if s.phase != stage_pb2.SESSION_PHASE_INDETERMINATE or outcome is None:
                    continue
                try:
                    stubs[address].ResolveEpoch(_resolve_request(incarnation, s.session_id, s.epoch, outcome),
                                                timeout=2.0)
                    resolved += 1
                except grpc.RpcError as e:
                    log.warning("could not resolve an epoch", extra={"address": address, "session": s.session_id,
                                                                     "error": from_rpc_error(e).message})
        if resolved:
            log.warning("resolved indeterminate epochs from the decision log",
                        extra={"incarnation": incarnation, "epochs": resolved})
        return resolved

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def wait_ready(self, timeout_s: float) -> bool:
        """Waits out a recovery: a request that arrives meanwhile is delayed, not refused."""
        return self._ready.wait(timeout_s)

    def register_with_kvstore(self) -> None:
        """Tells the KV store which executors it may seed and copy between: every configured executor (a
        later re-plan may use any of them). A store that does not answer gets it again at the next install, or
        when it refuses a seed for an unregistered executor (it restarted)."""
        if self.kvstore is None or not self.kv_breaker.allow():
            return
        try:
            self.kvstore.register_executors(self.addresses, timeout=KV_REGISTER_TIMEOUT_S)
        except GraphmeshError as e:
            self.kv_breaker.failed(e)
            log.warning("could not register the executors with the kvstore", extra={"error": e.message})
        else:
            self.kv_breaker.succeeded()

    def _seed_timeout(self, tokens: int) -> float:
        """The deadline of seeding up to `tokens` rows on every stage (f32 K and V of every layer)."""
        row_bytes = self.config.n_layers * 2 * self.config.kv_dim * 4
        return KV_SEED_BASE_S + tokens * row_bytes / KV_SEED_MIN_BYTES_PER_S

    def seed_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        """Seeds a new session's KV on every rank from the longest prefix all of them have stored, leaving at
        least one token to compute; returns the rows seeded (0 when there is no store or no common hit). A store
        that fails is a cache miss, never a failed request; one that does not answer is skipped for a while
        (the circuit breaker) instead of making every new session wait out a deadline."""
        if self.kvstore is None:
            return 0
        block = self.kv_block_tokens
        limit = (len(token_ids) - 1) // block * block
        if limit <= 0 or not self.kv_breaker.allow():  # allow() last: a probe it lets through must be made
            return 0
        ranks, incarnation = self.ranks, self.incarnation
        spaces = [kvkeys.namespace(r.model_identity, r.plan.layer_start, r.plan.layer_end, self.config.kv_dim,
                                   block_tokens=block) for r in ranks]
        try:
            # One call: the store finds the prefix every stage has and writes all the stages in parallel (it was
            # a lookup per stage, then a seed per stage, one after another)
            matched = self.kvstore.seed_stages([(ns, r.plan.address) for ns, r in zip(spaces, ranks)],
                                               token_ids[:limit], incarnation, session_id, max_tokens=limit,
                                               timeout=self._seed_timeout(limit))[0]
        except GraphmeshError as e:
            self.kv_breaker.failed(e)
            log.warning("kv seed failed; computing the whole prompt", extra={"error": e.message, "reason": e.reason})
            self.release(session_id)
            if e.reason == "UNREGISTERED_EXECUTOR":  # the store restarted and forgot the roster
                self.register_with_kvstore()
            return 0
        self.kv_breaker.succeeded()
        return matched

    def recover(self, failed_incarnation: int, deadline_s: float = 120.0) -> None:
        """Rebuilds the roster after incarnation `failed_incarnation` was lost: fence it, wait for healthy
        executors (a restarted one at the same address counts), install incarnation k+1 on them. Idempotent:
        concurrent sessions that saw the same failure wait here and find the work done."""
        with self._recover_lock, telemetry.span("mesh.recover", failed_incarnation=failed_incarnation):
            if self.incarnation != failed_incarnation and self.ready:
                return
            t0 = time.monotonic()
            self.fence(failed_incarnation, "recovery")
            while True:
                healthy = self._answering(self.addresses, 1.0)
                if healthy:
                    try:
                        self.install(healthy)
                        break
                    except Unavailable as e:
                        log.warning("install during recovery failed; retrying", extra={"error": e.message})
                if time.monotonic() - t0 > deadline_s:
                    raise Unavailable(f"no healthy executors within {deadline_s:.0f} s of losing incarnation "
                                      f"{failed_incarnation}", "NO_HEALTHY_EXECUTORS")
                time.sleep(0.1)
            self.recoveries += 1
            log.warning("recovered", extra={"failed_incarnation": failed_incarnation, "incarnation": self.incarnation,
                                            "executors": len(self.ranks),
                                            "ms": round((time.monotonic() - t0) * 1e3, 1)})

    def watch(self, interval_s: float = 0.1, window_s: float = 1.0) -> None:
        """Health watching: every executor is probed every `interval_s`, probes overlapping (so one slow or frozen
        executor holds up nobody's probes), and an executor of the roster that has answered no probe sent in the
        last `window_s` (dead, frozen, cut off) is lost: the in-flight invocations are cancelled, fail as COMM and
        trigger recovery, within about window_s + interval_s of the failure. A probe's answer counts from when it
        was sent, so a slow link that still answers within the window is never taken for a lost executor.
        The window is a trade: 0.4 s finds a frozen executor in ~0.5 s, but a 2-core machine under load (a test
        suite, a compile) leaves a healthy executor silent that long often enough to cost needless re-plans."""
        lock = threading.Lock()
        last_ok: dict[str, float] = {}  # when the latest answered probe was sent (monotonic), per executor
        back: dict[str, int] = {}  # rounds in a row an executor outside the roster answered
        planned: set[str] = set()  # executors that were ranks of a roster (the others joined since)
        request = health_pb2.HealthCheckRequest()

        def probe(address: str) -> None:
            sent = time.monotonic()

            def done(call: grpc.Future[health_pb2.HealthCheckResponse]) -> None:
                try:
                    ok = call.result().status == health_pb2.HealthCheckResponse.SERVING
                except (grpc.RpcError, grpc.FutureCancelledError, ValueError):  # ValueError: the mesh closed the
                    ok = False  # channel meanwhile (close()), which must not end this thread with an error
                if ok:
                    with lock:
                        last_ok[address] = max(last_ok.get(address, 0.0), sent)

            health_pb2_grpc.HealthStub(self.channels[address]).Check.future(request, timeout=window_s) \
                .add_done_callback(done)

        def loop() -> None:
            was_ready = False
            while not self._watch_stop.wait(interval_s):
                now = time.monotonic()
                # ready first: install sets the ranks before it sets ready, so these ranks are the ready roster's
                ready = self.ready
                ranks = list(self.ranks)
                if ready and not was_ready:
                    # a roster just installed: its ranks start with a clean slate (they may have been too busy
                    # loading their layers to answer while the mesh was not ready)
                    with lock:
                        for rank in ranks:
                            last_ok[rank.plan.address] = max(last_ok.get(rank.plan.address, 0.0), now)
                was_ready = ready
                members, watched = self.addresses, self._known()  # membership may change between rounds
                for address in watched:
                    probe(address)
                    self._hold_channel(address)
                with lock:
                    silent = {a for a in watched if now - last_ok.setdefault(a, 0.0) > window_s}
                    fresh = {a for a in watched if now - last_ok[a] <= 2 * interval_s + 0.05}
                self._lost = frozenset(silent)
                for rank in ranks:
                    address = rank.plan.address
                    # every round, not once: a rank that froze while no step was in flight must also fail the
                    # steps sent to it later at once (they recover the mesh), not after their whole deadline
                    if address in silent and ready:
                        if rank.healthy:
                            log.warning("executor lost", extra={"address": address, "rank": rank.plan.rank,
                                                                "silent_ms": round((now - last_ok[address]) * 1e3)})
                        rank.healthy = False
                        with self._lock:
                            lost, self._in_flight = list(self._in_flight), set()
                        for call in lost:
                            call.cancel()
                    elif address in fresh and not rank.healthy and ready:
                        # silent for a while (a pause, a long compile) on an idle mesh, where no step failed to
                        # recover it: it serves again, and Status must not keep calling it unhealthy
                        log.warning("executor answers again", extra={"address": address, "rank": rank.plan.rank})
                        rank.healthy = True
                # An executor left out of the roster (it froze, or was down when the roster was rebuilt) that
                # answers again is taken back: the mesh re-plans over every healthy executor, as a recovery
                # does, so its layers and KV pool are used again instead of idling until the next failure.
                current = {r.plan.address for r in ranks}
                planned.update(current)
                for address in members:
                    if address in current or not ready or len(current) >= self.config.n_layers:
                        back[address] = 0
                        continue
                    back[address] = back.get(address, 0) + 1 if address in fresh else 0
                    if back[address] == (REJOIN_CHECKS if address in planned else JOIN_CHECKS):
                        log.warning("executor answers again: re-planning to take it back into the roster"
                                    if address in planned else "new executor answers: re-planning to take it in",
                                    extra={"address": address, "incarnation": self.incarnation})
                        threading.Thread(target=self._rejoin, args=(self.incarnation,), name="rejoin",
                                         daemon=True).start()

        threading.Thread(target=loop, name="health-watch", daemon=True).start()

    def _hold_channel(self, address: str) -> None:
        """Keeps a call open on the executor's channel (a health Watch stream, never read): a grpc channel runs a
        thread to complete its calls only while it has one, so without it the first call after an idle moment
        (most steps: a rank's reply often leaves its channel with none) created and started a thread first, 1.4 ms
        (median) against 0.2 with four threads contending for the GIL. Reopened once it ended (an executor
        restart); it takes one of the executor's --max-concurrent-rpcs slots."""
        held = self._held.get(address)
        if held is None or not held.is_active():
            self._held[address] = health_pb2_grpc.HealthStub(self.channels[address]).Watch(
                health_pb2.HealthCheckRequest())

    def _answering(self, addresses: Sequence[str], timeout_s: float) -> list[str]:
        """The addresses that answer a health check, all probed at once. One the health watch found lost is not
        waited for: it counts only if it has answered by the time the others did (an executor restarted at the
        same address), so a frozen executor costs recovery no timeout."""
        request = health_pb2.HealthCheckRequest()
        calls = {a: health_pb2_grpc.HealthStub(self.channels[a]).Check.future(request, timeout=timeout_s)
                 for a in addresses}
        lost = self._lost
        for address, call in calls.items():
            if address not in lost:
                call.exception()  # waits for it (an RPC error is an answer too: not healthy)
        answering = []
        for address, call in calls.items():
            if address in lost and not call.done():
                call.cancel()
                continue
            try:
                if call.result().status == health_pb2.HealthCheckResponse.SERVING:
                    answering.append(address)
            except (grpc.RpcError, grpc.FutureCancelledError):
                pass
        return answering

    def _rejoin(self, incarnation: int) -> None:
        """Re-plans the working roster of `incarnation` over every healthy member (one joined, came back, or left):
        the executors new to it install first while it serves, then it is fenced and the rest installed. Steps in
        flight fail as fenced and their sessions are restored and replayed, exactly as after a loss, so no token
        changes. A re-plan that fails before the fence leaves the roster serving; one that fails after it is
        finished as a recovery."""
        with self._recover_lock, telemetry.span("mesh.replan", incarnation=incarnation):
            if self.incarnation != incarnation or not self.ready:
                return  # a recovery (or another re-plan) got there first
            t0 = time.monotonic()
            try:
                self.install(self._answering(self.addresses, 1.0), replacing=incarnation)
            except GraphmeshError as e:
                log.warning("re-plan failed", extra={"incarnation": incarnation, "error": e.message})
            else:
                self.recoveries += 1
                log.warning("re-planned", extra={"incarnation": self.incarnation, "executors": len(self.ranks),
                                                 "ms": round((time.monotonic() - t0) * 1e3, 1)})
                return
        if self.incarnation == incarnation and not self.ready:  # fenced, then an install failed
            try:
                self.recover(incarnation)
            except GraphmeshError as e:
                log.warning("recovery after a failed re-plan failed", extra={"error": e.message})

    def _abort_step(self, ranks: Sequence[Rank], step: stage_pb2.ExecuteStepRequest) -> None:
        request = stage_pb2.AbortStepRequest(incarnation=step.incarnation, step_id=step.step_id, rows=step.rows)
        calls = [r.stub.AbortStep.future(request, timeout=self.rpc_timeout_s) for r in ranks]
        for call in calls:
            try:
                call.result()
            except grpc.RpcError:
                pass  # a rank that cannot abort is handled by the fence of a later COMM failure

    def fence(self, incarnation: int, reason: str) -> None:
        """Poisons `incarnation` on every executor that answers."""
        log.warning("fencing", extra={"incarnation": incarnation, "reason": reason})
        if incarnation == self.incarnation:
            self._ready.clear()  # a late fence of an incarnation already replaced must not un-ready its successor
        # Short deadline: a frozen executor must not hold up recovery; a later Install supersedes it anyway.
        with telemetry.span("mesh.fence", incarnation=incarnation, reason=reason):
            calls = [(a, stage_pb2_grpc.StageServiceStub(self.channels[a]).Fence.future(
                stage_pb2.FenceRequest(incarnation=incarnation, reason=reason), timeout=0.5))
                for a in self._known()]
            lost = self._lost
            for address, call in calls:
                if address in lost:
                    continue  # not waited for: it did not answer the health watch, and Install supersedes it anyway
                try:
                    call.result()
                except grpc.RpcError:
                    for rank in self.ranks:
                        if rank.plan.address == address:
                            rank.healthy = False

    def release(self, session_id: str, *more: str) -> None:
        """Drops the sessions on every rank, in one call a rank. A rank the health watch finds lost is not waited for:
        a frozen executor held every caller for the call's whole deadline (a failed seed releases under the
        scheduler's lock, so all admission stalled for a minute), and the install that replaces it drops the session
        anyway."""
        request = stage_pb2.ReleaseSessionRequest(
            header=stage_pb2.FencingHeader(incarnation=self.incarnation, session_id=session_id), session_ids=more)
        calls = [(r.plan.address, r.stub.ReleaseSession.future(request, timeout=self.rpc_timeout_s)) for r in self.ranks]
        for address, call in calls:
            while address not in self._lost:
                try:
                    call.exception(timeout=0.1)  # an error is an answer too: a fenced or dead rank dropped it
                    break
                except grpc.FutureTimeoutError:
                    continue
        for released in (session_id, *more):
            self.state.forget(released)  # no rank holds it: none will ask how its epochs ended

    def share_prefix(self, session_id: str, donor_id: str, token_ids: Sequence[int]) -> int:
        """Starts a new session on every rank with the KV blocks of a prefix its donor holds there (shared, not
        copied: ShareSessionKv); returns the rows shared, or 0, the session released everywhere, if any rank
        refused (the donor's epoch is not committed there yet, it was just released...): then it is computed."""
        header = stage_pb2.FencingHeader(incarnation=self.incarnation, session_id=session_id)
        request = stage_pb2.ShareSessionKvRequest(header=header, donor_session_id=donor_id, token_ids=token_ids)
        calls = [r.stub.ShareSessionKv.future(request, timeout=SHARE_TIMEOUT_S) for r in self.ranks]
        errors = [call.exception() for call in calls]  # every answer first: a late share must not outlive a release
        refused = next((e for e in errors if e is not None), None)
        if refused is not None:
            error = from_rpc_error(refused) if isinstance(refused, grpc.RpcError) else refused
            log.info("prefix not shared; computing it", extra={"session": session_id, "donor": donor_id,
                                                                "error": str(error)})
            self.release(session_id)
            return 0
        return len(token_ids)

    def stage_statuses(self) -> list[stage_pb2.StageServiceStatusResponse | None]:
        out: list[stage_pb2.StageServiceStatusResponse | None] = []
        for rank in self.ranks:
            try:
                out.append(rank.stub.Status(stage_pb2.StageServiceStatusRequest(), timeout=5.0))
            except grpc.RpcError:
                out.append(None)
        return out

    def close(self) -> None:
        self._watch_stop.set()
        for held in list(self._held.values()):  # a copy: the health watch may still be adding one
            held.cancel()
        if self.kvstore is not None:
            self.kvstore.close()
        for channel in self.channels.values():
            channel.close()


_OUTCOME_PB = {"COMMITTED": stage_pb2.EPOCH_OUTCOME_COMMITTED, "ABORTED": stage_pb2.EPOCH_OUTCOME_ABORTED}


def _resolve_request(incarnation: int, session_id: str, epoch: int, outcome: str) -> stage_pb2.ResolveEpochRequest:
    return stage_pb2.ResolveEpochRequest(header=stage_pb2.FencingHeader(incarnation=incarnation, session_id=session_id,
                                                                        epoch=epoch), outcome=_OUTCOME_PB[outcome])


def _healthy(channel: grpc.Channel, timeout_s: float) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def wait_for_executors(addresses: Sequence[str], timeout_s: float, tls: security.Tls | None = None) -> None:
    """Waits until every executor answers its health check, or fails naming the ones that don't."""
    deadline = time.monotonic() + timeout_s
    pending = list(addresses)
    with futures.ThreadPoolExecutor(max(1, len(pending))) as pool:
        while pending:
            def ok(address: str) -> bool:
                with channels.channel(address, tls) as channel:
                    return _healthy(channel, 2.0)
            results = list(pool.map(ok, pending))
            pending = [a for a, good in zip(pending, results) if not good]
            if pending and time.monotonic() > deadline:
                raise Unavailable(f"executor(s) {', '.join(pending)} did not answer within {timeout_s:.0f} s",
                                  "EXECUTOR_UNREACHABLE")
            if pending:
                time.sleep(0.2)
