"""Mutation registry: one entry per promise README makes, each a patch that switches the mechanism behind the
promise off, and the tests that must then fail. A test that still passes with its mechanism gone guards
nothing; `python -m tests.mutations` applies each patch in turn, runs only that entry's tests (in this one
process, through pytest.main) and fails unless every named test fails. `tests/mutations/test_mutations.py`
runs it in the suite.

A patch is a function of a pytest.MonkeyPatch, applied before collection and undone after the run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Mutation:
    name: str
    promise: str  # what README promises, in a few words
    patch: Callable[[pytest.MonkeyPatch], None]
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root; each must fail


REGISTRY: list[Mutation] = []


def mutation(name: str, promise: str, *tests: str) -> Callable[[Callable], Callable]:
    def register(patch: Callable[[pytest.MonkeyPatch], None]) -> Callable:
        assert tests, f"{name}: a mutation names the tests that catch it"
        assert name not in {m.name for m in REGISTRY}, name
        REGISTRY.append(Mutation(name, promise, patch, tests))
        return patch

    return register


CORPUS = "tests/test_sim_corpus.py::test_program_is_judged_like_cuda"


def corpus(*ids: str) -> tuple[str, ...]:
    return tuple(f"{CORPUS}[{i}]" for i in ids)


# ----- the stream sanitizer ------------------------------------------------------------------------------
@mutation(
    "sanitizer-access-race",
    "two unordered accesses to the same bytes, one a write, raise StreamRaceError",
    *corpus(
        "ordering-h2d_then_compute_read_without_wait",
        "ordering-two_streams_write_the_same_tensor",
        "ordering-write_after_read_on_another_stream",
        "copies-d2h_pinned_host_read_before_sync",
        "copies-host_overwrites_pinned_source_of_inflight_h2d",
        "allocator-block_from_compute_used_on_side_without_wait",
        "views-overlapping_column_blocks",
        "threads-worker_runs_on_the_default_stream",
        "autograd-grad_read_on_a_third_stream_without_wait",
        "collectives-async_all_reduce_read_before_wait",
        "compiled-compiled_read_of_an_inflight_h2d",
        "storages-deepcopy_of_a_tensor_being_written",
    ),
)
def _no_access_races(mp: pytest.MonkeyPatch) -> None:
    from device.sim import sanitizer

    mp.setattr(sanitizer.AccessLog, "conflict", lambda self, acc, clocks: None)


@mutation(
    "sanitizer-free-race",
    "a block freed while another stream may still use it raises StreamRaceError when it may be reused",
    *corpus("allocator-free_while_side_stream_uses_it"),
)
def _no_free_races(mp: pytest.MonkeyPatch) -> None:
    from device.sim.device import SimDevice

    mp.setattr(SimDevice, "_check_free", lambda self, info: None)


@mutation(
    "sanitizer-host-reads",
    "host reads outside the dispatcher (tolist, numpy, DLPack, torch.save) are checked like any access",
    *corpus(
        "copies-tolist_of_pinned_before_d2h_finishes",
        "copies-numpy_of_pinned_before_d2h_finishes",
        "copies-dlpack_of_pinned_before_d2h_finishes",
        "copies-torch_save_of_pinned_before_d2h_finishes",
    ),
)
def _no_host_read_checks(mp: pytest.MonkeyPatch) -> None:
    from device.sim.device import SimDevice

    mp.setattr(SimDevice, "_host_read", lambda self, t, what: None)


# ----- swapopt -------------------------------------------------------------------------------------------
@mutation(
    "offload-empty-cache",
    "offload(empty_cache=True) returns the allocator's cached blocks to the device",
    "tests/test_offload.py::test_offload_empty_cache_returns_the_cached_segments_to_the_device",
)
def _offload_keeps_the_cache(mp: pytest.MonkeyPatch) -> None:
    offload = importlib.import_module("swapopt.offload")  # the package exports a function of that name
    call = offload._device_call
    mp.setattr(offload, "_device_call", lambda name: None if name == "empty_cache" else call(name))


@mutation(
    "resident-states",
    "resident_mb keeps the states of params that fit it on the device, never swapped",
    "tests/test_parity.py::test_parity_resident",
)
def _nothing_resident(mp: pytest.MonkeyPatch) -> None:
    layout = importlib.import_module("swapopt.layout")
    make_plan = layout.make_plan
    mp.setattr(layout, "make_plan", lambda *args, **kw: make_plan(*args, **{**kw, "resident_bytes": 0}))


@mutation(
    "overlap-forward-waits",
    "with overlap_forward, each module's forward waits for its own params' update (bitwise the same results)",
    "tests/test_overlap.py::test_losses_and_params_bitwise_equal_on_and_off[fused-plain]",
    "tests/test_overlap.py::test_losses_and_params_bitwise_equal_on_and_off[fused-scaler]",
    "tests/test_overlap.py::test_losses_and_params_bitwise_equal_on_and_off[foreach-plain]",
)
def _forward_does_not_wait(mp: pytest.MonkeyPatch) -> None:
    overlap = importlib.import_module("swapopt.overlap")
    mp.setattr(overlap.ForwardWaits, "_plain_hook", lambda self, fsdp_cls: lambda module, args: None)


@mutation(
    "bitwise-parity",
    "a swapped optimizer's params and states are bitwise those of the unwrapped optimizer",
    "tests/test_parity.py::test_parity_optimizers[adamw]",
    "tests/test_parity.py::test_parity_optimizers[sgd_momentum]",
    "tests/test_parity.py::test_parity_swap_times[3]",
)
def _updated_states_not_swapped_out(mp: pytest.MonkeyPatch) -> None:
    operate = importlib.import_module("swapopt.operate")
    swap_out = operate.SwapOptimizerOperate.swap_out
    mp.setattr(operate.SwapOptimizerOperate, "swap_out", lambda self, k, copies, hold=(): swap_out(self, k, [], hold))


@mutation(
    "memory-cap",
    "a step stages at most `slots` chunks on the device at once",
    "tests/test_overlap.py::test_peak_extra_memory_of_the_step_stays_within_slots_plus_one_chunks",
)
def _every_chunk_staged_at_once(mp: pytest.MonkeyPatch) -> None:
    operate = importlib.import_module("swapopt.operate")
    mp.setattr(operate.SwapOptimizerOperate, "slots_for", lambda self, n_chunks: max(n_chunks, 1))
