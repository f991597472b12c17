"""KServe v2 ModelInfer through the real tritonclient against the native CoordinatorService, for the same request.

One mesh (SmolLM2-135M over 2 torch executors on loopback) serves both protocols on one port. Two requests:
- text: the chat-templated prompt, 16 tokens greedy with EOS ignored (so both generate exactly 16 tokens):
  ModelInfer (BYTES text_input -> text_output) vs the Generate stream read to its end;
- logits: a prefill of 8 token ids: ModelInfer (INT64 input_ids -> FP32 logits [1, 49152]) vs ComputeLogits.
tritonclient needs protobuf < 7, so it runs in its own venv (build/triton-venv, see tests/test_kserve.py) as a
long-lived subprocess (tests/kserve_client.py bench) that times each call it is told to make; the native calls are
timed here. The calls alternate one by one, in both orders, so that load from other processes on this small machine
falls on both alike; besides the medians, the median of the paired ratios is reported. Prints a table and writes
bench/results/kserve.json.

    .venv/bin/python bench/bench_kserve.py [--max-tokens 16] [--runs 12]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import REPO, machine, median, progress, table, write_results
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from tests.test_kserve import triton_python

MODEL = "smollm2-135m"
PROMPT = "Write a haiku about the sea."
TOKEN_IDS = [1, 504, 3458, 282, 4649, 314, 260, 1345]
KINDS = ("text", "logits")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per text request (greedy)")
    p.add_argument("--runs", type=int, default=12, help="timed requests of each kind through each client (median)")
    a = p.parse_args(argv)
    python = triton_python()
    load = os.getloadavg()
    progress(f"starting SmolLM2-135M over 2 torch executors; load average {load}")
    ms: dict[str, dict[str, list[float]]] = {"native": {k: [] for k in KINDS}, "kserve": {k: [] for k in KINDS}}
    with LocalMesh(2, "torch", MODEL) as mesh, CoordinatorClient(mesh.coordinator_address) as client:
        config = {"address": mesh.coordinator_address, "model": MODEL, "prompt": PROMPT, "token_ids": TOKEN_IDS,
                  "params": {"max_tokens": a.max_tokens, "ignore_eos": True}}
        triton = subprocess.Popen([str(python), str(REPO / "tests" / "kserve_client.py"), "bench", json.dumps(config)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert triton.stdin is not None and triton.stdout is not None
        stdin, stdout = triton.stdin, triton.stdout
        texts: dict[str, str] = {}

        def native_text() -> float:
            t0 = time.perf_counter()
            texts["native"] = "".join(c.text for c in client.generate(PROMPT, max_tokens=a.max_tokens,
                                                                       ignore_eos=True))
            return (time.perf_counter() - t0) * 1000.0

        def native_logits() -> float:
            t0 = time.perf_counter()
            client.compute_logits(TOKEN_IDS)
            return (time.perf_counter() - t0) * 1000.0

        def through_tritonclient(kind: str) -> Callable[[], float]:
            def call() -> float:
                stdin.write(kind + "\n")
                stdin.flush()
                answer = json.loads(stdout.readline())
                texts["kserve"] = answer.get("text", texts.get("kserve", ""))
                return float(answer["ms"])
            return call

        calls = {("native", "text"): native_text, ("native", "logits"): native_logits,
                 ("kserve", "text"): through_tritonclient("text"), ("kserve", "logits"): through_tritonclient("logits")}
        try:
            for fn in calls.values():  # warm-up: channels, the first request's costs
                fn()
            progress(f"{a.runs} runs of each request through each client, alternating")
            for run in range(a.runs):
                for kind in KINDS:
                    order = ("native", "kserve") if run % 2 == 0 else ("kserve", "native")
                    for side in order:
                        ms[side][kind].append(calls[(side, kind)]())
        finally:
            stdin.close()
            triton.wait(timeout=60)
    if texts["kserve"] != texts["native"]:
        raise SystemExit(f"the two protocols disagree: {texts['kserve']!r} vs {texts['native']!r}")
    summary = {}
    rows = []
    for kind, what in zip(KINDS, (f"{a.max_tokens} tokens greedy", f"prefill of {len(TOKEN_IDS)} ids")):
        n, k = median(ms["native"][kind]), median(ms["kserve"][kind])
        paired = median([ks / nat for ks, nat in zip(ms["kserve"][kind], ms["native"][kind])])
        summary[kind] = {"native_ms": n, "kserve_ms": k, "ratio_of_medians": k / n, "median_paired_ratio": paired}
        rows.append((kind, what, n, k, k / n, paired, a.runs))
    print(table(["request", "what", "native ms", "kserve ms", "kserve/native", "paired ratio", "runs"], rows))
    write_results("kserve.json", {
        "machine": machine(load),
        "what": "SmolLM2-135M (f32) over 2 torch executors on loopback; one coordinator port serves both protocols",
        "native": "CoordinatorClient: the Generate stream read to its end / ComputeLogits",
        "kserve": "tritonclient.grpc InferenceServerClient.infer (ModelInfer), in its own venv and process",
        "prompt": PROMPT, "max_tokens": a.max_tokens, "token_ids": TOKEN_IDS, "runs": a.runs, "text": texts["native"],
        "median": summary, "latency_ms": ms,
    })


if __name__ == "__main__":
    main()
