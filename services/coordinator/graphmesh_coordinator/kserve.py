"""The Open Inference Protocol (KServe v2) beside CoordinatorService: on the coordinator, over its own Generator,
and on a front end (graphmesh-frontend --model), relayed to the coordinator (an Upstream either way, upstream.py).

The coordinator's model answers two kinds of request, told apart by the input's name:
- "text_input" (BYTES, shape [1]) generates text: "text_output" (BYTES, shape [1]); the request's parameters
  max_tokens, temperature, top_k, top_p, seed, raw and ignore_eos mean what they mean for Generate; guided decoding
  takes one of guided_json (a JSON Schema's text), guided_json_object (bool), guided_regex, guided_grammar (EBNF),
  as vLLM names them (Generate's `guided`); speculative ("prompt-lookup[:K]", "draft[:K]" or "off";
  absent: the coordinator's --speculative) is Generate's `speculative` and never changes the tokens.
- "input_ids" (INT64, shape [1, n]) runs one prefill: "logits" (FP32, shape [1, vocab]) of the last position.
ModelStreamInfer answers a text request with one response per new piece of text, Triton's decoupled way: every
response carries the bool parameter triton_final_response, true on the last one only.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from importlib import metadata

import grpc
import grpc.aio
import numpy as np
from opentelemetry import trace

from graphmesh.errors import GraphmeshError, InvalidArgument, NotFound
from graphmesh.kserve import grpc_service_pb2 as pb
from graphmesh.kserve import grpc_service_pb2_grpc as pb_grpc
from graphmesh_coordinator import guided, speculative
from graphmesh_coordinator.generation import Event, GenerationRequest
from graphmesh_coordinator.servicer import RECOVERY_WAIT_S, as_status, prompt_token_ids
from graphmesh_coordinator.upstream import Sessions, Upstream
from graphmesh_server.interceptors import Admission

MODEL_VERSION = "1"
TEXT_INPUT, TEXT_OUTPUT, IDS_INPUT, LOGITS_OUTPUT = "text_input", "text_output", "input_ids", "logits"
DEFAULT_MAX_TOKENS = 64  # as `graphmesh generate`
FINAL = "triton_final_response"
GUIDED_PARAMETERS = ("guided_json", "guided_json_object", "guided_regex", "guided_grammar")
# Threads for the inference requests' code while it runs (parsing, tokenizing, detokenizing, a logits call): a
# generation waiting for its tokens holds none, so thousands of queued requests share these.
STREAM_WORKERS = 32

_LENGTH = struct.Struct("<I")
_INT32_MAX, _UINT64_MAX = 2**31 - 1, 2**64 - 1


def pack_bytes(items: Sequence[bytes]) -> bytes:
    """BYTES elements in the protocol's raw layout: each one a 4-byte little-endian length, then its bytes."""
    return b"".join(_LENGTH.pack(len(item)) + item for item in items)


def unpack_bytes(raw: bytes, name: str) -> list[bytes]:
    items, at = [], 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise InvalidArgument(f"input {name!r}: {len(raw) - at} stray bytes where a 4-byte length was expected",
                                  "BAD_BYTES_CONTENTS")
        (n,) = _LENGTH.unpack_from(raw, at)
        if at + 4 + n > len(raw):
            raise InvalidArgument(f"input {name!r}: an element of {n} bytes runs past the end ({len(raw)} bytes)",
                                  "BAD_BYTES_CONTENTS")
        items.append(raw[at + 4: at + 4 + n])
        at += 4 + n
    return items


@dataclass(frozen=True)
class Output:
    name: str
    datatype: str
    shape: list[int]
    raw: bytes


def _parameter(params: dict[str, pb.InferParameter], key: str, kinds: tuple[str, ...],
               default: bool | int | float | str) -> bool | int | float | str:
    if key not in params:
        return default
    kind = params[key].WhichOneof("parameter_choice")
    if kind not in kinds:
        raise InvalidArgument(f"parameter {key!r} must be {' or '.join(kinds)}, got {kind or 'no value'}",
                              "BAD_PARAMETER", {"parameter": key})
    value: bool | int | float = getattr(params[key], kind)
    return value


def _int(params: dict[str, pb.InferParameter], key: str, default: int, low: int, high: int) -> int:
    value = int(_parameter(params, key, ("int64_param", "uint64_param"), default))
    if not low <= value <= high:
        raise InvalidArgument(f"parameter {key!r} is {value}; it must be in [{low}, {high}]", "BAD_PARAMETER",
                              {"parameter": key})
    return value


