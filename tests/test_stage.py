"""The stage protocol in-process (no gRPC): two StageRuntimes wired by a direct pusher, against transformers."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from graphmesh import plan as dag
from graphmesh.errors import FailedPrecondition
from graphmesh.protocol import ProtocolError
from graphmesh_executor.backends.torch_backend import TorchExecutable
from graphmesh_executor.executable import DeviceValue, Executable, HostOutput
from graphmesh_executor.fencing import AuthorityState, SessionPhase
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_servicer import BoundaryPusher
from graphmesh_executor.stage_types import Boundary, KvBlocks, Queue, Sampling, StageSpec, StepResult, StepRow
from tests.host_slots import HostSlots
from tests.model_fixtures import make_tiny_llama
from tests.stage_pipeline import two_stages

KV_CACHE_BYTES = 1 << 20  # 1 MiB: hundreds of blocks for these tiny layers (the default pool would be 512 MiB)
_step_ids = itertools.count(1)  # never reused, like the coordinator's


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _pipeline(path: Path, split: int, n_layers: int) -> list[StageRuntime]:
    return two_stages(path, "numpy", split, n_layers, kv_cache_bytes=KV_CACHE_BYTES)


def _step(runtimes: list[StageRuntime], rows: list[StepRow], timeout_s: float = 5.0) -> StepResult:
    # rank 1 waits for its boundary, so run rank 0 first in-process: its push lands in rank 1's mailbox
    step_id = next(_step_ids)
    runtimes[0].execute_step(1, step_id, rows, False, timeout_s)
    return runtimes[1].execute_step(1, step_id, rows, False, timeout_s)


def _invoke(runtimes: list[StageRuntime], session: str, epoch: int, commit: int, start: int, ids: list[int]) -> int:
    return _step(runtimes, [StepRow(session, epoch, commit, start, ids)]).tokens[0]


def _txn(runtime: StageRuntime, session: str) -> tuple[SessionPhase, int, int]:
    t = dict(runtime.sessions())[session].txn
    return t.phase, t.epoch, t.kv_length


def test_two_stage_greedy_matches_transformers(tiny_llama: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    prompt = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=70, do_sample=False, min_new_tokens=70)[0, len(prompt):]
    runtimes = _pipeline(tiny_llama, 1, hf.config.num_hidden_layers)
    tokens, pending, start = [], prompt, 0
    for epoch in range(1, 71):  # 11 + 70 tokens fill five KV blocks of 16 on both ranks
        token = _invoke(runtimes, "s", epoch, epoch - 1, start, pending)
        start += len(pending)
        tokens.append(token)
        pending = [token]
    assert tokens == expected.tolist()
    for runtime in runtimes:
        # epoch 70 is still open: 79 committed rows, its 80th row written into the fifth block
        assert _txn(runtime, "s") == (SessionPhase.IN_TXN, 70, len(prompt) + 68)
        assert len(runtime.pool.table("s")) == 5


def _run_pipeline(path: Path, ranks: int, abort_at: int = 0, delay_s: float = 0.0, backend: str = "numpy",
                  device_links: frozenset[str] = frozenset(), sent: list[Boundary] | None = None,
                  queued: HostSlots | None = None, queue_to: frozenset[str] = frozenset(),
                  runs: list[tuple[str, int, int]] | None = None) -> list[StageRuntime]:
    """`ranks` stages over the tiny model's 2 layers, wired so the last can feed a decode run's tokens to the first.
    `abort_at` > 0: instead of feeding back the tokens of that iteration, the first run is aborted on every rank.
    `delay_s` > 0: every bundle between ranks arrives that much later (a link's latency). `device_links`: the ranks
    (addresses) whose links take device values (as one that maps the sender's GPU), handed over as they are. `sent`:
    every bundle pushed. `queue_to`: the ranks whose links queue decode runs, through `queued`'s slots in host
    memory (a queued run's bundles are sent as the first one's frame sends them: all accepted at once); `runs`: each
    run queued (address, its first bundle's iteration, bundles). With `abort_at` too, the sender of a queued run stops
    writing at that iteration (as though it died) and every rank aborts the run."""
    runtimes: list[StageRuntime] = []
    aborts = [abort_at] if abort_at else []
    ends = {address: queued.link() for address in queue_to} if queued is not None else {}

    def queue(address: str, incarnation: int, boundary: Boundary, bundles: int, timeout_s: float,
              delivered: Callable[[Exception | None], None]) -> Queue | None:
        if address not in ends:
            return None
        if sent is not None:
            sent.append(boundary)
        sender, receiver = ends[address]
        made = sender.queue(BoundaryPusher._request(incarnation, boundary, data=False), list(boundary.values.values()),
                            bundles)
        assert made is not None
        payload, run = made
        for k, values in enumerate(receiver.queued(payload)[1]):
            runtimes[int(address)].accept_boundary(incarnation, replace(
                boundary, iteration=boundary.iteration + k, values=dict(zip(boundary.values, values))))
        delivered(None)
        if runs is not None:
            runs.append((address, boundary.iteration, bundles))
        if aborts and boundary.iteration <= aborts[0] < boundary.iteration + bundles:
            def abort() -> None:
                for r in runtimes:
                    r.abort_step(incarnation, boundary.step_id, [])
            return _Dying(run, aborts.pop() - boundary.iteration - 1, abort)
        return run

    def push(address: str, incarnation: int, boundary: Boundary, timeout_s: float,
             delivered: Callable[[Exception | None], None]) -> None:
        if sent is not None:
            sent.append(boundary)
        if delay_s:
            threading.Timer(delay_s, deliver, (address, incarnation, boundary, delivered)).start()
        else:
            deliver(address, incarnation, boundary, delivered)

    def deliver(address: str, incarnation: int, boundary: Boundary,
                delivered: Callable[[Exception | None], None]) -> None:
        if dag.ACTIVATION not in boundary.values and boundary.iteration in aborts:
            aborts.clear()
            for r in runtimes:
                r.abort_step(incarnation, boundary.step_id, [])
        else:
            runtimes[int(address)].accept_boundary(incarnation, boundary)
        delivered(None)

    runtimes = [StageRuntime(backend, pusher=push, kv_cache_bytes=KV_CACHE_BYTES,
                             device_links=lambda address: address in device_links, queue=queue) for _ in range(ranks)]
    if ranks == 1:
        runtimes[0].install(1, 0, 1, StageSpec(str(path), 0, 2, True, True))
    else:
        plan = dag.pipeline([(0, 1), (1, 2)], ["0", "1"], 64)
        runtimes[0].install(1, 0, 2, StageSpec(str(path), 0, 1, True, False), plan)
        runtimes[1].install(1, 1, 2, StageSpec(str(path), 1, 2, False, True), plan)
    return runtimes


class _Dying:
    """A queued run whose sender stops writing after `puts` more bundles (its first was written), as though its
    process died: then every rank aborts the step, once the ranks' engines are waiting for what will never come."""

    def __init__(self, run: Queue, puts: int, abort: Callable[[], None]) -> None:
        self._run, self._puts, self._abort = run, puts, abort

    def put(self, values: list[Any]) -> None:
        if self._puts:
            self._puts -= 1
            self._run.put(values)
        elif self._puts == 0:
            self._puts = -1
            threading.Timer(0.3, self._abort).start()

    def end(self) -> None:
        self._run.end()

    def release(self) -> None:
        self._run.release()


def _run(runtimes: list[StageRuntime], rows: list[StepRow], steps: int, timeout_s: float = 5.0,
         alone: bool = True) -> StepResult:
    """One step on every rank at once (a decode run's first rank waits for what the last one feeds back), alone
    (ExecuteStepRequest.alone) unless told: no other step is in flight meanwhile."""
    step_id = next(_step_ids)
    with ThreadPoolExecutor(len(runtimes)) as pool:
        calls = [pool.submit(r.execute_step, 1, step_id, rows, False, timeout_s, steps, frozenset(), alone)
                 for r in runtimes]
        return [c.result() for c in calls][-1]


def _one_at_a_time(path: Path, prompts: dict[str, list[int]], sampling: dict[str, Sampling]) -> dict[str, list[int]]:
    """Each session's first 7 tokens, one token a step over two stages: the tokens a decode run must sample."""
    reference = _pipeline(path, 1, 2)
    want: dict[str, list[int]] = {}
    for sid, prompt in prompts.items():
        tokens = [_step(reference, [StepRow(sid, 1, 0, 0, prompt, sampling[sid])]).tokens[0]]
        for epoch in range(2, 8):
            tokens += _step(reference, [StepRow(sid, epoch, epoch - 1, len(prompt) + epoch - 2, [tokens[-1]],
                                                sampling[sid])]).tokens
        want[sid] = tokens
    return want


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_decode_run_samples_what_single_steps_do_and_commits_or_rolls_back_whole(tiny_llama: Path,
                                                                                   ranks: int) -> None:
    sampled = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    prompts = {"a": [5, 17, 99], "b": [8, 9]}
    want = _one_at_a_time(tiny_llama, prompts, {"a": Sampling(), "b": sampled})
    runtimes = _run_pipeline(tiny_llama, ranks)
    first = _run(runtimes, [StepRow("a", 1, 0, 0, prompts["a"]), StepRow("b", 1, 0, 0, prompts["b"], sampled)], 1)
    rows = [StepRow("a", 2, 1, 3, [first.tokens[0]]), StepRow("b", 2, 1, 2, [first.tokens[1]], sampled)]
    run = _run(runtimes, rows, 5)
    assert [[t, *r] for t, r in zip(first.tokens, run.run_tokens)] == [want["a"][:6], want["b"][:6]]
    assert run.tokens == [r[0] for r in run.run_tokens] and run.kv_lengths == [3 + 5, 2 + 5]
    for r in runtimes:  # one epoch over the whole run: open until the next step folds its commit
        assert _txn(r, "a") == (SessionPhase.IN_TXN, 2, 3)
    after = _run(runtimes, [StepRow("a", 3, 2, 8, [run.run_tokens[0][-1]]),
                            StepRow("b", 3, 2, 7, [run.run_tokens[1][-1]], sampled)], 1)
    assert after.tokens == [want["a"][6], want["b"][6]]
    for r in runtimes:
        assert _txn(r, "a") == (SessionPhase.IN_TXN, 3, 8) and _txn(r, "b") == (SessionPhase.IN_TXN, 3, 7)
        assert dict(r.sessions())["a"].tokens == prompts["a"] + want["a"][:5]  # every rank knows the run's tokens


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_row_takes_its_share_of_a_decode_run_and_rides_along_to_the_end(tiny_llama: Path, ranks: int) -> None:
    """A row whose share of a run is shorter (StepRow.steps: its last outputs) keeps only that many tokens and KV
    rows: its next step starts where its share ended and samples what single steps would, over one rank (chained)
    and two (the tokens fed back). Its share ends with its first block (16 tokens): riding along must not reach
    into blocks it does not hold."""
    sampled = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    prompts = {"a": list(range(5, 19)), "b": [8, 9]}
    want = _one_at_a_time(tiny_llama, prompts, {"a": Sampling(), "b": sampled})
    runtimes = _run_pipeline(tiny_llama, ranks)
    first = _run(runtimes, [StepRow("a", 1, 0, 0, prompts["a"]), StepRow("b", 1, 0, 0, prompts["b"], sampled)], 1)
    run = _run(runtimes, [StepRow("a", 2, 1, 14, [first.tokens[0]], steps=2),
                          StepRow("b", 2, 1, 2, [first.tokens[1]], sampled)], 5)
    assert run.run_tokens == [want["a"][1:3], want["b"][1:6]] and run.kv_lengths == [14 + 2, 2 + 5]
    after = _run(runtimes, [StepRow("a", 3, 2, 16, [want["a"][2]]), StepRow("b", 3, 2, 7, [want["b"][5]], sampled)],
                 1)
    assert after.tokens == [want["a"][3], want["b"][6]]
    for r in runtimes:
        assert _txn(r, "a") == (SessionPhase.IN_TXN, 3, 16)
        assert dict(r.sessions())["a"].tokens == prompts["a"] + want["a"][:2]  # the KV rows of its share alone


def _outputs_land_later(monkeypatch: pytest.MonkeyPatch, hold: Callable[[int], None]) -> list[str]:
    """Every stage run's output comes back not ready, as TorchExecutable.run_async's do on CUDA: the result is read
    where Engine.after puts it (the engine's completion thread). `hold(n)` runs as the n-th output is read.
    Returns the names of the threads that read them."""
    readers: list[str] = []

    def later(self: Executable[Any], inputs: dict[str, np.ndarray], index: int, extent: tuple[int, int] | None = None,
              light: bool = False) -> HostOutput:
        value = self.run(inputs, [index], typed=True, extent=extent, light=light)[0]
        n = len(readers)
        readers.append("")

        def wait() -> np.ndarray:
            readers[n] = threading.current_thread().name
            hold(n)
            return value
        return HostOutput(wait=wait)
    monkeypatch.setattr(Executable, "run_async", later)
    return readers


def _within(seconds: float, condition: Callable[[], bool], why: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, why
        time.sleep(0.001)


def test_outputs_read_on_the_completion_thread_give_the_same_tokens(tiny_llama: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode run over two ranks whose every output lands on the engine's completion thread samples what single
    steps do, and every rank still knows the run's tokens."""
    sampled = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    prompts = {"a": [5, 17, 99], "b": [8, 9]}
    want = _one_at_a_time(tiny_llama, prompts, {"a": Sampling(), "b": sampled})
    readers = _outputs_land_later(monkeypatch, lambda n: None)
    runtimes = _run_pipeline(tiny_llama, 2)
    first = _run(runtimes, [StepRow("a", 1, 0, 0, prompts["a"]), StepRow("b", 1, 0, 0, prompts["b"], sampled)], 1)
    run = _run(runtimes, [StepRow("a", 2, 1, 3, [first.tokens[0]]), StepRow("b", 2, 1, 2, [first.tokens[1]], sampled)],
               5)
    assert [[t, *r] for t, r in zip(first.tokens, run.run_tokens)] == [want["a"][:6], want["b"][:6]]
    after = _run(runtimes, [StepRow("a", 3, 2, 8, [run.run_tokens[0][-1]]),
                            StepRow("b", 3, 2, 7, [run.run_tokens[1][-1]], sampled)], 1)
    assert after.tokens == [want["a"][6], want["b"][6]]
    for r in runtimes:
        assert dict(r.sessions())["a"].tokens == prompts["a"] + want["a"][:5]
    assert len(readers) == 2 * (1 + 5 + 1) and all(name.endswith("-done") for name in readers), readers


@pytest.mark.parametrize("ahead", ["01", "0", "1"], ids=["both-ways", "feedback-only", "forward-only"])
def test_a_decode_run_across_ranks_runs_ahead_on_device_values_with_the_same_tokens(
        tiny_llama: Path, ahead: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks whose links map one another's GPU run a decode run ahead: each iteration's output goes on as a device
    value when it is launched (the last rank's tokens fed back so too), and the tokens fed to each rank reach its
    host at the run's end. Here torch on the CPU stands for the GPU, the values handed over in-process as they are.
    The run's tokens, every rank's session tokens and a later step's tokens are those of the same ranks over host
    arrays, greedy and seeded; also where only one of the two links takes device values (the first rank then hands
    on, with its activation from the host, the tokens that came to it on the device)."""
    monkeypatch.setattr(TorchExecutable, "keeps_on_device", lambda self: True)
    sampled = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    prompts = {"a": [5, 17, 99], "b": [8, 9]}

    def serve(links: str) -> tuple[list[Any], list[Boundary]]:
        sent: list[Boundary] = []
        runtimes = _run_pipeline(tiny_llama, 2, backend="torch", device_links=frozenset(links), sent=sent)
        first = _run(runtimes, [StepRow("a", 1, 0, 0, prompts["a"]), StepRow("b", 1, 0, 0, prompts["b"], sampled)],
                     1)
        run = _run(runtimes, [StepRow("a", 2, 1, 3, [first.tokens[0]]),
                              StepRow("b", 2, 1, 2, [first.tokens[1]], sampled)], 5)
        after = _run(runtimes, [StepRow("a", 3, 2, 8, [run.run_tokens[0][-1]]),
                                StepRow("b", 3, 2, 7, [run.run_tokens[1][-1]], sampled)], 1)
        held = [dict(r.sessions())[sid].tokens for r in runtimes for sid in prompts]
        return [first.tokens, run.run_tokens, after.tokens, held], sent

    over_host, host_sent = serve("")
    got, ahead_sent = serve(ahead)
    assert got == over_host
    assert over_host[3][0] == prompts["a"] + [over_host[0][0], *over_host[1][0][:4]]  # the run's fed tokens are held
    assert not any(isinstance(v, DeviceValue) for b in host_sent for v in b.values.values())
    # rank 1 feeds the run's 4 later iterations back (its last feeds nothing back), rank 0 hands on 5 activations
    on_device = [(b.iteration, sorted(k for k, v in b.values.items() if isinstance(v, DeviceValue)))
                 for b in ahead_sent if any(isinstance(v, DeviceValue) for v in b.values.values())]
    back = [(i, [dag.RUN_TOKENS]) for i in range(1, 5)] if "0" in ahead else []
    fed = [dag.RUN_TOKENS] if "0" in ahead else []  # the tokens rank 0 hands on as they came to it
    forth = [(0, [dag.ACTIVATION])] + [(i, [dag.ACTIVATION, *fed]) for i in range(1, 5)] if "1" in ahead else \
        [(i, fed) for i in range(1, 5)]
    assert sorted(on_device) == sorted(back + forth), on_device


@pytest.mark.parametrize("queue_to", ["01", "1", "0"], ids=["both-ways", "forward-only", "feedback-only"])
def test_a_decode_run_queued_on_the_device_has_the_tokens_of_one_run_ahead(
        tiny_llama: Path, queue_to: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a link can queue a decode run (two executors on one GPU), a run's bundles over it from its second
    iteration on go as one queued run: the first's frame announces them, and each later one is written into the
    run's slot as its iteration launches, read by the receiver's run through the slot's words. The tokens of two runs
    in a row (the second through the slots the first ended), every rank's session tokens and a later step's are those
    of the same ranks running ahead bundle by bundle, greedy and seeded. Here torch on the CPU stands for the GPU and
    the slots lie in host memory (test_transport.py's CUDA test runs the words on a GPU). A step the coordinator did
    not send alone is never queued: it runs ahead, with the same tokens."""
    monkeypatch.setattr(TorchExecutable, "keeps_on_device", lambda self: True)
    sampled = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    prompts = {"a": [5, 17, 99], "b": [8, 9]}

    def serve(queue_to: str, alone: bool = True) -> tuple[list[Any], list[tuple[str, int, int]]]:
        runs: list[tuple[str, int, int]] = []
        runtimes = _run_pipeline(tiny_llama, 2, backend="torch", device_links=frozenset("01"),
                                 queued=HostSlots(monkeypatch) if queue_to else None, queue_to=frozenset(queue_to),
                                 runs=runs)
        first = _run(runtimes, [StepRow("a", 1, 0, 0, prompts["a"]), StepRow("b", 1, 0, 0, prompts["b"], sampled)],
                     1)
        run = _run(runtimes, [StepRow("a", 2, 1, 3, [first.tokens[0]]),
                              StepRow("b", 2, 1, 2, [first.tokens[1]], sampled)], 5, alone=alone)
        again = _run(runtimes, [StepRow("a", 3, 2, 8, [run.run_tokens[0][-1]]),
                                StepRow("b", 3, 2, 7, [run.run_tokens[1][-1]], sampled)], 4, alone=alone)
        after = _run(runtimes, [StepRow("a", 4, 3, 12, [again.run_tokens[0][-1]]),
                                StepRow("b", 4, 3, 11, [again.run_tokens[1][-1]], sampled)], 1)
        held = [dict(r.sessions())[sid].tokens for r in runtimes for sid in prompts]
        return [first.tokens, run.run_tokens, again.run_tokens, after.tokens, held], runs

    ahead, none = serve("")
    got, runs = serve(queue_to)
    assert got == ahead and not none
    assert ahead[4][0] == prompts["a"] + [ahead[0][0], *ahead[1][0], *ahead[2][0][:-1]]  # fed tokens held
    # each run, each way queued: its bundles from iteration 1 (the first rank's iteration 0 hands on no tokens)
    assert sorted(runs) == sorted((address, 1, n) for address in queue_to for n in (4, 3)), runs
    assert serve(queue_to, alone=False) == (ahead, [])


def test_two_runs_in_flight_at_once_are_never_queued_and_keep_their_tokens(tiny_llama: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two decode runs in flight at once over links that queue runs (two micro-batches, as a coordinator with
    --steps-in-flight 2 sends them): neither step was sent alone, so neither is queued, and each runs ahead with the
    tokens it has alone (where both are queued). Queued together, each rank's stream (here its engine thread) would
    take the two runs' waits in the order they reached it, and the ranks could each wait for a word the other writes
    only after its own wait (it hung so on an H100)."""
    monkeypatch.setattr(TorchExecutable, "keeps_on_device", lambda self: True)
    sampled = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    prompts = {"a": ([5, 17, 99], Sampling()), "b": ([8, 9], sampled)}

    def serve(together: bool) -> tuple[list[list[int]], list[tuple[str, int, int]]]:
        runs: list[tuple[str, int, int]] = []
        runtimes = _run_pipeline(tiny_llama, 2, backend="torch", device_links=frozenset("01"),
                                 queued=HostSlots(monkeypatch), queue_to=frozenset("01"), runs=runs)
        steps = [[StepRow(sid, 2, 1, len(prompt), [_run(runtimes, [StepRow(sid, 1, 0, 0, prompt, sampling)], 1)
                                                    .tokens[0]], sampling)] for sid, (prompt, sampling) in prompts.items()]
        if not together:
            return [_run(runtimes, rows, 5).run_tokens[0] for rows in steps], runs
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(_run, runtimes, rows, 5, 5.0, False) for rows in steps]
            return [c.result().run_tokens[0] for c in calls], runs

    alone, queued = serve(together=False)
    together, none = serve(together=True)
    assert together == alone and len(queued) == 4 and not none, (queued, none)


def test_the_engine_launches_another_step_while_an_output_is_on_its_way(tiny_llama: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step's output is held until a second step's run has been launched: the engine thread does not wait
    for an output it only hands on (on CUDA, a rank's other micro-batch goes to the device meanwhile)."""
    second_launched = threading.Event()

    def hold(n: int) -> None:
        if n == 0:
            second_launched.wait(10)
    readers = _outputs_land_later(monkeypatch, hold)
    runtime = _run_pipeline(tiny_llama, 1)[0]
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(runtime.execute_step, 1, next(_step_ids), [StepRow("a", 1, 0, 0, [5, 17, 99])], False, 20.0)
        _within(10, lambda: len(readers) == 1, "the first step's run was never launched")
        b = pool.submit(runtime.execute_step, 1, next(_step_ids), [StepRow("b", 1, 0, 0, [8, 9])], False, 20.0)
        _within(10, lambda: len(readers) == 2, "the engine waited for the first output before the second launch")
        second_launched.set()
        assert a.result().tokens and b.result().tokens
    assert readers[0].endswith("-done") and readers[1].endswith("-done")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.parametrize("greedy", [False, True], ids=["one-sampled", "greedy"])
@pytest.mark.parametrize("backend,device", [("numpy", "cpu"), ("torch", "cpu"), pytest.param(
    "torch", "cuda:0", marks=pytest.mark.skipif(not _cuda(), reason="needs a CUDA device"))])
def test_a_one_rank_decode_run_chains_its_iterations_with_the_tokens_of_one_at_a_time(
        tiny_llama: Path, backend: str, device: str, greedy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank holding every layer runs a decode run's iterations as one chain (on a GPU each iteration's ids come
    from the tokens the one before sampled without leaving the device, one read back at the end): the tokens, KV
    lengths and the next step's tokens are those of the same runs iteration by iteration. Three runs a session, so
    that on CUDA the chain replays captured graphs too (where every row is greedy: a sampled row runs eagerly);
    three sessions, so that a bucket of four pads one row (what a padded row samples is never fed on)."""
    sampled = Sampling() if greedy else Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    chained: list[int] = []
    compute_chain = StageRuntime._compute_chain

    def spy(self: StageRuntime, runs: list[Any]) -> Any:
        chained.append(len(runs))
        return compute_chain(self, runs)
    monkeypatch.setattr(StageRuntime, "_compute_chain", spy)
    got = []
    for chain in (True, False):
        if not chain:
            monkeypatch.setattr(StageRuntime, "_chains", lambda self, step: False)
        runtime = StageRuntime(backend, device, kv_cache_bytes=KV_CACHE_BYTES)
        runtime.install(1, 0, 1, StageSpec(str(tiny_llama), 0, 2, True, True, dtype="f32"))
        prompts = {"a": [5, 17, 99], "b": [8, 9], "c": [40, 41, 42, 43]}
        sampling = {"a": Sampling(), "b": sampled, "c": Sampling()}
        first = _run([runtime], [StepRow(sid, 1, 0, 0, prompt, sampling[sid]) for sid, prompt in prompts.items()], 1)
        tokens, lengths = [[t] for t in first.tokens], [len(p) for p in prompts.values()]
        for epoch in range(2, 6):
            rows = [StepRow(sid, epoch, epoch - 1, n, [t[-1]], sampling[sid])
                    for sid, n, t in zip(prompts, lengths, tokens)]
            if epoch == 5:  # the next step's tokens: each session's KV holds what the runs sampled
                got.append((tokens, lengths, _run([runtime], rows, 1).tokens))
                break
            run = _run([runtime], rows, 6)
            for t, r in zip(tokens, run.run_tokens):
                t.extend(r)
            lengths = list(run.kv_lengths)
        if device.startswith("cuda") and greedy:  # the decode runs replayed captured graphs, chained or not
            assert any(getattr(exe, "_captures", None) for exe in runtime._executables.values()), "no CUDA graph replayed"
    assert chained == [6, 6, 6], chained  # every run chained when chaining is on, none when off
    assert got[0][1] == [3 + 18, 2 + 18, 4 + 18], got[0][1]
    assert got[0] == got[1], got


def test_a_stage_whose_table_width_costs_nothing_meets_every_shape_at_load(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a block table's width costs nothing (on CUDA; forced here on the host), one width serves every run and
    the load compiles and runs every bucket of the warm-up's sizes over padding: steps within them compile nothing,
    and their tokens are those of a stage without either (the padding wrote nothing but the scratch block)."""
    from graphmesh_executor import stage_inputs
    from graphmesh_executor.backends.torch_backend import TorchExecutable

    prompts = {"a": list(range(5, 40)), "b": [8, 9], "c": [40, 41, 42, 43]}
    sampling = {"a": Sampling(), "b": Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7), "c": Sampling()}
    got = []
    for wide in (False, True):
        if wide:
            monkeypatch.setattr(TorchExecutable, "reads_own_blocks", lambda self: True)
            monkeypatch.setattr(stage_inputs, "WARM_SEQS", 4)
            monkeypatch.setattr(stage_inputs, "WARM_TOKENS", 64)
        runtime = StageRuntime("torch", "cpu", kv_cache_bytes=KV_CACHE_BYTES)
        runtime.install(1, 0, 1, StageSpec(str(tiny_llama), 0, 2, True, True, dtype="f32"))
        compiled = runtime.compiles
        first = _run([runtime], [StepRow(sid, 1, 0, 0, prompt, sampling[sid]) for sid, prompt in prompts.items()], 1)
        tokens, lengths = [[t] for t in first.tokens], [len(p) for p in prompts.values()]
        for epoch in range(2, 5):  # a 3-row decode step, then decode runs of 4 (a bucket of 4 sessions)
            rows = [StepRow(sid, epoch, epoch - 1, n, [t[-1]], sampling[sid])
                    for sid, n, t in zip(prompts, lengths, tokens)]
            run = _run([runtime], rows, 1 if epoch == 2 else 4)
            for t, r in zip(tokens, run.run_tokens or [[x] for x in run.tokens]):
                t.extend(r)
            lengths = list(run.kv_lengths)
        widths = {key[2] for key in runtime._executables}
        if wide:
            # prompts of 16, 32 and 64 tokens over 1, 2 and 4 sessions, decodes of 1, 2 and 4 sessions (the holder
            # is not counted): one width, the context's
            max_blocks = runtime.max_blocks
            assert widths == {min(max_blocks, stage_inputs.TABLE_BLOCKS)}, widths
            assert compiled == 9 + 3 and runtime.compiles == compiled, (compiled, runtime.compiles)
        else:
            assert widths == {4}, widths  # the ladder's rung for the longest session (its 35-38 tokens: 3 blocks)
        got.append(tokens)
    assert got[0] == got[1], got


def test_a_decode_run_builds_each_next_iteration_while_its_boundary_is_on_the_way(tiny_llama: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank waiting for a decode run's next boundary builds that iteration's run ahead (its rows, positions,
    slots, tables) and runs it when the boundary comes: the same tokens as when nothing was built ahead. Only a
    run's first iteration is built row by row; each later one follows the run before it with array operations,
    and its inputs are exactly what the row-by-row build gives."""
    built: list[tuple[str, int]] = []
    run_inputs, next_run = StageRuntime._run_inputs, StageRuntime._next_run

    def spy_rows(self: StageRuntime, rows: list[StepRow], sample: bool, iteration: int, encoded: bool = False) -> Any:
        built.append(("rows", iteration))
        return run_inputs(self, rows, sample, iteration, encoded)

    def spy_next(self: StageRuntime, prev: Any, rows: list[StepRow], iteration: int) -> Any:
        run = next_run(self, prev, rows, iteration)
        full = run_inputs(self, rows, prev.sample, iteration)
        assert run is not None and run.inputs.keys() == full.inputs.keys()
        for name, value in run.inputs.items():
            assert np.array_equal(value, full.inputs[name]), name
        assert (run.exe, run.tokens, run.seqs, run.blocks, run.extent) == \
            (full.exe, full.tokens, full.seqs, full.blocks, full.extent)
        built.append(("next", iteration))
        return run
    monkeypatch.setattr(StageRuntime, "_run_inputs", spy_rows)
    monkeypatch.setattr(StageRuntime, "_next_run", spy_next)
    sampled = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    prepare = StageRuntime._prepare
    runs = []
    for ahead in (False, True):
        monkeypatch.setattr(StageRuntime, "_prepare", prepare if ahead else lambda *_: None)
        runtimes = _run_pipeline(tiny_llama, 2, delay_s=0.02)
        first = _run(runtimes, [StepRow("a", 1, 0, 0, [5, 17, 99]), StepRow("b", 1, 0, 0, [8, 9], sampled)], 1)
        built.clear()
        rows = [StepRow("a", 2, 1, 3, [first.tokens[0]]), StepRow("b", 2, 1, 2, [first.tokens[1]], sampled)]
        runs.append((first.tokens, _run(runtimes, rows, 5).run_tokens))
        # each rank builds its first iteration when the step (or its activation) comes, and every later one once,
        # ahead where it may: the rows, positions and tables built ahead are the ones run
        assert sorted(built) == [("next", i) for i in (1, 1, 2, 2, 3, 3, 4, 4)] + [("rows", 0)] * 2, built
    assert runs[0] == runs[1]


@pytest.mark.parametrize("queued", [False, True], ids=["pushed", "queued"])
def test_a_decode_run_rolled_back_part_way_leaves_every_rank_where_it_was(tiny_llama: Path, queued: bool,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode run aborted once two of its four tokens were computed fails on every rank, leaves each where it was,
    and replayed gives the fault-free tokens. `queued`: a run queued on the device whose sender stops writing there
    (as though its process died), each rank's engine waiting for bytes that never come until the abort releases its
    waits (they run on, computing what is never used); the replay goes through the same links (the failed sender's
    slot retired, the failed receiver's slot free)."""
    backend = "torch" if queued else "numpy"
    if queued:
        monkeypatch.setattr(TorchExecutable, "keeps_on_device", lambda self: True)
    runtimes = _run_pipeline(tiny_llama, 2, abort_at=2, backend=backend, device_links=frozenset("01" if queued else ""),
                             queued=HostSlots(monkeypatch) if queued else None, queue_to=frozenset("01" if queued else ""))
    first = _run(runtimes, [StepRow("a", 1, 0, 0, [5, 17, 99])], 1).tokens[0]
    with pytest.raises(ProtocolError) as e:
        _run(runtimes, [StepRow("a", 2, 1, 3, [first])], 4)
    assert (e.value.error_class, e.value.reason) == ("ARCH", "EPOCH_ABORTED")
    for r in runtimes:
        assert _txn(r, "a") == (SessionPhase.IDLE, 2, 3) and r.authority.state is AuthorityState.ACTIVE
        assert not r._mailbox
    clean = _run_pipeline(tiny_llama, 2, backend=backend)
    _run(clean, [StepRow("a", 1, 0, 0, [5, 17, 99])], 1)
    want = _run(clean, [StepRow("a", 2, 1, 3, [first])], 4).run_tokens
    assert _run(runtimes, [StepRow("a", 3, 0, 3, [first])], 4).run_tokens == want  # replayed: the same tokens


def test_a_decode_run_refuses_what_it_cannot_run(tiny_llama: Path) -> None:
    runtimes = _run_pipeline(tiny_llama, 2)
    for rows, logits in (([StepRow("s", 1, 0, 0, [1, 2])], False), ([StepRow("s", 1, 0, 0, [1])], True),
                         ([StepRow("s", 1, 0, 0, [1], Sampling(logprobs=True))], False),
                         ([StepRow("s", 1, 0, 0, [1], steps=5)], False)):  # a share larger than the run
        with pytest.raises(ProtocolError) as e:
            runtimes[0].execute_step(1, next(_step_ids), rows, logits, 1.0, 4)
        assert (e.value.error_class, e.value.reason) == ("ARCH", "BAD_DECODE_RUN")
    with pytest.raises(ProtocolError) as e:  # a run past the context is refused before it begins
        runtimes[0].execute_step(1, next(_step_ids), [StepRow("s", 1, 0, 0, [1])], False, 1.0, 10**6)
    assert e.value.reason == "CONTEXT_EXCEEDED"
    assert runtimes[0].authority.state is AuthorityState.ACTIVE and not runtimes[0].sessions()


def test_arch_failure_rolls_back_and_the_session_continues(tiny_llama: Path) -> None:
    runtimes = _pipeline(tiny_llama, 1, 2)
    _invoke(runtimes, "s", 1, 0, 0, [1, 2, 3])
    step_id = next(_step_ids)
    rows = [StepRow("s", 2, 1, 3, [10**6])]  # token id outside the vocabulary
    with pytest.raises(ProtocolError) as e:
        runtimes[0].execute_step(1, step_id, rows, False, 1.0)
    assert e.value.error_class == "ARCH" and e.value.reason == "BAD_TOKEN_ID"
    for runtime in runtimes:  # what the coordinator does on ARCH: AbortStep on every rank, folded commit first
        runtime.abort_step(1, step_id, rows)
    for runtime in runtimes:
        assert runtime.authority.state is AuthorityState.ACTIVE
        assert _txn(runtime, "s") == (SessionPhase.IDLE, 2, 3)
    # epoch 1 was committed by the folded commit, epoch 2 aborted everywhere; epoch 3 continues from 3 tokens
    token = _invoke(runtimes, "s", 3, 0, 3, [4])
    assert isinstance(token, int)
    assert all(_txn(r, "s") == (SessionPhase.IN_TXN, 3, 3) for r in runtimes)


def test_a_bad_row_rolls_back_every_row_of_its_step(tiny_llama: Path) -> None:
    # One invalid row fails the whole step before any row begins; after AbortStep every session is where it was
    # (with its folded commit applied) and continues with the tokens of a run that never saw the bad row.
    runtimes, clean = _pipeline(tiny_llama, 1, 2), _pipeline(tiny_llama, 1, 2)
    a1, b1 = _step(runtimes, [StepRow("a", 1, 0, 0, [5, 6, 7]), StepRow("b", 1, 0, 0, [8, 9])]).tokens
    step_id = next(_step_ids)
    rows = [StepRow("a", 2, 1, 3, [a1]), StepRow("b", 2, 1, 2, [10**6])]
    with pytest.raises(ProtocolError) as e:
        runtimes[0].execute_step(1, step_id, rows, False, 1.0)
    assert e.value.error_class == "ARCH"
    for runtime in runtimes:
        runtime.abort_step(1, step_id, rows)
        assert _txn(runtime, "a") == (SessionPhase.IDLE, 2, 3) and _txn(runtime, "b") == (SessionPhase.IDLE, 2, 2)
    a2, b2 = _step(runtimes, [StepRow("a", 3, 0, 3, [a1]), StepRow("b", 3, 0, 2, [b1])]).tokens
    for session, prompt, want in (("a", [5, 6, 7], [a1, a2]), ("b", [8, 9], [b1, b2])):
        first = _invoke(clean, session, 1, 0, 0, prompt)
        assert [first, _invoke(clean, session, 2, 1, len(prompt), [first])] == want


def test_stale_incarnation_changes_nothing(tiny_llama: Path) -> None:
    runtimes = _pipeline(tiny_llama, 1, 2)
    _invoke(runtimes, "s", 1, 0, 0, [1, 2, 3])
    before = [(t.phase, t.epoch, t.kv_length) for t in (s.txn for _, s in runtimes[0].sessions())]
    with pytest.raises(FailedPrecondition) as e:
        runtimes[0].execute_step(0, next(_step_ids), [StepRow("s", 2, 1, 3, [4])], False, 1.0)
    assert e.value.reason == "STALE_INCARNATION"
    assert before == [(t.phase, t.epoch, t.kv_length) for t in (s.txn for _, s in runtimes[0].sessions())]
    runtimes[0].fence(1, "test", False)
    # The fence itself does change one thing: epoch 1 ran here and waits for a decision that no step of the
    # fenced incarnation can bring any more, so it is undecided (kept, not rolled back) until resolved.
    before = [(t.phase, t.epoch, t.kv_length) for t in (s.txn for _, s in runtimes[0].sessions())]
    assert before == [(SessionPhase.INDETERMINATE, 1, 0)]
    with pytest.raises(FailedPrecondition) as e:
        runtimes[0].execute_step(1, next(_step_ids), [StepRow("s", 2, 1, 3, [4])], False, 1.0)
    assert e.value.reason == "POISONED"
    assert before == [(t.phase, t.epoch, t.kv_length) for t in (s.txn for _, s in runtimes[0].sessions())]


def test_a_device_failure_has_its_own_reason_and_poisons(tiny_llama: Path) -> None:
    runtimes = _pipeline(tiny_llama, 1, 2)
    runtimes[0].faults_enabled = True
    runtimes[0].inject_fault("device", 1)
    with pytest.raises(ProtocolError) as e:
        runtimes[0].execute_step(1, next(_step_ids), [StepRow("s", 1, 0, 0, [1, 2])], False, 1.0)
    # COMM: the rank's device state is unknown, so the incarnation is fenced and rebuilt; but it is not the link
    assert e.value.error_class == "COMM" and e.value.reason == "DEVICE_FAILURE"
    assert runtimes[0].authority.state is AuthorityState.POISONED
    assert runtimes[0].authority.cause.startswith("COMM: device cpu failed: RuntimeError: CUDA error")


def test_boundary_timeout_is_a_comm_failure_that_poisons(tiny_llama: Path) -> None:
    runtimes = _pipeline(tiny_llama, 1, 2)
    with pytest.raises(ProtocolError) as e:
        runtimes[1].execute_step(1, next(_step_ids), [StepRow("s", 1, 0, 0, [1, 2])], False, 0.2)
    assert e.value.error_class == "COMM"
    assert runtimes[1].authority.state is AuthorityState.POISONED


def test_abort_step_wakes_a_rank_waiting_for_its_boundary(tiny_llama: Path) -> None:
    # The coordinator's answer to an ARCH failure upstream: the waiting rank fails ARCH (not COMM), stays ACTIVE,
    # and a late push for the aborted step is dropped rather than left for another step to find.
    runtimes = _pipeline(tiny_llama, 1, 2)
    step_id, rows = next(_step_ids), [StepRow("s", 1, 0, 0, [1, 2])]
    errors: list[ProtocolError] = []

    def wait() -> None:
        try:
            runtimes[1].execute_step(1, step_id, rows, False, 30.0)
        except ProtocolError as e:
            errors.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    while not runtimes[1].sessions():  # the rank has begun the row and waits for the boundary
        waiter.join(0.01)
    runtimes[1].abort_step(1, step_id, rows)
    waiter.join(10.0)
    assert not waiter.is_alive() and len(errors) == 1
    assert (errors[0].error_class, errors[0].reason) == ("ARCH", "EPOCH_ABORTED")
    assert runtimes[1].authority.state is AuthorityState.ACTIVE
    assert _txn(runtimes[1], "s") == (SessionPhase.IDLE, 1, 0)
    route = runtimes[1].plan.routes[0] if runtimes[1].plan else None
    assert route is not None
    runtimes[1].accept_boundary(1, Boundary(step_id, 0, route.id, {dag.ACTIVATION: np.zeros((2, 64), np.float32)},
                                            route.schema.identity))
    assert runtimes[1]._mailbox == {}


def test_a_commit_folded_into_abort_step_records_its_tokens_and_writes_them_behind(tiny_llama: Path) -> None:
    # A rank that refuses a step before any row begins (here: another session's bad token) learns of the folded
    # commit only from AbortStep. That commit must be one like any other: the epoch's tokens recorded (they key the
    # KV store's blocks) and its whole blocks written behind, or the session's blocks never reach the store.
    written: list[KvBlocks] = []
    runtime = StageRuntime("numpy", kv_cache_bytes=KV_CACHE_BYTES, block_writer=written.append)
    runtime.install(1, 0, 1, StageSpec(str(tiny_llama), 0, 2, True, True, kvstore_address="kvstore:0"))
    prompt = list(range(100, 120))  # one whole block of 16, and 4 rows of the next
    token, _ = runtime.execute_step(1, next(_step_ids), [StepRow("a", 1, 0, 0, prompt), StepRow("b", 1, 0, 0, [5])],
                                    False, 5.0).tokens
    step_id, rows = next(_step_ids), [StepRow("a", 2, 1, 20, [token]), StepRow("b", 2, 1, 1, [10**6])]
    with pytest.raises(ProtocolError):
        runtime.execute_step(1, step_id, rows, False, 5.0)
    runtime.abort_step(1, step_id, rows)
    runtime.engine.run("test.drain", lambda: None)  # the write-behind is queued on the engine thread
    session = dict(runtime.sessions())["a"]
    assert session.txn.kv_length == 20 and session.tokens == prompt
    assert [(b.first_block, b.token_ids, b.rows.shape[0], b.epoch) for b in written] == [(0, prompt[:16], 16, 1)]
    np.testing.assert_array_equal(written[0].rows, runtime.read_kv(1, "a", 0, 16))


def test_a_new_session_shares_a_prefix_another_holds_and_computes_the_same_tokens(tiny_llama: Path) -> None:
    runtimes, clean = _pipeline(tiny_llama, 1, 2), _pipeline(tiny_llama, 1, 2)
    prefix = [(7 * i + 3) % 500 for i in range(32)]  # two whole blocks of 16
    donor_first = _invoke(runtimes, "donor", 1, 0, 0, [*prefix, 9, 9, 9])
    _invoke(runtimes, "donor", 2, 1, 35, [donor_first])  # folds the commit of the prompt
    free = runtimes[0].pool.free
    for runtime in runtimes:
        assert runtime.share_kv(1, "b", "donor", prefix) == 32
    assert runtimes[0].pool.free == free  # shared, not copied
    # b computes only its suffix, and its tokens are those of a session that computed everything
    tokens = [_invoke(runtimes, "b", 1, 0, 32, [5, 6])]
    tokens.append(_invoke(runtimes, "b", 2, 1, 34, [tokens[0]]))
    want = [_invoke(clean, "b", 1, 0, 0, [*prefix, 5, 6])]
    want.append(_invoke(clean, "b", 2, 1, 34, [want[0]]))
    assert tokens == want
    # the donor goes on, and its shared blocks outlive it while b holds them
    for runtime in runtimes:
        runtime.release(1, "donor")
    assert _invoke(runtimes, "b", 3, 2, 35, [tokens[1]]) == _invoke(clean, "b", 3, 2, 35, [want[1]])
    with pytest.raises(FailedPrecondition) as e:
        runtimes[0].share_kv(1, "c", "b", [1] * 32)  # b's prefix is not these tokens
    assert e.value.reason == "PREFIX_NOT_HELD"


def test_one_release_frees_every_session_it_names_and_only_those(tiny_llama: Path) -> None:
    runtimes = _pipeline(tiny_llama, 1, 2)
    for session in ("a", "b", "c"):
        _invoke(runtimes, session, 1, 0, 0, [5, 6, 7])
    free = runtimes[0].pool.free
    assert runtimes[0].release(1, "a", "c", "never-held")
    assert sorted(dict(runtimes[0].sessions())) == ["b"] and runtimes[0].pool.free > free
    assert not runtimes[0].release(1, "a", "never-held")  # none of these is held any more
    with pytest.raises(FailedPrecondition):
        runtimes[1].release(0, "a", "b")  # a stale incarnation releases nothing
    assert sorted(dict(runtimes[1].sessions())) == ["a", "b", "c"]


def test_replan_takes_standby_weights_and_compiles_the_recent_shapes(tiny_llama: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that held the rest of the model in standby takes a re-plan's new layers without reading the
    checkpoint, compiles the shapes it ran before up front, and computes what a fresh load of those layers does."""
    from graphmesh.checkpoints import Checkpoint

    def run_alone(runtime: StageRuntime, incarnation: int) -> list[int]:
        tokens, pending, start = [], [5, 17, 99, 3, 250, 42, 7], 0
        for epoch in range(1, 6):
            tokens += runtime.execute_step(incarnation, next(_step_ids),
                                           [StepRow("s", epoch, epoch - 1, start, pending)], False, 5.0).tokens
            start += len(pending)
            pending = tokens[-1:]
        return tokens

    whole = StageSpec(str(tiny_llama), 0, 2, True, True)
    fresh = StageRuntime("numpy", kv_cache_bytes=KV_CACHE_BYTES, standby_weights=False)
    fresh.install(1, 0, 1, whole)
    expected = run_alone(fresh, 1)

    def push(address: str, incarnation: int, boundary: Boundary, timeout_s: float,
             delivered: Callable[[Exception | None], None]) -> None:
        delivered(None)

    runtime = StageRuntime("numpy", pusher=push, kv_cache_bytes=KV_CACHE_BYTES, standby_weights=True)
    runtime.install(1, 0, 2, StageSpec(str(tiny_llama), 0, 1, True, False),
                    dag.pipeline([(0, 1), (1, 2)], ["0", "1"], 64))
    runtime.execute_step(1, next(_step_ids), [StepRow("a", 1, 0, 0, [5, 17, 99])], False, 5.0)
    runtime.execute_step(1, next(_step_ids), [StepRow("a", 2, 1, 3, [1])], False, 5.0)
    ran = list(runtime._executables)
    assert runtime.standby_ready.wait(30)  # read in the background after install
    reads: list[str] = []
    original = Checkpoint.tensor

    def tensor(self: Checkpoint, name: str, dtype: str = "f32") -> np.ndarray:
        reads.append(name)
        return original(self, name, dtype)

    monkeypatch.setattr(Checkpoint, "tensor", tensor)
    runtime.install(2, 0, 1, whole)  # its peer is lost: this rank now holds every layer
    assert reads == []
    assert list(runtime._executables) == ran  # compiled by the install, before any step of the new plan
    assert run_alone(runtime, 2) == expected


def test_standby_weights_of_one_model_never_serve_another(tiny_llama: Path, tmp_path: Path) -> None:
    """Two checkpoints with the same param names: after the first is held in standby, installing the second
    computes what a fresh load of the second does (the standby set belongs to one checkpoint)."""
    other = make_tiny_llama(tmp_path / "other", seed=7)
    prompt = [5, 17, 99, 3, 250, 42, 7]

    def first_token(runtime: StageRuntime, incarnation: int) -> int:
        return runtime.execute_step(incarnation, next(_step_ids), [StepRow("s", 1, 0, 0, prompt)], False, 5.0).tokens[0]

    fresh = StageRuntime("numpy", kv_cache_bytes=KV_CACHE_BYTES, standby_weights=False)
    fresh.install(1, 0, 1, StageSpec(str(other), 0, 2, True, True))
    expected = first_token(fresh, 1)
    runtime = StageRuntime("numpy", kv_cache_bytes=KV_CACHE_BYTES, standby_weights=True)
    runtime.install(1, 0, 1, StageSpec(str(tiny_llama), 0, 1, True, False))
    assert runtime.standby_ready.wait(30)
    runtime.install(2, 0, 1, StageSpec(str(other), 0, 2, True, True))
    assert first_token(runtime, 2) == expected
