"""Every private API of PyTorch, Hydra, Hugging Face datasets and Python itself that membudget uses, each in one
place, with what it stands in for.

When a public API appears for one of these, only this file changes. Two exceptions, imported where Hydra loads
them before any run starts, which must not import torch (as this module does): the Optuna sweeper's
SamplerConfig (hydra_plugins/membudget_search) and Hydra's experimental Callback (rundir.py, the run-dir lock).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch.nn.functional as F

# torch.utils._pytree: flattening nested args/outputs; stands in for a public pytree API (optree is not a
# dependency of torch on every platform).
from torch.utils._pytree import tree_leaves  # noqa: F401

# torch._dynamo.utils.counters: what torch.compile counted, inductor's and AOTAutograd's cache hits and misses
# among them (the tests read it); torch has no public compile statistics.
from torch._dynamo.utils import counters as compile_counters  # noqa: F401

# torch.compiler._cache.CacheArtifactManager: what this process's compiles recorded, the content of
# torch.compiler.save_cache_artifacts; its clear() starts a new record for a run that follows another in one
# process (a multirun's next job), which torch.compiler has no public call for.
from torch.compiler._cache import CacheArtifactManager as compile_artifacts  # noqa: F401

# torch._subclasses.fake_tensor: tensors with shapes, dtypes and storages but no memory, for the planner;
# torch has no public fake-tensor mode.
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401

# torch.distributed.algorithms._checkpoint: the module wrapper around torch.utils.checkpoint that
# torchtitan and FSDP use; the public alternative is calling torch.utils.checkpoint in forward ourselves.
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401
    ActivationWrapper,
    CheckpointWrapper,
    checkpoint_wrapper,
)


class BlockWrapper(ActivationWrapper):
    """A module around one block (a per-block budget, offloading) that checkpoints and state dicts see through,
    as they see through torch's own checkpoint wrapper (its base): parameters keep the block's own names, so a
    checkpoint loads under any other AC setting."""

    @property
    def block(self) -> torch.nn.Module:
        return self._checkpoint_wrapped_module

    def replace_block(self, block: torch.nn.Module) -> None:
        self._checkpoint_wrapped_module = block


# torch.utils._python_dispatch.TorchDispatchMode: a mode that sees every op below autograd (the planner's recorder);
# torch has no public base class for one.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

# torch.distributed._functional_collectives.wait_tensor: waits on an async collective's output; the
# public Work.wait() has no tensor-level form that Dynamo traces.
from torch.distributed._functional_collectives import wait_tensor  # noqa: F401

# torch.utils.flop_counter.flop_registry: torch's FLOP formula per aten op, the table behind FlopCounterMode; the
# public mode counts a whole region, the planner's recorder needs each op's.
from torch.utils.flop_counter import flop_registry  # noqa: F401

# torch.utils.weak.WeakIdKeyDictionary: a dict keyed by a tensor's or storage's identity that does not keep it
# alive (weakref.WeakKeyDictionary hashes by value, which tensors do not support).
from torch.utils.weak import WeakIdKeyDictionary  # noqa: F401

# The kernels behind F.scaled_dot_product_attention and F.rms_norm: underscored aten ops, which torch picks per
# device and input. Selective AC saves the attention kernels' outputs; the planner counts their FLOPs and runs the
# CUDA kernels' meta functions on a CPU. The public functions cannot name a kernel.
_aten = torch.ops.aten
SDPA_FLASH = _aten._scaled_dot_product_flash_attention
SDPA_FLASH_BACKWARD = _aten._scaled_dot_product_flash_attention_backward
SDPA_EFFICIENT = _aten._scaled_dot_product_efficient_attention
SDPA_EFFICIENT_BACKWARD = _aten._scaled_dot_product_efficient_attention_backward
SDPA_CUDNN = _aten._scaled_dot_product_cudnn_attention
SDPA_CUDNN_BACKWARD = _aten._scaled_dot_product_cudnn_attention_backward
SDPA_FLASH_CPU = _aten._scaled_dot_product_flash_attention_for_cpu
SDPA_FLASH_CPU_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward
FUSED_RMS_NORM = _aten._fused_rms_norm
FUSED_RMS_NORM_BACKWARD = _aten._fused_rms_norm_backward
SCALED_MM = _aten._scaled_mm  # float8 GEMMs

# torch.ops._c10d_functional.wait_tensor: the op a functional collective's wait dispatches (DTensor, compiled
# graphs), which the planner's recorder sees below autograd.
WAIT_TENSOR_OP = torch.ops._c10d_functional.wait_tensor.default


@contextlib.contextmanager
def functional_replaced(name: str, replacement: Callable) -> Iterator[None]:
    """torch.nn.functional.<name> is `replacement` inside: the planner runs on a CPU the kernel CUDA would pick
    (attention, fused RMSNorm), which torch offers no hook to choose."""
    with mock.patch.object(F, name, replacement):
        yield


@contextlib.contextmanager
def foreach_kernels_on_meta() -> Iterator[None]:
    """torch.nn.utils' gradient clipping takes the _foreach_ kernels for meta tensors inside, as it does for CUDA
    tensors: the planner records a GPU's optimizer step on the meta device. torch chooses them by a private
    list of devices (torch.utils._foreach_utils), with no public switch (foreach=True refuses meta)."""
    from torch.utils import _foreach_utils

    devices = _foreach_utils._get_foreach_kernels_supported_devices
    with mock.patch.object(_foreach_utils, "_get_foreach_kernels_supported_devices", lambda: [*devices(), "meta"]):
        yield


@contextlib.contextmanager
def storage_resizes(callback: Callable[[torch.UntypedStorage, int], None]) -> Iterator[None]:
    """`callback(storage, nbytes)` after every UntypedStorage.resize_ inside: FSDP2 frees and re-allocates its
    all-gather buffers by resizing their storages, which no dispatch mode sees."""
    resize = torch.UntypedStorage.resize_

    def tracked(storage, nbytes):
        resize(storage, nbytes)
        callback(storage, nbytes)

    with mock.patch.object(torch.UntypedStorage, "resize_", tracked):
        yield


@contextlib.contextmanager
def functorch_config(**settings: Any) -> Iterator[None]:
    """torch._functorch.config, patched for a scope: the min-cut partitioner reads its memory budget (and
    solver, estimator, Pareto plots) only there; torch.autograd.graph.region_activation_memory_budget is the
    public form, for one region at a time."""
    with torch._functorch.config.patch(**settings):
        yield


@contextlib.contextmanager
def below_autograd() -> Iterator[None]:
    """Run ops below the autograd key (their kernels, or fake kernels, not their composite under autograd), as
    a custom autograd.Function's forward must to call an op whose formula it supplies itself; torch's
    _AutoDispatchBelowAutograd guard has no public form."""
    with torch._C._AutoDispatchBelowAutograd():
        yield


def functorch_supports(setting: str) -> bool:
    """Whether this torch's torch._functorch.config has `setting` (older releases lack some)."""
    import torch._functorch.config as config

    return hasattr(config, setting)


