"""`asynctp demo`: train the Llama-style model with vanilla sequence-parallel TP and with asynctp,
side by side, on every local GPU (NCCL, one process per GPU) or on 2 CPU processes (gloo)."""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import traceback
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch

__all__ = ["add_arguments", "run"]

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
_LR = {"tiny": 3e-3, "small": 1e-3, "8b-block": 3e-4}
_CPU_WORLD = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=["tiny", "small", "8b-block"], default=None,
                        help="model size (default: 8b-block with >= 2 GPUs, tiny on CPU)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per run (default: 30, which ends within a minute on 2 GPUs; --long: 200)")
    parser.add_argument("--long", action="store_true", help="200 steps per run (longer loss curves, steadier times)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="parameter and activation dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--float8", choices=["none", "rowwise", "tensorwise"], default="none",
                        help="fp8 recipe of asynctp's matmuls (vanilla TP stays in --dtype)")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--torch-async-tp", action="store_true",
                        help="add a third run: vanilla TP compiled with inductor's own async-TP pass (GPU only)")
    parser.add_argument("--asynctp-pass", action="store_true",
                        help="add a run: vanilla TP compiled with asynctp's FX pass (asynctp.compile), the compiled path "
                             "for plans written with torch's styles; compare with --compile")
    parser.add_argument("--serial-baseline", action="store_true",
                        help="add a run: asynctp's styles with strategy='serial' (each collective, then its matmul: same "
                             "numerics and fp8 recipe, nothing overlapped), and compare asynctp with it too")
    parser.add_argument("--no-comm-baseline", action="store_true",
                        help="add a run: vanilla TP with every collective a local copy of this rank's data (a fake "
                             "process group: wrong losses, the same compute on real values): vanilla's step time minus "
                             "this run's is the communication vanilla TP leaves exposed, and asynctp's share of it is reported")
    parser.add_argument("--control", action="store_true",
                        help="add a run: vanilla TP with one initial weight changed by one ulp (how far rounding alone moves a loss curve)")
    parser.add_argument("--profile", action="store_true",
                        help="profile a few extra steps of each run: TP communication left exposed (GPU only)")
    parser.add_argument("--profile-gpu", action="store_true",
                        help="as --profile, over 10 steps, recording the GPU's activity only: recording the host's "
                             "ops makes a GPU-bound step host-bound; the GPU's busy time a step is reported beside the "
                             "wall")
    parser.add_argument("--trace", action="store_true",
                        help="with --profile or --profile-gpu: every rank writes each run's profiler trace (Chrome "
                             "trace, gzipped) to --out")
    parser.add_argument("--host-profile", action="store_true",
                        help="queue 3 extra steps of each run under cProfile: where the host time goes (in the JSON)")
    parser.add_argument("--regather-input", action="store_true",
                        help="asynctp re-gathers column-parallel inputs in backward instead of keeping them (less memory)")
    parser.add_argument("--no-shared-gather", action="store_true",
                        help="asynctp gathers once per linear (as vanilla TP does) instead of once for wq/wk/wv and w1/w3")
    parser.add_argument("--interleave", action="store_true",
                        help="run the variants step by step in turn (every model alive at once) instead of one after "
                             "the other: a machine's drift then touches every run alike (no per-run peak memory)")
    parser.add_argument("--sync-every", type=int, default=1, metavar="N",
                        help="queue N timed steps back to back before the host waits for the GPU and reads their "
                             "losses, as a training loop that logs every N steps does (the host then queues a step "
                             "while the GPU runs the last); each step's time is the stretch's over N. 1 (default): "
                             "every step starts from an idle GPU, host latency included. Warm-up steps run one at a time")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="sequences per step (default: per model size, 1 for 8b-block): more GPU work per step "
                             "for the same host work")
    parser.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: per model size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="use 2 CPU processes (gloo) even when GPUs are present")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where the JSON and PNG go")


