"""Access: loopback binding, TLS and mutual TLS from the config, the shared
token (health stays open for probes), no pickle/eval of client data, and
keepalive settings that keep an idle, politely pinging engine connected while
a client that floods pings is sent GOAWAY (too_many_pings).

Certificates (a CA, a server certificate for 127.0.0.1/localhost, a client
certificate, and a second, untrusted CA with its own client certificate) are
made at test time with the ``openssl`` command line (the ``cryptography``
package is not a dependency).
"""
from __future__ import annotations

import ast
import dataclasses
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from conftest import free_port, loopback_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import (
    reward_pb2,
    reward_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)

from loadtest.reliability_figures import (
    AccessFigures,
    KeepaliveFigures,
    LoopbackFigures,
    MutualTlsFigures,
    NoPickleFigures,
    TokenFigures,
    save_figures,
)
from reward_service import server as reward_server
from scheduler.main import start as start_scheduler
from search_service import server as search_server
from tandem.config import DEFAULT_CONFIG, TandemConfig, load_config, parse_config
from tandem.device import cpu_only
from tandem.paths import REPO_ROOT
from tandem.server import KEEPALIVE_OPTIONS, channel, health_status

C = grpc.StatusCode
FIGURES = AccessFigures()  # each test fills its part


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield
    if FIGURES != AccessFigures():
        save_figures(FIGURES)


