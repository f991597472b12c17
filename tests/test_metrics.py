"""Every service's Prometheus endpoint, scraped before and after generations: the values move by what the
generations did (tokens streamed, one TTFT per request, one ExecuteStep per rank per step, KV blocks lent and
given back, blocks written behind and then found again)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from graphmesh import errors
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from graphmesh_server import telemetry
from tests.model_fixtures import make_tiny_llama

PROMPT = list(range(200, 240))  # two whole 16-token blocks
MAX_TOKENS = 5
EXECUTE_STEP = "/graphmesh.v1.StageService/ExecuteStep"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    path = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    # A pool of a few hundred blocks: the default (up to 512 MiB) costs the numpy backend a copy of it every step
    with LocalMesh(2, "numpy", str(path), metrics=True, extra_executor_args=("--kv-cache-bytes", "4Mi")) as m:
        yield m


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample's value; 0 for a labelled series that has not been observed yet."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def rpc_count(samples: Samples, method: str) -> float:
    return sum(v for (name, labels), v in samples.items()
               if name == "graphmesh_rpc_server_seconds_count" and ("method", method) in labels)


def _generate(mesh: LocalMesh) -> int:
    with CoordinatorClient(mesh.coordinator_address) as client:
        chunks = list(client.generate(prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True))
    return sum(len(c.token_ids) for c in chunks)


def _scrape_all(mesh: LocalMesh) -> dict[str, Samples]:
    return {name: scrape(port) for name, port in mesh.metrics_ports.items()}


def _wait(mesh: LocalMesh, service: str, done: Callable[[Samples], bool], timeout_s: float = 30.0) -> Samples:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(mesh.metrics_ports[service])
        if done(samples):
            return samples
        assert time.monotonic() < deadline, f"{service} metrics never reached the expected values"
        time.sleep(0.1)


def test_every_service_serves_metrics(mesh: LocalMesh) -> None:
    assert set(mesh.metrics_ports) == {"kvstore", "executor-0", "executor-1", "coordinator"}
    samples = _scrape_all(mesh)
    assert value(samples["coordinator"], "graphmesh_incarnation") == 1
    assert value(samples["coordinator"], "graphmesh_mesh_ready") == 1
    for rank in (0, 1):
        executor = samples[f"executor-{rank}"]
        assert value(executor, "graphmesh_incarnation") == 1
        assert value(executor, "graphmesh_poisoned") == 0
        assert rpc_count(executor, "/graphmesh.v1.StageService/Install") == 1
    assert ("graphmesh_kv_blocks", ()) in samples["kvstore"]


def test_a_generation_moves_the_counters(mesh: LocalMesh) -> None:
    before = _scrape_all(mesh)
    streamed = _generate(mesh)
    assert streamed == MAX_TOKENS
    after = _scrape_all(mesh)
    c0, c1 = before["coordinator"], after["coordinator"]
    assert value(c1, "graphmesh_tokens_generated_total") - value(c0, "graphmesh_tokens_generated_total") == streamed
    assert value(c1, "graphmesh_ttft_seconds_count") - value(c0, "graphmesh_ttft_seconds_count") == 1
    assert value(c1, "graphmesh_inter_token_seconds_count") - value(c0, "graphmesh_inter_token_seconds_count") == \
        streamed - 1
    assert value(c1, "graphmesh_ttft_seconds_sum") > value(c0, "graphmesh_ttft_seconds_sum")
    generate = "/graphmesh.v1.CoordinatorService/Generate"
    assert value(c1, "graphmesh_rpc_server_seconds_count", method=generate, code="OK") - \
        value(c0, "graphmesh_rpc_server_seconds_count", method=generate, code="OK") == 1
    assert value(c1, "graphmesh_active_sessions") == 0 and value(c1, "graphmesh_running_sessions") == 0
    assert value(c1, "graphmesh_waiting_sessions") == 0
    # A session alone in the mesh, its prompt within one step's token budget: its prefill, then decode runs (up to
    # 4 tokens a step on CPU executors). Every step is one ExecuteStep on every rank, every token one push forward,
    # and every token a run decodes past its first one push of the tokens fed back to the first rank.
    steps = value(c1, "graphmesh_steps_total") - value(c0, "graphmesh_steps_total")
    fed_back = value(c1, "graphmesh_decode_run_tokens_total") - value(c0, "graphmesh_decode_run_tokens_total")
    assert steps + fed_back == streamed and steps < streamed
    # by kind: the prompt's step, then the rest as decode runs (nothing proposed); one row each, each with its time
    kinds = {k: [value(c1, f"graphmesh_{m}_total", kind=k) - value(c0, f"graphmesh_{m}_total", kind=k)
                 for m in ("steps_by_kind", "step_rows", "step_seconds")] for k in ("prompt", "decode_run", "decode", "verify")}
    assert kinds["prompt"][:2] == [1, 1] and kinds["decode_run"][0] >= 1 and kinds["verify"][0] == 0
    assert sum(k[0] for k in kinds.values()) == steps and all(k[1] == k[0] for k in kinds.values())
    assert all(k[2] > 0 for k in kinds.values() if k[0])
    # one session's steps follow one another: the time with a step in flight is their seconds' sum, no more
    busy = value(c1, "graphmesh_steps_busy_seconds_total") - value(c0, "graphmesh_steps_busy_seconds_total")
    assert 0 < busy <= sum(k[2] for k in kinds.values()) + 1e-3
    for rank in (0, 1):  # each stage compiled the shapes of those steps as they first came, and timed it
        compiled = after[f"executor-{rank}"]
        assert value(compiled, "graphmesh_stage_compiles_total") >= 1
        assert value(compiled, "graphmesh_stage_compile_seconds_total") > 0
    for rank in (0, 1):
        e0, e1 = before[f"executor-{rank}"], after[f"executor-{rank}"]
        assert rpc_count(e1, EXECUTE_STEP) - rpc_count(e0, EXECUTE_STEP) == steps
    for rank, pushes in ((1, streamed), (0, fed_back)):  # over gRPC, or the boundary link once it is open
        e0, e1 = before[f"executor-{rank}"], after[f"executor-{rank}"]
        assert rpc_count(e1, "/graphmesh.v1.StageService/PushBoundary") - \
            rpc_count(e0, "/graphmesh.v1.StageService/PushBoundary") + \
            value(e1, "graphmesh_boundary_link_pushes_total") - value(e0, "graphmesh_boundary_link_pushes_total") == pushes
    # The session's KV blocks go back to every pool once it ends (released after the stream closes).
    pools = [_wait(mesh, f"executor-{rank}", lambda s: value(s, "graphmesh_kv_pool_free_blocks") ==
                   value(s, "graphmesh_kv_pool_blocks") > 0) for rank in (0, 1)]
    c2 = _wait(mesh, "coordinator", lambda s: value(s, "graphmesh_kv_blocks_used") == 0)
    assert value(c2, "graphmesh_kv_blocks_total") == min(value(p, "graphmesh_kv_pool_blocks") for p in pools)
    # the prefill's two whole blocks are committed with the second token and written behind, on both stages
    kv = _wait(mesh, "kvstore", lambda s: value(s, "graphmesh_kv_blocks") >= 4)
    assert value(kv, "graphmesh_kv_memory_bytes") > 0
    assert rpc_count(kv, "/graphmesh.v1.KvStoreService/PutBlocks") >= 2


def test_a_repeated_prompt_raises_the_hit_ratio(mesh: LocalMesh) -> None:
    _generate(mesh)
    _wait(mesh, "kvstore", lambda s: value(s, "graphmesh_kv_blocks") >= 4)
    before = scrape(mesh.metrics_ports["kvstore"])
    _generate(mesh)
    after = scrape(mesh.metrics_ports["kvstore"])
    # both stages look up (and then read) the prompt's 32 whole-block tokens, and find all of them
    assert value(after, "graphmesh_kv_hit_tokens_total") - value(before, "graphmesh_kv_hit_tokens_total") >= 2 * 32
    assert value(after, "graphmesh_kv_miss_tokens_total") == value(before, "graphmesh_kv_miss_tokens_total")
    assert value(after, "graphmesh_kv_hit_ratio") >= value(before, "graphmesh_kv_hit_ratio") > 0
    assert rpc_count(after, "/graphmesh.v1.KvStoreService/SeedStages") - \
        rpc_count(before, "/graphmesh.v1.KvStoreService/SeedStages") == 1  # one call seeds every stage


def test_a_refused_request_is_counted_with_its_status(mesh: LocalMesh) -> None:
    generate = "/graphmesh.v1.CoordinatorService/Generate"
    before = scrape(mesh.metrics_ports["coordinator"])
    with CoordinatorClient(mesh.coordinator_address) as client, pytest.raises(errors.NotFound):
        list(client.generate(prompt_token_ids=PROMPT, max_tokens=1, model="no-such-model"))
    after = scrape(mesh.metrics_ports["coordinator"])
    assert value(after, "graphmesh_rpc_server_seconds_count", method=generate, code="NOT_FOUND") - \
        value(before, "graphmesh_rpc_server_seconds_count", method=generate, code="NOT_FOUND") == 1
    assert value(after, "graphmesh_tokens_generated_total") == value(before, "graphmesh_tokens_generated_total")


def test_many_observations_at_once_are_those_one_at_a_time() -> None:
    """telemetry.observe_many against prometheus_client's own observe, called count times: the same buckets (a
    bound itself included, +Inf), sum and count, with and without labels; a count of 0 observes nothing."""
    def exposition(observe: Callable[[Histogram, float, int], None]) -> bytes:
        registry = CollectorRegistry()
        plain = Histogram("h_seconds", "h", buckets=(0.005, 0.25, 1), registry=registry)
        labelled = Histogram("l_seconds", "l", ["kind"], buckets=(0.5, 2), registry=registry)
        for amount, count in ((0.0, 31), (0.005, 3), (0.0075, 2), (0.25, 1), (0.5, 4), (7.0, 5), (0.125, 0)):
            observe(plain, amount, count)
            observe(labelled.labels("a"), amount, count)
        return b"\n".join(line for line in generate_latest(registry).splitlines() if b"_created" not in line)

    def one_at_a_time(histogram: Histogram, amount: float, count: int) -> None:
        for _ in range(count):
            histogram.observe(amount)

    single = exposition(one_at_a_time)
    assert b'h_seconds_bucket{le="0.005"} 34.0' in single and b'h_seconds_count 46.0' in single
    assert exposition(telemetry.observe_many) == single
