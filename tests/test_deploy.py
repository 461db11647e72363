"""deploy/ cannot run here (no Docker engine, no cluster); check what can be checked offline:
the manifests parse, their probes and routes hit real routes of the app, their flags and
environment variables are ones `slc serve` and Settings accept."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from serving.app import create_app
from serving.settings import Settings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def _docs():
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and "kind" in doc:  # patches (gpu-patch.yaml) have no kind
                yield path.name, doc


def _containers(doc):
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])


def _route_regexes():
    """(path regex, methods) of every documented route, from the app's own OpenAPI schema."""
    app = create_app(Settings(bundle=Path("/nonexistent"), warmup=False))
    out = []
    for template, ops in app.openapi()["paths"].items():
        rx = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$")
        out.append((rx, {m.upper() for m in ops}))
    return out


def _matches(path: str, method: str, routes) -> bool:
    return any(rx.match(path) and method in methods for rx, methods in routes)


def test_every_manifest_parses_with_a_kind():
    assert MANIFESTS
    kinds = [doc["kind"] for _, doc in _docs()]
    assert {"Deployment", "StatefulSet", "Service", "Ingress"} <= set(kinds)


def test_probes_point_at_real_get_routes():
    routes = _route_regexes()
    probes = []
    for name, doc in _docs():
        for c in _containers(doc):
            for key in ("readinessProbe", "livenessProbe", "startupProbe"):
                if key in c:
                    probes.append((name, c[key]["httpGet"]["path"]))
    assert probes
    for name, path in probes:
        assert _matches(path, "GET", routes), f"{name}: probe {path} is not a GET route of the app"


def test_container_args_are_serve_flags():
    from serving.cli import serve

    flags = {opt for p in serve.params for opt in p.opts}
    for name, doc in _docs():
        for c in _containers(doc):
            for arg in c.get("args", []):
                if arg.startswith("--"):
                    assert arg in flags, f"{name}: {arg} is not a flag of `slc serve`"


def test_env_vars_are_settings():
    fields = {f"SLC_{k.upper()}" for k in Settings.model_fields}
    env = [(name, e["name"]) for name, doc in _docs() for c in _containers(doc) for e in c.get("env", [])]
    env += [("Dockerfile", v) for v in re.findall(r"(SLC_[A-Z_]+)=", (DEPLOY / "Dockerfile").read_text())]
    assert env
    for name, var in env:
        assert var in fields, f"{name}: {var} is not a Settings field"


@pytest.mark.parametrize("path,method", [("/v1/gallery/items", "POST"), ("/v1/classes/7/search", "POST")])
def test_ingress_sends_gallery_routes_to_the_gallery(path, method):
    ingress = next(doc for _, doc in _docs() if doc["kind"] == "Ingress")
    rules = ingress["spec"]["rules"][0]["http"]["paths"]
    first = next(r for r in rules if (re.match(r["path"], path) if r["pathType"] == "ImplementationSpecific" else path.startswith(r["path"])))
    assert first["backend"]["service"]["name"] == "slc-gallery"
    assert _matches(path, method, _route_regexes())
