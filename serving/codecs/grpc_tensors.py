"""KServe v2 tensors of a gRPC `ModelInferRequest` -> numpy, checked as the HTTP body's are
(serving/codecs/v2_tensors.py): `raw_input_contents` (what tritonclient sends) or typed `contents`,
counted before anything is converted. Reads protobuf messages; imports no gRPC."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from serving.codecs.v2_tensors import DTYPES, FLOATS
from serving.errors import InvalidInput

_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
             "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents"}



def decode_tensors(request, max_values: int = 1 << 28, max_int_values: int = 1 << 16) -> dict[str, tuple[np.ndarray, str]]:
    """ModelInferRequest inputs -> {name: (array shaped as declared, datatype)}, checked as over HTTP;
    a tensor may hold at most `max_values` values, typed integer or bool contents `max_int_values`."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs", code="validation_error")
    names = [t.name for t in request.inputs]
    if unknown := [n for n in names if n not in ("input", "class_id")]:
        raise InvalidInput(f"unknown input tensor {unknown[0]!r}; the models take 'input' (and 'class_id')",
                           code="unknown_input")
    if len(set(names)) != len(names):
        raise InvalidInput("an input tensor is given twice", code="validation_error")
    tensors = {}
    for i, t in enumerate(request.inputs):
        dt = t.datatype.upper()
        if dt not in DTYPES or dt == "FP16":
            raise InvalidInput(f"input {t.name!r}: datatype {t.datatype!r} is not supported", code="unsupported_datatype")
        shape = [int(s) for s in t.shape]
        if any(s < 0 for s in shape):
            raise InvalidInput(f"input {t.name!r}: negative dimension in shape {shape}", code="shape_mismatch")
        count = math.prod(shape)  # Python ints: no overflow
        if count > max_values:
            raise InvalidInput(f"input {t.name!r}: shape {shape} holds more values than a request may",
                               code="too_many_inputs")
        if raw:
            itemsize = np.dtype(DTYPES[dt]).itemsize
            if len(raw[i]) != count * itemsize:
                raise InvalidInput(f"input {t.name!r}: {len(raw[i])} bytes for shape {shape} {dt}", code="shape_mismatch")
            arr = np.frombuffer(raw[i], dtype=DTYPES[dt])
        else:
            arr = _typed_contents(t, dt, count, shape, max_int_values)
        try:
            arr = arr.reshape(shape)
        except ValueError:  # e.g. [0, 2^62]: no values, and a dimension numpy cannot hold
            raise InvalidInput(f"input {t.name!r}: shape {shape} cannot be held (a dimension is too large)",
                               code="shape_mismatch") from None
        if dt in FLOATS and not np.isfinite(arr).all():
            raise InvalidInput(f"input {t.name!r}: NaN or infinite values", code="non_finite_value")
        tensors[t.name] = (arr, dt)
    return tensors


_FIXED = {"FP32": (6, "<f4"), "FP64": (7, "<f8")}  # field number in InferTensorContents, wire dtype


def _typed_contents(t, dt: str, count: int, shape: list[int], max_int_values: int) -> np.ndarray:
    """A tensor's typed `contents` as a flat array, counted before anything is converted: FP32 and FP64
    straight from their packed wire bytes (a few ms for 2 M values, against 0.3 s element by
    element); integers and booleans (class ids: at most max_int_values) element by element."""
    values = getattr(t.contents, _CONTENTS[dt])
    if len(values) != count:  # len() of a repeated field: no conversion
        raise InvalidInput(f"input {t.name!r}: {len(values)} values for shape {shape}", code="shape_mismatch")
    if dt in _FIXED:
        field, wire = _FIXED[dt]
        data = _packed_field(t.contents.SerializeToString(), field)
        if data is not None and len(data) == count * np.dtype(wire).itemsize:
            return np.frombuffer(data, dtype=wire).astype(DTYPES[dt], copy=False)
        return np.fromiter(values, dtype=DTYPES[dt], count=count)  # (not written packed: never seen)
    if count > max_int_values:
        raise InvalidInput(f"input {t.name!r}: {count} {dt} values; integer and bool tensors hold class ids, at most "
                           f"{max_int_values}", code="too_many_inputs")
    if dt == "BOOL":
        return np.fromiter(values, dtype=np.bool_, count=count)
    arr = np.fromiter(values, dtype=np.uint64 if dt.startswith("U") else np.int64, count=count)
    info = np.iinfo(DTYPES[dt])
    if count and (arr.min() < info.min or arr.max() > info.max):
        raise InvalidInput(f"input {t.name!r}: values outside the range of {dt}", code="validation_error")
    return arr.astype(DTYPES[dt])


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def _packed_field(buf: bytes, number: int) -> Optional[bytes]:
    """The payload of length-delimited field `number` of a serialised message (the packed repeated
    field as protobuf writes it), None when absent or not alone of its number. Fields are few:
    one per contents kind."""
    pos, found = 0, None
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 2:
            size, pos = _varint(buf, pos)
            if key >> 3 == number:
                if found is not None:
                    return None
                found = buf[pos:pos + size]
            pos += size
        elif wire == 0:
            _, pos = _varint(buf, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            return None
    return found


