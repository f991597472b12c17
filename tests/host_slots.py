"""A boundary link's two GPU ends (transport.DeviceSender and DeviceReceiver) with their slots in host memory, for
the tests that check the GPU path's layout and protocol without a GPU: a buffer's handle is its index among those
exported, and the receiver "maps" it by taking that very tensor."""

from __future__ import annotations

import json

import pytest
import torch

from graphmesh_executor import transport


class HostSlots:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.exported: list[torch.Tensor] = []

        def export(buffer: torch.Tensor, gpu: str) -> bytes:
            self.exported.append(buffer)
            return json.dumps({"gpu": gpu, "id": len(self.exported) - 1}).encode()
        monkeypatch.setattr(transport, "_export", export)
        monkeypatch.setattr(transport.DeviceReceiver, "_map", lambda receiver, handle: self.exported[handle["id"]])

    def link(self, gpu: str = "GPU-aaaa") -> tuple[transport.DeviceSender, transport.DeviceReceiver]:
        """A new link's sender and receiver."""
        receiver = object.__new__(transport.DeviceReceiver)
        receiver._slots, receiver._torch = {}, torch
        return transport.DeviceSender("cpu", gpu), receiver
