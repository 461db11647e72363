"""GET /demo: a page where a person draws or uploads an image, names a class, and sees the
single-logit answer beside the top-k (serving/http/static/demo.html: plain HTML and JavaScript, no
build step, nothing fetched from outside). It calls the public API like any client.

Sent with security headers: a Content-Security-Policy allowing only the page's own inline script
and style (by their SHA-256), requests to this server and images it drew itself, framed by no
one (frame-ancestors 'none', and X-Frame-Options DENY for older browsers); nosniff; no referrer.
"""
from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@lru_cache(maxsize=1)
def page() -> tuple[str, dict[str, str]]:
    """(the page, its headers): the policy names the hash of each inline <script> and <style> block."""
    html = files("serving.http.static").joinpath("demo.html").read_text(encoding="utf-8")
    scripts = " ".join(_sha256(s) for s in re.findall(r"<script>(.*?)</script>", html, flags=re.S)) or "'none'"
    styles = " ".join(_sha256(s) for s in re.findall(r"<style>(.*?)</style>", html, flags=re.S)) or "'none'"
    policy = (f"default-src 'none'; script-src {scripts}; style-src {styles}; img-src 'self' blob: data:; "
              "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, {"Cache-Control": "no-cache", "Content-Security-Policy": policy, "X-Frame-Options": "DENY",
                  "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


@router.get("/demo", response_class=HTMLResponse, include_in_schema=False)
async def demo() -> HTMLResponse:
    html, headers = page()
    return HTMLResponse(html, headers=headers)
