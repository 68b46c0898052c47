"""How a plan executes on a device: streams, copy-engine transfers, signals, the single-launch
GEMM path (kernel_path), CUDA-graph capture and replay."""
