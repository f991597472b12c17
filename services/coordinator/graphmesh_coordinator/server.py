"""graphmesh-coordinator: plans the partition, installs it, serves generation."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from graphmesh import logs, security, telemetry
from graphmesh.aio_serving import AioServer, MirroredHealth
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.errors import InvalidArgument, NotFound
from graphmesh.kserve import grpc_service_pb2 as kserve_pb2
from graphmesh.kserve import grpc_service_pb2_grpc as kserve_grpc
from graphmesh.security import ServerSecurity
from graphmesh.serving import run_until_signalled
from graphmesh.tokenizer import Tokenizer
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc
from graphmesh_coordinator.generation import Generator
from graphmesh_coordinator.kserve import KServeServicer
from graphmesh_coordinator.openai_api import OpenAIServer
from graphmesh_coordinator.pipeline import Mesh, wait_for_executors
from graphmesh_coordinator.scheduler import Scheduler
from graphmesh_coordinator.servicer import CoordinatorServicer
from graphmesh_coordinator.state import DurableState

log = logging.getLogger("graphmesh.coordinator")


@dataclass
class CoordinatorConfig:
    listen: str
    executors: list[str]
    model: str = "smollm2-135m"
    state_dir: str = "./coordinator-state"
    kvstore: str = ""
    split: list[int] = field(default_factory=list)
    weights: str = "f32"
    startup_timeout_s: float = 60.0
    rpc_timeout_s: float = 60.0
    max_context_tokens: int = 0
    metrics_port: int = 0  # Prometheus /metrics; 0: off
    security: ServerSecurity = field(default_factory=ServerSecurity)
    dtype: str = ""  # stage dtype: f32, bf16, f16; "" is bf16 on CUDA executors, f32 on CPU ones
    max_step_tokens: int = 256  # tokens per step (decode rows and prompt chunks together)
    max_step_seqs: int = 64  # sessions per step
    http_listen: str = ""  # HOST:PORT of the OpenAI HTTP API; "": off
    http_ready_wait_s: float = 10.0  # how long an HTTP request waits out a recovery before its 503
    steps_in_flight: int = 0  # steps in flight at most; 0: one per stage
    health_window_s: float = 1.0  # an executor that answers no health probe for this long is lost


@dataclass
class Coordinator:
    server: grpc.Server
    port: int
    mesh: Mesh
    http: OpenAIServer | None = None


def _http_listen(config: CoordinatorConfig) -> str:
    """The HTTP API's address under the gRPC port's rule: a coordinator that authenticates nobody serves loopback
    only unless --allow-insecure-remote says otherwise."""
    host, _, port = config.http_listen.rpartition(":")
    sec = config.security
    if sec.authenticated or sec.allow_insecure_remote or security._is_loopback(host):
        return config.http_listen
    log.warning("no credentials configured: the HTTP API listens on loopback only; --allow-insecure-remote "
                "listens as asked", extra={"http_listen": config.http_listen})
    return f"127.0.0.1:{port}"


def build_server(config: CoordinatorConfig) -> Coordinator:
    """Starts serving health at once (NOT_SERVING; the HTTP API's /health says 503), installs the mesh, then turns
    SERVING."""
    if not config.executors:
        raise InvalidArgument("--executors lists no executor", "NO_EXECUTORS")
    path = resolve_model(config.model)
    ckpt = open_checkpoint(path)
    if ckpt.config is None:
        raise InvalidArgument(f"{path} has no model config", "NO_MODEL_CONFIG")
    try:
        tokenizer: Tokenizer | None = Tokenizer.from_checkpoint(ckpt)
    except NotFound as e:
        log.warning("no tokenizer: only token-id requests will be served", extra={"reason": e.message})
        tokenizer = None
    state = DurableState(config.state_dir)
    mesh = Mesh(config.model, ckpt.config, config.executors, state, config.split or None, config.weights,
                config.rpc_timeout_s, max_context_tokens=config.max_context_tokens, dtype=config.dtype,
                kvstore=config.kvstore, tls=config.security.tls)
    context = config.max_context_tokens or ckpt.config.max_position
    eos = tokenizer.eos_token_ids if tokenizer else ckpt.config.eos_token_ids
    scheduler = Scheduler(mesh, config.max_step_tokens, config.max_step_seqs, steps_in_flight=config.steps_in_flight)
    generator = Generator(mesh, tokenizer, eos, context, scheduler)
    # 64 calls at once (Generate streams hold one each); --max-concurrent-rpcs changes it. Asynchronous: streams
    # that hold no work (an idle ModelStreamInfer) hold no thread, and health is answered on the event loop.
    server = config.security.server(64, [("grpc.max_send_message_length", 64 << 20),
                                         ("grpc.max_receive_message_length", 64 << 20)],
                                    telemetry.server_interceptors(config.metrics_port > 0), "coordinator-rpc",
                                    asynchronous=True)
    assert isinstance(server, AioServer)
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(
        CoordinatorServicer(generator, mesh, config.model, config.security), server)
    kserve_grpc.add_GRPCInferenceServiceServicer_to_server(
        KServeServicer(generator, mesh, config.model, server.admission), server)
    health_servicer = MirroredHealth(server)
    names = (coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name,
             kserve_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = config.security.add_port(server, config.listen)
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server.start()
    config.security.serve_health(health_servicer)
    http = None
    if config.http_listen:
        http = OpenAIServer(generator, mesh, config.model, config.security.auth_token,
                            config.security.max_concurrent_rpcs or 64, config.http_ready_wait_s)
        http.start(_http_listen(config), config.security.tls)
        log.info("HTTP API", extra={"http_listen": config.http_listen, "port": http.port})
    if config.metrics_port or http is not None:  # the HTTP API serves /metrics too
        telemetry.expose(
            ("graphmesh_incarnation", "gauge", "The incarnation the mesh runs under", lambda: mesh.incarnation),
            ("graphmesh_recoveries", "counter", "Rosters rebuilt after a lost incarnation", lambda: mesh.recoveries),
            ("graphmesh_mesh_ready", "gauge", "1 while the mesh is installed and not recovering", lambda: mesh.ready),
            ("graphmesh_active_sessions", "gauge", "Generation sessions in progress", lambda: len(generator.sessions)),
            ("graphmesh_running_sessions", "gauge", "Sessions holding KV blocks", lambda: scheduler.running),
            ("graphmesh_waiting_sessions", "gauge", "Sessions waiting for admission", lambda: scheduler.waiting),
            ("graphmesh_kv_blocks_used", "gauge", "KV blocks lent to sessions (every rank)", lambda: scheduler.used_blocks),
            ("graphmesh_kv_blocks_total", "gauge", "KV blocks of the smallest stage pool", lambda: mesh.kv_pool_blocks),
            ("graphmesh_kv_cache_usage_ratio", "gauge", "Share of the KV blocks lent to sessions (0 to 1)",
             lambda: scheduler.used_blocks / mesh.kv_pool_blocks if mesh.kv_pool_blocks else 0.0),
            ("graphmesh_steps", "counter", "Steps executed", lambda: scheduler.steps),
            ("graphmesh_preemptions", "counter", "Sessions preempted for KV blocks", lambda: scheduler.preemptions),
            ("graphmesh_prefix_shared_tokens", "counter", "Prompt tokens shared from a live session's KV blocks",
             lambda: scheduler.shared_tokens))
    wait_for_executors(config.executors, config.startup_timeout_s, config.security.tls)
    if state.incarnation:
        # A restarted coordinator: whatever incarnation its predecessor left is fenced everywhere before a
        # new one is issued, so an executor never obeys the old coordinator again.
        mesh.fence(state.incarnation, "coordinator restarted")
    mesh.install()
    mesh.watch(window_s=config.health_window_s)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return Coordinator(server, port, mesh, http)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="graphmesh-coordinator", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:50050")
    parser.add_argument("--executors", required=True, help="comma-separated executor addresses, in pipeline order")
    parser.add_argument("--model", default="smollm2-135m", help="bundled model name or checkpoint path")
    parser.add_argument("--state-dir", default="./coordinator-state")
    parser.add_argument("--kvstore", default="")
    parser.add_argument("--split", default="", help="layers per executor, e.g. 15,15 (default: balanced)")
    parser.add_argument("--weights", default="f32", choices=["f32", "packed", "packed-bf16"])
    parser.add_argument("--startup-timeout", type=float, default=60.0)
    parser.add_argument("--rpc-timeout", type=float, default=60.0)
    parser.add_argument("--max-context", type=int, default=0, help="cap on tokens per session (0: the model's)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0 is off")
    parser.add_argument("--dtype", default="", choices=["", "f32", "bf16", "f16"],
                        help="stage dtype (default: bf16 on CUDA executors, f32 on CPU ones)")
    parser.add_argument("--max-step-tokens", type=int, default=256, help="token budget of one step")
    parser.add_argument("--max-step-seqs", type=int, default=64, help="sessions in one step at most")
    parser.add_argument("--health-window", type=float, default=1.0,
                        help="seconds without an answered health probe after which an executor is lost (detection "
                             "takes about this plus 0.1 s; below ~0.5 s a loaded machine gets needless re-plans)")
    parser.add_argument("--steps-in-flight", type=int, default=0,
                        help="steps in flight at most (default 0: one per stage); more hides the RPC round trip "
                             "when a step's compute is short (a GPU), fewer makes bigger steps (a CPU)")
    parser.add_argument("--http-listen", default="", help="HOST:PORT of the OpenAI-compatible HTTP API (default: off)")
    parser.add_argument("--http-ready-wait", type=float, default=10.0,
                        help="seconds an HTTP request waits for a recovering mesh before a 503")
    security.add_arguments(parser, auth_token=True)
    args = parser.parse_args(argv)
    logs.configure("coordinator")
    telemetry.setup("graphmesh-coordinator")
    try:
        config = CoordinatorConfig(args.listen, [a for a in args.executors.split(",") if a], args.model, args.state_dir,
                                   args.kvstore, [int(x) for x in args.split.split(",") if x], args.weights,
                                   args.startup_timeout, args.rpc_timeout, args.max_context, args.metrics_port,
                                   security.from_args(args), args.dtype, args.max_step_tokens, args.max_step_seqs,
                                   http_listen=args.http_listen, http_ready_wait_s=args.http_ready_wait,
                                   steps_in_flight=args.steps_in_flight, health_window_s=args.health_window)
        telemetry.serve_metrics(config.metrics_port)
        running = build_server(config)
    except Exception as e:
        log.error("coordinator failed to start", extra={"error": str(e)})
        raise SystemExit(f"graphmesh-coordinator: {e}") from e
    log.info("serving", extra={"listen": config.listen, "port": running.port, "incarnation": running.mesh.incarnation})
    try:
        run_until_signalled(running.server, grace_s=2.0)
    finally:
        if running.http is not None:
            running.http.stop()
        running.mesh.close()


if __name__ == "__main__":
    main()
