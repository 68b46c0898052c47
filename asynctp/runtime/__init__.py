"""How a plan executes on a device: the schedules behind the Transport interface (the
symmetric-memory pipeline, the send/recv ring), streams, copy-engine transfers, signals, the SM
carve-out, the single-launch GEMM path (kernel_path), CUDA-graph capture and replay."""
