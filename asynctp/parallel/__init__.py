"""DTensor ParallelStyles whose linears overlap their tensor-parallel communication.

A plan written for vanilla sequence-parallel TP becomes async by swapping the style classes:

    ColwiseParallel(input_layouts=Shard(1))   ->  AsyncColwiseParallel(input_layouts=Shard(1))
    RowwiseParallel(output_layouts=Shard(1))  ->  AsyncRowwiseParallel(output_layouts=Shard(1))
    SequenceParallel()                         ->  SequenceParallel()   (norms: torch's, re-exported)

Sibling linears fed the same input (wq / wk / wv, w1 / w3) can share one gather: give their
styles one SharedGather (an optimization beyond the swap; without it each linear gathers).
Embeddings keep torch's RowwiseParallel / ColwiseParallel (a lookup has no matmul to overlap);
WaitedRowwiseParallel is the row-parallel one with its output waited, so that a block compiled on
its own gets a plain input (make_async puts it on nn.Embedding entries).

make_async(plan, model) does the swap for a whole plan: the classic shape (PrepareModuleInput
gathering on the parent, plain ColwiseParallel children), per-linear plans, torchao's float8
styles, and Hugging Face tp_plan string dicts.
"""

from torch.distributed.tensor.parallel import SequenceParallel

from asynctp.parallel.colwise import AsyncColwiseParallel
from asynctp.parallel.rowwise import AsyncRowwiseParallel
from asynctp.parallel.make_async import make_async
from asynctp.parallel.shared_gather import SharedGather
from asynctp.parallel.waited import WaitedRowwiseParallel

__all__ = ["AsyncColwiseParallel", "AsyncRowwiseParallel", "SharedGather", "SequenceParallel", "WaitedRowwiseParallel",
           "make_async"]