def _float(params: dict[str, pb.InferParameter], key: str, default: float) -> float:
    # A Python client sends temperature=0 as an int64: a whole number is as good as a double.
    return float(_parameter(params, key, ("double_param", "int64_param", "uint64_param"), default))


def _bool(params: dict[str, pb.InferParameter], key: str) -> bool:
    return bool(_parameter(params, key, ("bool_param",), False))


def _str(params: dict[str, pb.InferParameter], key: str) -> str:
    return str(_parameter(params, key, ("string_param",), ""))


def _message(error: Exception) -> str:
    """An error as ModelStreamInfer's in-band error_message: there is no status code there, so it leads."""
    status = as_status(error)
    return f"{status.code.name}: {status.details}"


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, upstream: Upstream, model_name: str, admission: Admission | None = None,
                 leader_gate: Callable[[], None] | None = None) -> None:
        self.upstream, self.model_name = upstream, model_name
        self.leader_gate = leader_gate  # raises NOT_LEADER on a standby (CoordinatorServicer's)
        # the coordinator's server's: a logits request is counted against it (a front end's goes to the coordinator's
        # ComputeLogits, counted there)
        self.admission = admission
        self._pool = futures.ThreadPoolExecutor(STREAM_WORKERS, thread_name_prefix="kserve-stream")

    def _check_model(self, name: str, version: str) -> None:
        if self.leader_gate is not None:
            self.leader_gate()
        if name != self.model_name:
            raise NotFound(f"unknown model {name!r}; this server serves {self.model_name!r}", "UNKNOWN_MODEL")
        if version not in ("", MODEL_VERSION):
            raise NotFound(f"model {name!r} has no version {version!r}; it has {MODEL_VERSION!r}",
                           "UNKNOWN_MODEL_VERSION")

    def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.ServicerContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.ServicerContext) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.upstream.ready())

    def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.ServicerContext) -> pb.ModelReadyResponse:
        try:
            self._check_model(request.name, request.version)
        except GraphmeshError as e:
            context.abort_with_status(e.to_status())
            raise
        return pb.ModelReadyResponse(ready=self.upstream.ready())

    def ServerMetadata(self, request: pb.ServerMetadataRequest,
                       context: grpc.ServicerContext) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="graphmesh", version=metadata.version("graphmesh-coordinator"),
                                         extensions=["parameters"])

    def ModelMetadata(self, request: pb.ModelMetadataRequest,
                      context: grpc.ServicerContext) -> pb.ModelMetadataResponse:
        try:
            self._check_model(request.name, request.version)
            vocab_size = self.upstream.vocab_size
        except GraphmeshError as e:
            context.abort_with_status(e.to_status())
            raise
        T = pb.ModelMetadataResponse.TensorMetadata
        inputs = [T(name=IDS_INPUT, datatype="INT64", shape=[1, -1])]
        outputs = [T(name=LOGITS_OUTPUT, datatype="FP32", shape=[1, vocab_size])]
        if self.upstream.tokenizer is not None:  # without one, only token ids can be served
            inputs.append(T(name=TEXT_INPUT, datatype="BYTES", shape=[1]))
            outputs.append(T(name=TEXT_OUTPUT, datatype="BYTES", shape=[1]))
        return pb.ModelMetadataResponse(name=self.model_name, versions=[MODEL_VERSION], platform="graphmesh",
                                        inputs=inputs, outputs=outputs)

    def _parse(self, request: pb.ModelInferRequest) -> list[int] | GenerationRequest:
        """The token ids of a logits request, or the generation a text request asks for (the mesh's readiness is
        waited for later: a generation waits for it queued, without a thread)."""
        self._check_model(request.model_name, request.model_version)
        if len(request.inputs) != 1:
            raise InvalidArgument(f"the request has {len(request.inputs)} inputs; send one: {TEXT_INPUT!r} (BYTES [1]) "
                                  f"or {IDS_INPUT!r} (INT64 [1, n])", "BAD_INPUT_COUNT")
        tensor = request.inputs[0]
        if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
            raise InvalidArgument(f"{len(request.raw_input_contents)} raw_input_contents for {len(request.inputs)} "
                                  "inputs", "BAD_RAW_INPUT_COUNT")
        raw = request.raw_input_contents[0] if request.raw_input_contents else None
        if raw is not None and tensor.HasField("contents"):
            raise InvalidArgument(f"input {tensor.name!r} has both raw and typed contents", "BOTH_CONTENTS")
        if tensor.name not in (TEXT_INPUT, IDS_INPUT):
            raise InvalidArgument(f"unknown input {tensor.name!r}; expected {TEXT_INPUT!r} or {IDS_INPUT!r}",
                                  "UNKNOWN_INPUT")
        produced = TEXT_OUTPUT if tensor.name == TEXT_INPUT else LOGITS_OUTPUT
        for wanted in request.outputs:
            if wanted.name != produced:
                raise InvalidArgument(f"output {wanted.name!r} is not produced for input {tensor.name!r}; "
                                      f"it produces {produced!r}", "UNKNOWN_OUTPUT")
        if tensor.name == IDS_INPUT:
            return self._token_ids(tensor, raw)
        return self._generation(request, self._text(tensor, raw))

    @staticmethod
    def _check_type(tensor: pb.ModelInferRequest.InferInputTensor, datatype: str) -> None:
        if tensor.datatype != datatype:
            raise InvalidArgument(f"input {tensor.name!r} has datatype {tensor.datatype!r}; expected {datatype!r}",
                                  "WRONG_DATATYPE", {"input": tensor.name})

    @staticmethod
    def _check_shape(tensor: pb.ModelInferRequest.InferInputTensor, ok: bool, expected: str) -> None:
        if not ok:
            raise InvalidArgument(f"input {tensor.name!r} has shape {list(tensor.shape)}; expected {expected}",
                                  "SHAPE_MISMATCH", {"input": tensor.name})

    def _text(self, tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> str:
        self._check_type(tensor, "BYTES")
        self._check_shape(tensor, list(tensor.shape) == [1], "[1]")
        items = unpack_bytes(raw, tensor.name) if raw is not None else list(tensor.contents.bytes_contents)
        self._check_shape(tensor, len(items) == 1, f"[1], as many elements as the contents hold ({len(items)})")
        try:
            return items[0].decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgument(f"input {tensor.name!r} is not UTF-8: {e}", "BAD_TEXT") from e

    def _token_ids(self, tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> list[int]:
        self._check_type(tensor, "INT64")
        shape = list(tensor.shape)
        self._check_shape(tensor, len(shape) == 2 and shape[0] == 1 and shape[1] >= 1, "[1, n] with n >= 1")
        if raw is not None:
            self._check_shape(tensor, len(raw) == 8 * shape[1], f"[1, {len(raw) / 8:g}] for {len(raw)} raw bytes")
            return np.frombuffer(raw, "<i8").tolist()
        ids = list(tensor.contents.int64_contents)
        self._check_shape(tensor, len(ids) == shape[1], f"[1, {len(ids)}] for {len(ids)} int64_contents")
        return ids

    def _generation(self, request: pb.ModelInferRequest, text: str) -> GenerationRequest:
        p = dict(request.parameters)
        ids = prompt_token_ids(self.upstream.tokenizer, self.model_name, prompt=text, raw=_bool(p, "raw"),
                               parse_special=_bool(p, "parse_special_tokens"))
        # top_p 0 means "unset" as in Generate, where it is a proto3 default.
        return GenerationRequest(ids, _int(p, "max_tokens", DEFAULT_MAX_TOKENS, 1, _INT32_MAX),
                                 _float(p, "temperature", 0.0), _int(p, "top_k", 0, 0, _INT32_MAX),
                                 _float(p, "top_p", 1.0) or 1.0, _int(p, "seed", 0, 0, _UINT64_MAX),
                                 ignore_eos=_bool(p, "ignore_eos"),
                                 guided=guided.from_fields(_str(p, "guided_json"), _bool(p, "guided_json_object"),
                                                           _str(p, "guided_regex"), _str(p, "guided_grammar"),
                                                           names=GUIDED_PARAMETERS),
                                 speculative=self._speculative(p))

    def _speculative(self, params: dict[str, pb.InferParameter]) -> speculative.Mode | None:
        if "speculative" not in params:
            return None
        return speculative.from_json(_str(params, "speculative"), self.upstream.speculative)

    def _response(self, request: pb.ModelInferRequest, output: Output,
                  parameters: dict[str, pb.InferParameter]) -> pb.ModelInferResponse:
        response = pb.ModelInferResponse(model_name=self.model_name, model_version=MODEL_VERSION, id=request.id,
                                         parameters=parameters, raw_output_contents=[output.raw])
        response.outputs.add(name=output.name, datatype=output.datatype, shape=output.shape)
        return response

    async def _logits(self, token_ids: list[int]) -> Output:
        """Compute, not a queued generation: admitted as any call."""
        if self.admission is not None and not self.admission.enter():
            raise self.admission.error()
        try:
            logits = await self.upstream.logits(token_ids, self._pool, RECOVERY_WAIT_S)
        finally:
            if self.admission is not None:
                self.admission.leave()
        raw = np.ascontiguousarray(logits, "<f4").reshape(1, -1)  # [1, vocab]
        return Output(LOGITS_OUTPUT, "FP32", list(raw.shape), raw.tobytes())

    @staticmethod
    def _text_output(text: str) -> Output:
        return Output(TEXT_OUTPUT, "BYTES", [1], pack_bytes([text.encode("utf-8")]))

    async def _events(self, call: GenerationRequest) -> AsyncIterator[Event]:
        """The generation's events. It waits for its turn, the mesh and its tokens holding no thread; when the
        client leaves, the call's task is cancelled and the session ends with it."""
        sessions = Sessions(self.upstream, [call], trace.get_current_span(), self._pool, RECOVERY_WAIT_S)
        try:
            while (item := (await sessions.queue.get())[1]) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            sessions.cancel()

    async def ModelInfer(self, request: pb.ModelInferRequest,
                         context: grpc.aio.ServicerContext[pb.ModelInferRequest, pb.ModelInferResponse],
                         ) -> pb.ModelInferResponse:
        """Async, on the server's event loop: a text request queues with the other generations (not behind the
        admission limit) and holds a thread only while its code runs; a logits request is admitted as any call."""
        try:
            call = await asyncio.get_running_loop().run_in_executor(self._pool, self._parse, request)
            if not isinstance(call, GenerationRequest):
                return self._response(request, await self._logits(call), {})
            text, finish = "", ""
            async for event in self._events(call):
                text, finish = text + event.text, event.finish_reason or finish
            return self._response(request, self._text_output(text),
                                  {"finish_reason": pb.InferParameter(string_param=finish)})
        except Exception as e:
            status = as_status(e)
        await context.abort(status.code, status.details, status.trailing_metadata)
        raise AssertionError("abort returns by raising")

    async def _stream(self, request: pb.ModelInferRequest) -> AsyncIterator[pb.ModelInferResponse]:
        call = await asyncio.get_running_loop().run_in_executor(self._pool, self._parse, request)
        if not isinstance(call, GenerationRequest):
            yield self._response(request, await self._logits(call), {FINAL: pb.InferParameter(bool_param=True)})
            return
        async for event in self._events(call):
            final = bool(event.finish_reason)
            if event.text or final:
                parameters = {FINAL: pb.InferParameter(bool_param=final)}
                if final:
                    parameters["finish_reason"] = pb.InferParameter(string_param=event.finish_reason)
                yield self._response(request, self._text_output(event.text), parameters)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest],
                               context: grpc.aio.ServicerContext[pb.ModelInferRequest, pb.ModelStreamInferResponse],
                               ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests of one stream run concurrently (decoupled: responses of different requests interleave, each
        carrying its request's id); a failed request is answered in-band and the stream goes on.

        Async, on the server's event loop: an open stream that sends nothing holds no thread and no admission
        slot (tritonclient keeps one open per client, so counting open streams would let idle clients lock the
        others out). A text request queues with the other generations (--max-waiting-requests) and a logits request
        is admitted on its own (--max-concurrent-rpcs); either is refused in-band with RESOURCE_EXHAUSTED past its
        bound, and holds a thread only while its code runs. When the client leaves, its requests' sessions end."""
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()  # the requests in progress (a long-lived stream keeps no others)

        def failed(request: pb.ModelInferRequest, error: Exception) -> pb.ModelStreamInferResponse:
            return pb.ModelStreamInferResponse(error_message=_message(error),
                                               infer_response=pb.ModelInferResponse(id=request.id))

        async def serve(request: pb.ModelInferRequest) -> None:
            try:
                async for response in self._stream(request):
                    out.put_nowait(pb.ModelStreamInferResponse(infer_response=response))
            except Exception as e:
                out.put_nowait(failed(request, e))

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.create_task(serve(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
            finally:  # the client is done sending: the stream ends when its requests are answered
                await asyncio.gather(*running, return_exceptions=True)
                out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (response := await out.get()) is not None:
                yield response
        finally:  # the stream ended, or its client left: what still runs for it stops
            for task in (reader, *running):
                task.cancel()
