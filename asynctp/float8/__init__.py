"""fp8 recipes (current scaling, tensorwise or rowwise) and the quantization helpers the training
code uses in front of asynctp.all_gather_scaled_matmul / scaled_matmul_reduce_scatter.

Not public: amax_to_scale / to_float8 are importable from asynctp.float8.quantize, but may change.
"""

from asynctp.float8.quantize import quantize_activation, quantize_weight
from asynctp.float8.recipe import Float8Recipe

__all__ = [
    # config
    "Float8Recipe",
    # quantization (scale = dequantization multiplier, as torch._scaled_mm takes it)
    "quantize_activation",
    "quantize_weight",
]
