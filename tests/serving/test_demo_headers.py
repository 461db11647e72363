"""GET /demo is sent with security headers (issue 30): a CSP whose hashes are exactly those of the
page's inline script and style (so the page still runs), no framing, nosniff."""
from __future__ import annotations

import base64
import hashlib
import re


def _directives(policy: str) -> dict[str, list[str]]:
    return {d.split()[0]: d.split()[1:] for d in (p.strip() for p in policy.split(";")) if d}


def test_demo_sends_a_policy_that_allows_only_its_own_inline_code(client):
    r = client.get("/demo")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"
    csp = _directives(r.headers["content-security-policy"])
    assert csp["frame-ancestors"] == ["'none'"] and csp["default-src"] == ["'none'"]
    assert csp["base-uri"] == ["'none'"] and csp["form-action"] == ["'none'"]
    assert "'unsafe-inline'" not in r.headers["content-security-policy"]
    html = r.text
    for tag in ("script", "style"):
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        want = {"'sha256-" + base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() + "'" for b in blocks}
        assert blocks and set(csp[f"{tag}-src"]) == want
    # nothing the policy would block: no other script or style element, no inline handler or style attribute
    assert len(re.findall(r"<script\b", html)) == len(re.findall(r"<script>", html))
    assert not re.search(r"\son[a-z]+\s*=", html) and not re.search(r"\sstyle\s*=", html)
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", html)  # nothing fetched from elsewhere
    assert set(csp["connect-src"]) == {"'self'"}  # the page calls this server's API only