def functorch_budget() -> float:
    return torch._functorch.config.activation_memory_budget


def storage_key(storage: torch.UntypedStorage) -> int:
    """A storage's identity (its StorageImpl's address): unique per live storage, also for meta and fake
    tensors, where data_ptr() is 0 for all. `_cdata` stands in for a public storage id."""
    return storage._cdata


def op_packet(func: Any) -> Any:
    """An op overload's packet (aten.mm for aten.mm.default), which keys torch's FLOP formulas; `_overloadpacket`
    stands in for a public accessor."""
    return func._overloadpacket


def op_schema(func: Any) -> Any:
    """An op's schema (its name, argument names, whether it mutates), or None for a higher-order op; `_schema`
    stands in for a public accessor."""
    return getattr(func, "_schema", None)


def selective_cache(forward_ctx: Any) -> Any:
    """The outputs selective AC saved for backward (MUST_SAVE), held in its caching dispatch mode's
    `storage`; no public API exposes them, and saved_tensors_hooks do not see them."""
    return forward_ctx.storage


def register_fake_process_group() -> None:
    """Registers the "fake" c10d backend (no communication, per-rank shapes), which the planner runs on;
    it lives in torch.testing._internal and has no public registration."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


@contextlib.contextmanager
def cached_dtensor_sharding_propagation() -> Iterator[None]:
    """Eager DTensor caches the output shapes it derives by running ops on whole-size tensors; under a fake
    mode it does not, and redoes that work on every op (the planner's tracker would count it). This makes
    the fake run use the cache as eager does; there is no public switch."""
    from unittest import mock

    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    with mock.patch.object(ShardingPropagator, "_propagate_tensor_meta",
                           ShardingPropagator._propagate_tensor_meta_cached):
        yield


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches of sharding decisions. They are keyed by DeviceMesh equality, which compares a
    mesh's shape, ranks and dim names but not the process group under it nor this process's place in it, and
    they return specs that hold the mesh they were first computed on: after the planner's fake world (every
    rank plans as rank 0), a real mesh of the same shape got back the fake mesh, so rank 1 initialised and
    checkpointed rank 0's shards. torch has no public way to empty them; each is cleared where this torch has
    it."""
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagator = DTensor._op_dispatcher.sharding_propagator
    caches = (getattr(propagator, "propagate_op_sharding", None),
              getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None),
              getattr(_redistribute, "_gen_transform_infos", None),
              getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None))
    for cache in caches:
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch's own
    if native is not None:
        native()


