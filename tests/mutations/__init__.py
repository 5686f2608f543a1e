"""Mutation registry: one entry per promise README makes, each a patch that switches the mechanism behind the
promise off, and the tests that must then fail. A test that still passes with its mechanism gone guards
nothing; `python -m tests.mutations` applies each patch in turn, runs only that entry's tests (in this one
process, through pytest.main) and fails unless every named test fails. `tests/mutations/test_mutations.py`
runs it in the suite.

A patch is a function of a pytest.MonkeyPatch, applied before collection and undone after the run. A patch
that must also reach the Python processes the tests start (a CLI run, a typed-simulator program) passes its
change to ``in_subprocesses`` as well.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import os
import shutil
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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


# A sitecustomize.py on PYTHONPATH runs in every Python process started from here: it applies the change
# right after the module it changes is first imported there.
_SITE = """\
import importlib.machinery
import sys

{source}

class _AfterImport:
    def find_spec(self, name, path=None, target=None):
        if name != {module!r}:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                {change}(module)

            spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())
"""


def in_subprocesses(mp: pytest.MonkeyPatch, module: str, change: Callable[[object], None]) -> None:
    """Apply ``change`` (a self-contained top-level function of the module object) to ``module`` in every Python
    process the tests start while the mutation holds: a sitecustomize in a folder put first on PYTHONPATH."""
    folder = tempfile.mkdtemp(prefix="swapopt-mutation-")
    atexit.register(shutil.rmtree, folder, True)
    source = textwrap.dedent(inspect.getsource(change))
    Path(folder, "sitecustomize.py").write_text(_SITE.format(source=source, module=module, change=change.__name__))
    mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")])))


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
    from device.sim import race_checks, sanitizer

    # every race check goes through check_all: per op (race_checks) and per single access (AccessLog.conflict)
    mp.setattr(sanitizer, "check_all", lambda staged, clocks: None)
    mp.setattr(race_checks, "check_all", lambda staged, clocks: None)


@mutation(
    "sanitizer-free-race",
    "a block freed while another stream may still use it raises StreamRaceError when it may be reused",
    *corpus(
        "allocator-free_while_side_stream_uses_it",
        "allocator-free_while_side_stream_uses_it_then_factory_writes",
        "allocator-reused_block_handed_to_a_third_stream_before_the_old_use_is_ordered",
    ),
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


@mutation(
    "sanitizer-alias-reads",
    "pinned memory reached through an alias (numpy()/from_numpy, frombuffer, DLPack, pickling) is judged by address",
    *corpus(
        "aliases-torch_save_of_a_from_numpy_alias_before_d2h_finishes",
        "aliases-tolist_of_a_view_of_a_from_numpy_alias",
        "aliases-clone_of_a_from_numpy_alias",
        "aliases-clone_of_unaligned_bytes_of_a_pinned_tensor",
        "aliases-sum_of_a_dlpack_alias",
        "aliases-sum_of_a_frombuffer_alias",
    ),
    "tests/test_state_dict_aliases.py::test_without_the_wait_the_sanitizer_sees_the_read_through_the_aliases",
)
def _no_alias_lookup(mp: pytest.MonkeyPatch) -> None:
    from device.sim.device import SimDevice

    mp.setattr(SimDevice, "_alias", lambda self, t, storage: (t, storage, None))


@mutation(
    "collective-tensors-held",
    "a correct multi-process program exits normally: a collective's tensors are held until gloo lets go of them",
    "tests/test_dist_exit.py::test_collective_tensors_are_held_until_no_cpp_holder_is_left",
)
def _collective_tensors_not_held(mp: pytest.MonkeyPatch) -> None:
    from device.sim.device import SimDevice

    mp.setattr(SimDevice, "_hold_collective", lambda self, args, kwargs, out: None)


# ----- swapopt -------------------------------------------------------------------------------------------
@mutation(
    "offload-empty-cache",
    "offload(empty_cache=True) returns the allocator's cached blocks to the device",
    "tests/test_offload.py::test_offload_empty_cache_returns_the_cached_segments_to_the_device",
)
def _offload_keeps_the_cache(mp: pytest.MonkeyPatch) -> None:
    eviction = importlib.import_module("swapopt.eviction")
    call = eviction.device_call
    mp.setattr(eviction, "device_call", lambda name: None if name == "empty_cache" else call(name))


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
    "resident-auto-margin",
    "resident_mb='auto' keeps the spare memory's states less a margin, so the next forward does not run out of memory",
    "tests/test_resident_auto.py::test_tight_device_the_next_forward_does_not_run_out_of_memory",
)
def _auto_without_margin(mp: pytest.MonkeyPatch) -> None:
    auto = importlib.import_module("swapopt.resident_auto")
    mp.setattr(auto, "budget_bytes", lambda reading, fraction: reading.available)


@mutation(
    "resident-auto-replan",
    "resident_mb='auto' re-plans when free memory changes by more than 10%",
    "tests/test_resident_auto.py::test_a_change_of_free_memory_past_ten_percent_replans_and_below_does_not",
)
def _auto_never_replans(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(importlib.import_module("swapopt.resident_auto"), "REPLAN_CHANGE", float("inf"))


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


@mutation(
    "chunk-of-several-groups",
    "a chunk holding params of several param groups steps each with its own group's hyperparameters",
    "tests/test_parity_groups.py::test_chunk_of_several_groups_is_bitwise[adamw_foreach-split]",
    "tests/test_parity_groups.py::test_chunk_of_several_groups_is_bitwise[adamw_fused-one_chunk]",
    "tests/test_parity_groups.py::test_chunk_of_several_groups_is_bitwise[sgd_momentum-split]",
)
def _one_group_per_chunk(mp: pytest.MonkeyPatch) -> None:
    # swapopt.inner.run_groups hands the inner optimizer the chunk's share of each group: merge them into
    # the first group's copy, whose hyperparameters then step every param of the chunk
    inner = importlib.import_module("swapopt.inner")
    run_groups = inner.run_groups

    def merged(owner, order, groups, *rest):
        if len(groups) > 1:
            groups = [dict(groups[0], params=[p for g in groups for p in g["params"]])]
            order = order[:1]
        return run_groups(owner, order, groups, *rest)

    mp.setattr(inner, "run_groups", merged)


# ----- master weights (Note [master weights], swapopt.masters) -------------------------------------------
@mutation(
    "master-weights-fp32",
    "master_weights steps each bf16 param through its fp32 master, which moves with the states",
    "tests/test_master_weights.py::test_bf16_with_clipping_matches_the_recipe[adamw_foreach]",
    "tests/test_master_weights.py::test_nothing_fp32_on_the_device_between_steps_and_peak_within_the_cap",
)
def _no_masters(mp: pytest.MonkeyPatch) -> None:
    # swapopt.masters.Masters.wanted decides which params get a master: none do, so bf16 params step in bf16
    masters = importlib.import_module("swapopt.masters")
    mp.setattr(masters.Masters, "wanted", lambda self, p: False)


# ----- failure atomicity (Note [failure semantics], swapopt.recovery) -------------------------------------
@mutation(
    "failure-drain",
    "a failed step waits for the copies and updates already queued before it completes or rolls anything forward",
    "tests/test_failure.py::test_failure_in_chunk_k[1-2-adamw]",
    "tests/test_failure.py::test_failure_in_chunk_k[1-2-sgd_momentum]",
    "tests/test_faults.py::test_fault_at_every_stage[before_swap_in-2-adamw_foreach]",
)
def _in_flight_chunks_not_drained(mp: pytest.MonkeyPatch) -> None:
    # swapopt.recovery.recover starts with SwapOptimizerOperate.drain (the host waits for every stream)
    operate = importlib.import_module("swapopt.operate")
    mp.setattr(operate.SwapOptimizerOperate, "drain", lambda self: None)


@mutation(
    "failure-complete-chunk",
    "a chunk whose update returned before the failure is completed: its params end fully stepped",
    "tests/test_faults.py::test_fault_at_every_stage[after_update-2-adamw_foreach]",
    "tests/test_faults.py::test_fault_at_every_stage[swap_out_interrupt-2-sgd_momentum]",
)
def _updated_chunk_not_completed(mp: pytest.MonkeyPatch) -> None:
    recovery = importlib.import_module("swapopt.recovery")
    mp.setattr(recovery, "_complete_chunk", lambda run, k, chunk: False)


@mutation(
    "failure-roll-forward",
    "after a failed step every param is fully stepped or untouched: one split across the failing chunk is completed",
    "tests/test_failure.py::test_roll_forward_at_every_chunk[0-sgd_momentum]",
    "tests/test_failure.py::test_roll_forward_with_one_slot",
)
def _split_params_left_half_stepped(mp: pytest.MonkeyPatch) -> None:
    recovery = importlib.import_module("swapopt.recovery")
    mp.setattr(recovery, "_roll_forward", lambda run, failed, entered: None)


# ----- checkpoints: state_dict / load_state_dict, DCP (swapopt.checkpoint) --------------------------------
@mutation(
    "dcp-after-swap-outs",
    "DCP saves from and loads straight into the pinned host states once the last step's swap-outs have landed",
    "tests/test_dcp.py::test_save_load_resume_is_bitwise",
    "tests/test_dcp.py::test_checkpoint_of_a_plain_optimizer_resumes_a_swap_optimizer",
)
def _state_dict_while_swap_outs_write(mp: pytest.MonkeyPatch) -> None:
    # swapopt.checkpoint.state_dict waits for in-flight swap-outs (opt.wait_for_swap_out) before it hands out
    # the host tensors; on resume DCP's zero-grad step swaps out the very tensors dcp.load then writes
    checkpoint = importlib.import_module("swapopt.checkpoint")
    state_dict = checkpoint.state_dict

    def without_waiting(opt):
        opt.wait_for_swap_out = lambda params=None: None  # shadows the method for this call
        try:
            return state_dict(opt)
        finally:
            del opt.wait_for_swap_out

    mp.setattr(checkpoint, "state_dict", without_waiting)


@mutation(
    "state-dict-follows-the-step",
    "a state dict taken before a step and read after it holds that step's values (the step waits while one is alive)",
    "tests/test_state_dict_aliases.py::test_state_dict_taken_before_a_step_and_saved_after_it_holds_that_steps_values",
    "tests/test_state_dict_aliases.py::test_a_view_of_a_state_dict_tensor_keeps_the_step_waiting",
)
def _step_ignores_live_state_dicts(mp: pytest.MonkeyPatch) -> None:
    checkpoint = importlib.import_module("swapopt.checkpoint")
    mp.setattr(checkpoint, "after_step", lambda opt: None)


@mutation(
    "load-into-host-states",
    "load_state_dict (and DCP's set_optimizer_state_dict) writes loaded values into the existing pinned host states",
    "tests/test_checkpoint.py::test_set_optimizer_state_dict_fake_step_and_load_stay_on_host",
    "tests/test_checkpoint.py::test_load_allocates_no_device_memory[with-state]",
)
def _loaded_values_not_written(mp: pytest.MonkeyPatch) -> None:
    # swapopt.checkpoint.load_state_dict skips the in-place copy where source and host state are one tensor
    # (what DCP loaded into): take every pair for one, so nothing is written into an existing host state
    checkpoint = importlib.import_module("swapopt.checkpoint")
    mp.setattr(checkpoint, "_same_tensor", lambda a, b: True)


# ----- prefetch (the prefetch knob, Note [ramp] in swapopt.plan) ------------------------------------------
@mutation(
    "prefetch-validity",
    "the step adopts a prefetch only if it runs the very plan the prefetch was made for, else drops it",
    "tests/test_prefetch.py::test_plan_changes_after_the_prefetch_drop_it_without_a_leak[grad_lost]",
)
def _stale_prefetch_adopted(mp: pytest.MonkeyPatch) -> None:
    # HostLayout.prepare drops the pending prefetch (SwapOptimizerOperate.discard_prefetch) before it plans
    # anew: keep it, so that the step's begin() adopts a prefetch made for the old plan
    layout = importlib.import_module("swapopt.layout")
    operate = importlib.import_module("swapopt.operate")
    prepare, discard = layout.HostLayout.prepare, operate.SwapOptimizerOperate.discard_prefetch
    planning: list[bool] = []

    def prepare_keeping_the_prefetch(self, *args, **kwargs):
        planning.append(True)
        try:
            return prepare(self, *args, **kwargs)
        finally:
            planning.pop()

    mp.setattr(layout.HostLayout, "prepare", prepare_keeping_the_prefetch)
    mp.setattr(operate.SwapOptimizerOperate, "discard_prefetch", lambda self: False if planning else discard(self))


@mutation(
    "prefetch-no-ramp",
    "with prefetch the plan has no smaller first chunks (Note [ramp]): the prefetched chunks are full ones",
    "tests/test_prefetch_rules.py::test_prefetch_plans_no_ramp_where_one_forms_without_it[times]",
)
def _ramp_with_prefetch(mp: pytest.MonkeyPatch) -> None:
    # HostLayout.prepare asks swapopt.plan.make_plan for ramp=not prefetch: ask for a ramp always
    layout = importlib.import_module("swapopt.layout")
    make_plan = layout.make_plan
    mp.setattr(layout, "make_plan", lambda *args, **kw: make_plan(*args, **{**kw, "ramp": True}))


# ----- device identity (swapopt.engine.trainer.init_distributed) ------------------------------------------
def _engine_keeps_device_0(trainer) -> None:
    """init_distributed no longer makes LOCAL_RANK's device current: every rank builds on device 0."""
    real = trainer.init_distributed

    def init_distributed(device_type):
        module = trainer.device.get_torch_device_module()
        own = vars(module).get("set_device")  # a module's function, or None for an object's method
        module.set_device = lambda index: None
        try:
            return real(device_type)
        finally:
            if own is None:
                del module.set_device
            else:
                module.set_device = own

    trainer.init_distributed = init_distributed


