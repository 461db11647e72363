"""Server settings (docs/configuration.md): SLC_* environment variables, overridden by CLI flags.

Every limit the server enforces lives here, so an operator can read one file to know
what a request may cost.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

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

    # --- network
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: Optional[SecretStr] = Field(None, description="when set, write routes need `Authorization: Bearer KEY` or `X-API-Key: KEY`")

    # --- batching (serving/batcher.py)
    max_batch: int = Field(64, ge=1, description="inputs per backbone call")
    max_delay_ms: float = Field(2.0, ge=0, description="how long the first queued input waits for others to join its batch")
    adaptive_delay: bool = Field(True, description="skip the max_delay wait when no other request is on its way "
                                 "(every request inside the server already waits in the batcher): no added latency at low load")
    queue_size: int = Field(1024, ge=1, description="queued INPUTS (not requests) before new requests get 429; an empty queue always admits one request")
    request_timeout_s: float = Field(10.0, gt=0, description="per-request deadline from the moment its body is read, "
                                     "queue and compute included; past it the request gets 504, not a late answer")

    # --- transport limits (serving/protocol.py, serving/errors.py)
    header_timeout_s: float = Field(10.0, gt=0, description="a request whose headers have not arrived by then gets 408 and "
                                    "the connection is closed (also a connection that never sends a request)")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body that has not fully arrived by then gets 408")
    max_header_bytes: int = Field(64 * 1024, ge=1024, description="request headers larger than this get 431")
    drain_delay_s: float = Field(0.0, ge=0, description="on SIGTERM: readiness turns 503 at once, requests are still "
                                 "accepted for this long (load balancers see it), then the server stops accepting")

    # --- request limits (serving/errors.py)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="413 beyond this, counted while the body is read")
    max_inputs: int = Field(256, ge=1, description="examples per request (inputs, gallery items); 422 beyond")
    max_topk: int = Field(1000, ge=1)

    grpc_port: Optional[int] = Field(None, ge=0, le=65535, description=(
        "also serve KServe v2 over gRPC on this port (needs slc[grpc]); unset: HTTP only"))

    # --- storage (serving/gallery/)
    gallery_max_bytes: Optional[int] = Field(None, ge=65536, description="quota of the SQLite gallery; a write "
                                             "past it (or on a full disk) is answered 507 and nothing is written")
    gallery_url: Optional[str] = Field(None, pattern=r"^postgres(ql)?://", description=(
        "postgresql://… : keep the gallery in a PostgreSQL shared by every replica (needs slc[postgres]); "
        "default: SQLite under data_dir, for one process"))

    # --- compute
    device: Literal["auto", "cpu", "cuda"] = "auto"
    intra_op_threads: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1)
    softmax_impl: Literal["auto", "numpy", "ort", "ort_pair", "packed_pair", "onnx"] = Field(
        "auto", description="how all D logits are computed (softmax, exact top-k): a chunked pass over the head with "
        "numpy's GEMM or onnxruntime's, or two one-thread onnxruntime GEMMs taking chunks in turn (ort_pair; "
        "packed_pair: each chunk's rows pre-packed once, a second copy of the head; both with two or more "
        "intra-op threads), or full.onnx; auto = the fastest at warm-up (packed_pair and onnx only for heads of "
        "at most 64 Mi weights)")
    concurrent_batches: int = Field(2, ge=1, le=2, description=(
        "batches computed at once, each in a worker thread of its own: backbone-only requests (detect, v2 single "
        "logits) are batched apart from passes over the head and start beside a running pass instead of waiting "
        "for it; passes and index searches still run one at a time; 1: one batch at a time, in arrival order "
        "(always 1 on CUDA or with one intra-op thread)"))
    inline_max_ms: float = Field(0.5, ge=0, description=(
        "a backbone-only batch (detect, v2, gallery writes) whose measured cost is under this runs on the event "
        "loop instead of the worker thread, whose hop costs more; 0: always the worker"))
    warmup: bool = True

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

    @model_validator(mode="after")
    def _pairs_need_two_threads(self) -> "Settings":
        if self.softmax_impl in ("ort_pair", "packed_pair") and self.intra_op_threads < 2:
            raise ValueError(f"softmax_impl {self.softmax_impl} needs intra_op_threads >= 2 "
                             "(its two GEMMs run one thread each)")
        return self

    @model_validator(mode="after")
    def _resolve_paths(self) -> "Settings":
        self.home = Path(self.home).expanduser()
        if self.data_dir is None:
            self.data_dir = self.home / "data"
        self.data_dir = Path(self.data_dir).expanduser()
        if self.bundle is not None:
            self.bundle = Path(self.bundle).expanduser()
        return self

    def api_key_value(self) -> Optional[str]:
        return self.api_key.get_secret_value() if self.api_key else None