def run(args: argparse.Namespace, collect: list | None = None) -> int:
    """The demo; `collect` (benchmarks/train_bench.py) receives (runs, settings) of each launch."""
    num_gpus = 0 if args.cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    on_gpu = num_gpus >= 2
    if on_gpu:
        world, backend, device_type = num_gpus, "nccl", "cuda"
        # NVLink multicast stays off (it can take a shared host's GPUs down); the ranks inherit it
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    else:
        world, backend, device_type = _CPU_WORLD, "gloo", "cpu"
        if num_gpus == 1:
            print("asynctp demo: one GPU is not tensor parallelism; running on 2 CPU processes (gloo)")
        if args.profile or args.profile_gpu or args.torch_async_tp:
            flag = "--profile" if args.profile else "--profile-gpu" if args.profile_gpu else "--torch-async-tp"
            print(f"asynctp demo: {flag} requires >= 2 GPUs, got {num_gpus}", file=sys.stderr)
            return 2
    if args.trace and not (args.profile or args.profile_gpu):
        print("asynctp demo: --trace requires --profile or --profile-gpu", file=sys.stderr)
        return 2
    model_name = args.model or ("8b-block" if on_gpu else "tiny")
    from asynctp.demo.model import SIZES
    from asynctp.demo.train import VARIANTS, TrainSettings

    cfg = SIZES[model_name]
    if args.batch_size is not None:
        if args.batch_size < 1:
            print(f"asynctp demo: --batch-size requires a positive number, got {args.batch_size}", file=sys.stderr)
            return 2
        cfg = dataclasses.replace(cfg, batch_size=args.batch_size)
    try:
        cfg.check_tp(world)
    except ValueError as exc:
        print(f"asynctp demo: --model {model_name}: {exc}", file=sys.stderr)
        return 2
    settings = TrainSettings(
        cfg=cfg,
        steps=args.steps if args.steps is not None else (200 if getattr(args, "long", False) else 30),
        dtype=_DTYPES[args.dtype or ("bfloat16" if on_gpu else "float32")],
        lr=args.lr if args.lr is not None else _LR[model_name],
        seed=args.seed,
        float8=None if args.float8 == "none" else args.float8,
        compile=args.compile,
        profile_steps=10 if args.profile_gpu else 5 if args.profile else 0,
        trace_dir=str(args.out) if args.trace else None,
        profile_host_ops=not args.profile_gpu,
        host_profile_steps=3 if getattr(args, "host_profile", False) else 0,
        save_gathered_input=not args.regather_input,
        share_gathers=not args.no_shared_gather,
        interleave=args.interleave,
        sync_every=args.sync_every,
    )
    if settings.steps < 1:
        print(f"asynctp demo: --steps requires a positive number, got {settings.steps}", file=sys.stderr)
        return 2
    if args.sync_every < 1:
        print(f"asynctp demo: --sync-every requires a positive number, got {args.sync_every}", file=sys.stderr)
        return 2
    # torch's async-TP run goes last: it switches inductor's micro-pipeline pass on for the process
    variants = [VARIANTS["vanilla"], VARIANTS["asynctp"]]
    variants += [VARIANTS[name] for name, on in (("asynctp-serial", args.serial_baseline),
                                                 ("no-comm", args.no_comm_baseline), ("control", args.control),
                                                 ("asynctp-pass", args.asynctp_pass),
                                                 ("torch-async-tp", args.torch_async_tp)) if on]
    print(f"asynctp demo: model {model_name} ({cfg.num_params() / 1e6:.1f}M params), {world} ranks over "
          f"{backend} on {device_type}, {settings.steps} steps, {str(settings.dtype).removeprefix('torch.')}"
          + (f", float8 {settings.float8}" if settings.float8 else "") + (", compiled" if settings.compile else "")
          + (f", the host waiting every {settings.sync_every} steps" if settings.sync_every > 1 else ""))
    runs = _launch(world, backend, device_type, settings, variants)
    if runs is None:
        return 1
    if collect is not None:
        collect.append((runs, settings))
    _report(args, runs, settings, model_name, world, backend, device_type)
    return 0


def _launch(world: int, backend: str, device_type: str, settings: Any, variants: list) -> list[dict] | None:
    ctx = mp.get_context("spawn")
    fd, store = tempfile.mkstemp(prefix="asynctp-demo-store-")
    os.close(fd)
    os.unlink(store)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, backend, device_type, f"file://{store}", settings, variants, results))
             for r in range(world)]
    for p in procs:
        p.start()
    runs, failure = None, None
    try:
        while runs is None and failure is None:
            try:
                ok, payload = results.get(timeout=1.0)
                runs, failure = (payload, None) if ok else (None, payload)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if not p.is_alive() and p.exitcode != 0]
                if dead:
                    failure = f"rank {dead[0][0]} exited with code {dead[0][1]}"
    finally:
        for p in procs:
            p.join(timeout=60 if failure is None else 5)
            if p.is_alive():
                p.kill()
        if os.path.exists(store):
            os.unlink(store)
    if failure is not None:
        print(f"asynctp demo failed: {failure}", file=sys.stderr)
        return None
    return runs


