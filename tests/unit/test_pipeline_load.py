"""The reduce-scatter loads its reduction's kernels before it enqueues any wait on a peer
(asynctp/runtime/pipeline.py: _load_reduce_kernels): once per dtype / alignment / reduce op."""

import torch

from asynctp.runtime import pipeline


def test_reduction_kernels_are_launched_once_per_dtype_alignment_and_op(monkeypatch):
    calls = []
    real = pipeline._reduce_into
    monkeypatch.setattr(pipeline, "_loaded", set())
    monkeypatch.setattr(pipeline, "_reduce_into", lambda out, parts, op, acc: calls.append(
        (out.dtype, [p.data_ptr() % 16 for p in parts], op, acc is not None)) or real(out, parts, op, acc))
    base = torch.zeros(4 * 130, dtype=torch.bfloat16)
    parts = [base[:128].view(2, 64), base[130:258].view(2, 64)]  # the second 4 bytes off 16-byte alignment
    acc = torch.zeros(2, 64)
    out = torch.zeros(2, 64, dtype=torch.bfloat16)
    for _ in range(2):
        pipeline._load_reduce_kernels(out, parts, "sum", acc)
    assert len(calls) == 1
    # the scratch tensors copy each real tensor's alignment within 16 bytes
    assert calls[0][1] == [t.data_ptr() % 16 for t in parts] and calls[0][3]
    pipeline._load_reduce_kernels(out, parts, "avg", acc)  # another op: its own kernels (div_)
    pipeline._load_reduce_kernels(out, parts[:1] + [base[128:256].view(2, 64)], "sum", acc)  # another alignment
    assert len(calls) == 3
