"""Drives graphmesh's KServe v2 endpoint with the real tritonclient.grpc client and prints JSON.

It runs in its own venv (tritonclient pins protobuf < 7, the product needs 7), so it imports nothing from graphmesh:
    python kserve_client.py check '{"address": ..., "model": ..., "prompt": ..., "params": {...}, "token_ids": [...],
                                    "logits_path": "out.npy"}'
    python kserve_client.py bench '{"address": ..., "model": ..., "prompt": ..., "params": {...}, "token_ids": [...]}'
        then one line per call on stdin, "text" or "logits"; each is answered with {"ms": ...} on stdout
"""

from __future__ import annotations

import json
import queue
import sys
import time
from typing import Any

import numpy as np
import tritonclient.grpc as tc  # type: ignore[import-not-found, unused-ignore]
from tritonclient.utils import InferenceServerException  # type: ignore[import-not-found, unused-ignore]


def text_input(prompt: str, shape: list[int] | None = None) -> Any:
    data = np.array([prompt.encode()], dtype=np.object_)
    tensor = tc.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(data)
    if shape is not None:
        tensor.set_shape(shape)  # after the data, so the client's own shape check cannot catch it
    return tensor


def ids_input(token_ids: list[int], datatype: str = "INT64", shape: list[int] | None = None) -> Any:
    data = np.array([token_ids], dtype=np.int64 if datatype == "INT64" else np.int32)
    tensor = tc.InferInput("input_ids", list(data.shape), datatype)
    tensor.set_data_from_numpy(data)
    if shape is not None:
        tensor.set_shape(shape)
    return tensor


def failure(call: Any) -> dict[str, str]:
    try:
        call()
    except InferenceServerException as e:
        return {"status": str(e.status()), "message": str(e.message())}
    return {"status": "OK", "message": ""}


def generate(client: Any, model: str, prompt: str, params: dict[str, Any]) -> dict[str, Any]:
    result = client.infer(model, [text_input(prompt)], parameters=params, request_id="text-1")
    response = result.get_response()
    return {"text": result.as_numpy("text_output")[0].decode(), "id": response.id,
            "finish_reason": response.parameters["finish_reason"].string_param}


def stream(client: Any, requests: list[tuple[str, str, list[Any], dict[str, Any]]]) -> dict[str, Any]:
    """Sends (id, model, inputs, parameters) requests on one stream; collects responses until each request ended,
    with its final response or an in-band error (tritonclient keeps only the error's message, not the id)."""
    events: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        for request_id, model, inputs, params in requests:
            client.async_stream_infer(model, inputs, request_id=request_id, parameters=params)
        responses: dict[str, dict[str, list[Any]]] = {}
        errors: list[str] = []
        ended = 0
        while ended < len(requests):
            result, error = events.get(timeout=300)
            if error is not None:
                errors.append(str(error.message()))
                ended += 1
                continue
            response = result.get_response()
            entry = responses.setdefault(response.id, {"chunks": [], "finals": []})
            final = response.parameters["triton_final_response"].bool_param
            entry["finals"].append(final)
            text = result.as_numpy("text_output")
            entry["chunks"].append(text[0].decode() if text is not None else None)
            ended += final
        return {"responses": responses, "errors": errors}
    finally:
        client.stop_stream()


def check(cfg: dict[str, Any]) -> dict[str, Any]:
    model, prompt, params, ids = cfg["model"], cfg["prompt"], cfg["params"], cfg["token_ids"]
    client = tc.InferenceServerClient(cfg["address"])
    out: dict[str, Any] = {"live": client.is_server_live(), "ready": client.is_server_ready(),
                           "model_ready": client.is_model_ready(model)}
    meta = client.get_server_metadata(as_json=True)
    out["server_metadata"] = {"name": meta["name"], "version": meta["version"], "extensions": meta.get("extensions", [])}
    meta = client.get_model_metadata(model, as_json=True)
    out["model_metadata"] = {
        "name": meta["name"], "versions": meta["versions"], "platform": meta["platform"],
        "inputs": {t["name"]: [t["datatype"], [int(d) for d in t["shape"]]] for t in meta["inputs"]},
        "outputs": {t["name"]: [t["datatype"], [int(d) for d in t["shape"]]] for t in meta["outputs"]}}
    out["text"] = generate(client, model, prompt, params)
    logits = client.infer(model, [ids_input(ids)], outputs=[tc.InferRequestedOutput("logits")]).as_numpy("logits")
    np.save(cfg["logits_path"], logits)
    out["logits_dtype"] = str(logits.dtype)
    out["stream"] = stream(client, [("s-1", model, [text_input(prompt)], params)])
    out["errors"] = {
        "unknown_model": failure(lambda: client.infer("no-such-model", [text_input(prompt)])),
        "unknown_model_ready": failure(lambda: client.is_model_ready("no-such-model")),
        "unknown_model_metadata": failure(lambda: client.get_model_metadata("no-such-model")),
        "wrong_datatype": failure(lambda: client.infer(model, [ids_input(ids, "INT32")])),
        "shape_mismatch": failure(lambda: client.infer(model, [ids_input(ids, shape=[1, len(ids) + 2])])),
        "text_shape_mismatch": failure(lambda: client.infer(model, [text_input(prompt, [1, 1])])),
        "bad_parameter": failure(lambda: client.infer(model, [text_input(prompt)], parameters={"max_tokens": "many"})),
    }
    # The stream answers a bad request in-band and goes on with the next one on the same stream.
    out["stream_after_error"] = stream(client, [
        ("bad-model", "no-such-model", [text_input(prompt)], params),
        ("bad-type", model, [ids_input(ids, "INT32")], {}),
        ("s-2", model, [text_input(prompt)], params)])
    out["text_after_errors"] = generate(client, model, prompt, params)
    client.close()
    return out


def bench(cfg: dict[str, Any]) -> None:
    """Times one ModelInfer per line read from stdin ("text" or "logits") and answers each with a JSON line, so that
    the caller can interleave these calls with its own."""
    client = tc.InferenceServerClient(cfg["address"])
    text_in, ids_in = [text_input(cfg["prompt"])], [ids_input(cfg["token_ids"])]
    for line in sys.stdin:
        t0 = time.perf_counter()
        if line.strip() == "text":
            result = client.infer(cfg["model"], text_in, parameters=cfg["params"])
            answer = {"ms": (time.perf_counter() - t0) * 1000.0, "text": result.as_numpy("text_output")[0].decode()}
        else:
            client.infer(cfg["model"], ids_in).as_numpy("logits")
            answer = {"ms": (time.perf_counter() - t0) * 1000.0}
        print(json.dumps(answer), flush=True)
    client.close()


if __name__ == "__main__":
    mode, config = sys.argv[1], json.loads(sys.argv[2])
    if mode == "check":
        print(json.dumps(check(config)))
    else:
        bench(config)
