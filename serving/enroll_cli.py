"""`slc enroll URL NAME IMAGE...`: enroll a class on a running server from image files, as one
multipart/form-data request (PUT /v1/classes/NAME, or with --add POST /v1/classes/NAME/examples).
A client only: the standard library's urllib (the base install has no HTTP client), no server code."""
from __future__ import annotations

import json
import mimetypes
import os
import uuid
from pathlib import Path
from urllib.parse import quote

import click

from serving.bundle.sniff import image_type


def form_body(paths: list[Path]) -> tuple[bytes, str]:
    """(body, Content-Type) of a multipart/form-data form with one `image` part per file."""
    boundary = f"slc-{uuid.uuid4().hex}"
    chunks = []
    for path in paths:
        data = path.read_bytes()
        kind = image_type(data) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        filename = path.name.replace("\\", "\\\\").replace('"', '\\"').replace("\r", " ").replace("\n", " ")
        chunks += [f"--{boundary}\r\n".encode(),
                   f'Content-Disposition: form-data; name="image"; filename="{filename}"\r\n'.encode(),
                   f"Content-Type: {kind}\r\n\r\n".encode(), data, b"\r\n"]
    chunks.append(f"--{boundary}--\r\n".encode())
    return b"".join(chunks), f"multipart/form-data; boundary={boundary}"


def _send(url: str, method: str, body: bytes, content_type: str, api_key: str | None, timeout: float) -> tuple[int, bytes]:
    """(status, body) of one request; an HTTP error status is an answer too, an unreachable server a ClickException."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": content_type}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 - the URL the user gave
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise click.ClickException(f"cannot reach {url}: {reason} (is `slc serve` running there?)") from None


def _error_line(status: int, body: bytes) -> str:
    """One line for a non-2xx answer: the envelope's code and message, else the status and the first bytes."""
    try:
        error = json.loads(body)["error"]
        return f"{status} {error['code']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{status}: {body[:200].decode('utf-8', 'replace').strip() or 'no body'}"


@click.command()
@click.argument("url")
@click.argument("name")
@click.argument("images", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--add", is_flag=True, help="add the images to the enrolled class NAME (its row made again from all of "
              "its examples) [default: create or replace NAME]")
@click.option("--api-key", envvar="SLC_API_KEY", help="the server's API key [default: SLC_API_KEY]")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True, help="seconds")
def enroll(url: str, name: str, images: tuple[Path, ...], add: bool, api_key: str | None, timeout: float) -> None:
    """Enroll class NAME on the server at URL from IMAGE files (one multipart request), e.g.
    `slc enroll http://127.0.0.1:8000 cat a.png b.png`; prints the class, its id and its examples, a
    warning for each other class that says yes to the images, and the look-alikes stored with it."""
    base = url if "://" in url else f"http://{url}"
    target = f"{base.rstrip('/')}/v1/classes/{quote(name, safe='')}" + ("/examples" if add else "")
    body, content_type = form_body(list(images))
    status, answer = _send(target, "POST" if add else "PUT", body, content_type, api_key or os.environ.get("SLC_API_KEY"),
                           timeout)
    if not 200 <= status < 300:
        raise click.ClickException(_error_line(status, answer))
    got = json.loads(answer)
    how = f"added {len(images)}" if add else ("created" if status == 201 else "replaced")
    click.echo(f"class {got['class_name']}: id {got['class_id']}, {got['examples']} examples ({how}), "
               f"threshold {got['threshold']:.4g}")
    alike = set(got.get("lookalikes", []))
    for other in got.get("matched_by", []):
        said = (f"warning: class {other['class_name']} (id {other['class_id']}) also says yes to {other['examples']} "
                f"of these {len(images)} images at its threshold {other['threshold']:.4g}")
        click.echo(said + ("; stored as a look-alike: of the two, an input matches only the one it passes by more"
                           if other["class_id"] in alike else f", so it will match {got['class_name']}'s images too")
                   + " (docs/api.md, \"Look-alikes\")", err=True)
    if alike:
        named = {o["class_id"]: o["class_name"] for o in got.get("matched_by", [])}
        named.update((i, n) for i, n in zip(got["lookalikes"], got.get("lookalike_names", [])) if n is not None)
        ids = sorted(alike)
        shown = [f"{named[i]} (id {i})" if i in named else f"id {i}" for i in ids[:10]]
        click.echo(f"look-alikes stored with {got['class_name']}: {len(ids)} class{'es' if len(ids) > 1 else ''}"
                   f" ({', '.join(shown)}{', …' if len(ids) > 10 else ''})")
