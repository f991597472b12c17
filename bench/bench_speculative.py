"""Speculative decoding by prompt lookup (issue 39): decode tokens/s with speculation off and on, on a mesh of 2
torch executors (SmolLM2-135M-Instruct, f32 unless --weights says otherwise), against llama.cpp's own server
(llama-cpp-python, the bundled GGUF as stored) without and with its prompt-lookup speculation
(`--draft_model prompt-lookup-decoding`), in the same run on the same machine.

Prompts: input-grounded ones, where the output repeats the input (summarise or edit a given passage, code with
repetition), and open-ended chat. Each is chat-templated once; the mesh gets the ids, llama.cpp the text (checked to
tokenize to the same ids). Greedy, `--tokens` tokens each, end of sequence ignored (the mesh) or banned through
logit_bias (llama.cpp: its API has no ignore_eos). The mesh's runs with speculation on and off must give the same
tokens (same_tokens_on_off): speculation never changes a token.

Decode tokens/s of a stream: its tokens after the first over the time from its first to its last token (the
prompt's prefill left out); at 16 streams, the aggregate: every token over the wall time of the 16. Runs interleave
(each repeat goes through every engine), medians over the repeats; ratios are speculation on over off for each
engine, and the mesh over llama.cpp with each one's speculation on. The load average at the start and the end is
recorded: on a shared small machine it is part of the result.

    .venv/bin/python bench/bench_speculative.py [--repeats 3] [--tokens 128] [--streams 1,16] [--k 8]
        [--executors 2] [--weights f32] [--no-peer] [--quick] [--draft PATH]

--quick: 1 repeat, 1 stream, 16 tokens, one prompt of each kind, no peer: a smoke test of the harness, not figures.
--draft PATH: a draft model of SmolLM2's tokenizer (a checkpoint path or bundled name) on one more executor
(--speculative draft:PATH:K), run as a third mesh engine "mesh+draft"; its tokens must equal the mesh's without
speculation too (same_tokens_draft_off).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.bench_serving import EOG_BIAS, REQUEST_TIMEOUT_S, Stream, _completion_events
from bench.common import machine, median, progress, table, write_results
from bench.peers import LlamaCppServer
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from graphmesh.tokenizer import Tokenizer
from graphmesh.v1 import coordinator_pb2 as cpb
from graphmesh_coordinator import speculative

MODEL = "smollm2-135m"
PASSAGE = ("The lighthouse on Skerry Point was built in 1874 from granite quarried on the island itself. For ninety "
           "years a keeper lived in the cottage at its foot, climbing the one hundred and twelve steps at dusk to "
           "light the lamp and again at dawn to put it out. The last keeper, Margaret Innes, kept a logbook of "
           "every ship that passed, the weather at noon and the height of the tide; when the light was automated "
           "in 1964 she gave the logbooks to the village library, where they can still be read.")
CODE = ("class Vector:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
        "    def __add__(self, other):\n        return Vector(self.x + other.x, self.y + other.y)\n\n"
        "    def __sub__(self, other):\n        return Vector(self.x - other.x, self.y - other.y)\n")
PROMPTS: dict[str, list[tuple[str, str]]] = {
    "grounded": [
        ("summarise", f"Summarise this passage in a few sentences, keeping its facts and wording:\n\n{PASSAGE}"),
        ("edit", f"Rewrite this passage with British spelling and every number written in words:\n\n{PASSAGE}"),
        ("code", f"Add __mul__ and __truediv__ methods (by a scalar) to this class, and return the whole class:\n\n"
                 f"{CODE}"),
    ],
    "open": [
        ("chat", "Tell me about your favourite season and why."),
        ("story", "Write a short story about a fox who learns to swim."),
    ],
}
MESH_OFF, MESH_ON, MESH_DRAFT = "mesh", "mesh+spec", "mesh+draft"
LLAMA_OFF, LLAMA_ON = "llama.cpp", "llama.cpp+spec"


def decode_tps(streams: list[Stream]) -> float:
    """One stream: tokens after the first over first-to-last token; several: every token over their wall time."""
    if len(streams) == 1:
        s = streams[0]
        span = s.arrivals[-1] - s.arrivals[0] if len(s.arrivals) > 1 else float("nan")
        return (s.tokens - s.chunk_tokens[0]) / span if span > 0 else float("nan")
    start, end = min(s.started for s in streams), max(s.arrivals[-1] for s in streams)
    return sum(s.tokens for s in streams) / (end - start)


def lookup_bound(prompt: list[int], output: list[int], k: int) -> float:
    """The most tokens a pass any prompt-lookup proposer could average over `output` (the tokens without
    speculation): at each pass it proposes, of every earlier occurrence of the history's last token (every longer
    suffix's occurrences are among them), the one whose next tokens (up to k) match the output longest. A prompt
    whose bound is low is limited by its proposals, not by verification: no choice of match or of k passes it."""
    history, at, passes = [*prompt, *output[:1]], 1, 0
    while at < len(output):
        best, last = 0, len(history) - 1
        for start in (i for i in range(last) if history[i] == history[last]):
            a = 0
            while a < k and at + a < len(output) and start + 1 + a <= last and history[start + 1 + a] == output[at + a]:
                a += 1
            best = max(best, a)
        history += output[at:at + best + 1]
        at, passes = at + best + 1, passes + 1
    return (len(output) - 1) / passes if passes else float("nan")


def mesh_target(client: CoordinatorClient, spec: cpb.SpeculativeDecoding) -> Callable[[list[int], int], Stream]:
    def generate(prompt: list[int], tokens: int) -> Stream:
        stream = Stream(time.perf_counter(), prompt_tokens=len(prompt))
        for chunk in client.generate(prompt_token_ids=prompt, max_tokens=tokens, ignore_eos=True, speculative=spec):
            if chunk.token_ids:
                stream.arrived(time.perf_counter(), chunk.token_ids)
        return stream
    return generate


def llamacpp_target(server: LlamaCppServer, texts: dict[tuple[int, ...], str],
                    encode: Callable[[str], list[int]]) -> Callable[[list[int], int], Stream]:
    bias = {str(t): EOG_BIAS for t in server.eog_ids}

    def generate(prompt: list[int], tokens: int) -> Stream:
        body = json.dumps({"prompt": texts[tuple(prompt)], "max_tokens": tokens, "temperature": 0.0,
                           "repeat_penalty": 1.0, "logit_bias": bias, "stream": True}).encode()
        text: list[str] = []
        stream = Stream(time.perf_counter(), prompt_tokens=len(prompt))
        for now, event in _completion_events(server.address, body, "llama.cpp"):
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    stream.arrivals.append(now)
                    text.append(choice["text"])
                    stream.chunk_tokens.append(len(encode(choice["text"])) or 1)
        stream.token_ids = encode("".join(text))
        stream.chunk_tokens[-1] += len(stream.token_ids) - sum(stream.chunk_tokens)  # pieces that re-tokenize
        return stream
    return generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--streams", default="1,16")
    p.add_argument("--k", type=int, default=speculative.DEFAULT_K,
                   help="the largest k (proposed tokens a pass), both engines; default the coordinator's")
    p.add_argument("--executors", type=int, default=2)
    p.add_argument("--weights", default="f32")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--output", default="", help="results file under bench/results/ (default speculative.json)")
    p.add_argument("--draft", default="", help="a draft model of the same tokenizer: a third mesh engine speculating "
                                               "with it (on one more executor)")
    a = p.parse_args()
    repeats, tokens, streams_list = a.repeats, a.tokens, [int(x) for x in a.streams.split(",")]
    prompts = {kind: list(v) for kind, v in PROMPTS.items()}
    peer = not a.no_peer
    if a.quick:
        repeats, tokens, streams_list, peer = 1, 16, [1], False
        prompts = {kind: v[:1] for kind, v in prompts.items()}
    load = os.getloadavg()
    path = resolve_model(MODEL)
    tokenizer = Tokenizer.from_checkpoint(open_checkpoint(path))
    ids: dict[str, list[int]] = {}
    texts: dict[tuple[int, ...], str] = {}
    for named in prompts.values():
        for name, question in named:
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
            ids[name] = tokenizer.encode(text)
            texts[tuple(ids[name])] = text
    progress(f"{len(ids)} prompts, {tokens} tokens, streams {streams_list}, {repeats} repeat(s), k {a.k}; "
             f"load average {load}")
    on = cpb.SpeculativeDecoding(method=cpb.SPECULATIVE_METHOD_PROMPT_LOOKUP, max_proposed=a.k)
    off = cpb.SpeculativeDecoding(method=cpb.SPECULATIVE_METHOD_OFF)
    servers: list[LlamaCppServer] = []
    drafting = ["--speculative", f"draft:{a.draft}:{a.k}"] if a.draft else []
    with LocalMesh(a.executors, "torch", MODEL, kvstore=False, weights=a.weights, extra_coordinator_args=drafting,
                   draft_executor=bool(a.draft)) as mesh, \
            CoordinatorClient(mesh.coordinator_address, timeout=REQUEST_TIMEOUT_S) as client:
        targets: dict[str, Callable[[list[int], int], Stream]] = {
            MESH_OFF: mesh_target(client, off), MESH_ON: mesh_target(client, on)}
        if a.draft:
            targets[MESH_DRAFT] = mesh_target(client, cpb.SpeculativeDecoding(method=cpb.SPECULATIVE_METHOD_DRAFT,
                                                                               max_proposed=a.k))
        if peer:
            gguf = Path(path)
            n_ctx = max(len(v) for v in ids.values()) + tokens + 64
            plain = LlamaCppServer(gguf, n_ctx=n_ctx)
            spec = LlamaCppServer(gguf, n_ctx=n_ctx, extra_args=["--draft_model", "prompt-lookup-decoding",
                                                                  "--draft_model_num_pred_tokens", str(a.k)])
            for server in (plain, spec):
                server.start()
                servers.append(server)
            targets[LLAMA_OFF] = llamacpp_target(plain, texts, tokenizer.encode)
            targets[LLAMA_ON] = llamacpp_target(spec, texts, tokenizer.encode)
        try:
            for name in ids:  # warm-up: each engine compiles or loads what its first request needs
                for target in targets.values():
                    target(ids[name], 4)
            runs: dict[tuple[str, int, str], list[float]] = {}
            tokens_of: dict[tuple[str, int, str], list[int]] = {}
            for r in range(repeats):
                for n in streams_list:
                    for name in ids:
                        for engine, target in targets.items():
                            with ThreadPoolExecutor(n) as pool:
                                done = list(pool.map(target, [ids[name]] * n, [tokens] * n))
                            runs.setdefault((name, n, engine), []).append(decode_tps(done))
                            tokens_of[(name, n, engine)] = done[0].token_ids
                            progress(f"repeat {r + 1}: {name} x{n} {engine}: {runs[(name, n, engine)][-1]:.1f} tok/s")
        finally:
            for server in servers:
                server.stop()
    kind_of = {name: kind for kind, named in prompts.items() for name, _ in named}
    rows, results = [], []
    for n in streams_list:
        for name in ids:
            med = {e: median(runs[(name, n, e)]) for e in targets}
            same = tokens_of[(name, n, MESH_ON)] == tokens_of[(name, n, MESH_OFF)]
            entry: dict[str, Any] = {"prompt": name, "kind": kind_of[name], "streams": n, "tokens_per_s": med,
                                     "runs": {e: runs[(name, n, e)] for e in targets},
                                     "mesh_on_over_off": med[MESH_ON] / med[MESH_OFF], "same_tokens_on_off": same}
            entry["lookup_bound_tokens_per_pass"] = lookup_bound(ids[name], tokens_of[(name, n, MESH_OFF)], a.k)
            row = [name, kind_of[name], n, med[MESH_OFF], med[MESH_ON], entry["mesh_on_over_off"],
                   entry["lookup_bound_tokens_per_pass"]]
            if a.draft:
                entry["mesh_draft_over_off"] = med[MESH_DRAFT] / med[MESH_OFF]
                entry["same_tokens_draft_off"] = tokens_of[(name, n, MESH_DRAFT)] == tokens_of[(name, n, MESH_OFF)]
                same = same and entry["same_tokens_draft_off"]
                row += [med[MESH_DRAFT], entry["mesh_draft_over_off"]]
            if peer:
                entry["llamacpp_on_over_off"] = med[LLAMA_ON] / med[LLAMA_OFF]
                entry["mesh_on_over_llamacpp_on"] = med[MESH_ON] / med[LLAMA_ON]
                row += [med[LLAMA_OFF], med[LLAMA_ON], entry["llamacpp_on_over_off"], entry["mesh_on_over_llamacpp_on"]]
            rows.append([*row, "yes" if same else "NO"])
            results.append(entry)
    headers = ["prompt", "kind", "streams", "mesh tok/s", "+spec", "on/off", "lookup bound",
               *(["+draft", "draft/off"] if a.draft else [])]
    if peer:
        headers += ["llama.cpp", "+spec", "on/off", "mesh/llama (spec)"]
    print(table([*headers, "same tokens"], rows))
    write_results(a.output or ("speculative.json" if not a.quick else "speculative_quick.json"), {
        "benchmark": "bench_speculative", "model": MODEL, "weights": a.weights, "executors": a.executors,
        "draft": a.draft or None,
        "tokens": tokens, "k": a.k, "repeats": repeats, "peer": "llama-cpp-python server" if peer else None,
        "results": results, "machine": machine(load)})


if __name__ == "__main__":
    main()
