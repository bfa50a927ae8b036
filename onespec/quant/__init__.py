"""Quantized checkpoint formats onespec reads (decoded at load)."""
