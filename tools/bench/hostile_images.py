"""`slc bench hostile`, image cases (issue 30): crafted image bodies, several at once, against a server
whose bundle takes images, while a health probe and a valid image are sent in loops. Measured per
case: the hostile answers and the slowest of them, the worst probe and valid-image latencies during
the attack, and the resident memory of the server's process tree (its decode processes included):
its peak during the attack and after it, minus before. Goal: a refusal within 0.5 s, the probe
under 100 ms, a valid image within 1 s, RSS back within 300 MB.

`python -m tools.bench.hostile_images --pythonpath DIR` runs the same cases against the server
of another checkout (DIR), for before/after tables.
"""
from __future__ import annotations

import io
import os
import struct
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import orjson

from tools.bench.server import ServerProcess, free_port, process_tree_memory, timed_request
from tools.report import md_table

MB = 1 << 20
IMAGE_SPEC = {"height": 8, "width": 8, "channels": 1, "layout": "flat", "scale": 1.0 / 255.0, "background": "dark",
              "resample": "lanczos"}  # input 64, as the other hostile cases' bundle


def progressive_jpeg(side: int, scans: int, mode: str = "RGB") -> bytes:
    """A flat grey side x side progressive JPEG (Pillow's; mode RGB or L) whose last scan is repeated
    until the file holds `scans` scans: each repeat is a few dozen bytes and costs a pass over every pixel."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, (side, side), 128 if mode == "L" else (128, 128, 128)).save(buf, "JPEG", progressive=True)
    data = buf.getvalue()
    last, end = data.rindex(b"\xff\xda"), data.rindex(b"\xff\xd9")  # the last scan: its SOS segment and data
    return data[:end] + data[last:end] * max(0, scans - data.count(b"\xff\xda")) + data[end:]


def png_chunk(kind: bytes, data: bytes = b"") -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def chunk_flood_png(size: int) -> bytes:
    """An 8x8 PNG of about `size` bytes, nearly all of it empty private ancillary chunks after IHDR."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (8, 8)).save(buf, "PNG")
    png = buf.getvalue()
    head = 8 + 25  # signature, IHDR
    return png[:head] + png_chunk(b"prVt") * ((size - len(png)) // 12) + png[head:]


def sixteen_bit_png(side: int) -> bytes:
    """A side x side 16-bit grey PNG of one value: a few KB that decode to 2 bytes per pixel."""
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((side, side), 40_000, np.uint16)).save(buf, "PNG")
    return buf.getvalue()


def valid_png() -> bytes:
    import numpy as np
    from PIL import Image

    a = np.zeros((8, 8), np.uint8)
    a[1:7, 3:5] = 255
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


# kind -> (body, copies sent at once, content type)
IMAGE_CASES: dict[str, tuple[Callable[[], bytes], int, str]] = {
    "jpeg_scan_bomb": (lambda: progressive_jpeg(4000, 5000), 6, "image/jpeg"),
    "jpeg_scans_at_limit": (lambda: progressive_jpeg(4000, 32), 6, "image/jpeg"),
    "png_chunk_flood": (lambda: chunk_flood_png(8 * MB - 1024), 6, "image/png"),
    "png_16bit_4000": (lambda: sixteen_bit_png(4000), 50, "image/png"),
}


def _post(url: str, body: bytes, content_type: str, timeout: float = 300) -> tuple[int, str, float]:
    """(status, error code or "", seconds) of POST /v1/classes/3/detect with an image body."""
    return timed_request(url + "/v1/classes/3/detect", body, content_type=content_type, timeout=timeout)


class _Watch(threading.Thread):
    """Until stopped: a health probe, a valid image, the process tree's RSS, each in turn; worst of each."""

    def __init__(self, url: str, pid: int):
        super().__init__(daemon=True)
        self.url, self.pid, self.valid_body = url, pid, valid_png()
        self.busy = threading.Event()
        self.worst_probe = self.worst_valid = 0.0
        self.peak_rss, self.valid_statuses = 0, Counter()

    def run(self) -> None:
        while self.busy.is_set():
            t0 = time.perf_counter()
            try:
                urllib.request.urlopen(self.url + "/v1/health/live", timeout=30).read()
                self.worst_probe = max(self.worst_probe, time.perf_counter() - t0)
            except OSError:
                self.worst_probe = max(self.worst_probe, 30.0)
            status, _, seconds = _post(self.url, self.valid_body, "image/png", timeout=30)
            self.valid_statuses[status] += 1
            self.worst_valid = max(self.worst_valid, seconds)
            self.peak_rss = max(self.peak_rss, process_tree_memory(self.pid)["rss"])
            time.sleep(0.005)


