"""TLS and mutual TLS on every hop, bearer tokens, peer allow-lists and the plain-text health listener, with
certificates made here: a CA, one certificate per service (CN = its mesh role name, e.g. coordinator.graphmesh.internal;
SAN 127.0.0.1 and localhost), a client certificate, and a rogue CA whose certificate claims a trusted name."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from graphmesh import errors, security
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.kvstore_client import KvStoreClient
from graphmesh.launcher import LocalMesh, free_port
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from graphmesh_server import bootstrap
from tests.model_fixtures import make_tiny_llama
from tests.pki import Pem, issue, issue_mesh

TOKEN = "s3cret-token-of-the-tls-tests"
PROMPT = list(range(100, 140))  # two whole 16-token KV blocks: the second generation seeds them from the store


@dataclass(frozen=True)
class Pki:
    ca: str
    coordinator: Pem
    kvstore: Pem
    executor: Pem
    client: Pem
    rogue: Pem  # CN "client", but signed by another CA
    token_file: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    mesh = issue_mesh(d)
    rogue_dir = d / "rogue"
    rogue_dir.mkdir()
    rogue = issue(rogue_dir, "client", issue(rogue_dir, "rogue-ca"))
    token = d / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    return Pki(mesh.ca.cert, mesh.coordinator, mesh.kvstore, mesh.executor, mesh.client, rogue, str(token))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def health_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def mtls_mesh(pki: Pki, model: Path, health_port: int) -> Iterator[LocalMesh]:
    """Mutual TLS everywhere; executors obey only the coordinator, the kvstore and each other; a bearer token."""
    with LocalMesh(2, "numpy", str(model), tls_cert=pki.executor.cert, tls_key=pki.executor.key, tls_ca=pki.ca,
                   auth_token_file=pki.token_file,
                   extra_coordinator_args=["--tls-cert", pki.coordinator.cert, "--tls-key", pki.coordinator.key,
                                           "--health-listen", f"127.0.0.1:{health_port}"],
                   extra_kvstore_args=["--tls-cert", pki.kvstore.cert, "--tls-key", pki.kvstore.key],
                   extra_executor_args=["--allowed-peers", ",".join(f"{role}.graphmesh.internal" for role in
                                                                    ("coordinator", "kvstore", "executor"))]) as mesh:
        yield mesh


def _client_credentials(pki: Pki, pem: Pem | None) -> grpc.ChannelCredentials:
    return security.credentials(pki.ca, pem.cert, pem.key) if pem else security.credentials(pki.ca)


def _generate(address: str, credentials: grpc.ChannelCredentials, token: str = TOKEN) -> tuple[list[int], int]:
    with CoordinatorClient(address, credentials=credentials, token=token, timeout=120) as client:
        chunks = list(client.generate(prompt_token_ids=PROMPT, max_tokens=4, ignore_eos=True))
    return [t for c in chunks for t in c.token_ids], chunks[0].prefill_computed_tokens


def test_generation_over_tls_without_client_certificates(pki: Pki, model: Path) -> None:
    with LocalMesh(2, "numpy", str(model), tls_cert=pki.executor.cert, tls_key=pki.executor.key, tls_roots=pki.ca,
                   kvstore=False) as mesh:
        tokens, computed = _generate(mesh.coordinator_address, security.credentials(pki.ca))
        assert len(tokens) == 4 and computed == len(PROMPT)
        with grpc.insecure_channel(mesh.coordinator_address) as channel, pytest.raises(grpc.RpcError) as info:
            coordinator_pb2_grpc.CoordinatorServiceStub(channel).Status(coordinator_pb2.StatusRequest(), timeout=5)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE  # plaintext never completes a TLS handshake


def test_generation_over_mutual_tls_seeds_from_the_kvstore(mtls_mesh: LocalMesh, pki: Pki) -> None:
    """Every hop is mutual TLS: coordinator -> executors, executor -> executor pushes, executor -> kvstore
    write-behind, coordinator -> kvstore lookups and kvstore -> executor seeding (the second generation)."""
    credentials = _client_credentials(pki, pki.client)
    first, computed = _generate(mtls_mesh.coordinator_address, credentials)
    assert computed == len(PROMPT)
    with KvStoreClient(mtls_mesh.kvstore_address, credentials=_client_credentials(pki, pki.coordinator)) as kv:
        deadline = time.monotonic() + 30
        while kv.stats().blocks < 2 * 2:  # 2 blocks on each of the 2 stages
            assert time.monotonic() < deadline, "the executors' write-behind never reached the store over mTLS"
            time.sleep(0.05)
    second, computed = _generate(mtls_mesh.coordinator_address, credentials)
    assert second == first
    assert computed == len(PROMPT) - 32


def test_a_wrong_or_missing_token_is_unauthenticated(mtls_mesh: LocalMesh, pki: Pki) -> None:
    credentials = _client_credentials(pki, pki.client)
    for token, reason in (("not-the-token", "BAD_TOKEN"), ("", "MISSING_TOKEN")):
        with pytest.raises(errors.Unauthenticated) as info:
            _generate(mtls_mesh.coordinator_address, credentials, token)
        assert info.value.reason == reason
    with CoordinatorClient(mtls_mesh.coordinator_address, credentials=credentials, token="nope") as client, \
            pytest.raises(errors.Unauthenticated):
        client.status()


def test_health_stays_open_without_a_token_and_in_plain_text(mtls_mesh: LocalMesh, pki: Pki, health_port: int) -> None:
    request = health_pb2.HealthCheckRequest()
    with grpc.secure_channel(mtls_mesh.coordinator_address, _client_credentials(pki, pki.client)) as channel:
        assert health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    plain = f"127.0.0.1:{health_port}"
    with grpc.insecure_channel(plain) as channel:
        assert health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:  # the health listener serves nothing else
            coordinator_pb2_grpc.CoordinatorServiceStub(channel).Status(coordinator_pb2.StatusRequest(), timeout=5,
                                                                        metadata=security.bearer(TOKEN))
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("who", ["rogue", "none", "plaintext"])
def test_mutual_tls_refuses_a_client_without_a_certificate_of_the_ca(mtls_mesh: LocalMesh, pki: Pki, who: str) -> None:
    for address in (mtls_mesh.coordinator_address, mtls_mesh.executor_addresses[0], mtls_mesh.kvstore_address):
        channel = (grpc.insecure_channel(address) if who == "plaintext" else
                   grpc.secure_channel(address, _client_credentials(pki, pki.rogue if who == "rogue" else None)))
        with channel, pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE, (address, who)


def test_an_executor_obeys_only_the_allowed_peers(mtls_mesh: LocalMesh, pki: Pki) -> None:
    """The client's certificate is signed by the CA but is not one of the executors' allowed peers: it may
    check health, never drive the stage protocol; the coordinator's certificate may."""
    address = mtls_mesh.executor_addresses[0]
    with grpc.secure_channel(address, _client_credentials(pki, pki.client)) as channel:
        with pytest.raises(grpc.RpcError) as info:
            stage_pb2_grpc.StageServiceStub(channel).Fence(stage_pb2.FenceRequest(incarnation=99, reason="rogue"),
                                                            timeout=5)
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert errors.from_rpc_error(info.value).reason == "PEER_NOT_ALLOWED"
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    with grpc.secure_channel(address, _client_credentials(pki, pki.coordinator)) as channel:
        status = stage_pb2_grpc.StageServiceStub(channel).Status(stage_pb2.StageServiceStatusRequest(), timeout=5)
        assert status.state == stage_pb2.AUTHORITY_STATE_ACTIVE  # the refused Fence never reached the executor


