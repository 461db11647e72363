"""Server settings (docs/configuration.md): SLC_* environment variables, overridden by CLI flags.

Every limit the server enforces lives here, so an operator can read one file to know
what a request may cost.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from serving.bundle.home import slc_home


class Settings(BaseSettings):
    """`Settings(**overrides)`: keyword arguments win over SLC_* variables, which win over defaults."""

    model_config = SettingsConfigDict(env_prefix="SLC_", extra="ignore")

    # --- what to serve
    bundle: Optional[Path] = Field(None, description="bundle directory; None = the embedded default model")
    home: Path = Field(default_factory=slc_home, description="SLC_HOME: default bundle and data live here")
    data_dir: Optional[Path] = Field(None, description="gallery and index cache; default $SLC_HOME/data")
    verify: bool = Field(True, description="re-hash every bundle file at start; a mismatch means never ready")
    bundles: list[str] = Field(default_factory=list, description=(
        "more bundles served beside SLC_BUNDLE (the default model), each under its own name: `PATH` (its "
        "manifest's name) or `NAME=PATH`; a JSON list in the variable (`slc serve A B C` on the command line)"))
    model_repository: Optional[Path] = Field(None, description=(
        "a folder of bundle folders (a model repository): each served at start under its folder's name, and "
        "loadable / unloadable by name through POST /v2/repository/models/{name}/load | unload"))

    # --- network
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: Optional[SecretStr] = Field(None, description="when set, write routes need `Authorization: Bearer KEY` or `X-API-Key: KEY`")
    allow_open_writes: bool = Field(False, description=(
        "accept gallery writes without an API key on a non-loopback host (anyone who reaches the port may write); "
        "without it, a server on such a host with no SLC_API_KEY answers every write 403"))

    # --- batching (serving/core/batcher.py)
    max_batch: int = Field(64, ge=1, description="inputs per backbone call")
    max_delay_ms: float = Field(2.0, ge=0, description="how long the first queued input waits for others to join its batch")
    adaptive_delay: bool = Field(True, description="skip the max_delay wait when no other request is on its way "
                                 "(every request inside the server already waits in the batcher): no added latency at low load")
    queue_size: int = Field(1024, ge=1, description="queued INPUTS (not requests) before new requests get 429; an empty queue always admits one request")
    request_timeout_s: float = Field(10.0, gt=0, description="per-request deadline from the moment its body is read, "
                                     "queue and compute included; past it the request gets 504, not a late answer")

    # --- transport limits (serving/http/transport.py, serving/http/body_limit.py)
    header_timeout_s: float = Field(10.0, gt=0, description="a request whose headers have not arrived by then gets 408 and "
                                    "the connection is closed (also a connection that never sends a request)")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body that has not fully arrived by then gets 408")
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="request headers larger than this get 431")
    drain_delay_s: float = Field(0.0, ge=0, description="on SIGTERM: readiness turns 503 at once, requests are still "
                                 "accepted for this long (load balancers see it), then the server stops accepting")

    # --- request limits (serving/http/body_limit.py)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="413 beyond this, counted while the body is read")
    max_inputs: int = Field(256, ge=1, description="examples per request (inputs, gallery items); 422 beyond")
    max_topk: int = Field(1000, ge=1)
    max_detect_classes: int = Field(1000, ge=1, description="classes one POST /v1/detect may name; 422 beyond "
                                    "(its cost is those classes' rows: C dot products per input)")

    http: bool = Field(True, description="serve HTTP (/v1, /v2, /metrics); off: gRPC alone (needs grpc_port)")
    grpc_port: Optional[int] = Field(None, ge=0, le=65535, description=(
        "also serve KServe v2 over gRPC on this port (needs slc[grpc]); unset: HTTP only"))
    grpc_max_concurrent_rpcs: int = Field(32, ge=1, description=(
        "gRPC calls in progress at once (their request messages buffered included), over every connection; "
        "more get RESOURCE_EXHAUSTED at once"))
    grpc_max_streams_per_connection: int = Field(16, ge=1, description=(
        "HTTP/2 streams one gRPC connection may open at once (SETTINGS_MAX_CONCURRENT_STREAMS); more are refused"))
    grpc_idle_timeout_s: float = Field(300.0, gt=0, description=(
        "a gRPC connection with no call in progress for this long is closed"))
    grpc_max_connection_age_s: float = Field(3600.0, gt=0, description=(
        "a gRPC connection is asked to close (GOAWAY) after this long, and closed "
        "request_timeout_s later whatever it holds: no connection keeps buffers forever"))

    # --- storage (serving/gallery/)
    gallery_max_bytes: Optional[int] = Field(None, ge=65536, description="quota of the SQLite gallery; a write "
                                             "past it (or on a full disk) is answered 507 and nothing is written")
    gallery_url: Optional[str] = Field(None, pattern=r"^postgres(ql)?://", description=(
        "postgresql://… : keep the gallery in a PostgreSQL shared by every replica (needs slc[postgres]); "
        "default: SQLite under data_dir, for one process"))
    gallery_threads: int = Field(4, ge=1, le=64, description=(
        "threads of the gallery's own executor: its database calls and the parsing and serialising of gallery "
        "bodies run there, never on the event loop or beside image decoding (a frozen database only slows "
        "gallery routes)"))
    gallery_queue_size: int = Field(64, ge=1, description=(
        "gallery calls waiting or running at once; more get 429 with Retry-After"))
    max_enrolled_classes: int = Field(100_000, ge=0, description=(
        "enrolled classes (PUT /v1/classes/{name}) a bundle may have at once, over every replica; creating one more "
        "is answered 507 enrolled_limit and nothing is written (replacing one is always allowed)"))
    max_class_examples: int = Field(4096, ge=1, description=(
        "examples an enrolled class may be made from, over every PUT and POST /v1/classes/{name}/examples: their "
        "embeddings are kept with the class (n x d float32) so that added examples give exactly the row of "
        "enrolling all at once; beyond it, 422 too_many_examples"))
    enrolled_sync_s: float = Field(0.5, gt=0, le=60, description=(
        "how often a server asks the store for enrollments made by other processes (a second replica on the "
        "same SQLite data_dir or PostgreSQL): another replica's enrolled class is served here within this time "
        "(plus the time of one read); this process's own enrollments are served as soon as they are answered"))
    enroll_rule: Literal["auto", "imprint", "standardised", "fitted"] = Field("auto", description=(
        "how an enrolled class's row is made from its examples' embeddings (serving/core/enrollment.py): imprint = "
        "their normalised mean at the trained rows' median norm, the median trained bias; standardised = the same "
        "direction centred on the calibration negatives' mean, scaled and shifted so that its logits on the "
        "negatives spread as a typical trained class's do (uncentred, a new row scores every image high); fitted = "
        "an L2-regularised logistic regression of the examples against the calibration negatives, scaled as "
        "standardised, with a threshold of its own cross-fitted on the examples against the negatives at the "
        "bundle's target precision (needs 2 examples or more; SLC_ENROLL_THRESHOLD does not apply to it); "
        "auto = fitted where the bundle carries calibration negatives (standardised for a class of one "
        "example), else imprint"))
    enroll_threshold: Literal["global", "negatives"] = Field("global", description=(
        "the threshold of an enrolled class: global = the bundle's global calibrated threshold (calibration.json "
        "`global`; PoLS logits are comparable across classes); negatives = the lowest logit at which the class "
        "reaches the bundle's target precision against its calibration negatives (calibration_embeddings.npy), "
        "the examples standing in for the positives; bundles without negatives keep the global threshold. Under "
        "global, a class whose global threshold rejects every one of its own examples gets the negatives rule"))
    lookalikes: Literal["exclusive", "trained", "off"] = Field("exclusive", description=(
        "how detect decides between a class and its look-alikes (the trained and enrolled classes an enrolled "
        "class's examples resembled, stored with it; and the pairs a folded bundle's calibration.json carries): "
        "exclusive = an input matches only the one of a pair whose logit passes its threshold by more (a tie: "
        "both); trained = the same, but two enrolled classes each decide alone; off = every class by its own "
        "logit and threshold alone; the look-alikes are stored and listed under every value"))
    max_metadata_bytes: int = Field(1024 * 1024, ge=2, description=(
        "an item's metadata as compact JSON (as the server stores and answers it) at most this long; 422 beyond"))
    max_metadata_values: int = Field(131072, ge=1, description=(
        "values, lists and objects in the metadata of one gallery request: counted on the raw body before it is "
        "parsed (commas inside strings count as values there) and again per item after; 422 beyond"))

    # --- compute
    device: Literal["auto", "cpu", "cuda"] = "auto"
    intra_op_threads: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    softmax_impl: Literal["auto", "numpy", "ort", "ort_pair", "packed_pair", "onnx", "device"] = Field(
        "auto", description="how all D logits are computed (softmax, exact top-k): a chunked pass over the head with "
        "numpy's GEMM or onnxruntime's, or two one-thread onnxruntime GEMMs taking chunks in turn (ort_pair; "
        "packed_pair: each chunk's rows pre-packed once, a second copy of the head; both with two or more "
        "intra-op threads), or full.onnx; auto = the least cost per input at warm-up (batches of 8 and max_batch; "
        "near ties to onnx, numpy, ort, packed_pair, ort_pair in that order; heads of at most 2^18 weights take "
        "that order untimed; packed_pair and onnx only for heads of at most 64 Mi weights); device = the float32 head "
        "resident on the execution device, only what each request answers with copied back (a candidate of auto "
        "with --device cuda; on the CPU only when named)")
    class_index: Literal["auto", "exact", "flat", "ivf", "hnsw"] = Field(
        "auto", description="the class index behind topk mode=index: auto = flat up to 50,000 classes, else ivf "
        "(hnsw when ivf misses its recall or speed target), built at start and cached under data_dir; on CUDA "
        "(float32 head, softmax_impl auto or device) auto = exact, the device's exact top-k; exact = no "
        "index, the same pass as mode=exact (nothing to build: a head too large to index within the start-up "
        "budget serves at once)")
    head_precision: Literal["float32", "int8", "bf16", "auto"] = Field(
        "float32", description="the head the passes over all D classes read (softmax, exact top-k, all logits): the "
        "float32 rows, or the bundle's int8 / bf16 copy (slc bundle quantize; docs/bundle-format.md). The top-k "
        "and the asked class's logit are re-scored on the float32 rows; all logits are then the quantized ones. "
        "Detect always reads its float32 row. auto: every head the bundle carries is timed at warm-up on the "
        "runtime's device and the fastest serves, never one slower than float32; int8 / bf16 asked for are "
        "served as asked (float32 timed beside them); GET /v1/model head_precision says which serves and why")
    concurrent_batches: int = Field(2, ge=1, le=2, description=(
        "batches computed at once, each in a worker thread of its own: backbone-only requests (detect, v2 single "
        "logits) are batched apart from passes over the head and start beside a running pass instead of waiting "
        "for it; passes and index searches still run one at a time; 1: one batch at a time, in arrival order "
        "(always 1 on CUDA or with one intra-op thread)"))
    one_thread_max_batch: Union[Literal["auto"], int] = Field("auto", description=(
        "backbone batches of up to this many inputs run on a one-thread onnxruntime session instead of the "
        "intra-op pool (waking the pool costs more than a small batch's work); auto = timed at warm-up (the "
        "largest of 1, 2, 4, ..., 32 where one thread is faster: a noisy choice on a busy machine), 0 = always "
        "the pool. Pin it to make replicas behave alike (GET /v1/model shows the value in use). Only on the "
        "CPU, with two or more intra-op threads, for a backbone graph of at most 64 MiB"))
    inline_max_ms: float = Field(0.5, ge=0, description=(
        "a backbone-only batch (detect, v2, gallery writes) whose measured cost is under this runs on the event "
        "loop instead of the worker thread, whose hop costs more; 0: always the worker"))
    warmup: bool = True

    # --- image bodies (serving/codecs/image_decoder.py)
    decode_workers: int = Field(2, ge=1, le=64, description=(
        "processes decoding image bodies, started with a bundle that takes images: a decode runs in one of them "
        "so that it can be stopped (its process killed) when it runs past decode_budget_s"))
    decode_queue: int = Field(64, ge=0, description="image bodies that may wait for a decode process; more get 429")
    decode_budget_s: float = Field(2.0, gt=0, description=(
        "time one image body may take to decode; past it the process is killed and replaced, and the request gets "
        "422 image_decode_timeout"))

    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("gallery_url", mode="before")
    @classmethod
    def _empty_url_is_unset(cls, value):
        """SLC_GALLERY_URL= (empty, as in deploy/k8s/base/slc.env) means SQLite."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value):
        return value.lower() if isinstance(value, str) else value

    @field_validator("one_thread_max_batch")
    @classmethod
    def _one_thread_range(cls, v):
        if v != "auto" and not 0 <= v <= 4096:
            raise ValueError(f"one_thread_max_batch must be auto or 0..4096, got {v}")
        return v

    @model_validator(mode="after")
    def _pairs_need_two_threads(self) -> "Settings":
        if self.softmax_impl in ("ort_pair", "packed_pair") and self.intra_op_threads < 2:
            raise ValueError(f"softmax_impl {self.softmax_impl} needs intra_op_threads >= 2 "
                             "(its two GEMMs run one thread each)")
        return self

    @model_validator(mode="after")
    def _something_to_serve(self) -> "Settings":
        if not self.http and self.grpc_port is None:
            raise ValueError("http is off (--no-http, SLC_HTTP) and no grpc_port is set (--grpc-port, SLC_GRPC_PORT): "
                             "nothing would be served")
        return self

    @model_validator(mode="after")
    def _one_model_per_gallery_url(self) -> "Settings":
        """A PostgreSQL gallery holds one model's items: a second model would take them for items stored
        under an old bundle and re-embed them as its own (a lost write)."""
        if self.gallery_url and (self.bundles or self.model_repository is not None):
            raise ValueError("SLC_GALLERY_URL (--gallery-url) keeps the gallery of one model: serve one bundle with it, "
                             "or several without it (each model keeps its gallery and enrolled classes under "
                             "DATA_DIR/models/NAME)")
        return self

    @model_validator(mode="after")
    def _resolve_paths(self) -> "Settings":
        self.home = Path(self.home).expanduser()
        if self.data_dir is None:
            self.data_dir = self.home / "data"
        self.data_dir = Path(self.data_dir).expanduser()
        if self.bundle is not None:
            self.bundle = Path(self.bundle).expanduser()
        if self.model_repository is not None:
            self.model_repository = Path(self.model_repository).expanduser()
        return self

    def api_key_value(self) -> Optional[str]:
        return self.api_key.get_secret_value() if self.api_key else None

    def open_writes_refused(self) -> bool:
        """No API key on a host others can reach, and open writes not allowed: writes get 403."""
        return not self.api_key_value() and not self.allow_open_writes and not is_loopback(self.host)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host`: localhost, 127.0.0.0/8, ::1 (0.0.0.0 and :: are every address)."""
    import ipaddress

    if host.strip().lower() in ("localhost", "localhost.", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False
