"""Client of CoordinatorService: generation streams, logits, status."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc
import numpy as np

from graphmesh import tensors
from graphmesh.errors import from_rpc_error
from graphmesh.security import bearer
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2

_FINISH = {coordinator_pb2.FINISH_REASON_LENGTH: "length", coordinator_pb2.FINISH_REASON_EOS: "eos",
           coordinator_pb2.FINISH_REASON_STOP: "stop"}


@dataclass
class Chunk:
    """One streamed piece of a completion."""

    token_ids: list[int]
    text: str
    finish_reason: str = ""
    session_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    ttft_ms: float = 0.0
    prefill_computed_tokens: int = 0


class CoordinatorClient:
    """credentials: TLS (graphmesh.security.credentials(ca, cert, key)); token: the coordinator's bearer token."""

    def __init__(self, address: str, *, timeout: float = 600.0, credentials: grpc.ChannelCredentials | None = None,
                 metadata: Sequence[tuple[str, str]] = (), token: str = "") -> None:
        options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self._channel = (grpc.secure_channel(address, credentials, options) if credentials
                         else grpc.insecure_channel(address, options))
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        self.timeout, self.metadata = timeout, (*metadata, *bearer(token))

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: str = "", *, max_tokens: int = 64, raw: bool = False, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop: Sequence[str] = (),
                 prompt_token_ids: Sequence[int] = (), messages: Sequence[dict[str, str]] = (),
                 ignore_eos: bool = False, model: str = "", parse_special_tokens: bool = False) -> Iterator[Chunk]:
        """Streams the completion; raises graphmesh.errors types on a bad request. parse_special_tokens: special
        tokens spelled in the prompt or messages ("<|im_start|>") are control tokens, not text."""
        request = coordinator_pb2.GenerateRequest(
            model=model, prompt=prompt, raw=raw, max_tokens=max_tokens, stop=list(stop), ignore_eos=ignore_eos,
            parse_special_tokens=parse_special_tokens,
            prompt_token_ids=list(prompt_token_ids),
            messages=[coordinator_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
            sampling=stage_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
        try:
            for r in self._stub.Generate(request, timeout=self.timeout, metadata=self.metadata):
                yield Chunk(list(r.token_ids), r.text, _FINISH.get(r.finish_reason, ""), r.session_id,
                            list(r.prompt_token_ids), r.ttft_ms, r.prefill_computed_tokens)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    def compute_logits(self, token_ids: Sequence[int], model: str = "") -> np.ndarray:
        try:
            reply = self._stub.ComputeLogits(coordinator_pb2.ComputeLogitsRequest(model=model, token_ids=list(token_ids)),
                                             timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return tensors.from_proto(reply.logits)

    def status(self) -> coordinator_pb2.StatusResponse:
        try:
            return self._stub.Status(coordinator_pb2.StatusRequest(), timeout=30.0, metadata=self.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
