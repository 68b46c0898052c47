"""The fp8 GEMM of torch._scaled_mm called on cuBLASLt directly, through ctypes (no build step),
with what _scaled_mm does not expose: a C matrix apart from D and beta = 1, i.e.

    out = scale_a * scale_b * (a @ b) + c        in one GEMM (c read in its epilogue)

the accumulate epilogue that the fp8 reduce-scatter's own blocks lack: with _scaled_mm they add
the received partial in a separate kernel, which cost 1.2-1.3x the GEMM alone (NOTES, twelfth
session), and a Triton GEMM with the addition fused was slower than both. Used by
scaled_matmul_reduce_scatter with ASYNCTP_FP8_EPILOGUE=cublaslt (an experiment, off by default)
and by benchmarks/probe_cublaslt_algos.py / probe_fp8_epilogue.py.

Measured on 2xH200 (seventeenth session, NOTES): alone, the tensorwise GEMM with the addition is
faster than _scaled_mm + add (1024 / 2048 / 4096 rows of the seed shape: 53 / 106 / 209-224 us
against 64 / 116 / 227), and matches fp32 math within the tests' bounds. In the reduce-scatter
it is not: the own block's GEMM must wait for the peer's partial, which the default's separate
addition waits for instead, under the next GEMM, so the op was slower at every row-block count
(M 4096: 238-303 us against 226-232) and with the epilogue on the last own block only
(ASYNCTP_RS_EPILOGUE=last) it tied the default (224 / 418 against 226 / 419). Hence off.

Layout: a [M, K] row-major and b [K, N] column-major, as _scaled_mm takes them; c and out [M, N]
row-major, bfloat16 or float32. In cuBLAS's column-major terms out^T [N, M] = b^T [N, K] @ a^T
[K, M]: b's memory is a K x N column-major matrix (ld K) used transposed, a's a K x M one (ld K)
used as is, the "TN" form Hopper's fp8 GEMMs require. So cuBLAS's A is b (its scale: scale_b)
and its B is a. Scales: float32, tensorwise (one element each) or rowwise (scale_a [M, 1] and
scale_b [1, N]; one tensorwise next to a rowwise one is expanded): cuBLASLt's outer-vector mode,
which needs a cuBLAS that has it for the GPU at hand: on 2xH200 (sm_90, the cuBLASLt of torch
2.11's cu130 wheels) the heuristic query refuses it (status 7, "an unsupported value or
parameter", seventeenth session), so rowwise scales raise Unsupported there; supports() asks
cuBLASLt once per GPU and mode. The workspace is allocated per call from torch's caching
allocator on the current stream (stream-ordered, and inside a CUDA graph capture from its pool).

Algorithm choice: the candidates are the heuristic's answer when asked for one (what
_scaled_mm runs) and its list when asked for 8 (which need not contain that one: at 1024 rows
none of the 8 was within 1.4x of it). With beta = 1 the first was up to 1.35x the GEMM alone at
4096 rows, another candidate 1.1-1.2x (seventeenth session). So the first call of a problem
outside a CUDA graph capture times each candidate on random scratch operands of the same shape
on a side stream (it waits for nothing queued on the caller's streams, so ranks in the middle
of a pipeline cannot wait on each other through it) and keeps the fastest; a first call inside
a capture takes the heuristic's first, without remembering it. ASYNCTP_CUBLASLT_TUNE=0 always
takes the heuristic's first. tuning() reports what was chosen.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

__all__ = ["scaled_mm_lt", "available", "supports", "tuning", "candidate_configs", "Unsupported"]

_OP_N, _OP_T = 0, 1
_R_32F, _R_16BF = 0, 14
_OUT = {torch.bfloat16: _R_16BF, torch.float32: _R_32F}
_FP8 = {torch.float8_e4m3fn: 28, torch.float8_e5m2: 29}
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_SCALAR_32F, _SCALE_OUTER_VEC_32F = 0, 3
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = {"A": 5, "B": 6, "C": 7, "D": 8}  # bytes; cuBLASLt assumes 256 where unset
_WORKSPACE_BYTES = 32 << 20
_MAX_ALGOS = 8
_STATUS_NOT_SUPPORTED = 15
_STATUS_INVALID_VALUE = 7
_ALGO_CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                "inner_shape": 7, "cluster_shape": 8}


class Unsupported(RuntimeError):
    """cuBLASLt has no algorithm for this problem on this GPU (e.g. rowwise scales on sm_90)."""


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@functools.cache
def _lib() -> ctypes.CDLL:
    """The libcublasLt that torch loaded (found in the process's maps after a GEMM), else by name."""
    if not torch.cuda.is_current_stream_capturing():  # (a GEMM loads cuBLAS; a capture forbids the sync)
        x = torch.ones(8, 8, device="cuda")
        torch.mm(x, x)
        torch.cuda.synchronize()
    with open("/proc/self/maps") as f:
        loaded = sorted({line.split()[-1] for line in f if "libcublasLt" in line})
    for name in [*loaded, "libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cublasLtGetStatusString.restype = ctypes.c_char_p
        lib.cublasLtGetStatusString.argtypes = [ctypes.c_int]
        vp, size = ctypes.c_void_p, ctypes.c_size_t
        for fn, args in (
            ("cublasLtCreate", [vp]),
            ("cublasLtMatmulDescCreate", [vp, ctypes.c_int, ctypes.c_int]),
            ("cublasLtMatmulDescSetAttribute", [vp, ctypes.c_int, vp, size]),
            ("cublasLtMatrixLayoutCreate", [vp, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]),
            ("cublasLtMatmulPreferenceCreate", [vp]),
            ("cublasLtMatmulPreferenceSetAttribute", [vp, ctypes.c_int, vp, size]),
            ("cublasLtMatmulAlgoGetHeuristic", [vp] * 7 + [ctypes.c_int, vp, vp]),
            ("cublasLtMatmul", [vp] * 14 + [size, vp]),
            ("cublasLtMatmulAlgoConfigGetAttribute", [vp, ctypes.c_int, vp, size, vp]),
        ):
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = ctypes.c_int
        return lib
    raise RuntimeError(f"cublasLt requires libcublasLt loaded by torch or on the loader path, got none (maps: {loaded})")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cublasLt {what} failed: {_lib().cublasLtGetStatusString(status).decode()} ({status})")


@functools.cache
def _handle() -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


def _set(setter, obj: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData, what: str) -> None:
    _check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), what)


