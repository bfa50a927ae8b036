"""What request routers read from a worker, so that `onespec serve` replicas sit behind
sglang-router (sgl-model-gateway) or vllm-router as those projects' own workers do
(docs/SCALING.md).

- sglang-router registers a worker through /server_info and /model_info (falling back to
  /get_server_info and /get_model_info): the model's name there is the id it routes
  `model` by and lists at its own /v1/models (without them every worker is "unknown").
  Its power-of-two policy and /get_loads read /get_load (a list, one entry per data-parallel
  rank, with `num_tokens`); /flush_cache is fanned out to every worker; /health_generate
  is a health check that goes through the engine.
- vllm-router lists a worker's /v1/models, tokenizes through /tokenize (app.py) for its
  cache-aware tree, and its load-aware policies look for vLLM's gauges in /metrics
  (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`: metrics.py exports the load
  gauges under those names too).
/health (app.py) is what both poll for liveness. None of these routes needs an API key,
like /health and /metrics: routers probe workers without the clients' keys, and nothing
here says what any request contained."""
from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from onespec.models.loader import read_config


def model_facts(engine, served_model_name: str) -> dict:
    """The model's description, as /model_info and /server_info give it."""
    config = engine.config
    path = os.path.abspath(config.model)
    try:
        hf = read_config(config.model)
    except (OSError, ValueError):       # a model built in memory (tests)
        hf = {}
    spec = engine.spec_config
    return {
        "model_path": path,             # sglang-router loads its tokenizer from here
        "tokenizer_path": path,
        "served_model_name": served_model_name,     # the id routers route `model` by
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": hf.get("model_type"),
        "architectures": hf.get("architectures"),
        "max_model_len": engine.max_model_len,
        "tp_size": config.tensor_parallel_size,
        "dp_size": 1,
        "speculative_algorithm": type(spec).__name__ if spec is not None else None,
        "speculative_max_draft_len": engine.max_draft_len,
    }


def add_worker_routes(app: FastAPI, loop, serving, served_model_name: str, deep_problems):
    """Adds /model_info, /server_info (and their get_ names), /get_load, /flush_cache and
    /health_generate. deep_problems(loop, serving): the round trips of /health?deep=1."""
    facts = model_facts(loop.engine, served_model_name)
    block_size = loop.engine.config.block_size

    async def model_info():
        return facts

    async def server_info():
        snap = loop.snapshot
        return {**facts, "max_total_num_tokens": snap.num_blocks * block_size,
                "page_size": block_size, "internal_states": [{
                    "num_requests_running": snap.num_running,
                    "num_requests_waiting": snap.num_waiting}]}

    for path, fn in (("/model_info", model_info), ("/get_model_info", model_info),
                     ("/server_info", server_info), ("/get_server_info", server_info)):
        app.add_api_route(path, fn, methods=["GET"])

    @app.get("/get_load")
    async def get_load():
        """One entry (this server is one data-parallel rank): requests in the engine and
        the KV tokens they hold."""
        snap = loop.snapshot
        used = snap.num_blocks - snap.num_free_blocks
        return [{"rid": None, "http_worker_ipc": None, "dp_rank": 0,
                 "num_reqs": snap.num_running + snap.num_waiting,
                 "num_waiting_reqs": snap.num_waiting, "num_tokens": used * block_size}]

    @app.post("/flush_cache")
    async def flush_cache():
        """Drops every cached prefix that no running request holds (between two steps)."""
        num_blocks = await loop.flush_cache()
        return {"status": "ok", "num_blocks_flushed": num_blocks}

    @app.get("/health_generate")
    async def health_generate():
        """/health?deep=1's round trips through an admission thread and the engine loop."""
        problems = [] if loop.is_running else ["engine loop stopped"]
        if not problems:
            problems = await deep_problems(loop, serving)
        return JSONResponse({"status": "; ".join(problems) or "ok"},
                            status_code=503 if problems else 200)
