"""Client of CoordinatorService: generation streams, logits, status.

Given several coordinators (`a,b`: the replicas of one cluster, of which one leads), a stream that breaks with
UNAVAILABLE (the leader died, stepped down, or a standby answered) is resumed on the leader: the same request
again, carrying the tokens already delivered (resume_token_ids), so the new leader continues at the same positions
with the same seed and the caller sees one unbroken, token-identical completion.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc
import numpy as np

from graphmesh import tensors
from graphmesh.channels import KEEPALIVE_OPTIONS, MESSAGE_OPTIONS, open_channel
from graphmesh.errors import GraphmeshError, from_rpc_error
from graphmesh.security import bearer
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2

# GenerateResponse.finish_reason as the Generator names it (the coordinator's servicer maps it back)
FINISH_REASONS = {coordinator_pb2.FINISH_REASON_LENGTH: "length", coordinator_pb2.FINISH_REASON_EOS: "eos",
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
    logprobs: list[coordinator_pb2.GeneratedLogprob] = field(default_factory=list)  # one per token id, when asked


RESUME_BACKOFF_S = (0.05, 0.1)  # waits between attempts to find the leader, the last one repeated (a standby answers fast)


def _addresses(address: str | Sequence[str]) -> list[str]:
    found = [a.strip() for a in (address.split(",") if isinstance(address, str) else address) if a.strip()]
    if not found:
        raise ValueError("no coordinator address given")
    return found


class CoordinatorClient:
    """address: one coordinator, or several ("a,b" or a list) of one cluster. credentials: TLS
    (graphmesh.security.credentials(ca, cert, key)); token: the coordinator's bearer token. resume_timeout_s: how
    long a broken stream looks for a leader before its error is raised (per break; 0 never resumes; default: 30 s
    with several addresses, 0 with one)."""

    def __init__(self, address: str | Sequence[str], *, timeout: float = 600.0,
                 credentials: grpc.ChannelCredentials | None = None, metadata: Sequence[tuple[str, str]] = (),
                 token: str = "", resume_timeout_s: float | None = None) -> None:
        options: list[tuple[str, int]] = list(MESSAGE_OPTIONS)
        self.addresses = _addresses(address)
        self.resume_timeout_s = (30.0 if len(self.addresses) > 1 else 0.0) if resume_timeout_s is None \
            else resume_timeout_s
        if self.resume_timeout_s > 0:
            options += KEEPALIVE_OPTIONS  # a frozen leader's streams break, so that they resume on the new one
        self._channels = [open_channel(a, credentials, options) for a in self.addresses]
        self._stubs = [coordinator_pb2_grpc.CoordinatorServiceStub(c) for c in self._channels]
        self._current = 0  # the coordinator that answered last: the leader, as far as this client knows
        self.timeout, self.metadata = timeout, (*metadata, *bearer(token))
        self.resumes = 0  # streams continued on another (or the same, restarted) coordinator

    @property
    def _stub(self) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        return self._stubs[self._current]

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def _next_leader(self, error: GraphmeshError) -> None:
        """Where to try next: the leader a standby named, when it is one of ours, else the next address."""
        named = error.metadata.get("leader", "")
        self._current = self.addresses.index(named) if named in self.addresses else \
            (self._current + 1) % len(self.addresses)

    def generate(self, prompt: str = "", *, max_tokens: int = 64, raw: bool = False, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop: Sequence[str] = (),
                 prompt_token_ids: Sequence[int] = (), messages: Sequence[dict[str, str]] = (),
                 ignore_eos: bool = False, model: str = "", parse_special_tokens: bool = False,
                 encoder_input: np.ndarray | None = None,
                 guided: coordinator_pb2.GuidedDecoding | None = None,
                 speculative: coordinator_pb2.SpeculativeDecoding | None = None, logprobs: bool = False,
                 top_logprobs: int = 0) -> Iterator[Chunk]:
        """Streams the completion; raises graphmesh.errors types on a bad request. parse_special_tokens: special
        tokens spelled in the prompt or messages ("<|im_start|>") are control tokens, not text. encoder_input: f32
        [n, input_dim], the features of the prompt's n encoder placeholder tokens (a model with an encoder).
        logprobs: each chunk's tokens' log-probabilities (Chunk.logprobs), with the top_logprobs most likely tokens
        at each position."""
        request = coordinator_pb2.GenerateRequest(
            model=model, prompt=prompt, raw=raw, max_tokens=max_tokens, stop=list(stop), ignore_eos=ignore_eos,
            parse_special_tokens=parse_special_tokens, logprobs=logprobs, top_logprobs=top_logprobs,
            prompt_token_ids=list(prompt_token_ids),
            messages=[coordinator_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
            sampling=stage_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
        if encoder_input is not None:
            request.encoder_input.CopyFrom(tensors.to_proto(np.asarray(encoder_input)))
        if guided is not None:  # a JSON schema, any JSON object, a regex or a grammar the completion must follow
            request.guided.CopyFrom(guided)
        if speculative is not None:  # speculative decoding for this request (unset: the coordinator's default)
            request.speculative.CopyFrom(speculative)
        delivered: list[int] = []  # every token yielded so far: what a resumed request carries
        attempts, broke_at, finished = 0, 0.0, False
        while True:
            del request.resume_token_ids[:]
            request.resume_token_ids.extend(delivered)
            try:
                for r in self._stub.Generate(request, timeout=self.timeout, metadata=self.metadata):
                    if attempts and delivered:
                        self.resumes += 1
                    attempts = 0  # progress: a later break gets the whole resume timeout again
                    first = not delivered  # the prompt is echoed once, however many coordinators served the stream
                    delivered += r.token_ids
                    finished = finished or r.finish_reason != coordinator_pb2.FINISH_REASON_UNSPECIFIED
                    yield Chunk(list(r.token_ids), r.text, FINISH_REASONS.get(r.finish_reason, ""), r.session_id,
                                list(r.prompt_token_ids) if first else [], r.ttft_ms, r.prefill_computed_tokens,
                                list(r.logprobs))
                return
            except grpc.RpcError as e:
                error = from_rpc_error(e)
                if e.code() != grpc.StatusCode.UNAVAILABLE or self.resume_timeout_s <= 0:
                    raise error from e
                if finished:
                    return  # broke after its last message: the completion is whole, and a resume would be refused
                now = time.monotonic()
                broke_at = now if attempts == 0 else broke_at
                if now - broke_at > self.resume_timeout_s:
                    raise error from e
                self._next_leader(error)
                time.sleep(RESUME_BACKOFF_S[min(attempts, len(RESUME_BACKOFF_S) - 1)])
                attempts += 1

    def compute_logits(self, token_ids: Sequence[int], model: str = "") -> np.ndarray:
        try:
            reply = self._stub.ComputeLogits(coordinator_pb2.ComputeLogitsRequest(model=model, token_ids=list(token_ids)),
                                             timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        return tensors.from_proto(reply.logits)

    def status(self) -> coordinator_pb2.StatusResponse:
        """The status of the first coordinator that answers (with several, a standby answers too: ready false)."""
        for i in range(len(self.addresses)):
            stub = self._stubs[(self._current + i) % len(self.addresses)]
            try:
                return stub.Status(coordinator_pb2.StatusRequest(), timeout=30.0, metadata=self.metadata)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or i == len(self.addresses) - 1:
                    raise from_rpc_error(e) from e
        raise AssertionError("unreachable")
