"""DTensor ParallelStyles whose linears overlap their tensor-parallel communication.

A plan written for vanilla sequence-parallel TP becomes async by swapping the style classes:

    ColwiseParallel(input_layouts=Shard(1))   ->  AsyncColwiseParallel(input_layouts=Shard(1))
    RowwiseParallel(output_layouts=Shard(1))  ->  AsyncRowwiseParallel(output_layouts=Shard(1))
    SequenceParallel()                         ->  SequenceParallel()   (norms: torch's, re-exported)

Embeddings keep torch's RowwiseParallel / ColwiseParallel: a lookup has no matmul to overlap.
"""

from torch.distributed.tensor.parallel import SequenceParallel

from asynctp.parallel.colwise import AsyncColwiseParallel
from asynctp.parallel.rowwise import AsyncRowwiseParallel

__all__ = ["AsyncColwiseParallel", "AsyncRowwiseParallel", "SequenceParallel"]
