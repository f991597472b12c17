"""A stage's runs: the executable of each bucketed shape, and every input of an iteration but what a boundary
brings, built row by row for a step's first iteration and with array operations over all rows from the iteration
before within a decode run."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from graphmesh import models
from graphmesh.graph import parse
from graphmesh_executor.backends import compile_graph
from graphmesh_executor.executable import Executable
from graphmesh_executor.kv_pool import SCRATCH_BLOCK
from graphmesh_executor.stage_types import StageState, StepRow, copied
from graphmesh_executor.weights import load_params

log = logging.getLogger("graphmesh.executor.stage")
R = TypeVar("R")

MIN_PREFILL_ROWS = 16
# A block table at least this wide (blocks per sequence), or the context's width if narrower, where the width costs
# nothing (Executable.reads_own_blocks): one executable per bucket then serves sessions of any length up to it.
TABLE_BLOCKS = 256
# The runs a stage whose table width costs nothing meets at load (_warm_up): the coordinator's defaults on CUDA, a
# step of at most 256 sessions and 2,048 tokens. A shape met first by a step stalls it (compile, eager run, capture).
WARM_SEQS, WARM_TOKENS = 256, 2048


def bucket(n: int, minimum: int) -> int:
    """Power-of-two ladder: at most 2x padding."""
    size = minimum
    while size < n:
        size *= 2
    return size


def ladder(minimum: int, largest: int) -> list[int]:
    """The buckets from `minimum` up to the one that holds `largest`."""
    sizes = [minimum]
    while sizes[-1] < largest:
        sizes.append(sizes[-1] * 2)
    return sizes


_SEED_MASK = (1 << 63) - 1


def seed_for(session_seed: int, position: int) -> int:
    """The sample op's seed for the token at `position`: a replay of the same session draws the same."""
    return (session_seed * 1_000_003 + position) & _SEED_MASK


@dataclass(eq=False)
class Prepared:
    """A run with every input but those a boundary brings (the first stage's token ids, another's activation):
    a decode run's next iteration, built on the engine while it waited for that boundary. Within a run a row's
    positions, slots and block table are known ahead (its blocks were reserved when the run began), and building
    them and the rows was ~30% of a stage iteration's host work, on the path from one stage to the next."""

    iteration: int
    rows: list[StepRow]  # the iteration's rows, each token_ids a one-element list its token is written into
    sample: bool  # sampled in the graph (the last stage), as _compute is asked to
    exe: Executable[Any]
    inputs: dict[str, np.ndarray]
    tokens: int  # token rows of the run (a bucket)
    seqs: int  # sequences of the run (a bucket)
    blocks: int  # blocks per sequence of its block table (a rung of the ladder)
    extent: tuple[int, int] | None
    row_steps: np.ndarray  # per row, the decode run's tokens it takes (StepRow.steps)


