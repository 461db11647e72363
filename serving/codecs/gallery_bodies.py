"""Gallery request bodies: bounded before they are parsed, parsed and checked on the gallery's
executor (serving/gallery/executor.py), never on the event loop.

Order, each step bounded by the one before: the body size (BodyLimitMiddleware); counts of
objects, strings, lists and commas on the raw bytes (C speed, nothing allocated) against what
`max_inputs` items and `max_metadata_values` metadata values can hold; then, on a gallery
thread, the parse, the items' fields, each item's metadata walked (depth, integers beyond 2^53,
at most max_metadata_values values, stopping there) and serialised once (at most
max_metadata_bytes; the stored and answered text), and the inputs converted.
"""
from __future__ import annotations

import math
import re
from typing import Any, Optional

import orjson

from serving.codecs import strict_json as read
from serving.errors import InvalidInput

MAX_ID_CHARS = 256
# C0 and C1 control characters (a newline cannot be part of a URL path: an item stored under
# such an id could never be read or deleted) and NUL (PostgreSQL text cannot hold it)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def item_id(value: Any, where: str) -> str:
    """A gallery item id: 1..256 characters, none of them a control character, so that every id
    that can be written can be read and deleted at /v1/gallery/items/{id} (percent-encoded)."""
    item = read.string(value, where, MAX_ID_CHARS)
    if bad := _CONTROL.search(item):
        raise InvalidInput(f"{where} must not contain control characters (found {bad.group()!r} at position "
                           f"{bad.start()}): an id must fit in a URL path", code="validation_error")
    return item


def check_upsert_structure(body: bytes, max_items: int, input_shape: tuple[int, ...], metadata_values: int,
                           what: str = "items") -> None:
    """Refuse, before parsing, a POST /v1/gallery/items (or PUT, max_items=1) body that holds more
    objects, strings, lists or values than max_items items and their metadata can: per item the
    input's values and lists, 4 strings and 3 commas of its own; the metadata's count of each is
    metadata_values (commas inside strings count as values here: a body is read as bytes)."""
    size = math.prod(input_shape)
    lists_per_example = sum(math.prod(input_shape[:i]) for i in range(len(input_shape)))
    read.check_structure(body, max_values=None, what=what, max_lists=1 + max_items * lists_per_example + metadata_values,
                         max_objects=1 + max_items + metadata_values, max_strings=1 + 4 * max_items + metadata_values)
    bound = 1 + max_items * (size + 3) + metadata_values
    if len(body) > read.STRUCTURE_CHECK_BYTES and (values := body.count(b",") + 1) > bound:
        raise InvalidInput(f"the body holds about {values} values; at most {bound} fit ({max_items} {what} of "
                           f"{size} input values, and {metadata_values} metadata values: SLC_MAX_METADATA_VALUES)",
                           code="too_many_inputs")


def upsert_items(obj: dict, max_items: int) -> list[dict]:
    """items [{id, input, metadata?}], checked before any input is converted; last one wins per id."""
    read.check_keys(obj, ("items",), required=("items",))
    items = obj["items"]
    if type(items) is not list or not items:
        raise InvalidInput("items must be a non-empty list of {id, input, metadata?}", code="validation_error")
    if len(items) > max_items:
        raise InvalidInput(f"{len(items)} items in one request; the limit is {max_items}", code="too_many_inputs")
    for k, it in enumerate(items):
        if type(it) is not dict:
            raise InvalidInput(f"items[{k}] must be an object {{id, input, metadata?}}", code="validation_error")
        read.check_keys(it, ("id", "input", "metadata"), required=("id", "input"), where=f"items[{k}]")
        item_id(it["id"], f"items[{k}].id")
        if it.get("metadata") is not None and type(it["metadata"]) is not dict:
            raise InvalidInput(f"items[{k}].metadata must be an object or null", code="validation_error")
    return list({it["id"]: {"metadata": None, **it} for it in items}.values())


def metadata_json(metadata: Any, source: bytes, where: str, max_values: int, max_bytes: int) -> Optional[bytes]:
    """An item's metadata (an object or None) checked and serialised once: the text the gallery
    stores and answers. The walk stops at max_values values; the text is at most max_bytes."""
    if metadata is None:
        return None
    if type(metadata) is not dict:
        raise InvalidInput(f"{where} must be a JSON object or null", code="validation_error")
    read.check_metadata(metadata, source, where, max_values=max_values)
    text = orjson.dumps(metadata)
    if len(text) > max_bytes:
        raise InvalidInput(f"{where} is {len(text)} bytes as JSON; the limit is {max_bytes} (SLC_MAX_METADATA_BYTES)",
                           code="metadata_too_large")
    return text


def read_upsert(body: bytes, settings, input_shape: tuple[int, ...]) -> tuple[list[dict], Any]:
    """(items with their `metadata_json`, their inputs converted [N, *shape]) of a POST
    /v1/gallery/items body whose structure was bounded already. Runs on a gallery thread."""
    items = upsert_items(read.parse_object(body), settings.max_inputs)
    for k, it in enumerate(items):
        it["metadata_json"] = metadata_json(it["metadata"], body, f"items[{k}].metadata", settings.max_metadata_values,
                                            settings.max_metadata_bytes)
    x = read.examples([it["input"] for it in items], input_shape, settings.max_inputs, read.has_bool_token(body),
                      what="item inputs")
    return items, x


def read_put(body: bytes, item: str, settings, input_shape: tuple[int, ...]) -> tuple[list[dict], Any]:
    """`read_upsert` of a PUT /v1/gallery/items/{id} JSON body {input, metadata?}."""
    obj = read.parse_object(body)
    read.check_keys(obj, ("input", "metadata"), required=("input",))
    it = {"id": item, "input": obj["input"], "metadata": obj.get("metadata")}
    it["metadata_json"] = metadata_json(it["metadata"], body, "metadata", settings.max_metadata_values,
                                        settings.max_metadata_bytes)
    x = read.examples([it["input"]], input_shape, settings.max_inputs, read.has_bool_token(body), what="item inputs")
    return [it], x
