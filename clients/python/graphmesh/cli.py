"""graphmesh: start a mesh on loopback, generate text, show the mesh's status."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from graphmesh import models, security
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import GraphmeshError, Unavailable
from graphmesh.launcher import LocalMesh, fastest_backend, parse_gpus
from graphmesh.v1 import stage_pb2

DEFAULT_COORDINATOR = "127.0.0.1:50050"
DEFAULT_HTTP = "127.0.0.1:8000"


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", default="", help="bearer token for a coordinator started with --auth-token-file")
    p.add_argument("--tls-ca", default="", help="CA certificate: connect over TLS")
    p.add_argument("--tls-cert", default="", help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", default="", help="client key (mutual TLS)")


def _client(args: argparse.Namespace, address: str) -> CoordinatorClient:
    creds = security.credentials(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
    return CoordinatorClient(address, credentials=creds, token=args.token)


def _mesh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--executors", type=int, default=0, help="executor processes (default 2, or one per --gpus)")
    p.add_argument("--gpus", type=_gpus, default=[], help="one torch executor per GPU, pinned with "
                   "CUDA_VISIBLE_DEVICES: a count (2: GPUs 0 and 1) or GPU ids (0,1; one id alone: 3,)")
    p.add_argument("--backend", default="", help="numpy, torch or mlx; comma-separated per executor "
                                                "(default: the fastest installed)")
    p.add_argument("--model", default="smollm2-135m", help="bundled model name or checkpoint path")
    p.add_argument("--split", default="", help="layers per executor, e.g. 20,10 (default: balanced)")
    p.add_argument("--weights", default="packed", choices=list(models.WEIGHTS),
                   help="packed (default): quantized blocks kept packed, the same tokens as f32 and faster on CPUs")
    p.add_argument("--speculative", default="off",
                   help="the coordinator's speculative decoding: prompt-lookup[:K], draft:MODEL[:K] (one more executor "
                        "runs the draft model, of the same tokenizer) or off (default)")


@contextmanager
def _mesh(args: argparse.Namespace, listen: str = "", http_listen: str = "", frontend: bool = False) -> Iterator[LocalMesh]:
    """An embedded mesh, started and stopped with the block. A process of it that does not start ends `graphmesh`
    with status 1 and that process's own one line (what is wrong and what to do), not the launcher's traceback."""
    backends = [b for b in args.backend.split(",") if b]
    if args.gpus:
        if args.executors and args.executors != len(args.gpus):
            raise SystemExit(f"graphmesh: --executors {args.executors} and --gpus {len(args.gpus)}: one executor "
                             f"runs per GPU, so give one of them")
        if any(b != "torch" for b in backends):
            raise SystemExit(f"graphmesh: --gpus runs torch executors, not --backend {args.backend}")
        backends = ["torch"]
    backend: str | list[str] = backends if len(backends) > 1 else (backends[0] if backends else fastest_backend())
    count = len(backends) if len(backends) > 1 else (len(args.gpus) or args.executors or 2)
    mesh = LocalMesh(count, backend, args.model, [int(x) for x in args.split.split(",") if x], args.weights,
                     coordinator_listen=listen, http_listen=http_listen, gpus=args.gpus, frontend=frontend,
                     extra_coordinator_args=["--speculative", args.speculative],
                     draft_executor=args.speculative.startswith("draft:"))
    try:
        mesh.start()
    except (RuntimeError, TimeoutError) as e:  # the launcher's error ends with the tail of the process's log
        lines = str(e).splitlines()
        own = [line for line in lines if line.startswith("graphmesh-") and ": " in line]
        raise SystemExit(own[-1] if own else f"graphmesh: {lines[0] if lines else e}") from None
    try:
        yield mesh
    finally:
        mesh.stop()


def _gpus(text: str) -> list[int]:
    try:
        return parse_gpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@contextmanager
def _coordinator(args: argparse.Namespace) -> Iterator[str]:
    if args.coordinator:
        yield args.coordinator
        return
    print(f"starting an embedded mesh ({len(args.gpus) or args.executors or 2} executors)...", file=sys.stderr)
    with _mesh(args) as mesh:
        yield mesh.coordinator_address


def cmd_up(args: argparse.Namespace) -> int:
    with _mesh(args, args.listen, args.http_listen, args.frontend) as mesh:
        print(f"coordinator {mesh.coordinator_address}", flush=True)
        if mesh.frontend_address:
            print(f"front end {mesh.frontend_address} (gRPC and HTTP clients call it, not the coordinator)",
                  flush=True)
        if mesh.http_url:
            print(f"OpenAI API {mesh.http_url} (model {mesh.model!r})", flush=True)
        if mesh.kvstore_address:
            print(f"kvstore {mesh.kvstore_address}", flush=True)
        for rank, address in enumerate(mesh.executor_addresses):
            print(f"executor {rank} {address}" + (f" on GPU {mesh.gpus[rank]}" if mesh.gpus else ""), flush=True)
        print(f"mesh token in {mesh.mesh_token_file} (for calls to executors and the kvstore)", flush=True)
        # the last line, inside the try: a Ctrl-C as soon as it is read stops the mesh as any later one does
        try:
            print(f"logs in {mesh.log_dir}; Ctrl-C to stop", flush=True)
            while all(p.poll() is None for p in mesh.processes):
                time.sleep(0.5)
            print("a mesh process exited; stopping", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0


def cmd_generate(args: argparse.Namespace) -> int:
    with _coordinator(args) as address, _client(args, address) as client:
        t0 = time.perf_counter()
        token_ids: list[int] = []
        prompt_ids: list[int] = []
        text, ttft_ms, finish = "", 0.0, ""
        for chunk in client.generate(args.prompt, max_tokens=args.max_tokens, raw=args.raw,
                                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                     model=args.model if args.coordinator else ""):
            if not token_ids:
                ttft_ms, prompt_ids = chunk.ttft_ms or (time.perf_counter() - t0) * 1000, chunk.prompt_token_ids
            token_ids += chunk.token_ids
            text += chunk.text
            finish = chunk.finish_reason or finish
            if not args.json:
                print(chunk.text, end="", flush=True)
        elapsed = time.perf_counter() - t0
        decode_s = max(elapsed - ttft_ms / 1000, 1e-9)
        tokens_per_s = (len(token_ids) - 1) / decode_s if len(token_ids) > 1 else 0.0
        if args.json:
            print(json.dumps({"text": text, "prompt_token_ids": prompt_ids, "token_ids": token_ids,
                              "ttft_ms": round(ttft_ms, 2), "tokens_per_s": round(tokens_per_s, 2),
                              "finish_reason": finish}))
        else:
            print(f"\n[{len(token_ids)} tokens, ttft {ttft_ms:.0f} ms, {tokens_per_s:.1f} tok/s, {finish}]",
                  file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args, args.coordinator or DEFAULT_COORDINATOR)
    # session ids are shown to mesh members only: an operator proves it with the mesh token
    client.metadata = (*client.metadata, *security.mesh_metadata(security.read_token(args.mesh_token_file)))
    with client:
        s = client.status()
    if args.json:
        from google.protobuf import json_format
        print(json_format.MessageToJson(s, preserving_proto_field_name=True))
        return 0
    print(f"model {s.model}  incarnation {s.incarnation}  ready {s.ready}  recoveries {s.recoveries}"
          f"  speculative {s.speculative or 'off'}")
    for st in s.stages:
        print(f"  rank {st.rank} {st.address:21s} layers [{st.layer_start}, {st.layer_end})  {st.backend}/{st.device}"
              f"  {st.param_bytes / 2**20:.0f} MiB  {'healthy' if st.healthy else 'UNHEALTHY'}")
    for g in s.plan.groups:
        if g.kind == stage_pb2.GROUP_KIND_ENCODER:
            print(f"  rank {g.rank} also runs the encoder (group {g.id}{', optional' if g.optional else ''})")
    print(f"  {s.active_sessions} session(s) in progress")
    for sess in s.sessions:
        print(f"  session {sess.session_id} tokens {sess.tokens} epoch {sess.epoch}")
    return 0


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (kill, systemd, Kubernetes) unwinds the stack as Ctrl-C does, so the `with` of an embedded mesh
    stops every child process; Python's default would exit at once and leave them running. SIGINT does so too,
    also in a background job."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # A shell starts a background job with SIGINT ignored, and Python then installs no handler of its own: `kill
    # -INT` of a backgrounded `graphmesh up` did nothing.
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start kvstore, coordinator and executors on loopback (foreground)")
    _mesh_args(up)
    up.add_argument("--listen", default=DEFAULT_COORDINATOR, help="coordinator address")
    up.add_argument("--http-listen", default=DEFAULT_HTTP,
                    help="address of the OpenAI-compatible HTTP API, the front end's with --frontend ('' turns it "
                         "off)")
    up.add_argument("--frontend", action="store_true",
                    help="also start a graphmesh-frontend, which serves gRPC clients and the OpenAI API and relays "
                         "their calls to the coordinator over one stream each (for hundreds of concurrent streams)")
    gen = sub.add_parser("generate", help="generate text")
    _mesh_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--coordinator", default="",
                     help="address of a running coordinator, or comma-separated addresses of a cluster's coordinators: "
                          "a stream that breaks resumes on the leader, token-identical (default: embedded mesh)")
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", action="store_true")
    _client_args(gen)
    st = sub.add_parser("status", help="show the plan, executors, incarnation and sessions")
    st.add_argument("--coordinator", default="", help="a coordinator's address (several: the first that answers)")
    st.add_argument("--json", action="store_true")
    st.add_argument("--mesh-token-file", default="", help="the mesh token: list the session ids too (operators)")
    _client_args(st)
    args = parser.parse_args(argv)
    try:
        with _sigterm_unwinds():
            return {"up": cmd_up, "generate": cmd_generate, "status": cmd_status}[args.command](args)
    except Unavailable as e:
        where = getattr(args, "coordinator", "") or DEFAULT_COORDINATOR
        if "failed to connect" in e.message:  # nothing listens there: say so, not grpc's connection log
            print(f"graphmesh: no coordinator answers at {where}: start a mesh with `graphmesh up`, or pass "
                  f"--coordinator HOST:PORT", file=sys.stderr)
        else:
            print(f"graphmesh: {e.code.name}: {e.message}", file=sys.stderr)
        return 2
    except GraphmeshError as e:
        print(f"graphmesh: {e.code.name}: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
