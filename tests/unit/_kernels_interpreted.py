"""Run by tests/unit/test_kernels.py under TRITON_INTERPRET=1: the kernels on CPU tensors."""

import torch

from asynctp.kernels import _ag_kernel as kern
from asynctp.kernels.async_input_mm import ChunkMap
from asynctp.kernels.configs import Config
from asynctp.kernels.producer_mm import launch_producer, producer_mm_reference

torch.manual_seed(0)
cfg = Config(16, 16, 16, group_m=2, stages=1, warps=4)
a = torch.randint(-3, 4, (64, 40)).float()
b = torch.randint(-3, 4, (40, 48)).float()
out = torch.full((64, 48), float("nan"))
kern.launch(a, b, False, out, torch.ones(4, dtype=torch.int32), 4, 1, 0, 16, 1, ChunkMap(), None, None, None, None, cfg, 3)
assert torch.equal(out, a @ b)
a2 = torch.randint(-3, 4, (60, 40)).float()
out2 = torch.full((60, 48), float("nan"))
kern.launch(a2, b.t().contiguous().t(), True, out2, torch.ones(3, dtype=torch.int32), 3, 1, 0, 20, 2, ChunkMap(),
            None, None, None, None, cfg, 3)
assert torch.equal(out2, a2 @ b)  # ragged chunks (20 rows, 16-row tiles), weight.t()
flags = torch.ones(8, dtype=torch.int32)
counters = torch.zeros(4, dtype=torch.int32)
kern.launch(a, b, False, out, flags, 4, 1, 2, 16, 2, ChunkMap(blocks=2, local_src=1), counters, None, None, None, cfg, 3)
assert torch.equal(out, a @ b) and flags.tolist() == [0, 1, 0, 1, 1, 1, 1, 1] and counters.count_nonzero() == 0
ws = a.clone()
ws[32:] = float("nan")  # source 1's rows come from their own tensor
flags = torch.ones(8, dtype=torch.int32)
out.fill_(float("nan"))
kern.launch(ws, b, False, out, flags, 4, 1, 2, 16, 2, ChunkMap(blocks=2, local_src=1), counters, None, None, None, cfg,
            3, a_local=a[32:].clone())
assert torch.equal(out, a @ b)
# rowwise scales: source 1's rows and scales both from their own tensors (none staged in ws)
sa = 2.0 ** torch.randint(-2, 3, (64,)).float()
sa_ws = sa.clone()
sa_ws[32:] = float("nan")
flags = torch.ones(8, dtype=torch.int32)
out.fill_(float("nan"))
kern.launch(ws, b, False, out, flags, 4, 1, 2, 16, 2, ChunkMap(blocks=2, local_src=1), counters, sa_ws, None, None, cfg,
            3, a_local=a[32:].clone(), a_local_scale=sa[32:].clone())
assert torch.equal(out, (a * sa[:, None]) @ b)
# ... their scales left in a_scale (no a_local_scale): read from a_scale's rows of source 1
flags = torch.ones(8, dtype=torch.int32)  # (the launch above reset the waited flags)
out.fill_(float("nan"))
kern.launch(ws, b, False, out, flags, 4, 1, 2, 16, 2, ChunkMap(blocks=2, local_src=1), counters, sa, None, None, cfg,
            3, a_local=a[32:].clone())
assert torch.equal(out, (a * sa[:, None]) @ b)
a4 = torch.randint(-3, 4, (64, 256)).float()
b4 = torch.randint(-3, 4, (256, 48)).float()
out4 = torch.full((64, 48), float("nan"))
tail_counters = torch.zeros(4, dtype=torch.int32)
kern.tail_scratch = lambda device, tail, split, bm, bn: (torch.full((tail * split * bm * bn,), float("nan")),
                                                         tail_counters)
# 12 tiles on 5 programs: 2 full waves, the last 2 tiles split along K into 2 parts each
kern.launch(a4, b4, False, out4, torch.ones(4, dtype=torch.int32), 4, 1, 0, 16, 3, ChunkMap(), None, None, None, None,
            cfg, 5)
assert torch.equal(out4, a4 @ b4) and tail_counters.count_nonzero() == 0
for rank in range(3):
    a3 = torch.randint(-3, 4, (3 * 32, 24)).float()
    received = torch.randint(-3, 4, (3, 32, 40)).float()
    parts = torch.full((2, 32, 40), float("nan"))
    out3 = torch.full((32, 40), float("nan"))
    b3 = torch.randint(-3, 4, (24, 40)).float()
    cnt = torch.zeros(3 * 2 + 2, dtype=torch.int32)
    launch_producer(a3, b3, parts, received, out3, rank, 3, 2, (32, 16), torch.ones(6, dtype=torch.int32), (1, 3), cnt,
                    config=cfg)
    ref_parts, ref_out = producer_mm_reference(a3, b3, rank, 3, 2, list(received))
    assert all(torch.equal(parts[i], ref_parts[i]) for i in range(2)) and torch.equal(out3, ref_out)
    # avg and a bias in the own tiles' epilogue (two column halves; N 40 ends inside a tile's second half)
    bias = torch.randint(-3, 4, (40,)).float()
    cnt.zero_()
    launch_producer(a3, b3, parts, received, out3, rank, 3, 2, (32, 16), torch.ones(6, dtype=torch.int32), (1, 3), cnt,
                    reduce_op="avg", bias=bias, config=cfg)
    _, ref_avg = producer_mm_reference(a3, b3, rank, 3, 2, list(received), reduce_op="avg")
    assert torch.equal(out3, ref_avg + bias)
# the producer with its last, partial wave split along K (K 128: 8 K-tiles): 18 tiles on 4 programs,
# the last 2 (the own block 1's) in 2 parts each; the parts' fp32 sums added by the part that ends last
from asynctp.kernels import _rs_kernel  # noqa: E402

split_counters = torch.zeros(4, dtype=torch.int32)
splits = []


def _split_scratch(device, tail, split, bm, bn):
    splits.append((tail, split))
    return torch.full((tail * split * bm * bn,), float("nan")), split_counters


_rs_kernel.tail_scratch = _split_scratch
for rank in range(3):
    a5 = torch.randint(-3, 4, (3 * 32, 128)).float()
    b5 = torch.randint(-3, 4, (128, 40)).float()
    received = torch.randint(-3, 4, (3, 32, 40)).float()
    parts = torch.full((2, 32, 40), float("nan"))
    out5 = torch.full((32, 40), float("nan"))
    cnt = torch.zeros(3 * 2 + 2, dtype=torch.int32)
    launch_producer(a5, b5, parts, received, out5, rank, 3, 2, (32, 16), torch.ones(6, dtype=torch.int32), (1, 3), cnt,
                    reduce_op="avg", config=cfg)
    ref_parts, ref_out = producer_mm_reference(a5, b5, rank, 3, 2, list(received), reduce_op="avg")
    assert all(torch.equal(parts[i], ref_parts[i]) for i in range(2)) and torch.equal(out5, ref_out)
    assert split_counters.count_nonzero() == 0 and cnt[6:].count_nonzero() == 0
assert splits == [(2, 2)] * 3
# blocks that are not whole tiles: the caller's error, raised before anything launches
try:
    launch_producer(a5, b5, parts, received, out5, 0, 3, 3, (32, 10), torch.ones(9, dtype=torch.int32), (1, 3), cnt,
                    config=cfg)
except ValueError as exc:
    assert "requires blocks of a multiple of 16 rows, got 10" in str(exc), exc
else:
    raise AssertionError("blocks of 10 rows were accepted")
print("ok")
