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
        [--shape NAME [--draft-layers N] [--device cuda] [--dtype bf16]] [--guided]

--quick: 1 repeat, 1 stream, 16 tokens, one prompt of each kind, no peer: a smoke test of the harness, not figures.
--draft PATH: a draft model of SmolLM2's tokenizer (a checkpoint path or bundled name) on one more executor
(--speculative draft:PATH:K), run as a third mesh engine "mesh+draft"; its tokens must equal the mesh's without
speculation too (same_tokens_draft_off).

--guided: guided prompts instead, no peer: a JSON object copied under json_object, whose proposals its grammar
allows, and the passage copied under a regex that refuses its capitals and full stops (proposals stop where it
refuses one, each verified position sampled under its own mask). Its streams end where their grammar does.

--shape NAME (a shape of bench_gpu_mesh.py, e.g. tinyllama on --device cuda): a random-weight model of that shape
written by the benchmark instead of SmolLM2, no peer, prompts of random token ids ("repeated": a 16-token passage
four times; "random"); --draft-layers N adds the draft-model pair: the target's first N layers with its embedding,
final norm and head (a truncated self-draft). A random model's acceptance is its own, not a real model's: the
figures show what verification and drafting cost on the device at the acceptance measured (tokens_per_pass: a
verified pass's tokens, from the coordinator's counters).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.bench_gpu_mesh import SHAPES, write_random_model
from bench.bench_serving import EOG_BIAS, REQUEST_TIMEOUT_S, Stream, _completion_events
from bench.common import machine, median, metrics, progress, table, write_results
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
RECORD = ('{"lighthouse": "Skerry Point", "built": 1874, "steps": 112, "keeper": "Margaret Innes", '
          '"automated": 1964, "logbooks": "the village library"}')