@mutation(
    "device-identity",
    "each rank builds on its own device (LOCAL_RANK), made current before anything asks for the device",
    "tests/test_sim_device_type.py::test_engine_builds_on_its_ranks_device[h100]",
)
def _every_rank_on_device_0(mp: pytest.MonkeyPatch) -> None:
    # the typed simulator runs in a process of its own (tests/sim_typed_program.py)
    trainer = importlib.import_module("swapopt.engine.trainer")
    mp.setattr(trainer, "init_distributed", trainer.init_distributed)  # undone after the run
    _engine_keeps_device_0(trainer)
    in_subprocesses(mp, "swapopt.engine.trainer", _engine_keeps_device_0)


@mutation(
    "subclass-states-part-by-part",
    "torchao's low-bit states are swapped part by part, never dequantized, bitwise to themselves resident",
    "tests/test_lowbit.py::test_steps_bitwise_to_itself_resident_moving_the_parts_bytes[fp8]",
    "tests/test_lowbit.py::test_state_dict_torch_save_and_dcp_resume_bitwise[fp8]",
)
def _subclass_states_as_plain(mp: pytest.MonkeyPatch) -> None:
    # every subclass state is taken for a plain one: copied into plain host tensors through a dequantize
    subclass_state = importlib.import_module("swapopt.subclass_state")
    mp.setattr(subclass_state, "is_subclass_state", lambda value: False)
