"""Conversion between ``tandem.v1.Tensor`` (raw bytes + dtype + shape) and NumPy."""
from __future__ import annotations

import numpy as np

from tandem.v1 import reward_pb2

_TO_NUMPY = {
    reward_pb2.DATA_TYPE_BOOL: np.dtype(np.bool_),
    reward_pb2.DATA_TYPE_UINT8: np.dtype(np.uint8),
    reward_pb2.DATA_TYPE_INT8: np.dtype(np.int8),
    reward_pb2.DATA_TYPE_INT32: np.dtype("<i4"),
    reward_pb2.DATA_TYPE_INT64: np.dtype("<i8"),
    reward_pb2.DATA_TYPE_FLOAT16: np.dtype("<f2"),
    reward_pb2.DATA_TYPE_FLOAT32: np.dtype("<f4"),
    reward_pb2.DATA_TYPE_FLOAT64: np.dtype("<f8"),
}
_FROM_NUMPY = {(dt.kind, dt.itemsize): code for code, dt in _TO_NUMPY.items()}
# ONNX Runtime's type strings ("tensor(float)") to ours.
_FROM_ORT = {
    "tensor(bool)": reward_pb2.DATA_TYPE_BOOL,
    "tensor(uint8)": reward_pb2.DATA_TYPE_UINT8,
    "tensor(int8)": reward_pb2.DATA_TYPE_INT8,
    "tensor(int32)": reward_pb2.DATA_TYPE_INT32,
    "tensor(int64)": reward_pb2.DATA_TYPE_INT64,
    "tensor(float16)": reward_pb2.DATA_TYPE_FLOAT16,
    "tensor(float)": reward_pb2.DATA_TYPE_FLOAT32,
    "tensor(double)": reward_pb2.DATA_TYPE_FLOAT64,
}


def dtype_name(code: int) -> str:
    """``DATA_TYPE_FLOAT32`` for a DataType code (or the number if unknown)."""
    try:
        return reward_pb2.DataType.Name(code)
    except ValueError:
        return str(code)


def numpy_dtype(code: int) -> np.dtype:
    """NumPy dtype of a DataType code. Raises ValueError for an unknown code."""
    if code not in _TO_NUMPY:
        raise ValueError(f"unsupported dtype {dtype_name(code)}")
    return _TO_NUMPY[code]


def ort_dtype(type_str: str) -> int:
    """DataType code for an ONNX Runtime type string. Raises ValueError if unsupported."""
    if type_str not in _FROM_ORT:
        raise ValueError(f"unsupported ONNX type {type_str}")
    return _FROM_ORT[type_str]


def to_proto(name: str, array: np.ndarray) -> reward_pb2.Tensor:
    """Encodes an array (C order, little-endian) as a Tensor."""
    array = np.asarray(array, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    code = _FROM_NUMPY.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        raise ValueError(f"unsupported dtype {array.dtype}")
    data = array.astype(_TO_NUMPY[code], copy=False).tobytes()
    return reward_pb2.Tensor(name=name, dtype=code, shape=array.shape, data=data)


def from_proto(tensor: reward_pb2.Tensor) -> np.ndarray:
    """Decodes a Tensor without copying its bytes (the array is read-only).

    Raises:
        ValueError: unknown dtype, negative dimension, or a byte length that
            does not match ``prod(shape) * itemsize``; the message names the tensor.
    """
    dtype = numpy_dtype(tensor.dtype)
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor {tensor.name!r}: negative dimension in shape {list(shape)}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
    data = tensor.data  # each read of a bytes field makes a new bytes object (a copy)
    if len(data) != expected:
        raise ValueError(
            f"tensor {tensor.name!r}: {len(data)} bytes, but shape {list(shape)} of "
            f"{dtype_name(tensor.dtype)} needs {expected}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)
