"""A KServe v2 infer body -> (request fields, checked input tensors), shared by HTTP (serving/http/v2.py)
and, for the datatype tables, gRPC (serving/grpc/server.py).

Three readers give the same answer for every body they all read (tests/serving/test_v2_tensors.py):
- `read_common`: the usual body (the tensors `input` FP32 and `class_id` given flat as JSON, nothing
  else unusual) in one pass over simdjson's document; None for anything else, never an error.
- `fast_json.infer` + `parse_infer_request` + `decode_inputs`: any body whose float data is plain.
- orjson (serving/codecs/strict_json.py) + the same checks: everything else, with the errors named.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import simdjson

from serving.codecs import fast_json

from serving.codecs import strict_json as read
from serving.errors import SlcError, BadRequest, InvalidInput

DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}
FLOATS = {"FP16", "FP32", "FP64"}
INTS = {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}
Tensors = dict[str, tuple[np.ndarray, str]]  # {name: (array shaped as declared, datatype)}


def read_infer(body: bytes, binary: bytes, max_inputs: int, input_shape: tuple[int, ...]) -> tuple[dict, Tensors]:
    """(request fields id / parameters / outputs, checked tensors) of an infer body's JSON part."""
    check_structure(body, max_inputs, input_shape)
    common = read_common(body, binary)
    if common is not None:
        return common
    fast = fast_json.infer(body)  # float data as arrays, no float objects; None: the strict reader
    obj, bools = fast if fast is not None else (read.parse_object(body), read.has_bool_token(body))
    req = parse_infer_request(obj)
    return req, decode_inputs(req["inputs"], binary, bools)


def split_binary(header_len: Optional[bytes], body: bytes) -> tuple[bytes, bytes]:
    """(JSON header, raw tensors) of a binary-extension body; (body, b"") without the header."""
    if header_len is None:
        return body, b""
    try:
        n = int(header_len)
    except ValueError:
        raise BadRequest("Inference-Header-Content-Length must be an integer", code="malformed_request") from None
    if not 0 <= n <= len(body):
        raise BadRequest("Inference-Header-Content-Length is larger than the body", code="malformed_request")
    return body[:n], body[n:]


def check_structure(body: bytes, max_inputs: int, input_shape: tuple[int, ...]) -> None:
    """Bounds on the JSON header's raw bytes before it is parsed: the values of `input` and `class_id`
    for max_inputs examples, with room for the rest of the request."""
    per_example = math.prod(input_shape)
    nested = sum(math.prod(input_shape[:i]) for i in range(len(input_shape)))
    read.check_structure(body, max_values=max_inputs * (per_example + 1) + 4096,
                         max_lists=4096 + max_inputs * (1 + nested), max_objects=4096, what="inputs")


# ----------------------------------------------------------------------------- the usual body, one pass
_REQUEST_KEYS = frozenset({"id", "parameters", "inputs", "outputs"})
_JSON_KEYS = {"name", "shape", "datatype", "data"}
_BINARY_KEYS = {"name", "shape", "datatype", "parameters"}
# ids the strict reader also takes: within the datatype and within int64 (it reads JSON integers as int64)
_INT_RANGES = {dt: (int(np.iinfo(DTYPES[dt]).min), min(int(np.iinfo(DTYPES[dt]).max), 2 ** 63 - 1)) for dt in INTS}


def read_common(body: bytes, binary: bytes = b"") -> Optional[tuple[dict, Tensors]]:
    """What `read_infer` answers for a body whose two tensors are `input` and `class_id`, each either
    {name, shape, datatype, data} with flat JSON data that fits its shape (`input` FP32, `class_id`
    an integer type), or {name, shape, datatype, parameters: {binary_data_size}} with its bytes in
    `binary` (read by the general decoder); None for any other body, valid or not (the general
    readers then answer it, errors named). Never raises."""
    if body.startswith(fast_json.BOM):
        return None
    try:
        return _common(simdjson.Parser().parse(body), body, binary)
    except (*fast_json.ERRORS, AttributeError, SlcError):  # (AttributeError: a safety net, never expected)
        return None


