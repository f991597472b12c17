"""Dtype names, numpy dtypes and proto enum values, in one table."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from graphmesh.v1 import tensor_pb2

# name -> (numpy dtype, proto enum). bf16 comes from ml_dtypes: numpy has none.
_TABLE: dict[str, tuple[np.dtype, tensor_pb2.Dtype.ValueType]] = {
    "f64": (np.dtype(np.float64), tensor_pb2.DTYPE_F64),
    "f32": (np.dtype(np.float32), tensor_pb2.DTYPE_F32),
    "f16": (np.dtype(np.float16), tensor_pb2.DTYPE_F16),
    "bf16": (np.dtype(ml_dtypes.bfloat16), tensor_pb2.DTYPE_BF16),
    "i64": (np.dtype(np.int64), tensor_pb2.DTYPE_I64),
    "i32": (np.dtype(np.int32), tensor_pb2.DTYPE_I32),
    "u8": (np.dtype(np.uint8), tensor_pb2.DTYPE_U8),
    "bool": (np.dtype(np.bool_), tensor_pb2.DTYPE_BOOL),
}

DTYPE_NAMES: tuple[str, ...] = tuple(_TABLE)
FLOAT_DTYPES = frozenset({"f64", "f32", "f16", "bf16"})
INT_DTYPES = frozenset({"i64", "i32", "u8"})


class DTypeError(ValueError):
    """An unknown or unsupported dtype."""


def check(name: str) -> str:
    if name not in _TABLE:
        raise DTypeError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)}")
    return name


def to_numpy(name: str) -> np.dtype:
    return _TABLE[check(name)][0]


def to_proto(name: str) -> tensor_pb2.Dtype.ValueType:
    return _TABLE[check(name)][1]


def from_proto(value: int) -> str:
    for name, (_, enum) in _TABLE.items():
        if enum == value:
            return name
    raise DTypeError(f"unknown dtype enum value {value} (DTYPE_UNSPECIFIED or out of range)")


def from_numpy(dtype: np.dtype) -> str:
    for name, (np_dtype, _) in _TABLE.items():
        if np_dtype == dtype:
            return name
    raise DTypeError(f"numpy dtype {dtype} has no graphmesh dtype")


def itemsize(name: str) -> int:
    return int(to_numpy(name).itemsize)
