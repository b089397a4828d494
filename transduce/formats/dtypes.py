"""The one table of dtype names. Every tool spells dtypes its own way; transduce speaks numpy's names
("float32", "float16", "bfloat16", "int64", ...) and translates here, without importing any of the tools."""

from __future__ import annotations

from typing import Any

# a precision (an artifact's "precision") -> the dtype of its graphs' float tensors
PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

# ONNX TensorProto.DataType numbers (fixed by the ONNX standard), named as numpy / ml_dtypes name them
ONNX_TYPES = {
    0: "undefined", 1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
    8: "string", 9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 14: "complex64",
    15: "complex128", 16: "bfloat16", 17: "float8_e4m3fn", 18: "float8_e4m3fnuz", 19: "float8_e5m2",
    20: "float8_e5m2fnuz", 21: "uint4", 22: "int4", 23: "float4_e2m1fn",
}
# ONNX Runtime's NodeArg.type strings
ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
             "tensor(double)": "float64", "tensor(int64)": "int64", "tensor(int32)": "int32",
             "tensor(int8)": "int8", "tensor(uint8)": "uint8", "tensor(bool)": "bool"}
# TensorRT's DataType member names
TENSORRT_TYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
                  "BOOL": "bool", "INT8": "int8", "UINT8": "uint8"}
# safetensors' header dtype names
SAFETENSORS_TYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                     "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def precision_dtype(precision: str) -> str:
    """The dtype of a precision's float tensors: fp32 -> float32, fp16 -> float16, bf16 -> bfloat16."""
    return PRECISION_DTYPES[precision]


def onnx_type(elem_type: int) -> str:
    """An ONNX elem_type number -> its dtype name."""
    return ONNX_TYPES.get(int(elem_type), f"onnx type {elem_type}")


def ort_type(type_string: str) -> str:
    """An ONNX Runtime type string ("tensor(float)") -> its dtype name (an unknown one as it is)."""
    return ORT_TYPES.get(type_string, type_string)


def tensorrt_type(dt: Any) -> str:
    """A trt.DataType (or its name) -> its dtype name."""
    name = getattr(dt, "name", str(dt)).split(".")[-1].upper()
    return TENSORRT_TYPES.get(name, name.lower())


def safetensors_type(name: Any) -> str:
    """A safetensors header dtype ("F32") -> its dtype name."""
    return SAFETENSORS_TYPES.get(name, str(name).lower())