def _layout(dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
    lay = ctypes.c_void_p()
    _check(_lib().cublasLtMatrixLayoutCreate(ctypes.byref(lay), ctypes.c_int(dtype), ctypes.c_uint64(rows),
                                             ctypes.c_uint64(cols), ctypes.c_int64(ld)), "MatrixLayoutCreate")
    return lay


@functools.cache
def _plan(m: int, n: int, k: int, fp8_a: int, fp8_b: int, out_type: int, rowwise: bool, fast: bool,
          align: tuple[int, int, int, int]) -> tuple:
    """(matmul descriptor, layouts A, B, C/D, candidate algorithms) for one problem, cached:
    descriptors hold no pointers but the scales', which each call sets. align: the byte alignment
    of cuBLAS's A, B, C and D pointers (every candidate must work with them: the pipeline's blocks
    start mid-buffer). Raises Unsupported where cuBLASLt has no algorithm."""
    lib = _lib()
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), ctypes.c_int(_COMPUTE_32F), ctypes.c_int(_R_32F)),
           "MatmulDescCreate")
    setter = lib.cublasLtMatmulDescSetAttribute
    _set(setter, desc, _DESC_TRANSA, ctypes.c_int32(_OP_T), "TRANSA")
    _set(setter, desc, _DESC_TRANSB, ctypes.c_int32(_OP_N), "TRANSB")
    _set(setter, desc, _DESC_FAST_ACCUM, ctypes.c_int8(1 if fast else 0), "FAST_ACCUM")
    mode = _SCALE_OUTER_VEC_32F if rowwise else _SCALE_SCALAR_32F
    _set(setter, desc, _DESC_A_SCALE_MODE, ctypes.c_int32(mode), "A_SCALE_MODE")
    _set(setter, desc, _DESC_B_SCALE_MODE, ctypes.c_int32(mode), "B_SCALE_MODE")
    lay_a = _layout(fp8_b, k, n, k)  # cuBLAS's A: torch's b, K x N column-major, transposed
    lay_b = _layout(fp8_a, k, m, k)  # cuBLAS's B: torch's a, K x M column-major
    lay_c = _layout(out_type, n, m, n)  # C and D: out^T, N x M column-major
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
    _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES,
         ctypes.c_uint64(_WORKSPACE_BYTES), "MAX_WORKSPACE_BYTES")
    for (name, attr), value in zip(_PREF_MIN_ALIGNMENT.items(), align):
        _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, attr, ctypes.c_uint32(value), f"MIN_ALIGNMENT_{name}_BYTES")
    what = f"fp8 {m}x{n}x{k} ({'rowwise' if rowwise else 'tensorwise'} scales, fast_accum={fast})"
    # asked for one, the heuristic answers what torch._scaled_mm runs; asked for several, its list
    # need not start with that one (measured: at 1024 rows none of the 8 was within 1.4x of it)
    candidates, seen = [], set()
    for wanted in (1, _MAX_ALGOS):
        results, count = (_Heuristic * wanted)(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(_handle(), desc, lay_a, lay_b, lay_c, lay_c, pref, wanted,
                                                    results, ctypes.byref(count))
        if status in (_STATUS_INVALID_VALUE, _STATUS_NOT_SUPPORTED):
            raise Unsupported(f"cublasLt has no algorithm for {what} on this GPU: AlgoGetHeuristic says "
                              f"{lib.cublasLtGetStatusString(status).decode()} ({status})")
        _check(status, "AlgoGetHeuristic")
        for i in range(count.value):
            if results[i].state == 0 and bytes(results[i].algo) not in seen:
                seen.add(bytes(results[i].algo))
                candidates.append(results[i])
    if not candidates:
        raise Unsupported(f"cublasLt has no algorithm for {what}: none usable")
    return desc, lay_a, lay_b, lay_c, tuple(candidates)


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two (at most 256) that divides t's address."""
    ptr = t.data_ptr()
    return 256 if ptr % 256 == 0 else ptr & -ptr


def _problem(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, out: torch.Tensor, rowwise: bool,
             fast_accum: bool) -> tuple:
    """_plan's arguments for a call: shape, dtypes, flags and the pointers' alignments."""
    align = (_alignment(b), _alignment(a), _alignment(out if c is None else c), _alignment(out))
    return (a.shape[0], b.shape[1], a.shape[1], _FP8[a.dtype], _FP8[b.dtype], _OUT[out.dtype], rowwise, fast_accum,
            align)


def available() -> str | None:
    """None where scaled_mm_lt can run here, else why not (a line)."""
    if not torch.cuda.is_available():
        return "it needs a CUDA device, got none"
    try:
        _handle()
    except (RuntimeError, OSError, AttributeError) as exc:
        return f"libcublasLt could not be used ({exc})"
    return None


@functools.cache
def supports(rowwise: bool, device_index: int) -> str | None:
    """None where cuBLASLt has an fp8 algorithm with these scales on this GPU (asked once, with a
    small problem: no GEMM runs), else why not (a line)."""
    why = available()
    if why is not None:
        return why
    with torch.cuda.device(device_index):
        try:
            _plan(256, 256, 256, _FP8[torch.float8_e4m3fn], _FP8[torch.float8_e4m3fn], _R_16BF, rowwise, False,
                  (256, 256, 256, 256))
        except Unsupported as exc:
            major, minor = torch.cuda.get_device_capability(device_index)
            return f"{exc} (sm_{major}{minor})"
    return None


_chosen: dict[tuple, int] = {}
_tunings: dict[tuple, dict] = {}


def tuning() -> list[dict]:
    """The problems tuned in this process: shape, flags, each candidate's config and time (us),
    and the index chosen."""
    return list(_tunings.values())


def _describe(heuristic: _Heuristic) -> dict[str, int | float]:
    """A candidate's configuration (cuBLASLt's ALGO_CONFIG attributes: tile, split-K, stages...),
    its workspace bytes and the heuristic's wave count."""
    lib, got = _lib(), {}
    for name, attr in _ALGO_CONFIG.items():
        size = ctypes.c_size_t(0)  # asked with no buffer, it says the attribute's size (must match)
        lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(heuristic.algo), attr, None, 0, ctypes.byref(size))
        value = ctypes.c_uint64(0)
        if 0 < size.value <= 8 and lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(heuristic.algo), attr, ctypes.byref(value), size.value, ctypes.byref(size)) == 0:
            got[name] = int(value.value)  # little-endian: the low bytes hold the value
    return {**got, "workspace": int(heuristic.workspaceSize), "waves": round(heuristic.wavesCount, 3)}


