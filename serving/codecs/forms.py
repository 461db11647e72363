"""multipart/form-data bodies: the way browsers and `curl -F image=@a.png -F image=@b.png` send files.
Parsed by python-multipart (the parser FastAPI's forms use), in memory: the body is already read
and bounded by SLC_MAX_BODY_BYTES; the number of parts by the caller's limit (SLC_MAX_INPUTS),
checked while parsing. Every refusal names the part (its position, field name and file name)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from serving.errors import BadRequest, InvalidInput

FORM_TYPE = b"multipart/form-data"


@dataclass
class Part:
    index: int  # 1-based, in the body's order
    name: str
    filename: Optional[str]
    content_type: bytes  # lower-case, without parameters; b"" when the part declares none
    data: bytes

    def label(self) -> str:
        """How a message names the part: `part 2 (image=b.png)`."""
        return f"part {self.index} ({self.name or '?'}{'=' + self.filename if self.filename else ''})"


class _TooMany(Exception):
    pass


def _collector(parts: list[Part], max_parts: int) -> dict:
    """python-multipart callbacks that append each part, headers parsed, to `parts`."""
    from python_multipart.multipart import parse_options_header

    state: dict = {"field": b"", "value": b"", "headers": {}, "chunks": [], "ended": False}

    def begin():
        if len(parts) >= max_parts:
            raise _TooMany()
        state.update(headers={}, chunks=[], field=b"", value=b"")

    def header_end():
        state["headers"][state["field"].lower()] = state["value"]
        state.update(field=b"", value=b"")

    def part_end():
        _, disposition = parse_options_header(state["headers"].get(b"content-disposition", b""))
        content_type, _ = parse_options_header(state["headers"].get(b"content-type", b""))
        filename = disposition.get(b"filename")
        parts.append(Part(len(parts) + 1, disposition.get(b"name", b"").decode("utf-8", "replace"),
                          None if filename is None else filename.decode("utf-8", "replace"),
                          content_type.lower(), b"".join(state["chunks"])))

    return {"on_part_begin": begin, "on_part_end": part_end, "on_header_end": header_end,
            "on_header_field": lambda d, a, b: state.update(field=state["field"] + d[a:b]),
            "on_header_value": lambda d, a, b: state.update(value=state["value"] + d[a:b]),
            "on_part_data": lambda d, a, b: state["chunks"].append(bytes(d[a:b])),
            "on_end": lambda: state.update(ended=True)}, state


def parse(content_type: bytes, body: bytes, max_parts: int) -> list[Part]:
    """The parts of a multipart/form-data body, in order (`content_type`: the whole header value).
    400 malformed_multipart when it does not parse; 422 too_many_inputs past `max_parts`; 422
    empty_part / no_examples for a part without bytes or a form without parts."""
    from python_multipart.multipart import MultipartParseError, MultipartParser, parse_options_header

    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise BadRequest("multipart/form-data without a boundary parameter in its Content-Type; let the client "
                         "set the header (curl -F does)", code="malformed_multipart")
    parts: list[Part] = []
    callbacks, state = _collector(parts, max_parts)
    try:
        parser = MultipartParser(boundary, callbacks)
        parser.write(body)
        parser.finalize()
    except _TooMany:
        raise InvalidInput(f"the form holds more than {max_parts} parts (SLC_MAX_INPUTS); send at most that many "
                           "files per request, then add the rest with POST /v1/classes/{name}/examples",
                           code="too_many_inputs") from None
    except MultipartParseError as exc:
        raise BadRequest(f"the multipart body does not parse after part {len(parts)}: {exc}",
                         code="malformed_multipart") from None
    if not state["ended"]:
        raise BadRequest(f"the multipart body ends after part {len(parts)} without its closing boundary "
                         "(cut short?)", code="malformed_multipart")
    if not parts:
        raise InvalidInput("the form holds no part: send at least one file (curl -F image=@a.png)", code="no_examples")
    for part in parts:
        if not part.data:
            raise InvalidInput(f"{part.label()} is empty: no bytes to decode", code="empty_part")
    return parts