def _common(doc: Any, body: bytes, binary: bytes) -> Optional[tuple[dict, Tensors]]:
    keys = fast_json.unique_keys(doc)
    if keys is None or not _REQUEST_KEYS.issuperset(keys):
        return None
    given = doc["inputs"]  # (KeyError when absent: None)
    if type(given) is not simdjson.Array or len(given) != 2:
        return None
    fields = {key: fast_json.plain(doc[key]) for key in keys if key != "inputs"}
    req = _request_fields(fields)  # (an error: None, and the general reader names it)
    tensors: Tensors = {}
    offset, json_data, json_input = 0, 0, False
    for t in given:
        name, tensor, used = _common_tensor(t, binary, offset)
        if name in tensors:
            return None
        tensors[name] = tensor
        if used is None:
            json_data, json_input = json_data + 1, json_input or name == "input"
        else:
            offset += used
    if set(tensors) != {"input", "class_id"}:
        return None
    if json_input:  # numbers() flattens nested arrays: every '[' must be the inputs, a shape or a data array
        lists, _ = fast_json.census(list(fields.values()))  # (the list made here stands for `inputs`)
        if body.count(b"[") != lists + 2 + json_data:
            return None
    return req, tensors


def _common_tensor(t: Any, binary: bytes, offset: int) -> tuple[str, tuple[np.ndarray, str], Optional[int]]:
    """(name, (array, datatype), bytes of `binary` used or None for JSON data) of one usual tensor;
    raises KeyError for anything else."""
    if type(t) is not simdjson.Object or len(t) != 4:  # (len: no repeated key)
        raise KeyError
    keys = set(t.keys())
    name, datatype, shape = t["name"], t["datatype"], t["shape"]
    if type(name) is not str or type(datatype) is not str or type(shape) is not simdjson.Array:
        raise KeyError
    shape, dt = shape.as_list(), datatype.upper()
    if not all([type(s) is int and s >= 0 for s in shape]):
        raise KeyError
    if keys == _BINARY_KEYS:  # the general decoder, on the one kind of parameters it reads
        params = t["parameters"]
        if type(params) is not simdjson.Object or list(params.keys()) != ["binary_data_size"]:
            raise KeyError
        plain = {"name": name, "shape": shape, "datatype": datatype, "parameters": params.as_dict()}
        arr, dt, used = _decode_one(plain, binary, offset, False)
        return name, (arr, dt), used
    if keys != _JSON_KEYS:
        raise KeyError
    data = t["data"]
    if type(data) is not simdjson.Array or math.prod(shape) != len(data):  # (a string has a len() too)
        raise KeyError
    count = len(data)
    if name == "input" and dt == "FP32":
        values = fast_json.numbers(data, count)
        if values is None:
            raise KeyError
        return name, (values.astype(np.float32).reshape(shape), dt), None
    if name == "class_id" and dt in INTS:
        ids = data.as_list()
        low, high = _INT_RANGES[dt]
        if not all([type(i) is int and low <= i <= high for i in ids]):
            raise KeyError
        return name, (np.array(ids, dtype=DTYPES[dt]).reshape(shape), dt), None
    raise KeyError


# ----------------------------------------------------------------------------- the general checks
def _field(obj: dict, key: str, types: tuple, where: str, what: str, required: bool = False):
    """obj[key] when its type is one of `types` (exactly: a bool is not an int), None when absent and allowed."""
    value = obj.get(key)
    if value is None:
        if required:
            raise InvalidInput(f"{where}{key}: field required", code="validation_error")
        return None
    if type(value) not in types:
        raise InvalidInput(f"{where}{key}: must be {what}", code="validation_error")
    return value


def parse_infer_request(obj: dict) -> dict:
    """The infer body's fields, typed as the InferRequest model says (strict: nothing coerced)."""
    req = {"id": _field(obj, "id", (str,), "", "a string"),
           "parameters": _field(obj, "parameters", (dict,), "", "an object"),
           "inputs": _field(obj, "inputs", (list,), "", "a list of tensors", required=True),
           "outputs": _field(obj, "outputs", (list,), "", "a list of {name, parameters?}")}
    if not req["inputs"]:
        raise InvalidInput("inputs: must hold at least one tensor", code="validation_error")
    for i, t in enumerate(req["inputs"]):
        where = f"inputs[{i}]."
        if type(t) is not dict:
            raise InvalidInput(f"inputs[{i}]: must be an object {{name, shape, datatype, data}}", code="validation_error")
        _field(t, "name", (str,), where, "a string", required=True)
        _field(t, "datatype", (str,), where, "a string", required=True)
        _field(t, "parameters", (dict,), where, "an object")
        shape = _field(t, "shape", (list,), where, "a list of integers", required=True)
        if any(type(s) is not int for s in shape):
            raise InvalidInput(f"{where}shape: must be a list of integers (got {shape!r:.80})", code="validation_error")
    _check_outputs(req["outputs"])
    return req


def _request_fields(obj: dict) -> dict:
    """id, parameters and outputs, checked as parse_infer_request checks them."""
    req = {"id": _field(obj, "id", (str,), "", "a string"),
           "parameters": _field(obj, "parameters", (dict,), "", "an object"),
           "outputs": _field(obj, "outputs", (list,), "", "a list of {name, parameters?}")}
    _check_outputs(req["outputs"])
    return req


