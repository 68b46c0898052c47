#!/usr/bin/env bash
# Builds .torchtitan_kit/ (git-ignored): the wheels that torchtitan 0.3.0's trainer imports beyond
# what the GPU image has (torch 2.11, numpy, tokenizers, safetensors), for CPython 3.12 on x86-64
# Linux, each without its dependencies. wandb, datasets (pyarrow, pandas) and tensorboard's server
# side are left out: torchtitan imports wandb only when enabled, examples/torchtitan/train.py stands
# in for datasets, and torch.utils.tensorboard needs only tensorboard, protobuf and absl-py. No
# tokenizer and no dataset: examples/torchtitan/bench_configs.py trains on synthetic tokens.
# Run from the repo root on a machine that reaches PyPI; benchmarks/torchtitan_bench.sh uses the kit:
#   bash benchmarks/torchtitan_kit.sh
set -euo pipefail
KIT=.torchtitan_kit
WHEELS=(torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 torchdata==0.11.0
        tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 einops==0.8.2
        tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1)
rm -rf "$KIT" && mkdir -p "$KIT"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$KIT" "${WHEELS[@]}"
ls "$KIT"
du -sh "$KIT"