def test_server_security_flags_are_checked(tmp_path: Path, pki: Pki) -> None:
    def parse(*argv: str) -> bootstrap.ServerSecurity:
        p = argparse.ArgumentParser()
        bootstrap.add_arguments(p, auth_token=True)
        return bootstrap.from_args(p.parse_args(argv))

    with pytest.raises(errors.InvalidArgument, match="--tls-key"):
        parse("--tls-cert", pki.client.cert)
    with pytest.raises(errors.InvalidArgument, match="mutual TLS"):
        parse("--tls-cert", pki.client.cert, "--tls-key", pki.client.key, "--allowed-peers", "coordinator")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(errors.InvalidArgument, match="no token"):
        parse("--auth-token-file", str(empty))
    s = parse("--tls-cert", pki.client.cert, "--tls-key", pki.client.key, "--tls-ca", pki.ca, "--allowed-peers",
              "coordinator, kvstore", "--auth-token-file", pki.token_file)
    assert s.tls is not None and s.tls.ca is not None
    assert s.allowed_peers == {"coordinator", "kvstore"} and s.auth_token == TOKEN


def test_the_cli_speaks_mutual_tls_with_a_token(mtls_mesh: LocalMesh, pki: Pki) -> None:
    import json
    import subprocess
    import sys

    tls = ["--tls-ca", pki.ca, "--tls-cert", pki.client.cert, "--tls-key", pki.client.key]
    base = [sys.executable, "-m", "graphmesh.cli", "status", "--coordinator", mtls_mesh.coordinator_address, "--json"]
    ok = subprocess.run([*base, *tls, "--token", TOKEN], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ready"]
    refused = subprocess.run([*base, *tls, "--token", "wrong"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr
