"""Request bodies read cheaply and strictly, before any per-value work.

Order of checks, each bounded by the one before: the body size (BodyLimitMiddleware, while it
is read), the JSON parse (orjson, in C), the number of examples (`max_inputs`), then ONE
vectorised conversion of all examples to a numpy array (C: rejects ragged rows), whose dtype
says whether every value was a number. Only when it was not (or when the body holds a JSON
boolean) does a Python walk look for the first few bad positions, to name them; it stops at
the third. No value is coerced: strings, booleans and null are not numbers, 7.9 is not an
integer, NaN and Infinity are refused.
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterator, Optional

import numpy as np
import orjson

from serving.bundle.calibration import FLOAT32_MAX  # one bound for inputs and every number a bundle keeps
from serving.errors import BadRequest, InvalidInput

_NONFINITE_LITERAL = re.compile(rb"(?<![\w\"])-?(NaN|Infinity)(?![\w\"])")
_BOOL_TOKEN = re.compile(rb"(?<![\w\"])(true|false)(?![\w\"])")
_LONG_INT = re.compile(rb"(?<![\w.\"+-])-?\d{16,}(?![\w.])")
MAX_EXACT_INT = 2**53
SHOWN = 3  # bad positions named in one message


def parse_object(body: bytes) -> dict:
    """The body as a JSON object: 400 malformed_json, 422 for NaN/Infinity literals or a non-object."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "surrogate" in str(exc):  # valid JSON grammar, but no Unicode string: it could not be answered back
            raise InvalidInput(f"strings must be valid Unicode ({exc})", code="validation_error") from None
        if _NONFINITE_LITERAL.search(body) or b"infinity when parsed" in str(exc).encode():
            raise InvalidInput("numbers must be finite (NaN, Infinity and overflowing literals are refused)",
                               code="non_finite_value") from None
        raise BadRequest(f"request body is not valid JSON ({exc})", code="malformed_json") from None
    if type(obj) is not dict:
        raise InvalidInput(f"the body must be a JSON object, got {_json_type(obj)}", code="validation_error")
    return obj


def has_bool_token(body: bytes) -> bool:
    """Whether a JSON true/false may be in the body (a cheap scan; strings can cause a false yes)."""
    # one-byte tests first (memchr): a body of numbers under keys such as "inputs" has no r or l
    return (((b"r" in body and b"true" in body) or (b"l" in body and b"false" in body))
            and _BOOL_TOKEN.search(body) is not None)


MAX_METADATA_DEPTH = 64


def check_metadata(metadata: Any, body: bytes, where: str, max_values: Optional[int] = None) -> None:
    """Metadata is answered back as it came: nesting deeper than MAX_METADATA_DEPTH and integers
    beyond ±2^53 (which JSON readers do not keep exactly) are refused. orjson keeps 64-bit integers
    as int; longer literals become floats, so an integral float that large sends us to the raw
    body for an integer literal of exactly that value (1e20 written as such is a float, and kept).
    With `max_values`, more values (lists and objects included) than that are refused too, the walk
    stopping there."""
    stack = [(metadata, 1)]
    seen = 0
    while stack:
        v, depth = stack.pop()
        seen += 1
        if max_values is not None and seen > max_values:
            raise InvalidInput(f"{where} holds more than {max_values} values", code="metadata_too_large")
        if depth > MAX_METADATA_DEPTH:
            raise InvalidInput(f"{where} is nested deeper than {MAX_METADATA_DEPTH} levels", code="validation_error")
        if type(v) is dict:
            stack.extend((x, depth + 1) for x in v.values())
        elif type(v) is list:
            stack.extend((x, depth + 1) for x in v)
        elif (type(v) is int and abs(v) > MAX_EXACT_INT) or (
                type(v) is float and v.is_integer() and abs(v) > MAX_EXACT_INT and long_int_literal(body, v)):
            shown = v if type(v) is int else long_int_literal(body, v)
            raise InvalidInput(f"{where}: integer {shown} is beyond ±2^53, which JSON numbers do not keep exactly; "
                               "send it as a string", code="validation_error")


