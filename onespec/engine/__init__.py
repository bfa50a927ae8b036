"""The engine: scheduling, the KV block pool, model runs, CUDA graphs and the overlap of steps."""
