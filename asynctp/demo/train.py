"""One rank's side of the demo: build, shard and train the model once per variant (same seed, same
data), timing each step; rank 0 shows progress and returns the measurements."""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from asynctp.demo.compiled import compile_settings, enable_torch_async_tp
from asynctp.demo.data import MarkovTokens
from asynctp.demo.model import ModelConfig, Transformer
from asynctp.demo.nocomm import fake_mesh, local_collectives
from asynctp.demo.plan import parallelize
from asynctp.ops import dispatch

__all__ = ["Variant", "TrainSettings", "train", "train_interleaved", "VARIANTS"]


@dataclass(frozen=True)
class Variant:
    name: str  # shown in the table and the JSON
    asynchronous: bool  # asynctp's styles (else torch's)
    torch_async_tp: bool = False  # torch.compile with inductor's own async-TP (micro-pipeline) pass
    # a control: one initial weight moved by one unit in the last place, nothing else changed.
    # How far its loss curve strays from the unperturbed one is what rounding alone does to a
    # training run, the yardstick for the gap between vanilla TP and asynctp
    perturb_init: bool = False
    asynctp_pass: bool = False  # torch.compile with asynctp's FX pass (asynctp.compile) on vanilla styles
    strategy: str = "auto"  # asynctp's styles: the fused ops' strategy ("serial": nothing overlapped)
    # every collective skipped (the plan runs over a fake process group of the same ranks): wrong
    # numbers, the right compute and host work. Its step time is what the plan would take if
    # communication were free, so vanilla TP's step time minus it is the communication vanilla
    # TP leaves exposed, the ceiling of what any overlap can win
    no_comm: bool = False


VARIANTS = {
    "vanilla": Variant("vanilla TP", asynchronous=False),
    "asynctp": Variant("asynctp", asynchronous=True),
    # asynctp's styles with every collective run before its matmul: the same numerics and fp8
    # recipe as "asynctp", no overlap. The baseline of what overlap alone gains (vanilla TP has
    # no fp8 of its own to compare an fp8 run with)
    "asynctp-serial": Variant("asynctp, not overlapped", asynchronous=True, strategy="serial"),
    "torch-async-tp": Variant("torch async TP (compiled)", asynchronous=False, torch_async_tp=True),
    "control": Variant("vanilla TP, 1-ulp init change", asynchronous=False, perturb_init=True),
    "asynctp-pass": Variant("vanilla TP + asynctp pass (compiled)", asynchronous=False, asynctp_pass=True),
    "no-comm": Variant("vanilla TP, no communication", asynchronous=False, no_comm=True),
}


@dataclass(frozen=True)
class TrainSettings:
    cfg: ModelConfig
    steps: int
    dtype: torch.dtype
    lr: float
    seed: int = 0
    float8: str | None = None  # the async variant's fp8 recipe name
    compile: bool = False
    warmup: int = 3  # steps left out of the timings (allocation, autotuning, compilation)
    profile_steps: int = 0  # extra steps run under torch.profiler (0: no profile)
    trace_dir: str | None = None  # where each rank writes each run's profiler trace (profile_steps > 0)
    profile_host_ops: bool = True  # False: the profile records the GPU's activity only (demo --profile-gpu)
    host_profile_steps: int = 0  # extra steps queued under cProfile (0: none): where the host time goes
    # async column-parallel layers keep the gathered input for wgrad (vanilla TP's memory use);
    # False re-gathers it in backward (less memory, one more overlapped gather); fp8 re-gathers
    save_gathered_input: bool = True
    # async: wq / wk / wv and w1 / w3 share one gather per block (SharedGather)
    share_gathers: bool = True
    # the runs advance step by step in turn (train_interleaved), not one after the other
    interleave: bool = False
    # timed steps queued back to back before the host waits for the GPU (and reads their losses),
    # as a training loop that logs every sync_every steps runs: the host queues the next step
    # while the GPU still works on the last. 1: every step starts from an idle GPU and is timed
    # alone. The warm-up steps always run one at a time
    sync_every: int = 1


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # seconds, every step
    # seconds the host took to queue each step (forward, backward, optimizer) before it waited
    # for the loss: close to the step time means the GPU waited for the host (host-bound)
    host_times: list[float] = field(default_factory=list)
    peak_memory_bytes: int | None = None  # allocated by tensors (torch.cuda.max_memory_allocated)
    peak_reserved_bytes: int | None = None  # held from the device by torch's allocator, pools included
    profile: dict[str, float] | None = None
    host_profile: str | None = None  # cProfile of the extra steps, functions by own time
    fusion: str | None = None  # the asynctp pass's report, first line (asynctp-pass runs)
    graph_calls: dict[str, int] | None = None  # pipelined calls run eagerly / captured / replayed
    graph_calls_last_step: dict[str, int] | None = None  # the same, of the last step alone
    op_calls: dict[str, int] | None = None  # asynctp's calls by op and strategy (ops.dispatch.calls)
    no_comm: bool = False  # the collectives were skipped: its losses mean nothing