def _launch(plan: tuple, algo: int, a_ptr: int, b_ptr: int, sa_ptr: int, sb_ptr: int, c_ptr: int | None, out_ptr: int,
            device: torch.device) -> None:
    desc, lay_a, lay_b, lay_c, candidates = plan
    lib = _lib()
    setter = lib.cublasLtMatmulDescSetAttribute
    _set(setter, desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(sb_ptr), "A_SCALE_POINTER")
    _set(setter, desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(sa_ptr), "B_SCALE_POINTER")
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0 if c_ptr is None else 1.0)
    # stream-ordered: the caching allocator hands this block to no other stream while it is in use
    workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    _check(lib.cublasLtMatmul(
        _handle(), desc, ctypes.byref(alpha), ctypes.c_void_p(b_ptr), lay_a, ctypes.c_void_p(a_ptr), lay_b,
        ctypes.byref(beta), ctypes.c_void_p(out_ptr if c_ptr is None else c_ptr), lay_c, ctypes.c_void_p(out_ptr),
        lay_c, ctypes.byref(candidates[algo].algo), ctypes.c_void_p(workspace.data_ptr()),
        ctypes.c_size_t(_WORKSPACE_BYTES), ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)), "Matmul")


def _tune(plan: tuple, key: tuple, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
          with_c: bool, out: torch.Tensor, rowwise: bool, fast_accum: bool) -> int:
    """Times each candidate on random scratch operands shaped like the call's on a side stream,
    round-robin over 3 rounds of 5 launches, the median round kept; returns the fastest one's
    index."""
    device = out.device
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        # random values: zeros draw less power, and H200's fp8 GEMMs run at its power limit
        a_s = torch.randn(m, k, device=device).to(a.dtype)
        b_s = torch.randn(n, k, device=device).to(b.dtype).t()
        sa, sb = torch.ones_like(scale_a), torch.ones_like(scale_b)
        c_s = torch.randn(m, n, device=device).to(out.dtype) if with_c else None
        o_s = torch.empty(m, n, dtype=out.dtype, device=device)
        ptrs = (a_s.data_ptr(), b_s.data_ptr(), sa.data_ptr(), sb.data_ptr(), None if c_s is None else c_s.data_ptr(),
                o_s.data_ptr())
        candidates = plan[4]
        times: list[list[float]] = [[] for _ in candidates]
        for i in range(len(candidates)):  # warm-up: each once
            _launch(plan, i, *ptrs, device)
        for _ in range(3):
            for i in range(len(candidates)):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(side)
                for _ in range(5):
                    _launch(plan, i, *ptrs, device)
                end.record(side)
                end.synchronize()
                times[i].append(start.elapsed_time(end) * 1000 / 5)
    side.synchronize()
    medians = [sorted(t)[1] for t in times]
    best = min(range(len(candidates)), key=medians.__getitem__)
    _tunings[key] = {"m": m, "n": n, "k": k, "out": str(out.dtype), "fast_accum": fast_accum, "rowwise": rowwise,
                     "beta": 1 if with_c else 0, "chosen": best,
                     "candidates": [{**_describe(h), "us": round(t, 1)} for h, t in zip(candidates, medians)]}
    return best