def basic_sweeper_jobs(params: dict, task_overrides: list[str]) -> list[list[str]] | None:
    """Each job's overrides as Hydra's basic sweeper expands a sweep's params and overrides (for the report's
    list of jobs that never started); Hydra exposes the sweeper only through its private module. None for
    sweeps it cannot expand without the config loader (glob())."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    args = [f"{k}={v}" for k, v in (params or {}).items()] + list(task_overrides)
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except HydraException:
        return None
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


@contextlib.contextmanager
def dynamo_recompile_limit(graphs: int) -> Iterator[None]:
    """Let Dynamo keep `graphs` compiled versions of one frame: blocks share TransformerBlock's code, and
    per-block budgets compile one graph per distinct budget, more than the default limit of 8 (past it
    Dynamo would silently run further blocks eagerly, without their budget). No public setting exists."""
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(recompile_limit=max(dynamo_config.recompile_limit, graphs),
                             accumulated_recompile_limit=max(dynamo_config.accumulated_recompile_limit, 4 * graphs)):
        yield


def optuna_search_space(overrides: list[str]) -> tuple[dict, dict]:
    """Hydra's sweep syntax (choice(...), interval(a, b), range(...)) as Optuna distributions, by name, and the
    overrides that are not swept; the only parser is the Optuna sweeper's, in its private _impl module."""
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    return create_params_from_overrides(overrides)


def no_datasets_download_counts() -> None:
    """Stop Hugging Face datasets' download counting: every load_dataset of a packaged builder (text, json),
    local files included, first sends a HEAD request to the Hub's S3 bucket (3 s timeout: per epoch, on a
    node without internet). Its only switches are HF_HUB_OFFLINE, which would also cut off the Hub's datasets,
    and datasets.config.HF_UPDATE_DOWNLOAD_COUNTS, read from the environment once at import."""
    import datasets.config

    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False


def optuna_set_user_attr(study: Any, frozen_trial: Any, key: str, value: Any) -> None:
    """Set a user attribute of a trial that another process left running; Optuna 2's public API sets them only
    through the live Trial object of the process that asked for it."""
    study._storage.set_trial_user_attr(frozen_trial._trial_id, key, value)