def train(
    variant: Variant, settings: TrainSettings, mesh: DeviceMesh, device: torch.device,
    on_step: Callable[[int, float, float], None] | None = None,
) -> RunResult:
    """Train a fresh model for settings.steps steps; on_step(step, loss, seconds) after each."""
    with contextlib.ExitStack() as stack:
        if variant.asynctp_pass:  # graphs compile lazily, at the first forward and backward
            from asynctp.compile import enabled, fresh_compiles, fusion_report

            stack.enter_context(enabled())
            # graphs of an earlier run of the same model (this process or another) would load
            # from the caches unrewritten and unreported
            stack.enter_context(fresh_compiles())
            fusion_report(clear=True)
        result = _train(variant, settings, mesh, device, on_step)
        if variant.asynctp_pass:
            result.fusion = str(fusion_report()).splitlines()[0]
        return result


def _train(variant, settings, mesh, device, on_step) -> RunResult:
    from asynctp.runtime import graphs

    run = _Run(variant, settings, mesh, device)
    graphs.clear()  # a run neither reuses nor holds (in its peak memory) an earlier run's graphs
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # the reserved peak then counts this run's memory alone
        torch.cuda.reset_peak_memory_stats(device)
    with _collector_between_steps():
        for first, count in windows(settings):
            for step, (loss, seconds) in enumerate(run.steps(count), start=first):
                if on_step is not None:
                    on_step(step, loss, seconds)
    if device.type == "cuda":
        run.result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
        run.result.peak_reserved_bytes = torch.cuda.max_memory_reserved(device)
    return run.finish()


def windows(settings: TrainSettings) -> list[tuple[int, int]]:
    """(first step, steps) of each stretch the host queues before it waits for the GPU: the
    warm-up steps one at a time, then settings.sync_every steps at a time (the last stretch may be
    shorter)."""
    if settings.sync_every < 1:
        raise ValueError(f"sync_every requires a positive number of steps, got {settings.sync_every}")
    single = min(settings.warmup, settings.steps)
    out = [(step, 1) for step in range(single)]
    out += [(first, min(settings.sync_every, settings.steps - first))
            for first in range(single, settings.steps, settings.sync_every)]
    return out


def train_interleaved(
    variants: list[Variant], settings: TrainSettings, mesh: DeviceMesh, device: torch.device,
    on_step: Callable[[int, int, float, float], None] | None = None,
) -> list[RunResult]:
    """Train one fresh model per variant, step by step in turn (step i of every run, then step
    i + 1): a machine's drift over the minutes of a demo then touches every run alike, where
    runs one after the other can differ by more than what is being compared. The models are
    built alike (same seed) and never share state, so each loss curve is the one train() gives.
    Compiled runs compile at their first steps, each under its own compiler settings
    (demo/compiled.py); peak memory is not attributed (every model is alive at once).
    on_step(run index, step, loss, seconds)."""
    from asynctp.runtime import graphs

    graphs.clear()
    passes = any(v.asynctp_pass for v in variants)
    if passes:
        from asynctp.compile import fusion_report

        fusion_report(clear=True)
    runs = [_Run(v, settings, mesh, device, in_turn=True) for v in variants]
    # every compiled run's graphs stay in dynamo's caches of the same code objects
    limit = torch._dynamo.config.patch(recompile_limit=max(8, 4 * len(runs)))
    with _collector_between_steps(), limit:
        for first, count in windows(settings):
            for i, run in enumerate(runs):
                for step, (loss, seconds) in enumerate(run.steps(count), start=first):
                    if on_step is not None:
                        on_step(i, step, loss, seconds)
    results = [run.finish() for run in runs]
    for run, result in zip(runs, results):
        if run.variant.asynctp_pass:  # the only run compiled with the pass
            result.fusion = str(fusion_report()).splitlines()[0]
    return results