def _check_outputs(outputs: Optional[list]) -> None:
    for i, o in enumerate(outputs or ()):
        if type(o) is not dict:
            raise InvalidInput(f"outputs[{i}]: must be an object {{name, parameters?}}", code="validation_error")
        _field(o, "name", (str,), f"outputs[{i}].", "a string", required=True)
        o.setdefault("parameters", None)
        _field(o, "parameters", (dict,), f"outputs[{i}].", "an object")


def decode_inputs(inputs: list[dict], binary: bytes, bools_possible: bool) -> Tensors:
    """Checked tensors from parse_infer_request's inputs."""
    tensors: Tensors = {}
    offset = 0
    names = [t["name"] for t in inputs]
    if unknown := [n for n in names if n not in ("input", "class_id")]:
        raise InvalidInput(f"unknown input tensor {unknown[0]!r}; the models take 'input' (and 'class_id')",
                           code="unknown_input")
    if len(set(names)) != len(names):
        raise InvalidInput("an input tensor is given twice", code="validation_error")
    for t in inputs:
        arr, dt, used = _decode_one(t, binary, offset, bools_possible)
        offset += used
        tensors[t["name"]] = (arr, dt)
    return tensors


def _decode_one(t: dict, binary: bytes, offset: int, bools_possible: bool) -> tuple[np.ndarray, str, int]:
    """One input tensor -> (array shaped as declared, datatype, bytes of the binary part it used):
    raw bytes at `offset` of the binary part when it has binary_data_size, else its JSON data."""
    name, shape = t["name"], t["shape"]
    dt = t["datatype"].upper()
    if dt not in DTYPES:
        raise InvalidInput(f"input {name!r}: datatype {t['datatype']!r} is not supported", code="unsupported_datatype")
    if min(shape, default=0) < 0:
        raise InvalidInput(f"input {name!r}: negative dimension in shape {shape}", code="shape_mismatch")
    count = math.prod(shape)  # Python ints: no overflow
    size = (t.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0 or offset + size > len(binary):
            raise BadRequest(f"input {name!r}: binary_data_size does not fit the body", code="malformed_request")
        if size != count * np.dtype(DTYPES[dt]).itemsize:
            raise InvalidInput(f"input {name!r}: {size} bytes for shape {shape} {dt}", code="shape_mismatch")
        arr = np.frombuffer(binary, dtype=DTYPES[dt], count=count, offset=offset)
    else:
        arr = _json_values(t, dt, count, bools_possible)
    try:
        arr = arr.reshape(shape)
    except ValueError:
        raise InvalidInput(f"input {name!r}: data does not fit shape {shape}", code="shape_mismatch") from None
    finite = size is None and type(t.get("data")) is np.ndarray  # JSON data fast_json read: numbers below 2^53
    if dt in FLOATS and not finite and not np.isfinite(arr).all():
        raise InvalidInput(f"input {name!r}: NaN or infinite values", code="non_finite_value")
    return arr, dt, 0 if size is None else size


def _json_values(t: dict, dt: str, count: int, bools_possible: bool) -> np.ndarray:
    """A tensor's JSON `data` (flat or nested) as a flat array of its datatype, nothing coerced."""
    name = t["name"]
    if t.get("data") is None:
        raise InvalidInput(f"input {name!r} has no data", code="missing_input")
    kind = "float" if dt in FLOATS else "int" if dt in INTS else "bool"
    arr = read.tensor_values(t["data"], name, kind, bools_possible)
    if kind == "int" and arr.dtype != DTYPES[dt]:  # an int64 array already fits INT64
        info = np.iinfo(DTYPES[dt])
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise InvalidInput(f"input {name!r}: values outside the range of {dt}", code="validation_error")
        arr = arr.astype(DTYPES[dt])
    if arr.size != count:
        raise InvalidInput(f"input {name!r}: {arr.size} values for shape {t['shape']}", code="shape_mismatch")
    return arr


def tensor_bytes(datatype: str, arr: np.ndarray) -> bytes:
    """An output tensor's raw bytes as the protocol carries them: row-major little-endian values, or
    for BYTES each element's 4-byte little-endian length then its UTF-8 bytes (Triton's layout)."""
    if datatype != "BYTES":
        return np.ascontiguousarray(arr).tobytes()
    parts = []
    for item in arr.reshape(-1).tolist():
        raw = item.encode() if isinstance(item, str) else bytes(item)
        parts += (len(raw).to_bytes(4, "little"), raw)
    return b"".join(parts)