def cuda_memory_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Start (or stop) recording the CUDA caching allocator's allocations and frees with their stacks, for the
    memory visualiser; torch.cuda.memory._record_memory_history is documented ("Understanding CUDA Memory
    Usage") but private."""
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max_entries)


def dump_cuda_memory_snapshot(path: Any) -> None:
    """The recorded allocator history and the current segments as a pickle for https://pytorch.org/memory_viz;
    torch.cuda.memory._dump_snapshot, private like the recording."""
    torch.cuda.memory._dump_snapshot(str(path))


def decomposing_partitioning_backend(wrap_graph: Any) -> Any:
    """A torch.compile backend that is `aot_eager_decomp_partition` (inductor's decompositions and min-cut
    partitioner, graphs run op by op) with each compiled forward and backward graph passed through
    `wrap_graph(run) -> run` (boxed calling convention: `run(args_list)`), so a caller sees where a graph call
    begins and ends. The planner uses it to price what inductor would fuse; torch registers the plain backend
    by name only, and its parts (aot_autograd, boxed_nop, the partitioner, the decomposition table) are private."""
    import functools

    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor.compile_fx import select_decomp_table

    def compiler(gm: Any, example_inputs: Any) -> Any:
        run = wrap_graph(boxed_nop(gm, example_inputs))
        run._boxed_call = True
        return run

    def backend(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(unlift_effect_tokens=True):
            return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, decompositions=select_decomp_table(),
                                partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                               compiler="inductor"))(gm, example_inputs)

    return backend


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was made from (None for a tensor that is not a view); `Tensor._base` stands in for a
    public accessor (torch has none: untyped_storage() would also match unrelated tensors sharing a storage)."""
    return t._base


def tqdm_logging_handlers(logger: Any) -> list:
    """The handlers tqdm.contrib.logging.logging_redirect_tqdm installed on `logger`: its handler class,
    `_TqdmLoggingHandler`, is private, so they are known by that class's name."""
    return [h for h in logger.handlers if type(h).__name__ == "_TqdmLoggingHandler"]


def mem_tracker_class() -> type:
    """torch's MemTracker (per-module memory by category: parameters, gradients, activations, optimizer states),
    which the tests measure real steps with; it lives in torch.distributed._tools, with no public form."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker


GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch's ProcessGroupGloo gives its worker threads


def gloo_worker_threads() -> list[str]:
    """The Linux thread ids of gloo's worker threads in this process (none elsewhere than Linux)."""
    import os

    tasks = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == GLOO_WORKER_THREAD:
                    tasks.append(tid)
    return tasks


def wait_for_idle_gloo_workers(timeout_s: float = 2.0, poll_s: float = 0.01) -> bool:
    """Wait, with the GIL released, until each of gloo's worker threads in this process sleeps (Linux: its state
    in /proc) at two polls in a row; False if one still ran at `timeout_s`. Stands in for a gloo shutdown that
    joins its workers, which torch has not (destroy_process_group leaves a group that is still referenced running).

    Why: a worker drops a collective's Work after the main thread's wait has returned. Where the Work holds the
    last reference to a tensor whose Python object is kept for it, the drop needs the GIL, and a thread that asks
    for it while the interpreter finalizes is ended inside C++: the process aborts ("terminate called without an
    active exception", SIGABRT) after its work is done (pytorch/pytorch#179291)."""
    import time

    def all_asleep(tasks: list[str]) -> bool:
        for tid in tasks:
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("S", "D", "Z"):
                    return False
        return True

    tasks = gloo_worker_threads()
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while tasks and quiet < 2:
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)  # the GIL is free: a worker waiting for it takes it and finishes
        quiet = quiet + 1 if all_asleep(tasks) else 0
    return True


# atexit._run_exitfuncs: the registered exit handlers, run now as the interpreter's exit would run them, for a
# process that then ends with os._exit (launch.exit_without_stranded_calls); the atexit module has no public call.
def run_exit_handlers() -> None:
    import atexit

    atexit._run_exitfuncs()
