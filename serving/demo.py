"""GET /demo: a page where a person draws or uploads an image, names a class, and sees the
single-logit answer beside the top-k (serving/static/demo.html: plain HTML and JavaScript, no
build step, nothing fetched from outside). It calls the public API like any client."""
from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()


@router.get("/demo", response_class=HTMLResponse, include_in_schema=False)
async def demo() -> HTMLResponse:
    return HTMLResponse(files("serving.static").joinpath("demo.html").read_text(encoding="utf-8"),
                        headers={"Cache-Control": "no-cache"})
