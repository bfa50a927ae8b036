"""Triton kernels for CUDA (GEMV chain, row ops, rotary + KV write, paged attention); their
settings (settings.py) import without Triton."""
