"""The SM carve-out setting: defaults per strategy, the environment override, and that the
context restores torch's global state (CUDA) or does nothing (CPU)."""

import pytest
import torch

from asynctp import config
from asynctp.runtime import carveout
from asynctp.runtime.carveout import carveout_for, sm_carveout


def test_defaults_and_override():
    with config.override(sm_carveout=None):
        assert carveout_for("pipeline") == carveout._DEFAULTS["pipeline"]
        assert carveout_for("ring") == carveout._DEFAULTS["ring"]
        assert carveout_for("serial") == 0
    with config.override(sm_carveout=7):
        assert carveout_for("pipeline") == 7 and carveout_for("ring") == 7
    with pytest.raises(ValueError, match="ASYNCTP_SM_CARVEOUT requires an integer >= 0, got '-3'"):
        config.Config.from_env({"ASYNCTP_SM_CARVEOUT": "-3"})  # never clamped silently


def test_cpu_is_a_no_op(monkeypatch):
    monkeypatch.setattr(config, "_current", config.Config(sm_carveout=16))
    before = torch._C._get_sm_carveout_experimental()
    with sm_carveout(torch.device("cpu"), "ring"):
        assert torch._C._get_sm_carveout_experimental() == before
    assert torch._C._get_sm_carveout_experimental() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sets_and_restores(monkeypatch):
    monkeypatch.setattr(config, "_current", config.Config(sm_carveout=16))
    before = torch._C._get_sm_carveout_experimental(), torch._C._get_blas_preferred_backend()
    with pytest.raises(RuntimeError, match="inside"):
        with sm_carveout(torch.device("cuda"), "ring"):
            assert torch._C._get_sm_carveout_experimental() == 16
            assert torch._C._get_blas_preferred_backend() == torch._C._BlasBackend.Cublaslt
            raise RuntimeError("inside")
    assert (torch._C._get_sm_carveout_experimental(), torch._C._get_blas_preferred_backend()) == before


def test_single_launch_gemms_leave_the_carved_out_sms(monkeypatch):
    """The persistent GEMMs of the fused strategy run one program per SM, less the setting (unset:
    none left free), never fewer than one; the reduce-scatter's producer takes the same count."""
    import sys

    from asynctp.kernels import producer_mm

    aim = sys.modules["asynctp.kernels.async_input_mm"]  # (the package's async_input_mm is the function)
    monkeypatch.setattr(aim, "sm_count", lambda device: 132)
    device = torch.device("cuda", 0)
    with config.override(sm_carveout=None):
        assert aim.programs(device) == 132
    with config.override(sm_carveout=8):
        assert aim.programs(device) == 124
    with config.override(sm_carveout=500):
        assert aim.programs(device) == 1
    assert producer_mm.programs is aim.programs