class RunInputs(StageState):
    """The run-building part of StageRuntime (engine thread)."""

    def _compile(self, tokens: int, seqs: int, blocks: int, decode: bool, sample: bool, encoded: bool = False,
                 weights: Path | None = None, reuse: Executable[Any] | None = None) -> Executable[Any]:
        assert self.config is not None and self.spec is not None
        spec = self.spec
        # "packed": GGUF blocks stay packed, consumed by dequant_matmul (exact); "packed-bf16" also runs those
        # matmuls on bf16 activations, which torch's int4 kernel needs to be fast (not token-exact); "packed-q8"
        # quantizes their rows to int8 (llama.cpp's arithmetic, the CPU kernels' fastest).
        packed = self._packed
        layout = models.PagedLayout(seqs, blocks, self.pool.block_tokens, self.pool.blocks, decode)
        proto = models.build_stage(self.config, range(spec.layer_start, spec.layer_end), seq_len=tokens, cache_len=0,
                                   first=spec.first, last=spec.last, sample=sample, quantized=packed,
                                   packed_schemes=self._packed_schemes if packed else None,
                                   packed_activations=models.WEIGHTS[spec.weights] or "f32",
                                   dtype=self.dtype, paged=layout, encoded=encoded)
        exe = compile_graph(parse(proto), self.backend, self.device)
        if weights is not None:
            # A re-plan (recovery, rebalancing) keeps the layers this rank already holds and reads only the new ones.
            kept = set(exe.copy_params_from(reuse) if reuse is not None else [])
            for name in exe.graph.params.keys() - kept:
                # standby weights are f32 (dequantized): a packed stage's blocks come from the checkpoint
                if name in self._standby and exe.graph.params[name].dtype != "u8":
                    exe.set_param_typed(name, self._standby[name])
                    kept.add(name)
            load_params(exe, weights, {}, skip=kept)
            exe.finalize_params()
        elif self._holder is not None:
            exe.copy_params_from(self._holder)
        for j, name in enumerate(self._pool_names()):
            exe.set_handle_feed(name, 1 + j)  # the updated pool replaces the handle: kv_scatter writes in place
        return exe

    def _executable(self, tokens: int, seqs: int, blocks: int, decode: bool, sample: bool,
                    encoded: bool = False) -> Executable[Any]:
        key = (tokens, seqs, blocks, decode, sample, encoded)
        exe = self._executables.pop(key, None)
        if exe is None:
            t0 = time.perf_counter()
            exe = self._compile(*key)
            seconds = time.perf_counter() - t0
            self.compiles, self.compile_seconds = self.compiles + 1, self.compile_seconds + seconds
            # a step that waits for this is slower by that much: a shape bucket worth knowing about
            log.info("stage executable compiled", extra={"tokens": tokens, "seqs": seqs, "blocks": blocks,
                                                         "decode": decode, "ms": round(seconds * 1e3, 1)})
        self._executables[key] = exe  # (re)inserted last: the dict is in order of use, for a re-plan's warm-up
        return exe

    def _table_width(self, longest: int) -> int:
        """Blocks per sequence of a run's block table whose longest session holds `longest`: a rung of the ladder,
        never past the context, and at least TABLE_BLOCKS (or the context) where the width costs nothing."""
        floor = min(self.max_blocks, TABLE_BLOCKS) if self._wide_tables else 1
        return min(max(bucket(longest, 1), floor), max(self.max_blocks, longest))

    def _warm_up(self) -> None:
        """Every run of up to WARM_SEQS sessions and WARM_TOKENS tokens met now rather than by a step: each decode
        bucket compiled, run, and run again (a CUDA graph is captured at a shape's second run), each prompt bucket
        compiled and run. Padding runs only: every KV row they write goes to the scratch block."""
        t0 = time.perf_counter()
        seqs, tokens = WARM_SEQS, min(WARM_TOKENS, self.max_blocks * self.pool.block_tokens)
        shapes = [(t, s, False) for t in ladder(MIN_PREFILL_ROWS, tokens) for s in ladder(1, min(t, seqs))]
        shapes += [(s, s, True) for s in ladder(1, min(seqs, tokens))]
        for at, (t, s, decode) in enumerate(shapes):
            if at % 16 == 0:  # a long operation shows progress
                log.info("stage warming up", extra={"shapes": len(shapes), "done": at})
            self._padding_run(t, s, decode, times=2 if decode else 1)
        log.info("stage warmed up", extra={"shapes": len(shapes), "ms": round((time.perf_counter() - t0) * 1e3, 1)})

    def _padding_run(self, tokens: int, seqs: int, decode: bool, times: int) -> None:
        """Runs the executable of a bucket `times` over padding: `seqs` sequences of tokens/seqs rows each, from
        position 0, every table entry and slot the scratch block's."""
        assert self.spec is not None and self.config is not None
        spec, width, per = self.spec, self._table_width(1), tokens // seqs
        inputs: dict[str, np.ndarray] = {
            "positions": np.minimum(np.arange(tokens, dtype=np.int64) % per, width * self.pool.block_tokens - 1),
            "slots": np.full(tokens, SCRATCH_BLOCK * self.pool.block_tokens, np.int64),
            "token_seq": np.repeat(np.arange(seqs, dtype=np.int64), per),
            "block_table": np.full((seqs, width), SCRATCH_BLOCK, np.int64)}
        if spec.first:
            inputs["input_ids"] = np.zeros(tokens, np.int64)
        else:
            inputs["hidden_in"] = np.zeros((tokens, self.config.hidden_size), np.float32)
        if spec.last:
            inputs.update(last_index=np.arange(per - 1, tokens, per, dtype=np.int64),
                          temperature=np.zeros(seqs, np.float32), top_k=np.zeros(seqs, np.int64),
                          top_p=np.ones(seqs, np.float32), seed=np.zeros(seqs, np.int64))
        exe = self._executable(tokens, seqs, width, decode, True)
        for _ in range(times):
            self._with_pools(exe, lambda e: e.run(inputs, read_indices=[0], typed=True)[0])

    def _with_pools(self, exe: Executable[Any], call: Callable[[Executable[Any]], R]) -> R:
        """`call` on `exe` with the stage's KV pools swapped in as its handles (engine thread)."""
        own = exe.swap_handles(self._pools)
        try:
            return call(exe)
        finally:
            self._pools = exe.swap_handles(own)

    @staticmethod
    def _next_rows(rows: list[StepRow]) -> list[StepRow]:
        """The rows of a decode run's next iteration, one position on, each with a token to be written in."""
        return [copied(r, start=r.start + 1, token_ids=[0], encoder_input=None, encoded_offsets=()) for r in rows]

    def _inputs_for(self, prev: Prepared | None, rows: list[StepRow], sample: bool, iteration: int,
                    encoded: bool = False) -> Prepared:
        """`iteration`'s run: from `prev`, the run that ran last, where that was the same decode run's (each row one
        position on: array operations over all rows), else built row by row."""
        if (prev is not None and not encoded and iteration == prev.iteration + 1 and prev.sample == sample
                and len(prev.rows) == len(rows) and prev.tokens == prev.seqs):
            run = self._next_run(prev, rows, iteration)
            if run is not None:
                return run
        return self._run_inputs(rows, sample, iteration, encoded)

    def _next_run(self, prev: Prepared, rows: list[StepRow], iteration: int) -> Prepared | None:
        """The run of a decode run's next iteration from the run of the one before: the same executable, block
        tables and sampling, each real row one position on (its slot from its table, its seed seed_for's next);
        a row past its own share of the run stays where it ended and writes the scratch block (its samples are
        dropped). None where a row's next position is in no block of its table (the row-by-row build reports it)."""
        n, block = len(rows), self.pool.block_tokens
        alive = iteration < prev.row_steps
        positions = prev.inputs["positions"].copy()
        positions[:n] += alive
        table = prev.inputs["block_table"]
        at = positions[:n] // block
        if (at >= table.shape[1]).any():
            return None
        owned = table[np.arange(n), at]
        if (owned == SCRATCH_BLOCK).any():
            return None
        slots = prev.inputs["slots"].copy()
        slots[:n] = np.where(alive, owned * block + positions[:n] % block, SCRATCH_BLOCK * block)
        inputs = {**prev.inputs, "positions": positions, "slots": slots}
        if "seed" in inputs:  # seed_for(s, p + 1) == (seed_for(s, p) + 1) mod 2^63
            seed = inputs["seed"].copy()
            seed[:n] = (seed[:n] + 1) & _SEED_MASK
            inputs["seed"] = seed
        return Prepared(iteration, rows, prev.sample, prev.exe, inputs, prev.tokens, prev.seqs, prev.blocks,
                         prev.extent, prev.row_steps)

    def _run_inputs(self, rows: list[StepRow], sample: bool, iteration: int, encoded: bool = False) -> Prepared:
        """A run's executable and every input but those a boundary brings. Shapes are bucketed (powers of two) so
        a handful of executables serve every step: padded token rows write the scratch block, padded sequences
        read it, and the run's active extent skips them where it can."""
        assert self.spec is not None
        spec, pool = self.spec, self.pool
        counts = [len(row.token_ids) for row in rows]
        total, decode = sum(counts), all(n == 1 for n in counts)
        seqs = bucket(len(rows), 1)
        tokens = seqs if decode else bucket(total, MIN_PREFILL_ROWS)
        tables = [pool.table(row.session_id) for row in rows]
        blocks = self._table_width(max(len(t) for t in tables))
        positions = np.zeros(tokens, np.int64)
        slots = np.full(tokens, SCRATCH_BLOCK * pool.block_tokens, np.int64)
        token_seq = np.arange(tokens, dtype=np.int64) if decode else np.zeros(tokens, np.int64)
        block_table = np.full((seqs, blocks), SCRATCH_BLOCK, np.int64)
        last_index = np.zeros(seqs, np.int64)
        at = 0
        for b, (row, n, table) in enumerate(zip(rows, counts, tables)):
            positions[at:at + n] = row.start + np.arange(n)
            slots[at:at + n] = pool.slots(row.session_id, row.start, row.start + n)
            token_seq[at:at + n] = b
            block_table[b, :len(table)] = table
            last_index[b] = at + n - 1
            at += n
        inputs: dict[str, np.ndarray] = {"positions": positions, "slots": slots, "token_seq": token_seq,
                                         "block_table": block_table}
        if spec.last:
            inputs["last_index"] = last_index
            if sample:
                pad = seqs - len(rows)
                inputs.update(
                    temperature=np.array([r.sampling.temperature for r in rows] + [0.0] * pad, np.float32),
                    top_k=np.array([r.sampling.top_k for r in rows] + [0] * pad, np.int64),
                    top_p=np.array([r.sampling.top_p for r in rows] + [1.0] * pad, np.float32),
                    seed=np.array([seed_for(r.sampling.seed, r.start + n) for r, n in zip(rows, counts)] + [0] * pad,
                                  np.int64))
        exe = self._executable(tokens, seqs, blocks, decode, sample or not spec.last, encoded)
        # Only the real rows are computed (the padding is a bucket's, for a handful of executables), except where the
        # run may replay a captured graph of the whole bucket (a CUDA decode), far cheaper than an eager run of fewer.
        extent = (total, tokens) if total < tokens and not exe.replays_rows(max(counts)) else None
        return Prepared(iteration, rows, sample, exe, inputs, tokens, seqs, blocks, extent,
                        np.fromiter((r.steps or 1 for r in rows), np.int64, len(rows)))
