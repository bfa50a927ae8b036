"""Benchmarks (`onespec bench`, bench/*.py): decode throughput against a bandwidth floor and
transformers (decode.py), prefix-cache TTFT (prefix.py); the random-weight model shapes
(models.py, moe.py), the transformers baseline (hf.py) and the plot (plot.py)."""