# -- loopback -------------------------------------------------------------------------------------------
def _listeners(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, p = local.rpartition(":")
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                found.add(addr)
    return found


LOOPBACK_V4 = "0100007F"
LOOPBACK_V6 = "00000000000000000000000001000000"  # ::1
LOOPBACK_V4_MAPPED = "0000000000000000FFFF00000100007F"  # ::ffff:127.0.0.1 (prometheus_client binds this)


def test_shipped_config_binds_loopback_only(tmp_path):
    """Every address of the shipped config (and the defaults) is on 127.0.0.1,
    and a server started from it listens there only: gRPC and metrics."""
    shipped = load_config(DEFAULT_CONFIG)
    assert shipped == TandemConfig()
    for name in ("scheduler", "reward", "search"):
        assert getattr(shipped, name).address.rpartition(":")[0] == "127.0.0.1", name
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["scheduler"].update(address=f"127.0.0.1:{free_port()}", metrics_port=free_port())  # same host, free ports
    path = tmp_path / "shipped.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    port, metrics = int(cfg.scheduler.address.rpartition(":")[2]), cfg.scheduler.metrics_port
    proc = subprocess.Popen([sys.executable, "-m", "stack", "serve", "scheduler", "--config", str(path)],
                            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and health_status(cfg.scheduler.address, cfg) != "SERVING":
            assert proc.poll() is None, "scheduler exited"
            time.sleep(0.05)
        for p in (port, metrics):
            listening = _listeners(p)
            assert listening and listening <= {LOOPBACK_V4, LOOPBACK_V6, LOOPBACK_V4_MAPPED}, (p, listening)
        FIGURES.loopback = LoopbackFigures(config=str(DEFAULT_CONFIG.relative_to(REPO_ROOT)),
                                           grpc_listeners=sorted(_listeners(port)),
                                           metrics_listeners=sorted(_listeners(metrics)))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# -- certificates ---------------------------------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN=tandem test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def _make_leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=tandem test {name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_ca(d, "rogue_ca")
    _make_leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _make_leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _make_leaf(d, "rogue", "rogue_ca", "extendedKeyUsage=clientAuth\n")
    return d


def _tls_cfg(certs: Path, mutual: bool, client: str | None = "client", ca: str = "ca", **extra) -> TandemConfig:
    tls = {"cert_path": str(certs / "server.crt"), "key_path": str(certs / "server.key"), "ca_path": str(certs / f"{ca}.crt")}
    if mutual:
        tls["client_ca_path"] = str(certs / "ca.crt")
    if client:
        tls.update(client_cert_path=str(certs / f"{client}.crt"), client_key_path=str(certs / f"{client}.key"))
    base = loopback_config(search={"backend": "cpu"})
    data = {name: {"address": getattr(base, name).address, "metrics_port": 0, **extra.get(name, {})}
            for name in ("scheduler", "reward", "search")}
    return parse_config({**data, "tls": tls, **{k: v for k, v in extra.items() if k not in data}})


def _with_client(cfg: TandemConfig, certs: Path, client: str | None, ca: str = "ca") -> TandemConfig:
    """The same servers, seen by a client with another certificate (or none) and trust anchor."""
    tls = dataclasses.replace(cfg.tls, ca_path=str(certs / f"{ca}.crt"),
                              client_cert_path=str(certs / f"{client}.crt") if client else "",
                              client_key_path=str(certs / f"{client}.key") if client else "")
    return dataclasses.replace(cfg, tls=tls)


def _list_models(address: str, cfg: TandemConfig | None) -> C:
    with channel(address, cfg) as ch:
        try:
            reward_pb2_grpc.RewardServiceStub(ch).ListModels(reward_pb2.ListModelsRequest(), timeout=5)
            return C.OK
        except grpc.RpcError as exc:
            return exc.code()


def test_tls_server_is_verified_and_plaintext_refused(certs):
    cfg = _tls_cfg(certs, mutual=False, client=None)
    reward = reward_server.start(cfg, follow_scheduler=False)
    try:
        addr = cfg.reward.address
        assert _list_models(addr, cfg) == C.OK  # verified against tls.ca_path (the CA, not the leaf)
        assert health_status(addr, cfg) == "SERVING"
        assert _list_models(addr, None) == C.UNAVAILABLE  # plaintext client: no handshake
        assert _list_models(addr, _with_client(cfg, certs, None, ca="rogue_ca")) == C.UNAVAILABLE  # untrusted server
        FIGURES.tls = {"ca_verified_client": "OK", "plaintext_client": "UNAVAILABLE",
                       "client_trusting_another_ca": "UNAVAILABLE"}
    finally:
        reward.stop()


def test_mutual_tls_needs_a_client_certificate_from_the_ca(certs):
    cfg = _tls_cfg(certs, mutual=True, reward={"execution_provider": "cpu"},
                   search={"backend": "cpu", "evaluator": "value_model"},
                   scheduler={"report_interval_ms": 100})
    sched = start_scheduler(cfg, device=cpu_only())
    reward = reward_server.start(cfg, follow_scheduler=True)
    search = search_server.start(cfg, follow_scheduler=True)
    try:
        addr = cfg.reward.address
        outcomes = {
            "ca_signed_client_cert": _list_models(addr, cfg),
            "no_client_cert": _list_models(addr, _with_client(cfg, certs, None)),
            "client_cert_from_another_ca": _list_models(addr, _with_client(cfg, certs, "rogue")),
        }
        assert outcomes == {"ca_signed_client_cert": C.OK, "no_client_cert": C.UNAVAILABLE,
                            "client_cert_from_another_ca": C.UNAVAILABLE}
        # tandem's own clients present tls.client_cert_path: health checks, search -> reward, the scheduler client.
        for name in ("scheduler", "reward", "search"):
            assert health_status(getattr(cfg, name).address, cfg) == "SERVING"
        with channel(cfg.search.address, cfg) as ch:
            r = search_pb2_grpc.SearchServiceStub(ch).Search(search_pb2.SearchRequest(
                game="connect4", moves="4", simulations=16, evaluator=search_pb2.EVALUATOR_VALUE_MODEL), timeout=30)
        assert r.evaluator == search_pb2.EVALUATOR_VALUE_MODEL  # reached the reward service over mutual TLS
        with channel(cfg.scheduler.address, cfg) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            deadline = time.monotonic() + 15
            while len(stub.Status(scheduler_pb2.StatusRequest(), timeout=5).services) < 2:
                assert time.monotonic() < deadline, "the services did not register over mutual TLS"
                time.sleep(0.05)
        FIGURES.mutual_tls = MutualTlsFigures(outcomes={k: v.name for k, v in outcomes.items()},
                                              search_to_reward="VALUE_MODEL", services_registered_with_scheduler=2)
    finally:
        search.stop()
        reward.stop()
        sched.stop(grace_ms=0)


# -- the shared token ------------------------------------------------------------------------------------------
def test_token_is_required_except_for_health():
    token = "s3cret-token"
    cfg = dataclasses.replace(loopback_config(search={"backend": "cpu", "evaluator": "value_model"}), auth_token=token)
    sched = start_scheduler(cfg, device=cpu_only())
    reward = reward_server.start(cfg, follow_scheduler=False)
    search = search_server.start(cfg, follow_scheduler=False)
    try:
        calls = {
            "Search": (cfg.search.address, lambda ch: search_pb2_grpc.SearchServiceStub(ch).Search(
                search_pb2.SearchRequest(game="connect4", moves="4", simulations=8,
                                         evaluator=search_pb2.EVALUATOR_VALUE_MODEL), timeout=10)),
            "ListModels": (cfg.reward.address, lambda ch: reward_pb2_grpc.RewardServiceStub(ch).ListModels(
                reward_pb2.ListModelsRequest(), timeout=10)),
            "Status": (cfg.scheduler.address, lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).Status(
                scheduler_pb2.StatusRequest(), timeout=10)),
            "WatchAssignments": (cfg.scheduler.address, lambda ch: next(scheduler_pb2_grpc.SchedulerStub(ch).WatchAssignments(
                scheduler_pb2.WatchAssignmentsRequest(lease_id="x"), timeout=10))),
            "ServerReflectionInfo": (cfg.search.address, lambda ch: list(ch.stream_stream(
                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(iter([b"\x3a\x00"]), timeout=10))),
        }
        results = {}
        for name, (address, call) in calls.items():
            for who, md in (("none", None), ("wrong", "Bearer nope"), ("right", f"Bearer {token}")):
                ch = grpc.insecure_channel(address)
                if md:
                    ch = grpc.intercept_channel(ch, _Metadata(("authorization", md)))
                try:
                    call(ch)
                    code = C.OK
                except grpc.RpcError as exc:
                    code = exc.code()
                finally:
                    ch.close()
                results[f"{name}/{who}"] = code.name
                if who != "right":
                    assert code == C.UNAUTHENTICATED, (name, who, code)
                else:
                    assert code in (C.OK, C.NOT_FOUND), (name, code)  # NOT_FOUND: the made-up lease
        # tandem.server.channel adds the token; the search service's channel to the reward service does too.
        with channel(cfg.search.address, cfg) as ch:
            r = search_pb2_grpc.SearchServiceStub(ch).Search(search_pb2.SearchRequest(
                game="connect4", moves="4", simulations=8, evaluator=search_pb2.EVALUATOR_VALUE_MODEL), timeout=10)
        assert r.evaluator == search_pb2.EVALUATOR_VALUE_MODEL
        # Health stays open for probes (kubelet, compose) that carry no token.
        for name in ("scheduler", "reward", "search"):
            with grpc.insecure_channel(getattr(cfg, name).address) as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        FIGURES.token = TokenFigures(calls=results, health_without_token="SERVING")
    finally:
        search.stop()
        reward.stop()
        sched.stop(grace_ms=0)


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, *md):
        self._md = list(md)

    def _details(self, d):
        return d._replace(metadata=list(d.metadata or []) + self._md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


# -- no pickle / eval of anything a client sends -------------------------------------------------------------
_UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle", "joblib"}
_UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}
SERVING_CODE = ("tandem", "reward_service", "search_service", "scheduler", "loadtest")


def _unsafe(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in _UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _UNSAFE_MODULES:
            found.append(f"from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in _UNSAFE_CALLS:
                found.append(f"{f.id}()")
            elif isinstance(f, ast.Attribute):
                owner = f.value.id if isinstance(f.value, ast.Name) else ""
                if owner == "yaml" and f.attr in ("load", "load_all", "unsafe_load", "full_load"):
                    found.append(f"yaml.{f.attr}()")
                if owner in ("np", "numpy") and f.attr == "load" and any(
                        k.arg == "allow_pickle" and getattr(k.value, "value", False) for k in node.keywords):
                    found.append("np.load(allow_pickle=True)")
                if owner == "torch" and f.attr == "load":
                    found.append("torch.load()")
    return [f"{path.relative_to(REPO_ROOT)}:{x}" for x in found]


def test_no_pickle_or_eval_in_serving_code():
    """A guard: nothing that serves requests can deserialise code or objects.
    Requests are protobuf, tensors raw bytes (np.frombuffer), the config YAML
    (a yaml.SafeLoader that also refuses aliases)."""
    files = [p for d in SERVING_CODE for p in (REPO_ROOT / d).rglob("*.py")
             if "training" not in p.parts and p.name != "make_resnet18.py"]
    assert len(files) > 20
    found = [hit for p in files for hit in _unsafe(p)]
    assert found == [], found
    FIGURES.no_pickle_eval = NoPickleFigures(files_checked=len(files), hits=found)


# -- keepalive --------------------------------------------------------------------------------------------------
def test_shipped_keepalive_accepts_a_45_s_idle_pinger():
    opts = dict(KEEPALIVE_OPTIONS)
    assert opts["grpc.keepalive_permit_without_calls"] == 1  # idle pings are allowed at all
    assert TandemConfig().search.server.keepalive_min_ping_interval_ms <= 45_000  # an engine pinging every 45 s is fine
    assert opts["grpc.http2.max_ping_strikes"] >= 1  # a flooder is cut off after a few pings
    assert TandemConfig().search.server.keepalive_min_ping_interval_ms >= 5_000  # and "a few pings" is not many


def _idle_watcher(address: str, ping_ms: int) -> dict:
    """An idle client: one open health Watch stream, pinging every ``ping_ms``."""
    ch = grpc.insecure_channel(address, options=[
        ("grpc.keepalive_time_ms", ping_ms), ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0)])
    state = {"channel": ch, "states": [], "end": None, "first": threading.Event()}
    ch.subscribe(lambda s: state["states"].append(s), try_to_connect=True)
    call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
    state["call"] = call

    def read():
        try:
            for _ in call:
                state["first"].set()
        except grpc.RpcError as exc:
            state["end"] = (exc.code(), exc.details())

    threading.Thread(target=read, daemon=True).start()
    return state


@pytest.mark.slow
def test_keepalive_flooder_gets_goaway_while_a_polite_pinger_stays():
    """Scaled down 5x: the server allows a ping every 2 s (shipped: 10 s); a client
    pinging every 2.5 s (an engine's 45 s against 10 s) keeps its idle stream,
    a client pinging as fast as gRPC lets it (once a second) is cut off with
    GOAWAY ENHANCE_YOUR_CALM "too_many_pings" after its strikes."""
    cfg = loopback_config(scheduler={"server": {"keepalive_min_ping_interval_ms": 2000}})
    handle = start_scheduler(cfg, device=cpu_only())
    try:
        flooder = _idle_watcher(cfg.scheduler.address, 100)
        polite = _idle_watcher(cfg.scheduler.address, 2500)
        assert flooder["first"].wait(5) and polite["first"].wait(5)
        began = time.monotonic()
        while flooder["end"] is None and time.monotonic() - began < 15:
            time.sleep(0.05)
        cut_after_s = time.monotonic() - began
        assert flooder["end"] is not None, "the flooding client was never cut off"
        code, details = flooder["end"]
        assert code == C.UNAVAILABLE and "too many pings" in details.lower(), flooder["end"]
        time.sleep(max(0.0, 6.0 - cut_after_s))  # the polite client has pinged at least twice by now
        assert polite["end"] is None, polite["end"]
        assert polite["channel"]._channel.check_connectivity_state(False) == grpc.ChannelConnectivity.READY.value[0]
        FIGURES.keepalive = KeepaliveFigures(
            server_min_ping_interval_ms=2000, flooder_ping_ms=100, polite_ping_ms=2500,
            flooder_outcome=f"{code.name}: {details}", flooder_cut_after_s=round(cut_after_s, 1),
            polite_connected_after_s=round(time.monotonic() - began, 1))
        for s in (flooder, polite):
            s["call"].cancel()
            s["channel"].close()
    finally:
        handle.stop(grace_ms=0)
