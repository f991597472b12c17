"""Concurrent streams against a coordinator, each one's tokens collected: the load the fault tests run a mesh under."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from graphmesh.coordinator_client import CoordinatorClient


def run_streams(address: str, requests: Sequence[dict[str, Any]], progress: list[int] | None = None) -> list[list[int]]:
    """Each of `requests` (CoordinatorClient.generate's arguments) as a stream of its own, all at once: the token ids
    of each, in order. progress[i], when given, counts the tokens stream i has had so far (a fault can wait on it)."""
    def one(i: int) -> list[int]:
        out: list[int] = []
        with CoordinatorClient(address) as client:
            for chunk in client.generate(**requests[i]):
                out += chunk.token_ids
                if progress is not None:
                    progress[i] = len(out)
        return out

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, range(len(requests))))
