"""KServe v2 ModelInfer through the real tritonclient against the native CoordinatorService, for the same request.

One mesh (SmolLM2-135M over 2 torch executors on loopback) serves both protocols on one port. Two requests:
- text: the chat-templated prompt, 16 tokens greedy with EOS ignored (so both generate exactly 16 tokens):
  ModelInfer (BYTES text_input -> text_output) vs the Generate stream read to its end;
- logits: a prefill of 8 token ids: ModelInfer (INT64 input_ids -> FP32 logits [1, 49152]) vs ComputeLogits.
tritonclient needs protobuf < 7, so it runs in its own venv (build/triton-venv, see tests/test_kserve.py) as a
subprocess that times its own calls; the native calls are timed here. Rounds alternate the two clients so that
load from other processes falls on both alike. Prints a table and writes bench/results/kserve.json.

    .venv/bin/python bench/bench_kserve.py [--max-tokens 16] [--rounds 3] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import machine, median, progress, table, write_results
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from tests.test_kserve import run_client

MODEL = "smollm2-135m"
PROMPT = "Write a haiku about the sea."
TOKEN_IDS = [1, 504, 3458, 282, 4649, 314, 260, 1345]


def native_round(client: CoordinatorClient, max_tokens: int, runs: int) -> tuple[list[float], list[float], str]:
    """Generate and ComputeLogits latencies in ms, alternating as the tritonclient side does, after a warm-up."""
    text_ms, logits_ms, text = [], [], ""
    for run in range(runs + 1):
        t0 = time.perf_counter()
        text = "".join(c.text for c in client.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True))
        t1 = time.perf_counter()
        client.compute_logits(TOKEN_IDS)
        t2 = time.perf_counter()
        if run:
            text_ms.append((t1 - t0) * 1000.0)
            logits_ms.append((t2 - t1) * 1000.0)
    return text_ms, logits_ms, text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per text request (greedy)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each timing both clients")
    p.add_argument("--runs", type=int, default=3, help="timed requests of each kind per client per round")
    a = p.parse_args(argv)
    load = os.getloadavg()
    progress(f"starting SmolLM2-135M over 2 torch executors; load average {load}")
    native: dict[str, list[float]] = {"text": [], "logits": []}
    kserve: dict[str, list[float]] = {"text": [], "logits": []}
    with LocalMesh(2, "torch", MODEL) as mesh, CoordinatorClient(mesh.coordinator_address) as client:
        config = {"address": mesh.coordinator_address, "model": MODEL, "prompt": PROMPT, "token_ids": TOKEN_IDS,
                  "params": {"max_tokens": a.max_tokens, "ignore_eos": True}, "runs": a.runs}
        for r in range(a.rounds):
            progress(f"round {r + 1}/{a.rounds}: {a.runs} text + {a.runs} logits requests per client")
            text_ms, logits_ms, native_text = native_round(client, a.max_tokens, a.runs)
            native["text"] += text_ms
            native["logits"] += logits_ms
            out = run_client("bench", config)
            kserve["text"] += out["text_ms"]
            kserve["logits"] += out["logits_ms"]
            if out["text"] != native_text:
                raise SystemExit(f"the two protocols disagree: {out['text']!r} vs {native_text!r}")
    rows = []
    for kind, request in (("text", f"{a.max_tokens} tokens greedy"), ("logits", f"prefill of {len(TOKEN_IDS)} ids")):
        n, k = median(native[kind]), median(kserve[kind])
        rows.append((kind, request, n, k, k / n, len(native[kind])))
    print(table(["request", "what", "native ms", "kserve ms", "kserve/native", "runs"], rows))
    write_results("kserve.json", {
        "machine": machine(load),
        "what": "SmolLM2-135M (f32) over 2 torch executors on loopback; one coordinator port serves both protocols",
        "native": "CoordinatorClient: Generate stream read to its end / ComputeLogits",
        "kserve": "tritonclient.grpc InferenceServerClient.infer (ModelInfer), in its own venv",
        "prompt": PROMPT, "max_tokens": a.max_tokens, "token_ids": TOKEN_IDS, "rounds": a.rounds, "runs": a.runs,
        "text": native_text,
        "median_ms": {kind: {"native": median(native[kind]), "kserve": median(kserve[kind]),
                             "ratio_kserve_over_native": median(kserve[kind]) / median(native[kind])}
                      for kind in ("text", "logits")},
        "latency_ms": {"native": native, "kserve": kserve},
    })


if __name__ == "__main__":
    main()
