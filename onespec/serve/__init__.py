"""OpenAI-compatible HTTP server over one engine loop (docs/SERVING.md).

    from onespec import LLM
    from onespec.serve import create_app
    app = create_app(LLM("path/to/model"), "my-model", api_key=None)   # a FastAPI app
"""
__all__ = ["create_app"]


def __getattr__(name: str):
    """create_app on first use: `onespec serve` checks its arguments and port before the
    server's modules (and torch) load."""
    if name == "create_app":
        from onespec.serve.app import create_app
        return create_app
    raise AttributeError(f"module 'onespec.serve' has no attribute {name!r}")
