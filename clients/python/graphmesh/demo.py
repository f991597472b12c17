"""`make demo`: SmolLM2-135M-Instruct over two executors on loopback, answering a question."""

from __future__ import annotations

import sys
import time

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh, fastest_backend

QUESTION = "What is the capital of France, and what is it famous for?"


def main() -> int:
    backend = fastest_backend()
    print(f"== starting the mesh: kvstore + 2 executors ({backend}) + coordinator on loopback; "
          "each executor loads its own layers of SmolLM2-135M-Instruct", flush=True)
    t0 = time.perf_counter()
    with LocalMesh(2, backend, "smollm2-135m") as mesh, CoordinatorClient(mesh.coordinator_address) as client:
        status = client.status()
        print(f"== mesh ready in {time.perf_counter() - t0:.1f} s (incarnation {status.incarnation}, logs in "
              f"{mesh.log_dir})")
        for st in status.stages:
            print(f"   rank {st.rank} {st.address} layers [{st.layer_start}, {st.layer_end}) {st.backend}/{st.device}")
        print(f"\nuser> {QUESTION}\nassistant> ", end="", flush=True)
        t1 = time.perf_counter()
        tokens, ttft_ms = 0, 0.0
        for chunk in client.generate(QUESTION, max_tokens=96):
            if tokens == 0:
                ttft_ms = chunk.ttft_ms
            tokens += len(chunk.token_ids)
            print(chunk.text, end="", flush=True)
        total = time.perf_counter() - t1
        decode = max(total - ttft_ms / 1000, 1e-9)
        print(f"\n\n== {tokens} tokens in {total:.2f} s: time to first token {ttft_ms:.0f} ms, "
              f"decode {(tokens - 1) / decode:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
