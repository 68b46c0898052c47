"""Reproduction (one GPU): scaled_dot_product_attention's backward given an output gradient
[B, S, H * Dh] whose batch stride is smaller than its sequence stride (a view of [S, B, N] rows,
what a sequence gather returns before it is made contiguous). On H200 (torch 2.11, cuDNN 9.19)
cuDNN's bf16 backward returns wrong gradients for it; this is why asynctp's ops return contiguous
outputs. Runs the backward of one causal attention with a contiguous output gradient and with the
same values in that strided layout, per SDPA backend, and prints the largest difference of
dq / dk / dv.

    python benchmarks/probe_sdpa_strides.py OUT_DIR
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def run(backend, dtype, q, k, v, grad):
    qs, ks, vs = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    try:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            out.backward(grad.to(dtype) if grad.dtype != dtype else grad)
    except RuntimeError as exc:  # backend not available for these inputs
        return None, str(exc).splitlines()[0]
    return [t.grad.float() for t in (qs, ks, vs)], None


def main(out_dir):
    torch.manual_seed(0)
    B, S, H, D = 2, 1024, 8, 128
    dev = "cuda"
    q, k, v = (torch.randn(B, S, H, D, device=dev).transpose(1, 2) for _ in range(3))
    g = torch.randn(B, H, S, D, device=dev)
    rows = {}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        for dtype in (torch.bfloat16, torch.float32):
            # the same values, two layouts: [B, S, H*D] contiguous, and [S, B, H*D] rows viewed as [B, S, H*D]
            g_bshd = g.transpose(1, 2).contiguous().to(dtype)  # [B, S, H, D]
            plain = g_bshd.view(B, S, H * D).view(B, S, H, D).transpose(1, 2)
            strided = g_bshd.transpose(0, 1).contiguous().transpose(0, 1).view(B, S, H, D).transpose(1, 2)
            ref, err = run(backend, dtype, q, k, v, plain)
            got, err2 = run(backend, dtype, q, k, v, strided)
            key = f"{backend.name} {str(dtype).removeprefix('torch.')}"
            if ref is None or got is None:
                rows[key] = {"unavailable": err or err2}
            else:
                rows[key] = {n: (a - b).abs().max().item() / max(a.abs().max().item(), 1e-30)
                             for n, a, b in zip(("dq", "dk", "dv"), ref, got)}
            print(key, rows[key], flush=True)
    with open(os.path.join(out_dir, "sdpa_strides.json"), "w") as f:
        json.dump({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                   "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    main(sys.argv[1])