def long_int_literal(body: bytes, value: Optional[float] = None) -> Optional[str]:
    """The first integer literal beyond ±2^53 in the body (JSON parsers turn it into a float);
    with `value`, the first one that parses to that float."""
    for m in _LONG_INT.finditer(body):
        n = int(m.group())
        if abs(n) > MAX_EXACT_INT and (value is None or float(n) == value):
            return m.group().decode()
    return None


def check_keys(obj: dict, allowed: tuple[str, ...], required: tuple[str, ...] = (), where: str = "body") -> None:
    if extra := [k for k in obj if k not in allowed]:
        raise InvalidInput(f"{where}: unknown field {extra[0]!r} (fields: {', '.join(allowed)})", code="validation_error")
    if missing := [k for k in required if k not in obj]:
        raise InvalidInput(f"{where}: field {missing[0]!r} is required", code="validation_error")


# ----------------------------------------------------------------------------- scalars
def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", str: "a string", list: "a list", dict: "an object", int: "an integer",
            float: "a number"}.get(type(v), type(v).__name__)


def number(obj: dict, key: str, default: Optional[float] = None) -> Optional[float]:
    """A JSON number (int or float, not a boolean or a string), finite; `default` when absent or null."""
    if obj.get(key) is None:
        return default
    v = obj[key]
    if type(v) not in (int, float):
        raise InvalidInput(f"{key} must be a number, got {_json_type(v)}", code="validation_error")
    if not math.isfinite(v):  # pragma: no cover - orjson never yields one; kept for other callers
        raise InvalidInput(f"{key} must be finite, got {v}", code="non_finite_value")
    return float(v)


def integer(obj: dict, key: str, default: int, lo: int, hi: Optional[int] = None, code: str = "validation_error") -> int:
    """A JSON integer in [lo, hi]. As in JSON Schema, 5.0 is the integer 5; 7.9, "5" and true are refused."""
    if key not in obj:
        return default
    v = obj[key]
    if type(v) is float and v.is_integer():
        v = int(v)
    if type(v) is not int:
        raise InvalidInput(f"{key} must be an integer, got {_json_type(v)}" + (f" ({v})" if type(v) is float else ""),
                           code="validation_error")
    if v < lo or (hi is not None and v > hi):
        raise InvalidInput(f"{key}={v} is outside {lo}..{hi if hi is not None else '∞'}",
                           code=code if v > lo else "validation_error")
    return v


def choice(obj: dict, key: str, default: str, choices: tuple[str, ...]) -> str:
    v = obj.get(key, default)
    if type(v) is not str or v not in choices:
        raise InvalidInput(f"{key} must be one of {', '.join(choices)}; got {v!r}", code="validation_error")
    return v


def string(value: Any, where: str, max_len: int) -> str:
    if type(value) is not str or not 1 <= len(value) <= max_len:
        raise InvalidInput(f"{where} must be a string of 1..{max_len} characters, got {_json_type(value)}",
                           code="validation_error")
    return value


