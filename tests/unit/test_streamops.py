"""Stream memory operations (asynctp/symm/streamops.py) and the flag region in the signal pad
(asynctp/symm/cuda.py), on fakes: the GPU behaviour is covered by tests/gpu."""

from types import SimpleNamespace

import pytest

from asynctp.symm import streamops


def fake_lib(rc: int = 0):
    calls = []

    def entry(name):
        def fn(stream, address, value, flags):
            calls.append((name, stream, address, value, flags))
            return rc

        return fn

    lib = SimpleNamespace(cuStreamWriteValue32_v2=entry("write_v2"), cuStreamWaitValue32_v2=entry("wait_v2"),
                          cuStreamWriteValue32=entry("write_v1"), cuStreamWaitValue32=entry("wait_v1"))
    return lib, calls


def test_the_v2_entry_points_are_used_and_values_wrap_at_32_bits():
    lib, calls = fake_lib()
    ops = streamops.StreamOps(lib)
    ops.write(7, 4096, 5)
    ops.wait(7, 4100, 2**32 + 3)
    assert calls == [("write_v2", 7, 4096, 5, 0), ("wait_v2", 7, 4100, 3, 0)]  # GEQ wait, fenced write


def test_a_driver_error_raises_naming_the_call():
    lib, _ = fake_lib(rc=1)
    with pytest.raises(RuntimeError, match="cuStreamWaitValue32 failed with CUresult 1"):
        streamops.StreamOps(lib).wait(0, 0, 1)


def test_flags_take_the_end_of_the_pad_and_leave_torchs_channels_alone(monkeypatch):
    cuda = pytest.importorskip("asynctp.symm.cuda")
    from torch._C._distributed_c10d import _SymmetricMemory

    monkeypatch.delenv("ASYNCTP_SIGNALS", raising=False)
    monkeypatch.setattr(_SymmetricMemory, "signal_pad_size", 2048, raising=False)
    handle = SimpleNamespace(signal_pad_ptrs=[1 << 20, 2 << 20])
    (pads, base), why = cuda._flag_region(handle, 2)
    assert why is None and pads == [1 << 20, 2 << 20]
    ours = 2 * cuda.FLAG_CHANNELS * 2 * 4
    assert base == 2048 - ours and base >= cuda.FLAG_CHANNELS * 2 * 4  # torch: channel * world + rank
    region, why = cuda._flag_region(handle, 16)  # 16 ranks do not fit 2 KiB: torch's kernels, and why
    assert region is None and "too small for 16 ranks" in why
    monkeypatch.setenv("ASYNCTP_SIGNALS", "torch")
    assert cuda._flag_region(handle, 2) == (None, "ASYNCTP_SIGNALS=torch")
