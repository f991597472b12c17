"""What the torch backend's modules share about tensors: the dtypes by graphmesh's names, and the attribute that
keeps values derived from a tensor on it."""

from __future__ import annotations

import torch

Tensor = torch.Tensor
TORCH_DTYPES: dict[str, torch.dtype] = {
    "f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "i64": torch.int64, "i32": torch.int32, "u8": torch.uint8, "bool": torch.bool,
}
# Values derived from a tensor that every layer reads (the positions: rope tables, masks), each computed once
# and kept in its __dict__ under this name. They live exactly as long as the tensor, which is never written in place.
MEMO = "_graphmesh_memo"
