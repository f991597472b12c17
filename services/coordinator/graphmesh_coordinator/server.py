"""graphmesh-coordinator: plans the partition, installs it, serves generation.

With --etcd, several coordinators of one --cluster-name elect a leader (graphmesh_coordinator.election): only the
leader installs and drives the executors and reports SERVING; the others have loaded the tokenizer and config and
wait as hot standbys, answering UNAVAILABLE (NOT_LEADER) until they win."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2

from graphmesh import models
from graphmesh.bundled import resolve_model
from graphmesh.channels import MESSAGE_OPTIONS
from graphmesh.checkpoints import open_checkpoint
from graphmesh.errors import InvalidArgument, NotFound, Unavailable
from graphmesh.kserve import grpc_service_pb2 as kserve_pb2
from graphmesh.kserve import grpc_service_pb2_grpc as kserve_grpc
from graphmesh.tokenizer import Tokenizer
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from graphmesh_coordinator import http_api
from graphmesh_coordinator import scheduler as sched
from graphmesh_coordinator.draft import Drafter
from graphmesh_coordinator.election import Election, EtcdState, LeaderMesh, not_leader
from graphmesh_coordinator.generation import DEFAULT_MAX_WAITING, Generator
from graphmesh_coordinator.http_api import HttpApi
from graphmesh_coordinator.kserve import KServeServicer
from graphmesh_coordinator.pipeline import Mesh, wait_for_executors
from graphmesh_coordinator.servicer import CoordinatorServicer
from graphmesh_coordinator.speculative import DEFAULT_K, DRAFT, Mode, parse_mode
from graphmesh_coordinator.state import DurableState, default_state_dir
from graphmesh_coordinator.upstream import LocalUpstream
from graphmesh_server import bootstrap, etcd, logs, membership, telemetry
from graphmesh_server.aio_serving import AioServer, MirroredHealth
from graphmesh_server.bootstrap import ServerSecurity
from graphmesh_server.etcd import EtcdClient
from graphmesh_server.serving import run_until_signalled

if TYPE_CHECKING:
    from graphmesh_coordinator.openai_server import OpenAIServer

log = logging.getLogger("graphmesh.coordinator")
# grpc.health.v1 service name that is SERVING while this process is worth keeping: a standby too (it waits to lead),
# not a leader that stepped down (a restart makes it a standby again). "" is SERVING only on the leader, with its
# mesh installed: the readiness a Kubernetes Service routes by.
LIVENESS_SERVICE = "liveness"


@dataclass
class CoordinatorConfig:
    listen: str
    executors: list[str]
    model: str = "smollm2-135m"
    state_dir: str = field(default_factory=lambda: str(default_state_dir()))
    kvstore: str = ""
    split: list[int] = field(default_factory=list)
    weights: str = "packed"
    startup_timeout_s: float = 60.0
    rpc_timeout_s: float = 60.0
    max_context_tokens: int = 0
    metrics_port: int = 0  # Prometheus /metrics; 0: off
    security: ServerSecurity = field(default_factory=ServerSecurity)
    dtype: str = ""  # stage dtype: f32, bf16, f16; "" is bf16 on CUDA executors, f32 on CPU ones
    max_step_tokens: int = 0  # tokens per step (decode rows and prompt chunks together); 0: by the ranks' devices
    max_step_seqs: int = 0  # sessions per step; 0: by the devices (scheduler.STEP_SEQS_*)
    http: HttpApi = field(default_factory=HttpApi)  # the OpenAI HTTP API; off unless it has an address
    steps_in_flight: int = 0  # steps in flight at most; 0: by the stages' GPUs (Scheduler._micro_batches)
    decode_steps: int = 0  # the longest decode run (tokens per row of a step of decodes alone); 0: by the devices
    speculative: str = "off"  # speculative decoding of requests that do not choose: prompt-lookup[:K], draft:MODEL[:K]
    draft_executor: str = ""  # HOST:PORT of the executor that runs the draft model (--speculative draft:MODEL)
    health_window_s: float = 1.0  # an executor that answers no health probe for this long is lost
    etcd: list[str] = field(default_factory=list)  # etcd client URLs: elect a leader there; empty: file state
    cluster_name: str = "graphmesh"  # the election's and the incarnation counter's key prefix in etcd
    lease_ttl_s: float = 2.0  # the leader's etcd lease in seconds (etcd rounds it to whole seconds, >= its minimum)
    advertise: str = ""  # the address clients reach this coordinator at, stored in etcd by the leader; "": listen
    min_executors: int = 1  # with etcd: the members (static and registered) a new leader waits for before planning
    max_waiting_requests: int = DEFAULT_MAX_WAITING  # generation requests that may wait for their first token
    max_prompt_bytes: int = 0  # UTF-8 bytes of prompt text tokenized for one request; 0: by the context


@dataclass
class Coordinator:
    server: grpc.Server
    port: int
    mesh: Mesh
    http: OpenAIServer | None = None
    election: Election | None = None


PROMPT_BYTES_PER_TOKEN = 16  # a prompt of context tokens fits (a token is a few bytes of text; 16 leaves room)
MIN_PROMPT_BYTES = 1 << 20


def prompt_bytes_limit(flag: int, context_tokens: int) -> int:
    """--max-prompt-bytes, or by the context: a prompt longer than the context in tokens can never be served, and
    no token is spelled by more than a few bytes, so text beyond 16 bytes a context token (at least 1 MiB) is
    refused before it is tokenized. Tokenizing costs about 1 s a MiB: the limit is what one request can cost."""
    return flag if flag > 0 else max(MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN * context_tokens)


def build_server(config: CoordinatorConfig) -> Coordinator:
    """Starts serving health at once (NOT_SERVING; the HTTP API's /health says 503), installs the mesh, then turns
    SERVING."""
    if not config.executors and not config.etcd:
        raise InvalidArgument("--executors lists no executor (and without --etcd none can register)", "NO_EXECUTORS")
    path = resolve_model(config.model)
    ckpt = open_checkpoint(path)
    if ckpt.config is None:
        raise InvalidArgument(f"{path} has no model config", "NO_MODEL_CONFIG")
    try:
        tokenizer: Tokenizer | None = Tokenizer.from_checkpoint(ckpt)
    except NotFound as e:
        log.warning("no tokenizer: only token-id requests will be served", extra={"reason": e.message})
        tokenizer = None
    election = None
    if config.etcd:
        election = Election(EtcdClient(config.etcd), config.cluster_name, config.advertise or config.listen,
                            config.lease_ttl_s)
        state: DurableState = EtcdState(election, config.state_dir)
        mesh: Mesh = LeaderMesh(election, config.model, ckpt.config, config.executors, state, config.split or None,
                                config.weights, config.rpc_timeout_s, max_context_tokens=config.max_context_tokens,
                                dtype=config.dtype, kvstore=config.kvstore, tls=config.security.tls)
    else:
        state = DurableState(config.state_dir)
        mesh = Mesh(config.model, ckpt.config, config.executors, state, config.split or None, config.weights,
                    config.rpc_timeout_s, max_context_tokens=config.max_context_tokens, dtype=config.dtype,
                    kvstore=config.kvstore, tls=config.security.tls)
    context = config.max_context_tokens or ckpt.config.max_position
    if tokenizer is not None:
        tokenizer.max_input_bytes = prompt_bytes_limit(config.max_prompt_bytes, context)
    eos = tokenizer.eos_token_ids if tokenizer else ckpt.config.eos_token_ids
    scheduler = sched.Scheduler(mesh, config.max_step_tokens, config.max_step_seqs,
                                steps_in_flight=config.steps_in_flight, decode_steps=config.decode_steps)
    generator = Generator(mesh, tokenizer, eos, context, scheduler, config.max_waiting_requests)
    generator.speculative = parse_mode(config.speculative)
    drafter = _drafter(config, generator.speculative, ckpt.config.vocab_size, context)
    scheduler.drafter = drafter
    # 64 calls at once on handler threads; --max-concurrent-rpcs changes it. Generation is not counted there: it
    # queues in the Generator (--max-waiting-requests). Asynchronous: streams that hold no work (an idle
    # ModelStreamInfer, a Generate waiting for KV cache or tokens) hold no thread, and health is answered on the
    # event loop.
    # Clients that can resume on another coordinator ping their streams (CoordinatorClient: every second) to find a
    # frozen leader, whose connections stay open; without these a server answers such pings with GOAWAY.
    server = config.security.server(64, [*MESSAGE_OPTIONS,
                                         ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
                                         ("grpc.http2.max_ping_strikes", 0), ("grpc.keepalive_permit_without_calls", 1)],
                                    telemetry.server_interceptors(config.metrics_port > 0), "coordinator-rpc",
                                    asynchronous=True)
    assert isinstance(server, AioServer)
    gate = None
    if election is not None:
        def gate() -> None:
            if not election.is_leader():
                raise not_leader(election)
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
        CoordinatorServicer(generator, mesh, config.model, config.security, gate), server)
    upstream = LocalUpstream(generator, mesh)  # what KServe and the HTTP API run their sessions on
    kserve_grpc.add_GRPCInferenceServiceServicer_to_server(
        KServeServicer(upstream, config.model, server.admission, gate), server)
    health_servicer = MirroredHealth(server)
    names = (coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name,
             kserve_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name)
    # Alive at once, serving only once it has installed the mesh and leads (_take_over).
    port, _ = config.security.start(server, config.listen, names, health_servicer,
                                    {"": health_pb2.HealthCheckResponse.NOT_SERVING,
                                     LIVENESS_SERVICE: health_pb2.HealthCheckResponse.SERVING})
    # Registered before the HTTP API (which serves /metrics too) starts: a scrape never finds a metric missing
    if config.metrics_port or config.http.listen:
        telemetry.expose(
            ("graphmesh_incarnation", "gauge", "The incarnation the mesh runs under", lambda: mesh.incarnation),
            ("graphmesh_recoveries", "counter", "Rosters rebuilt after a lost incarnation", lambda: mesh.recoveries),
            ("graphmesh_mesh_ready", "gauge", "1 while the mesh is installed and not recovering", lambda: mesh.ready),
            ("graphmesh_active_sessions", "gauge", "Generation sessions in progress", lambda: len(generator.sessions)),
            ("graphmesh_running_sessions", "gauge", "Sessions holding KV blocks", lambda: scheduler.running),
            ("graphmesh_waiting_sessions", "gauge", "Sessions waiting for admission", lambda: scheduler.waiting),
            ("graphmesh_waiting_requests", "gauge", "Generation requests without their first token yet (the queue "
             "that --max-waiting-requests bounds)", lambda: generator.waiting),
            ("graphmesh_queue_full_refusals", "counter", "Generation requests refused because the waiting queue "
             "was full", lambda: generator.queue_full),
            ("graphmesh_kv_blocks_used", "gauge", "KV blocks lent to sessions (every rank)", lambda: scheduler.used_blocks),
            ("graphmesh_kv_blocks_total", "gauge", "KV blocks of the smallest stage pool", lambda: mesh.kv_pool_blocks),
            ("graphmesh_kv_cache_usage_ratio", "gauge", "Share of the KV blocks lent to sessions (0 to 1)",
             lambda: scheduler.used_blocks / mesh.kv_pool_blocks if mesh.kv_pool_blocks else 0.0),
            ("graphmesh_steps", "counter", "Steps executed", lambda: scheduler.steps),
            ("graphmesh_steps_by_kind", "counter", "Steps answered, by kind: prompt (a step with a prompt chunk), "
             "decode_run (decodes alone, several tokens a row), decode (one token a row), verify (proposals)",
             lambda: scheduler.kind_steps),
            ("graphmesh_step_rows", "counter", "Rows of the steps answered, by kind", lambda: scheduler.kind_rows),
            ("graphmesh_step_seconds", "counter", "Seconds from sending each step to its reply, by kind",
             lambda: scheduler.kind_seconds),
            ("graphmesh_steps_busy_seconds", "counter", "Seconds with at least one step sent and not yet answered",
             lambda: scheduler.busy_seconds),
            ("graphmesh_decode_run_tokens", "counter", "Tokens decode runs produced past each row's first",
             lambda: scheduler.run_tokens),
            ("graphmesh_preemptions", "counter", "Sessions preempted for KV blocks", lambda: scheduler.preemptions),
            ("graphmesh_prefix_shared_tokens", "counter", "Prompt tokens shared from a live session's KV blocks",
             lambda: scheduler.shared_tokens),
            ("graphmesh_speculative_cost_seconds", "gauge", "What speculation's gate measured lately, by kind: a "
             "verified step, a decode run's step per token, a draft pass, the turn between steps (PassCosts)",
             lambda: scheduler.costs.seconds()))
    http = None
    if config.http.listen:
        http = http_api.start(config.http, upstream, config.model, config.security, gate)
    if election is None:
        wait_for_executors(config.executors, config.startup_timeout_s, config.security.tls)
        _take_over(config, mesh, state.incarnation, health_servicer, drafter)
    else:
        assert isinstance(state, EtcdState)
        # Standbys follow membership too: the roster a new leader plans over is the one registered now
        static = list(config.executors)
        membership.watch(election.etcd, config.cluster_name,
                         lambda members: mesh.set_members([*static, *(m.address for m in members)]),
                         election.lost)
        threading.Thread(target=_lead, args=(config, election, mesh, state, health_servicer, drafter), name="election",
                         daemon=True).start()
    return Coordinator(server, port, mesh, http, election)


def _drafter(config: CoordinatorConfig, mode: Mode, vocab_size: int, context: int) -> Drafter | None:
    """The draft model of --speculative draft:MODEL, checked against the target (one tokenizer: one vocabulary)."""
    if mode.method != DRAFT:
        if config.draft_executor:
            raise InvalidArgument("--draft-executor needs --speculative draft:MODEL", "BAD_SPECULATIVE",
                                  {"parameter": "draft-executor"})
        return None
    if not config.draft_executor:
        raise InvalidArgument("--speculative draft:MODEL needs --draft-executor HOST:PORT (the executor that runs "
                              "the draft model)", "BAD_SPECULATIVE", {"parameter": "draft-executor"})
    if config.draft_executor in config.executors:
        raise InvalidArgument(f"--draft-executor {config.draft_executor} is one of --executors: the draft runs on "
                              "an executor of its own (an executor runs one stage)", "BAD_SPECULATIVE",
                              {"parameter": "draft-executor"})
    draft = open_checkpoint(resolve_model(mode.model))
    if draft.config is None:
        raise InvalidArgument(f"draft model {mode.model} has no model config", "NO_MODEL_CONFIG",
                              {"parameter": "speculative"})
    if draft.config.vocab_size != vocab_size:
        raise InvalidArgument(f"draft model {mode.model} has a vocabulary of {draft.config.vocab_size} tokens, the "
                              f"model {config.model} {vocab_size}: a draft must share the target's tokenizer",
                              "BAD_SPECULATIVE", {"parameter": "speculative"})
    return Drafter(mode.model, draft.config, config.draft_executor, str(Path(config.state_dir) / "draft"),
                   config.weights, max_context_tokens=min(context, draft.config.max_position), dtype=config.dtype,
                   tls=config.security.tls, health_window_s=config.health_window_s)


def _take_over(config: CoordinatorConfig, mesh: Mesh, predecessor: int, health: MirroredHealth,
               drafter: Drafter | None = None) -> None:
    if predecessor:
        # A restarted coordinator, or a standby that won the election: whatever incarnation its predecessor left
        # is fenced everywhere before a new one is issued, so an executor never obeys the old coordinator again.
        mesh.fence(predecessor, "coordinator restarted" if not config.etcd else "a new leader was elected")
        if not config.etcd:
            # The predecessor was this coordinator, its decision log read back from the state dir: the epochs the
            # fence left undecided are resolved from it (an elected leader's log is not its predecessor's).
            mesh.resolve_indeterminate(predecessor)
    mesh.install()
    mesh.watch(window_s=config.health_window_s)
    if drafter is not None:  # the leader's alone: a standby's install would fence it
        drafter.start()
    health.set("", health_pb2.HealthCheckResponse.SERVING)


def _executors_incarnation(mesh: Mesh) -> int:
    """The newest incarnation any executor answers with (0 for those that do not answer)."""
    calls = [stage_pb2_grpc.StageServiceStub(channel).Status.future(stage_pb2.StageServiceStatusRequest(), timeout=5.0)
             for channel in mesh.channels.values()]
    newest = 0
    for call in calls:
        try:
            newest = max(newest, int(call.result().incarnation))
        except grpc.RpcError:
            pass  # fenced or installed later, by this leader, with a newer one anyway
    return newest


def _lead(config: CoordinatorConfig, election: Election, mesh: Mesh, state: EtcdState, health: MirroredHealth,
          drafter: Drafter | None = None) -> None:
    """The standby's life: campaign, then take the mesh over; on losing the lease, stop serving for good (the
    process stays up answering NOT_LEADER and reports itself not live, so that a supervisor restarts it as a
    standby)."""
    def stepped_down(why: str) -> None:
        health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

    election.on_lost(stepped_down)
    while True:  # executors first: a leader that must wait for them would hold the lease with nothing to serve
        members = mesh.addresses  # the static ones and those registered in etcd, as membership last read them
        try:
            if len(members) < config.min_executors:
                raise Unavailable(f"{len(members)} executor(s) are members of the mesh, --min-executors asks for "
                                  f"{config.min_executors}", "TOO_FEW_EXECUTORS")
            # short: a member that died holds its registration until its lease lapses, and then it is gone
            wait_for_executors(members, 5.0, config.security.tls)
            break
        except Unavailable as e:
            log.warning("standby: waiting for the executors before campaigning", extra={"error": e.message})
            time.sleep(0.5)
    log.info("standby: campaigning", extra={"cluster": config.cluster_name, "etcd": config.etcd})
    election.campaign()
    try:
        # The executors may hold a newer incarnation than the cluster's counter (they ran under a coordinator on
        # its file state before): the counter moves past it, or every Install would be refused as stale.
        election.advance_to(_executors_incarnation(mesh))
        predecessor = state.refresh()
        log.info("leader: taking the mesh over", extra={"cluster": config.cluster_name, "fencing": predecessor})
        _take_over(config, mesh, predecessor, health, drafter)
    except Exception as e:  # let another coordinator try rather than hold the lease with no mesh
        log.error("leader could not install the mesh; stepping down", extra={"error": str(e)})
        election.step_down(f"install failed: {e}")
        return
    log.info("leader serving", extra={"cluster": config.cluster_name, "incarnation": mesh.incarnation})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="graphmesh-coordinator", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:50050")
    parser.add_argument("--executors", default="",
                        help="comma-separated executor addresses, in pipeline order (with --etcd optional: executors "
                             "started with --etcd register themselves and are planned after these, as they join)")
    parser.add_argument("--min-executors", type=int, default=1,
                        help="with --etcd: how many executors must be members before a leader plans the mesh")
    etcd.add_arguments(parser, "elect one leader among the coordinators of --cluster-name (default: this coordinator "
                               "alone, its incarnation in --state-dir)")
    parser.add_argument("--lease-ttl", type=float, default=2.0,
                        help="seconds the leader's etcd lease lasts without a renewal: how long a dead leader holds "
                             "up failover (whole seconds in etcd, at least its minimum)")
    parser.add_argument("--advertise", default="", help="the address clients reach this coordinator at (default: "
                                                        "--listen); etcd names it to clients of a standby")
    parser.add_argument("--model", default="smollm2-135m", help="bundled model name or checkpoint path")
    parser.add_argument("--state-dir", default=str(default_state_dir()),
                        help="the incarnation and the epoch decision log (default: $XDG_STATE_HOME/graphmesh/"
                             "coordinator, else ~/.local/state/graphmesh/coordinator)")
    parser.add_argument("--kvstore", default="")
    parser.add_argument("--split", default="", help="layers per executor, e.g. 15,15 (default: balanced)")
    parser.add_argument("--weights", default="packed", choices=list(models.WEIGHTS),
                        help="packed (default): a GGUF's quantized blocks kept packed (on CPUs the same tokens as f32, "
                             "faster); f32: dequantized; packed-bf16: bf16 activations into them; packed-q8: int8 "
                             "activations into them (llama.cpp's arithmetic)")
    parser.add_argument("--startup-timeout", type=float, default=60.0)
    parser.add_argument("--rpc-timeout", type=float, default=60.0)
    parser.add_argument("--max-context", type=int, default=0, help="cap on tokens per session (0: the model's)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0 is off")
    parser.add_argument("--dtype", default="", choices=["", "f32", "bf16", "f16"],
                        help="stage dtype (default: bf16 on CUDA executors, f32 on CPU ones)")
    parser.add_argument("--max-step-tokens", type=int, default=0,
                        help=f"token budget of one step (default: {sched.STEP_TOKENS_CUDA} when every executor is on "
                             f"CUDA, else {sched.STEP_TOKENS_CPU})")
    parser.add_argument("--max-step-seqs", type=int, default=0,
                        help=f"sessions in one step at most (default: {sched.STEP_SEQS_CUDA} when every executor is on "
                             f"CUDA, else {sched.STEP_SEQS_CPU})")
    parser.add_argument("--health-window", type=float, default=1.0,
                        help="seconds without an answered health probe after which an executor is lost (detection "
                             "takes about this plus 0.1 s; below ~0.5 s a loaded machine gets needless re-plans)")
    parser.add_argument("--steps-in-flight", type=int, default=0,
                        help="steps in flight at most (default 0: one per stage; stages sharing a GPU get fewer, "
                             "one where they queue runs); more hides the RPC round trip when a step's compute is "
                             "short (a GPU), fewer makes bigger steps (a CPU)")
    parser.add_argument("--decode-steps", type=int, default=0,
                        help="the longest decode run: a step of decodes alone (no prompt waiting) decodes up to this "
                             "many tokens per session on the executors, the last stage feeding each token back to "
                             "the first, with no round trip here between them; tokens then reach clients in bursts "
                             f"of that many. 1: every token is its own step. Default: when every executor is on "
                             f"CUDA {sched.DECODE_STEPS_CUDA} per {sched.RUN_ROWS_CUDA} rows of the step, up to "
                             f"{sched.LONGEST_RUN_CUDA}; else {sched.DECODE_STEPS_CPU}")
    parser.add_argument("--speculative", default="off",
                        help="speculative decoding of requests that do not choose: prompt-lookup (k proposed tokens "
                             "from n-gram matches over the session's prompt and output, verified in one pass through "
                             f"every stage; prompt-lookup:K caps k, default {DEFAULT_K}), draft:MODEL[:K] (the greedy "
                             "tokens of a smaller model of the same tokenizer, run on --draft-executor) or off (the "
                             "default). Never changes tokens; steps aside when a step holds many sessions")
    parser.add_argument("--draft-executor", default="",
                        help="HOST:PORT of the executor that runs the draft model of --speculative draft:MODEL (one "
                             "of its own, not one of --executors)")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING,
                        help="generation requests (gRPC Generate, KServe text inference, the HTTP API together) that "
                             "may wait at once for their first token: for a recovering mesh, for KV cache, in "
                             "prefill. They wait in order, each holding its prompt and its call's buffers "
                             "(kilobytes) but no thread; one more gets RESOURCE_EXHAUSTED (HTTP 429, reason "
                             f"QUEUE_FULL). Not --max-concurrent-rpcs, which counts no generation (default "
                             f"{DEFAULT_MAX_WAITING})")
    parser.add_argument("--max-prompt-bytes", type=int, default=0,
                        help="UTF-8 bytes of prompt text one request may have tokenized (chat messages together); "
                             "more is refused (INVALID_ARGUMENT / HTTP 400, reason PROMPT_TOO_LARGE) before any "
                             f"work. Default 0: {PROMPT_BYTES_PER_TOKEN} bytes per context token, at least 1 MiB")
    http_api.add_arguments(parser)
    bootstrap.add_arguments(parser, auth_token=True)
    args = parser.parse_args(argv)
    http = http_api.from_args(args, parser)
    if args.max_waiting_requests < 1:
        parser.error(f"--max-waiting-requests must be >= 1, not {args.max_waiting_requests}")
    for flag, value in (("--decode-steps", args.decode_steps), ("--max-step-tokens", args.max_step_tokens),
                        ("--max-step-seqs", args.max_step_seqs),
                        ("--max-prompt-bytes", args.max_prompt_bytes)):
        if value < 0:  # a negative budget would schedule no step at all: every request would wait forever
            parser.error(f"{flag} must be >= 0 (0: the default), not {value}")
    logs.configure("coordinator")
    telemetry.setup("graphmesh-coordinator")
    try:
        config = CoordinatorConfig(args.listen, [a for a in args.executors.split(",") if a], args.model, args.state_dir,
                                   args.kvstore, [int(x) for x in args.split.split(",") if x], args.weights,
                                   args.startup_timeout, args.rpc_timeout, args.max_context, args.metrics_port,
                                   bootstrap.from_args(args), args.dtype, args.max_step_tokens, args.max_step_seqs,
                                   http=http,
                                   steps_in_flight=args.steps_in_flight, decode_steps=args.decode_steps,
                                   speculative=args.speculative, draft_executor=args.draft_executor,
                                   health_window_s=args.health_window,
                                   etcd=args.etcd, cluster_name=args.cluster_name,
                                   lease_ttl_s=args.lease_ttl, advertise=args.advertise,
                                   min_executors=args.min_executors, max_waiting_requests=args.max_waiting_requests,
                                   max_prompt_bytes=args.max_prompt_bytes)
        telemetry.serve_metrics(config.metrics_port)
        running = build_server(config)
    except Exception as e:
        log.error("coordinator failed to start", extra={"error": str(e)})
        raise SystemExit(f"graphmesh-coordinator: {e}") from e
    log.info("serving", extra={"listen": config.listen, "port": running.port, "incarnation": running.mesh.incarnation})
    try:
        run_until_signalled(running.server, grace_s=2.0)
    finally:
        if running.election is not None:
            running.election.close()  # resign: a standby takes over now, not after the lease's TTL
        if running.http is not None:
            running.http.stop()
        running.mesh.close()


if __name__ == "__main__":
    main()