def scaled_mm_lt(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 c: torch.Tensor | None, out: torch.Tensor, *, fast_accum: bool = False,
                 algo: int | None = None) -> torch.Tensor:
    """out = scale_a * scale_b * (a @ b) (+ c when given, in the GEMM's epilogue: one rounding);
    see the module docstring for the layouts and the choice of algorithm (algo: an index into
    cuBLASLt's candidates instead, for probes). Returns out."""
    m, k = a.shape
    n = b.shape[1]
    if a.dtype not in _FP8 or b.dtype not in _FP8:
        raise TypeError(f"scaled_mm_lt requires float8 a and b, got {a.dtype} and {b.dtype}")
    if b.shape[0] != k or a.stride() != (k, 1) or b.stride() != (1, k):
        raise ValueError(f"scaled_mm_lt requires a [M, K] row-major and b [K, N] column-major, got shapes "
                         f"{tuple(a.shape)}, {tuple(b.shape)} and strides {a.stride()}, {b.stride()}")
    if out.dtype not in _OUT:
        raise TypeError(f"scaled_mm_lt requires out of bfloat16 or float32, got {out.dtype}")
    for name, t in (("out", out), ("c", c)):
        if t is not None and (t.dtype != out.dtype or tuple(t.shape) != (m, n) or t.stride() != (n, 1)):
            raise ValueError(f"scaled_mm_lt requires {name} a contiguous {out.dtype} [{m}, {n}], got {t.dtype} "
                             f"{tuple(t.shape)} strides {t.stride()}")
    if c is not None and c.data_ptr() == out.data_ptr():
        raise ValueError("scaled_mm_lt requires c apart from out (beta = 1 reads C while D is written), got the "
                         "same memory")
    rowwise = scale_a.numel() != 1 or scale_b.numel() != 1
    if rowwise:  # outer vectors, both: M and N float32 elements, contiguous
        scale_a = scale_a.reshape(-1).expand(m).contiguous() if scale_a.numel() == 1 else scale_a.reshape(-1)
        scale_b = scale_b.reshape(-1).expand(n).contiguous() if scale_b.numel() == 1 else scale_b.reshape(-1)
        if scale_a.numel() != m or scale_b.numel() != n or not (scale_a.is_contiguous() and scale_b.is_contiguous()):
            raise ValueError(f"scaled_mm_lt requires rowwise scales of {m} and {n} contiguous elements, got "
                             f"{scale_a.numel()} and {scale_b.numel()}")
    args = _problem(a, b, c, out, rowwise, fast_accum)
    plan = _plan(*args)
    if algo is None:
        key = (*args, c is not None)
        algo = _chosen.get(key)
        if algo is None:
            if len(plan[4]) == 1 or os.environ.get("ASYNCTP_CUBLASLT_TUNE", "1") == "0":
                algo = _chosen[key] = 0
            elif torch.cuda.is_current_stream_capturing():
                algo = 0  # no timing inside a capture; a later eager call tunes
            else:
                algo = _chosen[key] = _tune(plan, key, a, b, scale_a, scale_b, c is not None, out, rowwise, fast_accum)
    elif not 0 <= algo < len(plan[4]):
        raise ValueError(f"scaled_mm_lt requires algo in [0, {len(plan[4])}) (cuBLASLt's candidates), got {algo}")
    _launch(plan, algo, a.data_ptr(), b.data_ptr(), scale_a.data_ptr(), scale_b.data_ptr(),
            None if c is None else c.data_ptr(), out.data_ptr(), out.device)
    return out


def candidate_configs(a: torch.Tensor, b: torch.Tensor, rowwise: bool, out: torch.Tensor,
                      fast_accum: bool = False) -> list[dict]:
    """cuBLASLt's candidates for a problem whose C (if any) is aligned as out (for probes and
    tests: scaled_mm_lt's algo indexes this list), each one's configuration."""
    return [_describe(h) for h in _plan(*_problem(a, b, None, out, rowwise, fast_accum))[4]]