@contextlib.contextmanager
def _collector_between_steps():
    """Python's collector runs between steps, never inside a timed one (a collection over the
    autograd graph's objects would cost milliseconds at a random step otherwise)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _Run:
    """One variant's model, optimizer, data and record, advanced a step at a time."""

    def __init__(self, variant: Variant, settings: TrainSettings, mesh: DeviceMesh, device: torch.device,
                 in_turn: bool = False) -> None:
        cfg = settings.cfg
        self.variant, self.settings, self.device = variant, settings, device
        self.model = _build(variant, settings, mesh, device, own_type=in_turn)
        # runs in turn: a compiled run's compiler settings while its steps run (and compile)
        self._compiling = (lambda: compile_settings(variant)) if in_turn else contextlib.nullcontext
        # the no-communication run's collectives stay local while it trains (demo/nocomm.py)
        self._local = (lambda: local_collectives(fake_mesh(mesh))) if variant.no_comm else contextlib.nullcontext
        # fused on CUDA (one kernel per parameter group, as torchtitan runs it): the foreach
        # implementation over DTensor parameters spends ~15 ms of host time a step at the 8B block
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda"
        )
        self.data = MarkovTokens(cfg.vocab_size, seed=settings.seed)
        self.result = RunResult(variant.name, no_comm=variant.no_comm)
        self.result.graph_calls = {"eager": 0, "captured": 0, "replayed": 0}
        self.result.op_calls = {}

    def steps(self, count: int) -> list[tuple[float, float]]:
        """`count` steps queued back to back, the host waiting for the GPU only after the last;
        each step's (loss, seconds), seconds being the stretch's time over `count` (one step:
        its own time, from an idle GPU). Its pipelined calls are counted for this run."""
        calls = dispatch.calls()
        with self._local(), self._compiling():
            out = self._steps(count)
        for k, v in dispatch.calls().items():  # this run's own (runs in turn call between)
            if v > calls.get(k, 0):
                self.result.op_calls[k] = self.result.op_calls.get(k, 0) + v - calls.get(k, 0)
        return out

    def _steps(self, count: int) -> list[tuple[float, float]]:
        from asynctp.runtime import graphs

        cfg, device, result = self.settings.cfg, self.device, self.result
        batches = [self.data.batch(cfg.batch_size, cfg.seq_len).to(device) for _ in range(count)]
        gc.collect()
        _sync(device)
        before = graphs.stats()
        losses = []
        start = time.perf_counter()
        for tokens in batches:
            queued = time.perf_counter()
            losses.append(_queue_step(self.model, self.opt, tokens))
            result.host_times.append(time.perf_counter() - queued)
            after = graphs.stats()
            # eager, captured, replayed, the eager calls' reasons, the new keys' moved inputs
            calls = {k: after[k] - before.get(k, 0) for k in after if k != "graphs"}
            for k, v in calls.items():
                result.graph_calls[k] = result.graph_calls.get(k, 0) + v
            result.graph_calls_last_step, before = calls, after
        values = [loss.item() for loss in losses]
        _sync(device)
        seconds = (time.perf_counter() - start) / count
        result.losses += values
        result.step_times += [seconds] * count
        return [(loss, seconds) for loss in values]

    def finish(self) -> RunResult:
        """Profile (when asked), free the model, and return the record."""
        with self._local():
            self._profile()
        del self.model, self.opt
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return self.result

    def _profile(self) -> None:
        settings, device, cfg = self.settings, self.device, self.settings.cfg
        model, opt, data = self.model, self.opt, self.data
        if settings.profile_steps:
            from asynctp.demo.profile import profile_steps, trace_path

            trace = trace_path(settings.trace_dir, self.result.name)
            step = lambda: _step(model, opt, data.batch(cfg.batch_size, cfg.seq_len).to(device))  # noqa: E731
            self.result.profile = profile_steps(step, settings.profile_steps, trace, settings.profile_host_ops)
        if settings.host_profile_steps:
            from asynctp.demo.profile import host_profile

            batches = [data.batch(cfg.batch_size, cfg.seq_len).to(device) for _ in range(settings.host_profile_steps)]
            self.result.host_profile = host_profile(lambda tokens: _queue_step(model, opt, tokens), batches, device)