def measure_image_case(srv: ServerProcess, kind: str) -> dict:
    make, copies, content_type = IMAGE_CASES[kind]
    body = make()
    rss0 = process_tree_memory(srv.proc.pid)["rss"]
    watch = _Watch(srv.url, srv.proc.pid)
    watch.busy.set()
    watch.start()
    answers: list = [None] * copies

    def send(i: int) -> None:
        answers[i] = _post(srv.url, body, content_type)

    senders = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(copies)]
    t0 = time.perf_counter()
    for t in senders:
        t.start()
    during = _post(srv.url, watch.valid_body, "image/png", timeout=60)  # one valid image surely sent mid-attack
    for t in senders:
        t.join(600)
    attack_s = time.perf_counter() - t0
    watch.busy.clear()
    watch.join(60)
    time.sleep(1.0)  # the decode processes' freed memory back to the OS
    rss1 = process_tree_memory(srv.proc.pid)["rss"]
    codes = Counter(f"{s} {c}" if c else str(s) for s, c, _ in answers if s is not None)
    refusals, decoded = [a[2] for a in answers if a[0] != 200], [a[2] for a in answers if a[0] == 200]
    return {"kind": kind, "bytes": len(body), "copies": copies, "answers": dict(codes),
            "slowest_s": max(a[2] for a in answers), "attack_s": attack_s,
            "slowest_refusal_s": max(refusals, default=None), "slowest_200_s": max(decoded, default=None),
            "worst_probe_ms": watch.worst_probe * 1e3, "valid_during": during[0],
            "worst_valid_ms": max(watch.worst_valid, during[2]) * 1e3,
            "valid_statuses": {str(k): v for k, v in watch.valid_statuses.items()},
            "peak_rss_growth_mb": (max(watch.peak_rss, rss1) - rss0) / MB, "rss_after_growth_mb": (rss1 - rss0) / MB}


def image_bundle(work: Path) -> Path:
    from serving.bundle.synthetic import build_synthetic_bundle

    return build_synthetic_bundle(classes=1000, dim=64, input_dim=64, seed=0, out=work / "image-bundle",
                                  image=IMAGE_SPEC)


def image_rows(work: Path, pythonpath: Optional[str] = None, kinds=tuple(IMAGE_CASES)) -> list[dict]:
    """Every image case against `slc serve` of an image bundle (of the checkout at `pythonpath`, if given)."""
    bundle = image_bundle(work)
    port = free_port()
    env = {"SLC_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    argv = [sys.executable] + (["-P"] if pythonpath else []) + [  # -P: the other checkout, not the one in the cwd
        "-m", "slc", "serve", str(bundle), "--port", str(port), "--data-dir", str(work / "data")]
    with ServerProcess(argv, port, work / "server-hostile-images.log", env=env) as srv:
        srv.wait_ready(300)
        return [measure_image_case(srv, kind) for kind in kinds]


def goal_met(r: dict) -> bool:
    """Refusals within 0.5 s (a decoded large image may take longer: it is legitimate work), the probe
    under 100 ms, a valid image during the attack answered 200 within 1 s, RSS after within 300 MB."""
    return ((r["slowest_refusal_s"] or 0.0) <= 0.5 and r["worst_probe_ms"] < 100 and r["valid_during"] == 200
            and r["worst_valid_ms"] <= 1000 and r["rss_after_growth_mb"] < 300)


def _s(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.3f}"


def image_markdown(rows: list[dict], command: str) -> str:
    load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = ["## Hostile images", "", f"Command: `{command}`", "",
             "Each crafted body is sent `copies` times at once to a server of an image bundle (8x8 grey) while a "
             "health probe and a valid 8x8 PNG are sent in turn in a loop (and one valid PNG right after the attack "
             "is sent). RSS is the server's process tree (its decode processes included): the peak sampled during "
             f"the attack and the value 1 s after it, minus before. Load average when written: {load}.",
             "Goal: refusals within 0.5 s (a large image that is decoded may take longer: legitimate work, queued), "
             "probe < 100 ms, a valid image during the attack within 1 s, RSS after within 300 MB.", "",
             md_table(["body", "size", "copies", "answers", "slowest refusal s", "slowest 200 s", "worst probe ms",
                       "valid image during (worst ms)", "peak RSS growth MB", "RSS after growth MB", "goal met"],
                      [_image_row(r) for r in rows], "lrrlrrrlrrl")]
    return "\n".join(lines) + "\n"


def _image_row(r: dict) -> list[str]:
    answers = ", ".join(f"{n}× {k}" for k, n in r["answers"].items())
    return [r["kind"], f"{r['bytes'] / MB:.2f} MB", f"{r['copies']}", answers, _s(r["slowest_refusal_s"]),
            _s(r["slowest_200_s"]), f"{r['worst_probe_ms']:.1f}", f"{r['valid_during']} ({r['worst_valid_ms']:.0f})",
            f"{r['peak_rss_growth_mb']:.0f}", f"{r['rss_after_growth_mb']:.0f}", "yes" if goal_met(r) else "**no**"]


def main(argv: Optional[list[str]] = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pythonpath", help="serve from this checkout (its serving/ and slc/) instead of this one")
    ap.add_argument("--kinds", default=",".join(IMAGE_CASES), help="comma list of cases")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="slc-hostile-images-") as tmp:
        rows = image_rows(Path(tmp), args.pythonpath, tuple(k for k in args.kinds.split(",") if k))
    command = "python -m tools.bench.hostile_images" + (f" --pythonpath {args.pythonpath}" if args.pythonpath else "")
    print(image_markdown(rows, command))
    print(orjson.dumps(rows).decode(), file=sys.stderr)


if __name__ == "__main__":
    main()
