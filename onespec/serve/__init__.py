"""OpenAI-compatible HTTP server over one engine loop (docs/SERVING.md).

    from onespec import LLM
    from onespec.serve import create_app
    app = create_app(LLM("path/to/model"), "my-model", api_key=None)   # a FastAPI app
"""
from onespec.serve.app import create_app

__all__ = ["create_app"]
