"""Checks on request fields that hold for every public API (Generate, KServe, OpenAI) before any work starts."""

from __future__ import annotations

import math

from graphmesh.errors import InvalidArgument


def check_finite_sampling(**params: float) -> None:
    """Refuses NaN and infinite sampling parameters (temperature=..., top_p=..., ...): every range check is false
    for NaN, so `temperature < 0` lets it through, and the sampler then turns it into garbage tokens."""
    bad = {name: value for name, value in params.items() if not math.isfinite(value)}
    if bad:
        raise InvalidArgument("sampling parameters must be finite numbers: " +
                              ", ".join(f"{name} {value}" for name, value in bad.items()), "NON_FINITE_SAMPLING",
                              {name: str(value) for name, value in bad.items()})
