"""asynctp.float8.quantize on CPU (the torch formulas; the Triton kernels are checked against
them bit for bit in tests/gpu/test_float8.py)."""

import pytest
import torch

from asynctp.float8 import Float8Recipe
from asynctp.float8 import quantize as q

E4M3 = torch.float8_e4m3fn


def test_power_of_two_scales_round_up_exactly():
    # values just above a power of two, where exp2(ceil(log2(s))) used to round down
    powers = torch.tensor([2.0 ** e for e in range(-40, 20)])
    above = torch.nextafter(powers, torch.full_like(powers, float("inf")))
    below = torch.nextafter(powers, torch.zeros_like(powers))
    assert torch.equal(q._round_up_pow2(powers), powers)
    assert torch.equal(q._round_up_pow2(above), powers * 2)
    assert torch.equal(q._round_up_pow2(below), powers)
    s = torch.rand(10000, generator=torch.Generator().manual_seed(0)) * 100 + 1e-6
    r = q._round_up_pow2(s)
    assert bool(((r >= s) & (r / 2 < s)).all())
    assert torch.equal(torch.frexp(r).mantissa, torch.full_like(r, 0.5))  # powers of two
    special = q._round_up_pow2(torch.tensor([float("inf"), float("nan")]))
    assert special[0] == float("inf") and special[1].isnan()
    assert q._round_up_pow2(torch.tensor(0.3)).item() == 0.5  # 0-dim


def test_quantize_rows_into_kept_buffers():
    recipe = Float8Recipe.from_name("rowwise")
    x = torch.randn(4, 6, 32, dtype=torch.bfloat16)
    out, scale_out = torch.empty(4, 6, 32, dtype=E4M3), torch.empty(4, 6, 1)
    y, s = q.quantize_rows(x, E4M3, recipe, out=out, scale_out=scale_out)
    assert y is out and s is scale_out
    y2, s2 = q.quantize_rows(x, E4M3, recipe)
    assert torch.equal(y.view(torch.uint8), y2.view(torch.uint8)) and torch.equal(s, s2)
    assert torch.equal(s, q.amax_to_scale(x.abs().amax(-1, keepdim=True), E4M3, recipe))


def test_kept_buffer_of_the_wrong_shape_is_refused():
    recipe = Float8Recipe.from_name("rowwise")
    with pytest.raises(ValueError, match=r"out requires a contiguous torch.float8_e4m3fn tensor of shape \(4, 32\)"):
        q.quantize_rows(torch.randn(4, 32), E4M3, recipe, out=torch.empty(4, 16, dtype=E4M3))


@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise"])
def test_weight_for_dgrad_is_column_major_and_scaled_per_input_feature(scaling):
    recipe = Float8Recipe.from_name(scaling)
    w = torch.randn(24, 40)
    w_fp8, scale = q.quantize_weight_for_dgrad(w, recipe)
    assert w_fp8.shape == (24, 40) and w_fp8.stride() == (1, 24)
    assert scale.shape == ((1, 40) if scaling == "rowwise" else ())
    amax = w.abs().amax(0, keepdim=True) if scaling == "rowwise" else w.abs().amax()
    want = q.to_float8(w, q.amax_to_scale(amax, E4M3, recipe), E4M3)
    assert torch.equal(w_fp8.contiguous().view(torch.uint8), want.view(torch.uint8))


def test_dequantize_inverts_within_fp8_precision():
    recipe = Float8Recipe.from_name("tensorwise")
    x = torch.randn(16, 64)
    amax = q.abs_max(x).float()
    y, s = q.quantize_tensor(x, amax, E4M3, recipe)
    back = q.dequantize(y, s, torch.float32)
    assert torch.equal(back, y.float() * s)
    assert float((back - x).abs().max()) <= float(amax) / 8  # e4m3: 3 mantissa bits
