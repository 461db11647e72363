"""Arrays of numbers read out of JSON bodies without a Python float per value.

orjson makes one Python float per number and numpy then reads them back one by one: for the
784 values of one default-model example that is the largest part of a detect request's own
work on the event loop. simdjson (C++) parses the body and copies an array of numbers straight
into a float64 buffer.

A fast path only: it answers a body whose examples are plainly flat arrays of numbers and whose
objects have unique keys, and says None for anything else (booleans, strings or null among the
numbers, nesting, ragged examples, duplicate keys, a byte-order mark, magnitudes from 2^53 up, any
parse error). Such a body then goes through the strict reader (serving/codecs/strict_json.py), which names
the error; a body both can read gives the same float32 values either way
(tests/serving/test_fast_json.py checks this against the strict reader, on fuzzed bodies too).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import simdjson

BOM = b"\xef\xbb\xbf"  # orjson refuses it, simdjson would skip it
EXACT = 2.0 ** 53  # beyond: an integer literal's float32 rounding may differ between the two readers
ERRORS = (ValueError, TypeError, RuntimeError, UnicodeDecodeError, KeyError, IndexError)
_FLOAT_TYPES = ("FP16", "FP32", "FP64")


def query(body: bytes, shape: tuple[int, ...], max_inputs: int, lists: tuple[str, ...] = ()) -> Optional[dict]:
    """A /v1 query body {"inputs": [[flat example], ...], other scalar fields} -> its fields, with
    "inputs" as float32 [N, *shape]; None when the strict reader must read it. `lists`: fields that
    may also be a flat list of scalars (detect's `classes`), answered as a Python list."""
    if body.startswith(BOM):
        return None
    try:
        return _query(simdjson.Parser().parse(body), body, shape, max_inputs, lists)
    except ERRORS:
        return None


def _query(doc: Any, body: bytes, shape: tuple[int, ...], max_inputs: int, lists: tuple[str, ...]) -> Optional[dict]:
    keys = unique_keys(doc)
    if keys is None:
        return None
    fields = {key: doc[key] for key in keys}  # (items() would turn arrays into lists)
    flat = [k for k in lists if type(fields.get(k)) is simdjson.Array]
    for k in flat:  # a flat list of scalars (a nested one is the strict reader's: one '[' too many below)
        fields[k] = fields[k].as_list()
    if any(type(v) in (simdjson.Array, simdjson.Object) for k, v in fields.items() if k != "inputs"):
        return None
    examples = fields.get("inputs")
    n, size = (len(examples), math.prod(shape)) if type(examples) is simdjson.Array else (0, 0)
    # 1 + n (+ the flat lists) brackets in the whole body: no array inside an example, none elsewhere
    if not 1 <= n <= max_inputs or body.count(b"[") != 1 + n + len(flat):
        return None
    if any(type(ex) is not simdjson.Array or len(ex) != size for ex in examples):
        return None
    values = numbers(examples, n * size)
    if values is None:
        return None
    fields["inputs"] = values.reshape((n, *shape)).astype(np.float32)
    return fields


def infer(body: bytes) -> Optional[tuple[dict, bool]]:
    """A KServe v2 infer JSON body as orjson reads it, except that the `data` of an FP16/FP32/FP64
    tensor given flat is a float64 array (float32 for FP32), and whether a JSON boolean is in
    it anywhere; None when the strict reader must read it."""
    if body.startswith(BOM):
        return None
    try:
        return _infer(simdjson.Parser().parse(body), body)
    except ERRORS:
        return None


def _infer(doc: Any, body: bytes) -> Optional[tuple[dict, bool]]:
    keys = unique_keys(doc)
    tensors = doc.get("inputs") if keys is not None else None
    if type(tensors) is not simdjson.Array:
        return None
    out = {key: plain(doc[key]) if key != "inputs" else [] for key in keys}  # the document's order
    lists, bools = census([v for k, v in out.items() if k != "inputs"])  # (this list counts 1, as "inputs")
    for t in tensors:
        tensor = _tensor(t)
        if tensor is None:
            return None
        more, bools_here = census(list(tensor.values()))
        lists, bools = lists + more - 1, bools or bools_here  # (- the list made here)
        out["inputs"].append(tensor)
    # every '[' of the body is an array seen here: none nested in a data array, none inside a string
    return (out, bools) if body.count(b"[") == lists else None


def _tensor(t: Any) -> Optional[dict]:
    """One input tensor as orjson reads it, float data as an array when given flat (float32 for FP32)."""
    if type(t) is not simdjson.Object:
        return None
    datatype, data = t.get("datatype"), t.get("data")
    if type(data) is not simdjson.Array or type(datatype) is not str or datatype.upper() not in _FLOAT_TYPES:
        return t.as_dict()  # no float data to read (duplicate keys: the last wins, as in orjson)
    keys = unique_keys(t)  # get() above read the first of duplicates
    values = numbers(data, len(data)) if keys is not None else None  # flat: checked by the bracket count
    if values is None:
        return None
    tensor = {key: plain(t[key]) for key in keys if key != "data"}
    tensor["data"] = values.astype(np.float32) if datatype.upper() == "FP32" else values
    return tensor


def numbers(array: Any, count: int) -> Optional[np.ndarray]:
    """float64 [count] of an array of numbers (simdjson flattens nested arrays: callers rule them out);
    None unless every magnitude is below 2^53."""
    values = np.frombuffer(array.as_buffer(of_type="d"), dtype=np.float64)
    # one BLAS call: any |v| >= 2^53 makes the sum >= 2^106 (a large sum without one only means the strict path)
    if values.size != count or not float(values @ values) < EXACT * EXACT:
        return None
    return values


def unique_keys(obj: Any) -> Optional[list[str]]:
    """The keys of a simdjson object; None when it is not one or a key repeats (simdjson's obj[key]
    is the first of duplicate keys, orjson keeps the last: leave those to orjson)."""
    if type(obj) is not simdjson.Object:
        return None
    keys = list(obj.keys())
    return keys if len(set(keys)) == len(keys) else None


def plain(value: Any) -> Any:
    """A simdjson value as Python objects (duplicate keys: the last wins, as in orjson)."""
    if type(value) is simdjson.Array:
        return value.as_list()
    if type(value) is simdjson.Object:
        return value.as_dict()
    return value


def census(value: Any) -> tuple[int, bool]:
    """(how many lists a plain JSON value holds, itself included, a data array counting as one;
    whether a boolean is among its values)."""
    lists, bools, stack = 0, False, [value]
    while stack:
        v = stack.pop()
        kind = type(v)
        if kind is list:
            lists += 1
            stack += v
        elif kind is dict:
            stack += v.values()
        elif kind is np.ndarray:  # float data read here: stands for its one array
            lists += 1
        elif kind is bool:
            bools = True
    return lists, bools
