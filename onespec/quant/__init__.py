"""Quantized weights: formats that stay quantized in memory and are dequantized (or run by
quantized kernels) where a layer computes."""