# ----------------------------------------------------------------------------- examples
def examples(inputs: Any, shape: tuple[int, ...], max_inputs: int, bools_possible: bool = True, what: str = "inputs") -> np.ndarray:
    """A list of examples (each nested like `shape`, or flat) -> float32 [N, *shape], strictly."""
    if type(inputs) is not list:
        raise InvalidInput(f"{what} must be a list of examples, got {_json_type(inputs)}", code="validation_error")
    if not inputs:
        raise InvalidInput(f"{what} is empty", code="shape_mismatch")
    if len(inputs) > max_inputs:
        raise InvalidInput(f"{len(inputs)} {what} in one request; the limit is {max_inputs}", code="too_many_inputs")
    size = math.prod(shape)
    for i, ex in enumerate(inputs):  # O(N) with N <= max_inputs: bounds each example's top level
        if type(ex) is not list or len(ex) not in (size, shape[0]):
            got = f"{len(ex)} values at the top level" if type(ex) is list else _json_type(ex)
            raise InvalidInput(f"{what}[{i}]: an example is a list of {size} numbers or nested as {list(shape)}; "
                               f"got {got}", code="shape_mismatch")
    for i, ex in enumerate(inputs):  # a body of non-numbers is refused before any conversion
        first = ex
        while type(first) is list and first:
            first = first[0]
        if type(first) not in (int, float):
            _refuse_bad_values(ex, f"{what}[{i}]")
    try:
        arr = np.array(inputs)  # C: infers the dtype, refuses ragged nesting
    except (ValueError, OverflowError):
        arr = None
    if arr is not None and arr.dtype.kind in "iuf":
        out = _shaped(arr, shape, size, what)
        if bools_possible:  # a boolean among numbers becomes 1.0 in numpy: look for one, in C
            _refuse_booleans(inputs, what)
        return out
    _refuse_bad_values(inputs, what)  # strings, null, objects: named
    try:  # only numbers left (integers too large for int64 made an object array)
        arr = np.array(inputs, dtype=np.float64)
    except (ValueError, OverflowError):
        raise InvalidInput(f"{what}: examples must be rectangular: every example {list(shape)} or {size} flat values",
                           code="shape_mismatch") from None
    return _shaped(arr, shape, size, what)


def _shaped(arr: np.ndarray, shape: tuple[int, ...], size: int, what: str) -> np.ndarray:
    if arr.shape[1:] != shape:
        if arr.ndim == 2 and arr.shape[1] == size:
            arr = arr.reshape((arr.shape[0],) + shape)
        else:
            raise InvalidInput(f"{what}: each example must have shape {list(shape)} or {size} flat values; "
                               f"got {list(arr.shape[1:])}", code="shape_mismatch")
    if arr.dtype.kind == "f" and arr.size and not np.abs(arr).max() <= FLOAT32_MAX:  # rounding must not save it
        raise InvalidInput(f"{what} must be finite float32 values (|x| > {FLOAT32_MAX:.6g} found)", code="non_finite_value")
    with np.errstate(over="ignore"):
        out = arr.astype(np.float32)
    if not np.isfinite(out).all():
        raise InvalidInput(f"{what} must be finite float32 values (|x| > {FLOAT32_MAX:.6g} found)", code="non_finite_value")
    return out


def _refuse_booleans(values: list, what: str) -> None:
    """Among values numpy read as numbers, find JSON booleans without a Python loop over the values:
    orjson writes the (already parsed, number-or-boolean) lists back, and `true`/`false` can then only
    be booleans. Only the first example holding one is walked, to name the positions."""
    if b"true" not in (text := orjson.dumps(values)) and b"false" not in text:
        return
    for i, ex in enumerate(values):
        text = orjson.dumps(ex)
        if b"true" in text or b"false" in text:
            _refuse_bad_values(ex if type(ex) is list else [ex], f"{what}[{i}]")


def _refuse_bad_values(inputs: list, what: str) -> None:
    """Name the first few values that are not numbers (a walk that stops at the SHOWN-th)."""
    bad: list[str] = []
    for parent, i, v in _leaves(inputs, what):
        if type(v) is float or (type(v) is int and abs(v) <= FLOAT32_MAX):
            continue
        kind = "a number beyond float32" if type(v) is int else _json_type(v)
        bad.append(f"{parent}[{i}] is {kind}" + (f" ({v[:20]!r})" if type(v) is str else ""))
        if len(bad) == SHOWN:
            break
    if bad:
        raise InvalidInput(f"values must be numbers: {'; '.join(bad)}", code="validation_error")


