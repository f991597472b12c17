"""The coordinator's streaming of a session's outputs (generation.Generator), over a scheduler whose outputs are
scripted: the outputs that are ready together stream as one event, and stop strings, EOS, the length limit and an
error cut that event exactly where they would cut a stream of one token per event."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from graphmesh.errors import Unavailable
from graphmesh.tokenizer import Tokenizer
from graphmesh_coordinator.generation import Event, GenerationRequest, Generator
from graphmesh_coordinator.pipeline import Mesh
from graphmesh_coordinator.scheduler import Output, Scheduler
from graphmesh_coordinator.scheduler import Sequence as Seq

WORDS = ["<eos>", "a", "b", "c", " x", "y", " z", "!"]  # token id -> its text
EOS = 0


class Words:
    def decode(self, ids: list[int]) -> str:
        return "".join(WORDS[i] for i in ids)


class Scripted:
    """What Generator uses of the Scheduler: the session's outputs come in batches, each put on its queue at once
    (as a decode run's are): the first when it is submitted, each next one when the test says."""

    def __init__(self, batches: list[list[int | BaseException]]) -> None:
        self.batches = batches
        self.finished: list[Seq] = []

    def submit(self, seq: Seq) -> None:
        self.seq = seq
        self.feed()

    def feed(self) -> None:
        for item in self.batches.pop(0) if self.batches else []:
            self.seq.events.put(item if isinstance(item, BaseException) else Output([item], None, 3))

    def finish(self, seq: Seq) -> None:
        self.finished.append(seq)


def generator(scheduler: Scripted) -> Generator:
    mesh = SimpleNamespace(config=SimpleNamespace(vocab_size=len(WORDS), encoder=None))
    return Generator(cast(Mesh, mesh), cast(Tokenizer, Words()), [EOS], 1000, cast(Scheduler, scheduler))


def stream(batches: list[list[int | BaseException]], **request: Any) -> list[Event]:
    scheduler, events = Scripted(batches), []
    for event in generator(scheduler).generate(GenerationRequest(**{"prompt_ids": [1, 2], "max_tokens": 100,
                                                                    **request})):
        events.append(event)
        scheduler.feed()  # the next batch comes only once this event is out: it cannot join it
    assert scheduler.finished  # the session's KV is released however it ended
    return events


def test_outputs_that_are_ready_together_stream_as_one_event() -> None:
    events = stream([[1, 2, 3, 4]], max_tokens=4)
    assert [(e.token_ids, e.text, e.finish_reason) for e in events] == [([1, 2, 3, 4], "abc x", "length")]
    assert events[0].session_id and events[0].ttft_ms > 0 and events[0].prefill_computed_tokens == 3


def test_the_length_limit_cuts_an_event_at_the_last_token() -> None:
    events = stream([[1], [2, 3, 4, 5]], max_tokens=3)
    assert [(e.token_ids, e.text, e.finish_reason) for e in events] == [([1], "a", ""), ([2, 3], "bc", "length")]
    assert events[1].session_id == "" and events[1].ttft_ms == 0.0  # only the first event carries them


def test_a_stop_string_spanning_tokens_of_one_event_cuts_its_text_where_the_string_starts() -> None:
    events = stream([[1, 4, 5, 6, 7]], stop=("xy",))  # "a" " x" "y": the stop string is "xy"
    assert [(e.token_ids, e.text, e.finish_reason) for e in events] == [([1, 4, 5], "a ", "stop")]


def test_eos_inside_an_event_ends_it_with_the_text_before_it() -> None:
    events = stream([[1, 2, EOS, 3]])
    assert [(e.token_ids, e.text, e.finish_reason) for e in events] == [([1, 2, EOS], "ab", "eos")]
    events = stream([[1, 2, EOS, 3]], ignore_eos=True, max_tokens=4)
    assert [(e.token_ids, e.text, e.finish_reason) for e in events] == [([1, 2, EOS, 3], "ab<eos>c", "length")]


def test_an_error_after_outputs_streams_them_first_then_ends_the_stream() -> None:
    scheduler = Scripted([[1, 2, Unavailable("lost", "TOO_MANY_RECOVERIES")]])
    events = generator(scheduler).generate(GenerationRequest([1, 2], 10))
    first = next(events)
    assert (first.token_ids, first.text) == ([1, 2], "ab")
    with pytest.raises(Unavailable, match="lost"):
        next(events)
    assert scheduler.finished
