"""Model graph builders: one stage graph per contiguous span of layers, dispatched on ModelConfig.arch."""

from __future__ import annotations

from graphmesh import dtypes
from graphmesh.errors import InvalidArgument
from graphmesh.models import gpt2, llama
from graphmesh.models.config import ModelConfig
from graphmesh.models.llama import PagedLayout
from graphmesh.ops import TensorType
from graphmesh.v1 import graph_pb2

__all__ = ["WEIGHTS", "ModelConfig", "PagedLayout", "build_stage", "quantizable", "stage_params"]

# The weight formats a stage serves (StageSpec.weights, the coordinator's --weights), each the activations its
# dequant_matmuls take (build_stage's packed_activations); f32 dequantizes the checkpoint instead.
WEIGHTS = {"f32": "", "packed": "f32", "packed-bf16": "bf16", "packed-q8": "q8"}


def quantizable(config: ModelConfig) -> bool:
    """Whether the family's stages can consume packed GGUF blocks (dequant_matmul): the llama family's."""
    return config.arch != "gpt2"


def build_stage(config: ModelConfig, layers: range, seq_len: int, cache_len: int, first: bool, last: bool,
                sample: bool = False, name: str | None = None, quantized: bool = False,
                packed_schemes: dict[str, str] | None = None, packed_activations: str = "f32", dtype: str = "f32",
                paged: PagedLayout | None = None, encoded: bool = False) -> graph_pb2.Graph:
    """The stage graph for `layers` (global indices); see graphmesh.models.llama for the I/O contract. With
    `paged`, the batched form: seq_len token rows over paged.seqs sequences, cache_len ignored (the pools'
    size is paged.pool_rows). With `encoded` (the first stage of a llama-family model with an encoder), two
    more inputs, encoded and encoded_mask, whose rows replace input embeddings."""
    if layers.step != 1 or not 0 <= layers.start <= layers.stop <= config.n_layers:
        raise InvalidArgument(f"layers {layers} are not a contiguous span of the model's {config.n_layers} layers",
                              "BAD_LAYER_RANGE")
    if paged is not None:
        cache_len = paged.pool_rows
        if paged.seqs < 1 or paged.blocks < 1 or paged.pool_blocks < 1 or seq_len < paged.seqs or \
                (paged.decode and seq_len != paged.seqs):
            raise InvalidArgument(f"bad paged layout {paged} for {seq_len} token rows", "BAD_SHAPE")
    if seq_len < 1 or cache_len < seq_len:
        raise InvalidArgument(f"seq_len {seq_len} must be >= 1 and fit in cache_len {cache_len}", "BAD_SHAPE")
    if config.arch == "gpt2":
        if encoded:
            raise InvalidArgument("encoded stages (an encoder's rows as input embeddings) exist for the llama family "
                                  "only", "UNSUPPORTED_MODEL")
        if quantized and not quantizable(config):
            raise InvalidArgument("quantized stages exist for the llama family only", "UNSUPPORTED_MODEL")
        return gpt2.build_stage(config, layers, seq_len, cache_len, first, last, sample, name, dtype, paged)
    return llama.build_stage(config, layers, seq_len, cache_len, first, last, sample, name, quantized, packed_schemes,
                             dtype, packed_activations, paged, encoded)


def stage_params(config: ModelConfig, layers: range, first: bool, last: bool, quantized: bool = False,
                 packed_schemes: dict[str, str] | None = None) -> dict[str, TensorType]:
    """The params a stage declares (HF names, global layer indices) and their types."""
    proto = build_stage(config, layers, 1, 1, first, last, quantized=quantized, packed_schemes=packed_schemes)
    return {p.name: TensorType(dtypes.from_proto(p.type.dtype), tuple(p.type.shape)) for p in proto.params}