def _rank_main(rank: int, world: int, backend: str, device_type: str, init_method: str, settings: Any, variants: list, results: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from asynctp.demo.train import summarize, train

    # NVLink multicast stays off (it can take a shared host's GPUs down)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            torch.set_num_threads(1)
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=600))
        mesh = init_device_mesh(device_type, (world,))
        if settings.interleave:
            runs = [summarize(r, settings, world) for r in _train_in_turn(rank, variants, settings, mesh, device)]
        else:
            runs = []
            for variant in variants:
                progress = _Progress(variant.name, settings) if rank == 0 else None
                result = train(variant, settings, mesh, device, on_step=progress.update if progress else None)
                if progress:
                    progress.close()
                runs.append(summarize(result, settings, world))
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            results.put((True, runs))
    except BaseException:  # noqa: BLE001 - the parent prints it and fails
        results.put((False, f"rank {rank}:\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


def _train_in_turn(rank: int, variants: list, settings: Any, mesh: Any, device: torch.device) -> list:
    """train_interleaved with one progress bar for the rounds (the asynctp run's loss and speed)."""
    from asynctp.demo.train import train_interleaved

    progress = _Progress(f"{len(variants)} runs in turn", settings) if rank == 0 else None

    def on_step(index: int, step: int, loss: float, seconds: float) -> None:
        if progress is not None and index == 1:
            progress.update(step, loss, seconds)

    results = train_interleaved(variants, settings, mesh, device, on_step=on_step)
    if progress:
        progress.close()
    return results


class _Progress:
    """A tqdm bar when tqdm is installed, else a plain line every tenth of the run."""

    def __init__(self, name: str, settings: Any) -> None:
        self.name, self.steps = name, settings.steps
        self.tokens = settings.cfg.batch_size * settings.cfg.seq_len
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=self.steps, desc=f"{name:>12}", unit="step", file=sys.stdout)
        except ImportError:
            self.bar = None
        self.every = max(1, self.steps // 10)

    def update(self, step: int, loss: float, seconds: float) -> None:
        tok_s = self.tokens / seconds
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            self.bar.update(1)
        elif (step + 1) % self.every == 0 or step == 0 or step + 1 == self.steps:
            print(f"  {self.name}: step {step + 1:>4}/{self.steps}  loss {loss:.4f}  {tok_s:,.0f} tokens/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _hardware(world: int, device_type: str) -> str:
    if device_type == "cuda":
        name = torch.cuda.get_device_name(0).replace("NVIDIA", "").strip().split()[0]
        return f"{world}x{name}"
    return f"{world}xcpu"


def _report(args: argparse.Namespace, runs: list[dict], settings: Any, model_name: str, world: int, backend: str, device_type: str) -> None:
    from asynctp.demo.report import comparison, loss_notes, table, versions, write_json, write_png
    from asynctp.demo.train import VARIANTS

    print()
    print(table(runs))
    if settings.sync_every > 1:
        print(f"note: step times are each stretch of {settings.sync_every} steps over {settings.sync_every} (the host "
              f"waited once per stretch); host time then includes waits on a full launch queue, so it no longer "
              f"tells a host-bound run")
    def speed_line(name: str, base: str, c: dict, losses: bool = True) -> str:
        line = f"{name} vs {base}: speed-up {c['speedup']:.2f}x"
        if losses:
            line += f", loss curves max rel diff {c['max_rel_loss_diff']:.2e}"
        if "recovered_fraction_of_comm_cost" in c:
            line += (f", recovered {c['recovered_fraction_of_comm_cost'] * 100:.0f}% of the "
                     f"{c['vanilla_comm_cost_ms']:.1f} ms/step that communication costs {base} (step time minus "
                     f"the no-communication run's)")
        if "recovered_fraction_of_exposed_comm" in c:
            line += (f", recovered {c['recovered_fraction_of_exposed_comm'] * 100:.0f}% of {base}'s "
                     f"{c['vanilla_exposed_comm_ms']:.1f} ms/step exposed communication (profiled kernels)")
        return line

    no_comm = next((r for r in runs if r.get("no_comm")), None)
    compared = {r["name"]: comparison(runs[0], r, no_comm) for r in runs[1:] if r is not no_comm}
    if no_comm is not None:
        cost = (runs[0]["step_time_s"] - no_comm["step_time_s"]) * 1000
        print(f"{no_comm['name']}: {no_comm['step_time_s'] * 1000:.1f} ms a step, so communication costs "
              f"{runs[0]['name']} {cost:.1f} ms a step")
    for name, c in compared.items():
        if "1-ulp" in name:  # the control: only its loss curve means anything
            print(f"{name} vs {runs[0]['name']} (control: rounding alone): loss curves max rel diff "
                  f"{c['max_rel_loss_diff']:.2e}")
            continue
        print(speed_line(name, runs[0]["name"], c))
    for line in loss_notes(runs[0]["name"], compared, settings.cfg.batch_size):
        print(line)
    serial = [r for r in runs if r["name"] == VARIANTS["asynctp-serial"].name]
    if serial:  # what the overlap alone buys: asynctp against its own styles not overlapped
        c = compared[f"{runs[1]['name']} vs {serial[0]['name']}"] = comparison(serial[0], runs[1])
        print(speed_line(runs[1]["name"], serial[0]["name"], c, losses=False))
    for r in runs:
        calls = r.get("graph_calls") or {}
        if any(calls.values()):
            last = r.get("graph_calls_last_step") or {}
            why = ", ".join(f"{k.removeprefix('eager: ')} {v}" for k, v in last.items() if k.startswith("eager: ") and v)
            print(f"{r['name']}: pipelined calls (rank 0) {calls['eager']} eager, {calls['captured']} captured into "
                  f"CUDA graphs, {calls['replayed']} replayed; last step: {last.get('eager')} eager"
                  + (f" ({why})" if why else "") + f", {last.get('captured')} captured, {last.get('replayed')} replayed")
            moved = sorted(((k.removeprefix("moved: "), v) for k, v in calls.items() if k.startswith("moved: ") and v),
                           key=lambda kv: -kv[1])
            if moved:  # runtime/moves.py: why keys were new
                print(f"{r['name']}: new keys' inputs at new addresses (rank 0; tensor i: the i-th tensor of the "
                      "op's key() in asynctp/ops): " + ", ".join(f"{k} {v}" for k, v in moved))
    for r in runs:
        if r.get("op_calls"):
            print(f"{r['name']}: asynctp calls (rank 0), by op and strategy: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(r["op_calls"].items())))
    for r in runs:
        if r.get("fusion_report"):
            print(f"{r['name']}: {r['fusion_report']}")
    if any(r.get("fusion_report") for r in runs) and not settings.compile:
        print("note: vanilla TP and asynctp ran eagerly; add --compile to compare compiled with compiled")
    if settings.float8:
        print(f"note: asynctp runs float8 {settings.float8}; vanilla TP runs {str(settings.dtype).removeprefix('torch.')}"
              + ("; the not-overlapped run uses asynctp's float8 too" if serial else ""))
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    stem = args.out / f"demo_{_hardware(world, device_type)}"  # the latest run per hardware (dated inside)
    record = {
        "kind": "asynctp demo",
        "command": "asynctp demo " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["demo"] else "asynctp demo",
        "date": date,
        "hardware": _hardware(world, device_type),
        "backend": backend,
        "world_size": world,
        "model": model_name,
        "config": dataclasses.asdict(settings.cfg),
        "settings": {"steps": settings.steps, "dtype": str(settings.dtype).removeprefix("torch."), "lr": settings.lr,
                     "seed": settings.seed, "float8": settings.float8, "compile": settings.compile,
                     "warmup_steps_excluded": settings.warmup, "profile_steps": settings.profile_steps,
                     "save_gathered_input": settings.save_gathered_input and settings.float8 is None,
                     "share_gathers": settings.share_gathers, "interleave": settings.interleave,
                     "sync_every": settings.sync_every},
        "versions": versions(),
        "runs": runs,
        "comparison": compared,
    }
    for r in runs:
        if r.get("host_profile"):
            print(f"{r['name']}: " + "\n".join(r["host_profile"].splitlines()[:24]))
    json_path = stem.with_suffix(".json")
    write_json(json_path, record)
    title = f"{model_name} on {_hardware(world, device_type)}, {record['settings']['dtype']}"
    skipped = write_png(stem.with_suffix(".png"), runs, title)
    print(f"wrote {json_path}" + (f" (no PNG: {skipped})" if skipped else f" and {stem.with_suffix('.png')}"))