# Guided decoding under speculation: a copied JSON object whose proposals its grammar allows, and the passage
# under a grammar that refuses its capitals and full stops (proposals cut where it refuses one)
GUIDED: dict[str, tuple[str, cpb.GuidedDecoding]] = {
    "json": (f"Repeat this JSON object exactly, nothing else:\n\n{RECORD}", cpb.GuidedDecoding(json_object=True)),
    "lowercase": (f"Repeat this passage word for word:\n\n{PASSAGE}", cpb.GuidedDecoding(regex="[a-z ,]+")),
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


SPECULATION = ("passes", "pass_tokens", "proposed_tokens", "accepted_tokens")


def speculation(port: int) -> dict[str, float]:
    """The coordinator's speculation counters (verified passes, their tokens, proposals, accepted proposals) and
    its steps' (verified and decode-run steps, their seconds from send to reply)."""
    samples = metrics(port)
    out = {name: samples.get((f"graphmesh_speculative_{name}_total", ""), 0.0) for name in SPECULATION}
    for kind in ("verify", "decode_run"):
        out[f"{kind}_steps"] = samples.get(("graphmesh_steps_by_kind_total", kind), 0.0)
        out[f"{kind}_s"] = samples.get(("graphmesh_step_seconds_total", kind), 0.0)
    for kind in ("verify", "run_token", "turn"):
        out[f"gate_{kind}"] = samples.get(("graphmesh_speculative_cost_seconds", kind), 0.0)
    return out


def per_pass(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Between two readings: tokens a verified pass, the share of proposals accepted, the mean milliseconds from
    sending a verified step, and a decode run's step, to its reply (nan: none) and how many there were; and what
    speculation's gate weighed at the second."""
    d = {name: after[name] - before[name] for name in after}

    def ratio(a: float, b: float, scale: float = 1.0) -> float:
        return scale * a / b if b else float("nan")
    return {"tokens_per_pass": ratio(d["pass_tokens"], d["passes"]),
            "acceptance": ratio(d["accepted_tokens"], d["proposed_tokens"]),
            "verify_step_ms": ratio(d["verify_s"], d["verify_steps"], 1e3),
            "run_step_ms": ratio(d["decode_run_s"], d["decode_run_steps"], 1e3),
            "verify_steps": d["verify_steps"], "run_steps": d["decode_run_steps"],
            # what speculation's gate weighed at the end (PassCosts): a verified step, a run's token, the turn
            **{f"gate_{kind}_ms": 1e3 * after[f"gate_{kind}"] for kind in ("verify", "run_token", "turn")}}


def write_draft(target: Path, layers: int, path: Path) -> None:
    """The target's first `layers` layers with its embedding, final norm and head, as a checkpoint of its own."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=1))
    (path / "generation_config.json").write_text((target / "generation_config.json").read_text())
    weight_map: dict[str, str] = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    kept = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(target / file), framework="pt") as f:
            for name in f.keys():
                if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers:
                    kept[name] = f.get_tensor(name)
    save_file(kept, str(path / "model.safetensors"), metadata={"format": "pt"})


def random_prompts(vocab: int, seed: int = 0) -> dict[str, list[tuple[str, list[int]]]]:
    rng = np.random.default_rng(seed)
    passage = rng.integers(3, vocab, 16).tolist()
    return {"repeated": [("repeated", passage * 4)],
            "random": [(f"random-{i}", rng.integers(3, vocab, 64).tolist()) for i in range(2)]}


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


def mesh_target(client: CoordinatorClient, spec: cpb.SpeculativeDecoding,
                guided: dict[tuple[int, ...], cpb.GuidedDecoding]) -> Callable[[list[int], int], Stream]:
    def generate(prompt: list[int], tokens: int) -> Stream:
        stream = Stream(time.perf_counter(), prompt_tokens=len(prompt))
        grammar = guided.get(tuple(prompt))  # its end may come before `tokens`: a finished grammar allows only that
        for chunk in client.generate(prompt_token_ids=prompt, max_tokens=tokens, ignore_eos=grammar is None,
                                     speculative=spec, guided=grammar):
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
    p.add_argument("--shape", default="", choices=["", *sorted(SHAPES)],
                   help="a random-weight model of this shape instead of SmolLM2 (no peer)")
    p.add_argument("--draft-layers", type=int, default=0,
                   help="with --shape: a third engine drafting with the target's first N layers")
    p.add_argument("--device", default="cpu", help="the executors' device")
    p.add_argument("--dtype", default="", help="the stages' dtype (default: the coordinator's for the device)")
    p.add_argument("--guided", action="store_true", help="guided prompts instead (SmolLM2, no peer)")
    a = p.parse_args()
    repeats, tokens, streams_list = a.repeats, a.tokens, [int(x) for x in a.streams.split(",")]
    peer = not a.no_peer and not a.shape and not a.guided
    load = os.getloadavg()
    scratch = tempfile.TemporaryDirectory(prefix="graphmesh-speculative-")
    model, draft = MODEL, a.draft
    ids: dict[str, list[int]] = {}
    texts: dict[tuple[int, ...], str] = {}
    kind_of: dict[str, str] = {}
    guided: dict[tuple[int, ...], cpb.GuidedDecoding] = {}
    if a.shape:
        model = str(Path(scratch.name) / a.shape)
        progress(f"writing a random {a.shape} model")
        write_random_model(SHAPES[a.shape], a.device, Path(model))
        if a.draft_layers:
            draft = str(Path(scratch.name) / f"{a.shape}-{a.draft_layers}-layers")
            write_draft(Path(model), a.draft_layers, Path(draft))
        for kind, numbered in random_prompts(SHAPES[a.shape]["vocab_size"]).items():
            for name, prompt in numbered:
                ids[name], kind_of[name] = prompt, kind
    else:
        tokenizer = Tokenizer.from_checkpoint(open_checkpoint(resolve_model(MODEL)))
        questions = {"guided": [(name, question) for name, (question, _) in GUIDED.items()]} if a.guided else PROMPTS
        for kind, named in questions.items():
            for name, question in named:
                text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
                ids[name], kind_of[name] = tokenizer.encode(text), kind
                texts[tuple(ids[name])] = text
                if a.guided:
                    guided[tuple(ids[name])] = GUIDED[name][1]
    if a.quick:
        repeats, tokens, streams_list, peer = 1, 16, [1], False
        firsts = {next(name for name in ids if kind_of[name] == kind) for kind in set(kind_of.values())}
        ids = {name: prompt for name, prompt in ids.items() if name in firsts}
    progress(f"{len(ids)} prompts, {tokens} tokens, streams {streams_list}, {repeats} repeat(s), k {a.k}; "
             f"load average {load}")
    on = cpb.SpeculativeDecoding(method=cpb.SPECULATIVE_METHOD_PROMPT_LOOKUP, max_proposed=a.k)
    off = cpb.SpeculativeDecoding(method=cpb.SPECULATIVE_METHOD_OFF)
    servers: list[LlamaCppServer] = []
    drafting = ["--speculative", f"draft:{draft}:{a.k}"] if draft else []
    dtype = ["--dtype", a.dtype] if a.dtype else []
    with scratch, LocalMesh(a.executors, "torch", model, kvstore=False, weights=a.weights, startup_timeout_s=900,
                            extra_coordinator_args=[*drafting, *dtype], extra_executor_args=["--device", a.device], metrics=True,
                            draft_executor=bool(draft)) as mesh, \
            CoordinatorClient(mesh.coordinator_address, timeout=REQUEST_TIMEOUT_S) as client:
        targets: dict[str, Callable[[list[int], int], Stream]] = {
            MESH_OFF: mesh_target(client, off, guided), MESH_ON: mesh_target(client, on, guided)}
        if draft:
            targets[MESH_DRAFT] = mesh_target(client, cpb.SpeculativeDecoding(method=cpb.SPECULATIVE_METHOD_DRAFT,
                                                                               max_proposed=a.k), guided)
        if peer:
            gguf = Path(resolve_model(MODEL))
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
            passes: dict[tuple[str, int, str], list[dict[str, float]]] = {}
            tokens_of: dict[tuple[str, int, str], list[int]] = {}
            for r in range(repeats):
                for n in streams_list:
                    for name in ids:
                        for engine, target in targets.items():
                            before = speculation(mesh.metrics_ports["coordinator"])
                            with ThreadPoolExecutor(n) as pool:
                                done = list(pool.map(target, [ids[name]] * n, [tokens] * n))
                            runs.setdefault((name, n, engine), []).append(decode_tps(done))
                            passes.setdefault((name, n, engine), []).append(
                                per_pass(before, speculation(mesh.metrics_ports["coordinator"])))
                            tokens_of[(name, n, engine)] = done[0].token_ids
                            progress(f"repeat {r + 1}: {name} x{n} {engine}: {runs[(name, n, engine)][-1]:.1f} tok/s")
        finally:
            for server in servers:
                server.stop()
    rows, results = [], []
    for n in streams_list:
        for name in ids:
            med = {e: median(runs[(name, n, e)]) for e in targets}
            same = tokens_of[(name, n, MESH_ON)] == tokens_of[(name, n, MESH_OFF)]
            entry: dict[str, Any] = {"prompt": name, "kind": kind_of[name], "streams": n, "tokens_per_s": med,
                                     "runs": {e: runs[(name, n, e)] for e in targets},
                                     **{measure: {e: median([x[measure] for x in passes[(name, n, e)]])
                                                  for e in (MESH_OFF, MESH_ON, MESH_DRAFT) if e in targets}
                                        for measure in ("tokens_per_pass", "acceptance", "verify_step_ms",
                                                        "run_step_ms", "verify_steps", "run_steps", "gate_verify_ms",
                                                        "gate_run_token_ms", "gate_turn_ms")},
                                     "mesh_on_over_off": med[MESH_ON] / med[MESH_OFF], "same_tokens_on_off": same}
            entry["lookup_bound_tokens_per_pass"] = lookup_bound(ids[name], tokens_of[(name, n, MESH_OFF)], a.k)
            row = [name, kind_of[name], n, med[MESH_OFF], med[MESH_ON], entry["mesh_on_over_off"],
                   entry["tokens_per_pass"][MESH_ON], entry["lookup_bound_tokens_per_pass"]]
            if draft:
                entry["mesh_draft_over_off"] = med[MESH_DRAFT] / med[MESH_OFF]
                entry["same_tokens_draft_off"] = tokens_of[(name, n, MESH_DRAFT)] == tokens_of[(name, n, MESH_OFF)]
                same = same and entry["same_tokens_draft_off"]
                row += [med[MESH_DRAFT], entry["mesh_draft_over_off"], entry["tokens_per_pass"][MESH_DRAFT]]
            if peer:
                entry["llamacpp_on_over_off"] = med[LLAMA_ON] / med[LLAMA_OFF]
                entry["mesh_on_over_llamacpp_on"] = med[MESH_ON] / med[LLAMA_ON]
                row += [med[LLAMA_OFF], med[LLAMA_ON], entry["llamacpp_on_over_off"], entry["mesh_on_over_llamacpp_on"]]
            rows.append([*row, "yes" if same else "NO"])
            results.append(entry)
    headers = ["prompt", "kind", "streams", "mesh tok/s", "+spec", "on/off", "tok/pass", "lookup bound",
               *(["+draft", "draft/off", "tok/pass"] if draft else [])]
    if peer:
        headers += ["llama.cpp", "+spec", "on/off", "mesh/llama (spec)"]
    print(table([*headers, "same tokens"], rows))
    write_results(a.output or ("speculative.json" if not a.quick else "speculative_quick.json"), {
        "benchmark": "bench_speculative", "model": f"random {a.shape}" if a.shape else MODEL,
        "weights": "random bf16 checkpoint" if a.shape else a.weights, "device": a.device, "dtype": a.dtype or None,
        "executors": a.executors, "draft": f"its first {a.draft_layers} layers" if a.draft_layers else a.draft or None,
        "guided": {name: str(g).strip() for name, (_, g) in GUIDED.items()} if a.guided else None,
        "tokens": tokens, "k": a.k, "repeats": repeats, "peer": "llama-cpp-python server" if peer else None,
        "results": results, "machine": machine(load)})


if __name__ == "__main__":
    main()
