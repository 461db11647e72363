"""Request and response bodies of the /v1 API (docs/api.md).

These models describe the bodies in the OpenAPI schema. At run time the POST bodies are read by
serving/codecs/strict_json.py with the same rules, without walking a million floats in Python: numbers are
strict (no strings, no booleans) and finite, no value is coerced, and shapes are checked
against the bundle.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # strict: ints yes, "1.0" and true no
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # no "1.5", no true
# One example: flat, or nested like the bundle's input shape (up to rank 4: C, H, W, ...).
Example = Union[list[Number], list[list[Number]], list[list[list[Number]]], list[list[list[list[Number]]]]]
Inputs = Annotated[list[Example], Field(min_length=1, description="N examples, each nested like the input shape or flat")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ----------------------------------------------------------------------------- errors, health
class ErrorDetail(BaseModel):
    code: str = Field(description="snake_case, stable")
    message: str


class ErrorEnvelope(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["live", "ready"]


# ----------------------------------------------------------------------------- detect
class DetectRequest(_Body):
    inputs: Inputs
    threshold: Optional[FiniteFloat] = Field(None, description="override of the class's calibrated threshold")


class DetectResult(BaseModel):
    logit: float
    match: bool = Field(description="logit >= threshold")
    probability: float = Field(description="Platt-calibrated σ(a·logit + b)")


class DetectResponse(BaseModel):
    class_id: int
    class_name: str
    threshold: float
    results: list[DetectResult]


# ----------------------------------------------------------------------------- detect over a set of classes
ClassRefItem = Union[Annotated[int, Field(strict=True)], Annotated[str, Field(min_length=1)]]


class DetectSetRequest(_Body):
    inputs: Inputs
    classes: list[ClassRefItem] = Field(min_length=1, description=(
        "1..SLC_MAX_DETECT_CLASSES classes: names (read as a path's {class}: a name, else an id in decimal) "
        "or integer ids (trained 0..D-1, enrolled D + slot); a class named twice is answered twice"))
    threshold: Optional[FiniteFloat] = Field(None, description="override of every class's calibrated threshold")


class DetectSetClass(BaseModel):
    class_id: int
    class_name: str
    threshold: float = Field(description="the threshold its `match` uses")


class DetectSetResponse(BaseModel):
    classes: list[DetectSetClass] = Field(description="the classes resolved, in the request's order")
    results: list[list[DetectResult]] = Field(description="per input, one entry per class of `classes`, in order")


# ----------------------------------------------------------------------------- softmax
class SoftmaxRequest(_Body):
    inputs: Inputs


class SoftmaxResult(BaseModel):
    probability: float = Field(description="softmax over all D logits, entry of the class")
    logit: float
    is_top1: bool


class SoftmaxResponse(BaseModel):
    class_id: int
    class_name: str
    results: list[SoftmaxResult]


# ----------------------------------------------------------------------------- topk
class TopkRequest(_Body):
    inputs: Inputs
    k: int = Field(5, ge=1, strict=True, description="at most the server's max_topk")
    mode: Literal["exact", "index"] = "exact"
    threshold: Optional[FiniteFloat] = Field(None, description="override of every class's calibrated threshold")
    matches_only: bool = Field(False, strict=True, description="answer only the entries that match ([]: none of them)")


class TopkEntry(BaseModel):
    class_id: int
    class_name: str
    logit: float
    match: bool = Field(description="logit >= threshold")
    threshold: float = Field(description="the class's calibrated threshold, or the request's")


class TopkResponse(BaseModel):
    k: int
    mode: Literal["exact", "index"]
    results: list[list[TopkEntry]]
    complete: list[bool] = Field(description="per input: every class that matches is in its list")


# ----------------------------------------------------------------------------- gallery
ItemId = Annotated[str, Field(min_length=1, max_length=256)]


class GalleryItemIn(_Body):
    id: ItemId
    input: Example
    metadata: Optional[dict[str, Any]] = None

    @field_validator("metadata")
    @classmethod
    def _strict_json(cls, v):
        """Stored metadata is answered back later: reject now what cannot be (NaN, lone surrogates)."""
        if v is not None:
            if not _finite(v):
                raise ValueError("metadata holds NaN or infinite numbers")
            try:
                orjson.dumps(v)
            except TypeError as exc:  # e.g. a lone surrogate in a string
                raise ValueError(f"metadata is not strict JSON: {exc}") from None
        return v


def _finite(v) -> bool:
    """No NaN / inf anywhere in a JSON-like value (orjson writes them as null, silently)."""
    if isinstance(v, float):
        return v == v and v not in (float("inf"), float("-inf"))
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    if isinstance(v, list):
        return all(_finite(x) for x in v)
    return True


class GalleryUpsertRequest(_Body):
    items: Annotated[list[GalleryItemIn], Field(min_length=1)]


class GalleryPutRequest(_Body):
    input: Any = Field(..., description="one example (or send an image body, for bundles whose input is an image)")
    metadata: Optional[dict[str, Any]] = None


class GalleryUpsertResponse(BaseModel):
    upserted: int
    ids: list[str]


class GalleryItem(BaseModel):
    id: str
    input: Any
    metadata: Optional[dict[str, Any]] = None


class ClassSearchRequest(_Body):
    limit: int = Field(100, ge=1, le=100_000, strict=True, description="most items returned (best first)")
    threshold: Optional[FiniteFloat] = Field(None, description="override of the class's calibrated threshold")


class SearchHit(BaseModel):
    id: str
    logit: float
    metadata: Optional[dict[str, Any]] = None


class ClassSearchResponse(BaseModel):
    class_id: int
    class_name: str
    threshold: float
    results: list[SearchHit]


class GalleryInfo(BaseModel):
    count: int
    index_kind: str


# ----------------------------------------------------------------------------- admin
class CalibrationReloadRequest(_Body):
    expect_sha256: Optional[str] = Field(None, pattern="^[0-9a-f]{64}$", description="reload only if the folder's "
                                         "calibration.json has this sha256 (as `slc calibrate` prints it)")


class CalibrationReloadResponse(BaseModel):
    reloaded: bool = Field(description="false: the folder holds the calibration already served")
    calibration_sha256: str
    previous_sha256: str
    digest: str = Field(description="sha256 of the manifest.json now served")
    target: dict[str, Any]
    method: Optional[dict[str, Any]] = None
    classes_changed: int = Field(description="classes whose threshold differs from the one served before")
    recalibration: Optional[dict[str, Any]] = Field(None, description="the manifest's note of the recalibration")


# ----------------------------------------------------------------------------- enrolled classes
class EnrollRequest(_Body):
    inputs: Inputs


class Platt(BaseModel):
    a: float
    b: float


class MatchedBy(BaseModel):
    class_id: int
    class_name: str
    examples: int = Field(description="of this request's examples, those its detect says yes to")
    threshold: float = Field(description="the threshold it decided with")


class EnrolledClass(BaseModel):
    class_id: int = Field(description="D + slot: stable, never given to another class")
    class_name: str
    threshold: float = Field(description="detect's default threshold for the class")
    bias: float
    norm: float = Field(description="|row|: the median norm of the trained rows, by the imprinting rule")
    platt: Platt
    examples: int = Field(description="examples the row was computed from")
    rule: str = Field(description="the rule and the threshold's rule, e.g. imprint+global")
    created: float = Field(description="seconds since the epoch when this version was written")
    lookalikes: list[int] = Field(description="class ids its examples resembled: each one said yes to an example, or "
                                  "was an example's best-scoring trained class or best-scoring other enrolled class; "
                                  "GET /v1/classes: those still served, and the classes enrolled later that name it. "
                                  "Of the class and a look-alike, an input matches only the one it passes by more "
                                  "(docs/api.md, Look-alikes)")


class EnrollAnswer(EnrolledClass):
    """PUT /v1/classes/{name} and POST .../examples: the class, and who else says yes to its examples."""

    matched_by: list[MatchedBy] = Field(description="other classes whose own threshold says yes to some of this "
                                        "request's examples, before this write (all of them are among `lookalikes`)")
    matched_by_complete: bool = Field(description="every example's matches were among its 16 best classes")
    lookalike_names: list[Optional[str]] = Field(description="the names of `lookalikes`, in their order, as served "
                                                 "after this write (null: a class no longer served)")


class NotServed(BaseModel):
    reason: str = Field(description="head_changed, model_changed, other_model, unknown_model or unservable")
    count: int = Field(description="live classes of this group in the store")
    message: str
    action: str = Field(description="how to carry them over (the store keeps rows, not examples)")
    model: Optional[dict[str, Any]] = Field(description="the model they were made for, as the store recorded it "
                                            "({manifest_digest} for an older slc's key; null: this model)")
    classes: list[dict[str, Any]] = Field(description="up to 100: class_name, slot, created (re_enrolled: "
                                          "this server serves a class of that name now; problem: why not servable)")


class EnrolledList(BaseModel):
    count: int
    limit: int
    classes: list[EnrolledClass]
    not_served: list[NotServed] = Field(default_factory=list, description="enrolled classes the store holds that "
                                        "this server does not serve, by why (docs/api.md); none is dropped silently")


# ----------------------------------------------------------------------------- model
class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    version: Optional[str] = None
    input: dict[str, Any]
    embed_dim: int
    num_classes: int
    digest: str
    manifest: dict[str, Any] = Field(description="manifest summary (no class list, no file hashes)")
    calibration: dict[str, Any] = Field(description="target, global threshold, per-class summary")
    providers: list[str] = Field(description="onnxruntime execution providers in use")
    device: str
    head_device: dict[str, Any] = Field(description="where the passes over all D classes read the rows: host, or "
                                        "the device (cuda) holding them, its bytes and whether it is healthy")
    head_precision: Optional[dict[str, Any]] = Field(None, description="the head precision serving the passes over "
                                                     "all D classes, the setting, why (asked for, or each precision's "
                                                     "measured cost per input under auto)")
    softmax_impl: str
    index: Optional[dict[str, Any]] = None
    batching: dict[str, Any]


# ----------------------------------------------------------------------------- OpenAPI of the loaded model
FLOAT32_MAX = 3.4028234663852886e38
def example_schema(input_shape: tuple[int, ...]) -> dict:
    """JSON schema of one example of this model: flat (size numbers) or nested exactly like the shape."""
    number = {"type": "number", "minimum": -FLOAT32_MAX, "maximum": FLOAT32_MAX}  # float32 values
    nested: dict = number
    for n in reversed(input_shape):
        nested = {"type": "array", "items": nested, "minItems": n, "maxItems": n}
    size = 1
    for n in input_shape:
        size *= n
    flat = {"type": "array", "items": number, "minItems": size, "maxItems": size}
    return flat if len(input_shape) == 1 else {"anyOf": [flat, nested]}


def describe_model_inputs(openapi: dict, input_shape: tuple[int, ...], max_inputs: int, max_topk: int,
                          model_names: list[str], max_detect_classes: Optional[int] = None) -> dict:
    """The OpenAPI schema with the loaded model's real input shape, the server's limits and the KServe
    model names, so that a client (or a fuzzer) sees exactly what a valid request is."""
    schemas = openapi.get("components", {}).get("schemas", {})
    for path, ops in openapi.get("paths", {}).items():
        for op in ops.values():
            for param in op.get("parameters", []) if "{model}" in path else []:
                if param.get("name") == "model":
                    param["schema"] = {"type": "string", "enum": list(model_names)}
    one = example_schema(tuple(input_shape))
    inputs = {"type": "array", "items": one, "minItems": 1, "maxItems": max_inputs,
              "description": f"1..{max_inputs} examples, each {list(input_shape)} or flat"}
    for name in ("DetectRequest", "DetectSetRequest", "SoftmaxRequest", "TopkRequest", "EnrollRequest"):
        if name in schemas:
            schemas[name]["properties"]["inputs"] = inputs
    if "TopkRequest" in schemas:
        schemas["TopkRequest"]["properties"]["k"]["maximum"] = max_topk
    if "DetectSetRequest" in schemas and max_detect_classes is not None:
        schemas["DetectSetRequest"]["properties"]["classes"]["maxItems"] = max_detect_classes
    if "GalleryItemIn" in schemas:
        schemas["GalleryItemIn"]["properties"]["input"] = one
    if "GalleryUpsertRequest" in schemas:
        schemas["GalleryUpsertRequest"]["properties"]["items"]["maxItems"] = max_inputs
    return openapi
