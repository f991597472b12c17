"""The encoder group: a LLaVA-style projector, features [rows, input_dim] -> embeddings [rows, hidden].

Its rows replace the input embeddings of the prompt's placeholder tokens (EncoderConfig.token_id), in order:
the first stage takes them as its `encoded` and `encoded_mask` inputs (graphmesh.models.llama, encoded=True).
  inputs:  features f32[rows, input_dim]
  params:  encoder.fc1.weight [intermediate, input_dim], encoder.fc1.bias [intermediate],
           encoder.fc2.weight [output_dim, intermediate], encoder.fc2.bias [output_dim] (HF Linear layout)
  outputs: encoded f32[rows, output_dim] = fc2(gelu(fc1(features))), GELU exact (erf)
dtype="bf16"/"f16" keeps params and compute in that dtype, as a llama stage does; input and output stay f32.
"""

from __future__ import annotations

from graphmesh import dtypes
from graphmesh.errors import InvalidArgument
from graphmesh.graph import GraphBuilder, Value
from graphmesh.models.config import EncoderConfig, encoder_config
from graphmesh.ops import TensorType
from graphmesh.v1 import graph_pb2

__all__ = ["EncoderConfig", "build_encoder", "encoder_config", "encoder_params"]

DTYPES = ("f32", "bf16", "f16")


def _linear(g: GraphBuilder, x: Value, prefix: str, n: int, k: int, name: str | None = None) -> Value:
    """x [rows, k] @ W.T + b, W stored [n, k] as in HF; params in x's dtype."""
    y = g.matmul(x, g.param(prefix + ".weight", (n, k), x.dtype), transpose_b=True)
    return g.node("add", [y, g.param(prefix + ".bias", (n,), x.dtype)], name=name)


def build_encoder(enc: EncoderConfig, rows: int, dtype: str = "f32") -> graph_pb2.Graph:
    """The encoder graph over `rows` feature rows (one per placeholder token it fills)."""
    if rows < 1:
        raise InvalidArgument(f"an encoder graph needs at least one row, got {rows}", "BAD_SHAPE")
    if dtype not in DTYPES:
        raise InvalidArgument(f"encoder dtype must be one of {DTYPES}, not {dtype!r}", "UNSUPPORTED_DTYPE")
    g = GraphBuilder(f"encoder_r{rows}" + ("" if dtype == "f32" else f"_{dtype}"))
    features = g.input("features", (rows, enc.input_dim))
    x = g.cast(features, dtype) if dtype != "f32" else features
    h = g.gelu(_linear(g, x, "encoder.fc1", enc.intermediate_size, enc.input_dim), "none")
    # The output is named "encoded" (the first stage's input it feeds); it is f32 like a stage's hidden_out,
    # and the first stage rounds it to its own dtype.
    if dtype == "f32":
        g.output(_linear(g, h, "encoder.fc2", enc.output_dim, enc.intermediate_size, "encoded"))
    else:
        y = _linear(g, h, "encoder.fc2", enc.output_dim, enc.intermediate_size)
        g.output(g.node("cast", [y], name="encoded", dtype="f32"))
    return g.build()


def encoder_params(enc: EncoderConfig) -> dict[str, TensorType]:
    """The params the encoder graph declares (checkpoint names) and their f32 types."""
    proto = build_encoder(enc, 1)
    return {p.name: TensorType(dtypes.from_proto(p.type.dtype), tuple(p.type.shape)) for p in proto.params}
