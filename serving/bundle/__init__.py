"""The model bundle (docs/bundle-format.md), shared by the trainer (writes) and the server (reads).

numpy, onnx and onnxruntime only: no torch, no trainer. Modules:
format (names, manifest, hashes) · files (atomic writes) · output (the one guarded output folder) · home (SLC_HOME) · npy (.npy head) ·
names, calibration (compact per-class data) · graphs (ONNX checks) · session (onnxruntime) ·
image, imagespec (an image -> one input, for trainer and server alike; Pillow) ·
verify (`slc verify`) · loader (`load_bundle`) · synthetic (random bundles for scale work).
"""
from serving.bundle.calibration import PerClassCalibration, calibration_arrays
from serving.bundle.files import atomic_replace, atomic_write_text
from serving.bundle.format import (
    FORMAT, FORMAT_VERSION, GRAPH_IO, GRAPH_KINDS, MANIFEST, REQUIRED_FILES, BundleError, base_manifest,
    sha256_file, write_manifest,
)
from serving.bundle.graphs import graph_problems
from serving.bundle.home import slc_home
from serving.bundle.loader import Bundle, load_bundle, release_memory
from serving.bundle.names import IdNames, compact_names
from serving.bundle.npy import NpyStream
from serving.bundle.session import ort_session
from serving.bundle.verify import verify_bundle

__all__ = [
    "FORMAT", "FORMAT_VERSION", "GRAPH_IO", "GRAPH_KINDS", "MANIFEST", "REQUIRED_FILES", "Bundle", "BundleError",
    "IdNames", "NpyStream", "PerClassCalibration", "atomic_replace", "atomic_write_text", "base_manifest",
    "calibration_arrays", "compact_names", "graph_problems", "load_bundle", "ort_session", "release_memory",
    "sha256_file", "slc_home", "verify_bundle", "write_manifest",
]
