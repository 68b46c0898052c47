"""Integrations with the TP code users already have: torchtitan (its dist_gemm path) and Hugging
Face transformers (model.tp_plan). Each imports its library on use, never at `import asynctp`."""