def _leaves(value: list, path: str) -> Iterator[tuple[str, int, Any]]:
    """(path of the parent list, index, leaf) in order, without recursion (the nesting depth is
    the client's) and without building a path string per leaf."""
    stack = [(path, enumerate(value))]
    while stack:
        parent, items = stack[-1]
        for i, x in items:
            if type(x) is list:
                stack.append((f"{parent}[{i}]", enumerate(x)))
                break
            yield parent, i, x
        else:
            stack.pop()


def tensor_values(data: Any, name: str, kind: str, bools_possible: bool) -> np.ndarray:
    """KServe JSON tensor data (flat or nested) of kind "float", "int" or "bool", strictly: 7.9 is
    not an INT64, "1.5" is not an FP32, true is only a BOOL."""
    if type(data) is np.ndarray:  # float data serving/codecs/fast_json.py read: flat, numbers, |x| < 2^53
        return data
    if type(data) is not list:
        raise InvalidInput(f"input {name!r}: data must be a list, got {_json_type(data)}", code="validation_error")
    try:
        arr = np.array(data)
    except (ValueError, OverflowError):
        arr = None
    wanted = {"float": "iuf", "int": "iu", "bool": "b"}[kind]
    if arr is not None and arr.dtype.kind in wanted:
        if bools_possible and kind != "bool":
            _refuse_booleans([data], f"input {name!r} data")
        return arr  # (an int tensor of floats goes on to the walk: 7.9 is refused there)
    ok = {"float": lambda v: type(v) in (int, float),
          "int": lambda v: type(v) is int or (type(v) is float and v.is_integer()),  # 7.0 is 7, as in JSON Schema
          "bool": lambda v: type(v) is bool}[kind]
    bad = []
    for parent, i, v in _leaves(data, f"input {name!r} data"):
        if not ok(v):
            bad.append(f"{parent}[{i}] is {_json_type(v)}" + (f" ({v})" if type(v) is float else ""))
            if len(bad) == SHOWN:
                break
    if bad:
        raise InvalidInput(f"values must be {kind}s: {'; '.join(bad)}", code="validation_error")
    if kind == "int" and arr is not None and arr.dtype.kind == "f":  # integral floats only, checked above
        if arr.size and not np.abs(arr).max() < 2.0**63:
            raise InvalidInput(f"input {name!r}: values outside the range of a 64-bit integer", code="validation_error")
        return arr.astype(np.int64)
    if arr is None or arr.dtype.kind not in wanted:
        raise InvalidInput(f"input {name!r}: data must be a rectangular (nested) list", code="shape_mismatch")
    return arr


STRUCTURE_CHECK_BYTES = 64 * 1024  # smaller bodies parse in well under a millisecond: named errors instead


def check_structure(body: bytes, max_values: Optional[int], max_lists: int, max_objects: int,
                    what: str = "inputs", max_strings: Optional[int] = None) -> None:
    """Refuse, before parsing, a large body that holds more objects, lists or values than any valid
    one can: counting bytes is C-speed and allocates nothing, while parsing a million nested lists
    takes the event loop for the better part of a second. (Strings can only inflate the counts of
    a body that is refused anyway: no string field of these bodies holds brackets or commas.)"""
    if len(body) <= STRUCTURE_CHECK_BYTES:
        return
    if body.count(b"{") > max_objects:
        raise InvalidInput("the body holds objects where only numbers belong", code="validation_error")
    if max_strings is not None and body.count(b'"') // 2 > max_strings:  # escaped quotes only inflate it
        raise InvalidInput(f"the body holds more strings than {what} can (where only numbers belong)",
                           code="validation_error")
    if body.count(b"[") > max_lists:
        raise InvalidInput(f"{what}: more lists than the examples allowed in one request can hold (too many examples, "
                           "or nesting deeper than the input shape)", code="shape_mismatch")
    values = body.count(b",") + 1 if max_values is not None else 0
    if max_values is not None and values > max_values:
        raise InvalidInput(f"the body holds about {values} values; at most {max_values} fit ({what} limit × input size)",
                           code="too_many_inputs")
