"""torchtitan 0.3's trainer with its dist_gemm TP path running on asynctp's fused ops.

    pip install torchtitan==0.3.0      # and its dependencies (triton, datasets, ...)
    torchrun --nproc-per-node 2 examples/torchtitan/train.py \\
        --module llama3 --config llama3_debugmodel_dist_gemm \\
        --parallelism.tensor_parallel_degree 2 --training.steps 20

Every argument goes to torchtitan (torchtitan.train's --module / --config / --<section>.<key>),
except --asynctp.float8 {tensorwise,rowwise} (fp8 forward and dgrad matmuls) and --asynctp.off
(torchtitan's own dist_gemm, for comparison). The config must select tp_gemm_backend="dist_gemm"
and parallelism.spmd_backend="spmd_types", as torchtitan's llama3_debugmodel_dist_gemm does
(torchtitan 0.3 registers no 8B config with dist_gemm; benchmarks/train_bench.py times that shape).
The trainer needs torchtitan's tokenizer assets and dataset (see torchtitan's README), or
`--module bench_configs` (bench_configs.py beside this file: an 8B-shaped model on synthetic tokens,
which benchmarks/torchtitan_bench.sh times); the CPU test of this integration
(tests/dist/test_integrations.py) runs torchtitan's fused modules directly.

In torchtitan's eager loop (--training.disable_cuda_graphs) with --asynctp.float8, set ASYNCTP_GRAPHS=0:
same step time, less memory (the numbers: asynctp/integrations/torchtitan.py's docstring).

Before torchtitan is imported, _compat() fills in what torchtitan imports but the environment may lack
(see its docstring); it changes nothing where torch has those APIs and Hugging Face datasets is installed.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types

import asynctp.integrations.torchtitan as att


def _pop(flag: str, takes_value: bool) -> str | bool | None:
    """Remove `flag` (and its value) from sys.argv; its value, True, or None if absent."""
    for i, arg in enumerate(sys.argv):
        if arg == flag:
            del sys.argv[i]
            return sys.argv.pop(i) if takes_value else True
        if takes_value and arg.startswith(flag + "="):
            del sys.argv[i]
            return arg.split("=", 1)[1]
    return None


def _compat() -> None:
    """What torchtitan 0.3 (written against torch nightlies) uses but released torch (2.11 to 2.13)
    lacks, and what it imports but only its text dataloaders use, filled in where missing:
    torch.distributed.fsdp.DataParallelMeshDims (imported; only its full_dtensor / multi-axis FSDP
    paths construct one): a stand-in; torch.distributed.set_timeout (called after the first step):
    torch's private _set_pg_timeout, which sets the same thing; create_block_mask's
    separate_full_blocks=True (what torch without that argument always does): accepted; Hugging Face datasets: a
    placeholder module whose loaders raise."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex

    if "separate_full_blocks" not in inspect.signature(flex.create_block_mask).parameters:
        create_block_mask = flex.create_block_mask

        @functools.wraps(create_block_mask)
        def create_block_mask_compat(*args, separate_full_blocks: bool = True, **kwargs):
            if not separate_full_blocks:
                raise NotImplementedError("this torch's create_block_mask always separates full blocks")
            return create_block_mask(*args, **kwargs)

        flex.create_block_mask = create_block_mask_compat

    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout

    if not hasattr(fsdp, "DataParallelMeshDims"):
        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:
            shard: str | tuple[str, ...] | None = None
            replicate: str | None = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
    try:
        import datasets  # noqa: F401
    except ImportError:
        def unavailable(*args, **kwargs):
            raise RuntimeError("Hugging Face datasets is not installed: use a dataloader without it "
                               "(e.g. --module bench_configs's synthetic one)")

        placeholder = types.ModuleType("datasets")
        placeholder.Dataset = type("Dataset", (), {})
        placeholder.load_dataset = unavailable
        placeholder.distributed = types.ModuleType("datasets.distributed")
        placeholder.distributed.split_dataset_by_node = unavailable
        sys.modules.update({"datasets": placeholder, "datasets.distributed": placeholder.distributed})


def _reserved_by_pool() -> str:
    """GPU memory the caching allocator holds now, split between its general pool and CUDA graphs'
    private pools: where a growing reservation went."""
    import torch

    if not torch.cuda.is_available():
        return "no GPU"
    general = graph = graph_allocated = 0
    pools = set()
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg["segment_pool_id"]) == (0, 0):
            general += seg["total_size"]
        else:
            graph += seg["total_size"]
            graph_allocated += seg["allocated_size"]
            pools.add(tuple(seg["segment_pool_id"]))
    gib = 1 << 30
    return (f"general pool {general / gib:.2f} GiB, graph pools {graph / gib:.2f} GiB in {len(pools)} pools "
            f"({graph_allocated / gib:.2f} GiB allocated)")


def _report_at_exit() -> None:
    """At exit, print this rank's asynctp calls by op and strategy, its graph cache's counts (calls
    run eagerly and why, captured, replayed, graphs held), as `asynctp demo` does, and the GPU
    memory reserved by pool."""
    import atexit
    import os

    from asynctp.ops import dispatch
    from asynctp.runtime import graphs

    def report() -> None:
        rank = os.environ.get("RANK", "0")
        calls = ", ".join(f"{k} {v}" for k, v in sorted(dispatch.calls().items()))
        cache = ", ".join(f"{k} {v}" for k, v in graphs.stats().items() if v)
        print(f"asynctp (rank {rank}): calls by op and strategy: {calls or 'none'}; graph cache: {cache or 'unused'}; "
              f"reserved at exit: {_reserved_by_pool()}", flush=True)

    atexit.register(report)


def main() -> None:
    _compat()
    float8 = _pop("--asynctp.float8", True)
    if not _pop("--asynctp.off", False):
        att.enable(float8=float8)
        _report_at_exit()
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
