"""Quantized heads added to a bundle that lacks them (`slc bundle quantize`): the bundle staged with
its new heads, verified and swapped into place (serving/bundle/output.py). The heads themselves:
quantize.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from serving.bundle.quantize import FILES, write_heads


def add_heads(bundle: Path, precisions: tuple[str, ...], progress: bool = False) -> dict:
    """Add quantized heads to an existing bundle: a copy of it with the new heads and manifest is
    staged, verified and swapped into its place (serving/bundle/output.py; the other files' hashes are
    kept, not re-read). Returns the new manifest."""
    import json

    from serving.bundle import output
    from serving.bundle.format import MANIFEST, carry_files, write_manifest
    from serving.bundle.verify import verify_bundle

    bundle = Path(bundle)
    manifest = json.loads((bundle / MANIFEST).read_text())
    replaced = {name for p in precisions for name in FILES[p].values()}
    with output.staged(bundle, "bundle", in_place=True, verify=verify_bundle) as stage:
        known = carry_files(bundle, stage, manifest.get("files", {}), skip=replaced)
        weight = np.load(stage / "head_weight.npy", mmap_mode="r", allow_pickle=False)
        heads = {**(manifest.get("heads") or {}), **write_heads(stage, weight, precisions, progress)}
        write_manifest(stage, {**manifest, "heads": heads}, known_hashes=known)
    return json.loads((bundle / MANIFEST).read_text())