def _build(variant: Variant, settings: TrainSettings, mesh: DeviceMesh, device: torch.device,
           own_type: bool = False) -> torch.nn.Module:
    torch.manual_seed(settings.seed)
    with device:
        model = Transformer(settings.cfg)
    model.to(settings.dtype)
    if variant.perturb_init:
        _nudge_one_weight(model)
    float8 = settings.float8 if variant.asynchronous else None
    save = settings.save_gathered_input and float8 is None
    if variant.no_comm:
        mesh = fake_mesh(mesh)
    # the no-communication run splits its own copy of the model (every rank built the same one): the
    # fake group's scatter leaves the shards unwritten on some releases
    parallelize(model, mesh, variant.asynchronous, float8, save_gathered_input=save and variant.asynchronous,
                share_gathers=settings.share_gathers, strategy=variant.strategy, src_data_rank=None if variant.no_comm else 0)
    if variant.torch_async_tp:
        enable_torch_async_tp(mesh)
    if settings.compile or variant.torch_async_tp or variant.asynctp_pass:
        # dynamo's cache is per code object, and every run's model has the same forward: without
        # a reset a later run reuses the first run's compiled graphs and its passes never run.
        # Runs in turn keep every run's graphs: each model gets a class of its own (dynamo's
        # guards check the module's type)
        if own_type:
            model.__class__ = type(type(model).__name__, (type(model),), {})
        else:
            torch._dynamo.reset()
        model = torch.compile(model)
    return model


@torch.no_grad()
def _nudge_one_weight(model: torch.nn.Module) -> None:
    """Change the first element of the first 2-D weight by one unit in the last place (every rank
    holds the full unsharded model here, so all make the same change)."""
    w = next(p for p in model.parameters() if p.dim() == 2)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[w.element_size()]
    w.view(-1)[:1].view(bits).add_(1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    return _queue_step(model, opt, tokens).item()


def loss_and_backward(model: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of tokens [B, S + 1] and its backward, queued; the loss (a DTensor
    where the logits are sharded over the vocabulary: loss_parallel never gathers them)."""
    logits = model(tokens[:, :-1])
    with loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext():
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
    return loss


def _queue_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    """One training step queued on the device; the loss (not yet waited for)."""
    loss = loss_and_backward(model, tokens)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(result: RunResult, settings: TrainSettings, world_size: int) -> dict[str, Any]:
    """The numbers the table and the JSON show for one run."""
    def median_after_warmup(times: list[float]) -> float | None:
        timed = times[settings.warmup :] or times
        return sorted(timed)[len(timed) // 2] if timed else None

    step_time = median_after_warmup(result.step_times)
    tokens = settings.cfg.batch_size * settings.cfg.seq_len
    tail = result.losses[-min(5, len(result.losses)) :]
    return {
        "name": result.name,
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time,
        "peak_memory_bytes": result.peak_memory_bytes,
        "peak_reserved_bytes": result.peak_reserved_bytes,
        **({} if result.peak_memory_bytes is not None else
           {"peak_memory_missing": "interleaved" if settings.interleave else "cpu"}),
        "graph_calls": result.graph_calls,
        "graph_calls_last_step": result.graph_calls_last_step,
        "op_calls": result.op_calls,
        "final_loss": result.losses[-1],
        "final_loss_mean5": sum(tail) / len(tail),
        "losses": result.losses,
        "step_times_s": result.step_times,
        "host_time_s": median_after_warmup(result.host_times),
        "host_times_s": result.host_times,
        "profile": result.profile,
        **({"host_profile": result.host_profile} if result.host_profile else {}),
        **({"fusion_report": result.fusion} if result.fusion else {}),
        "world_size": world_size,
        **({"no_comm": True} if result.no_comm else {}),
    }
