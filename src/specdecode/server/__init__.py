"""HTTP server: OpenAI- and Anthropic-compatible APIs over one speculative-decoding LLM.

`create_app(llm, ...)` returns the FastAPI app; `serve(llm, ...)` runs it
with uvicorn (what `specdecode serve` does).
"""

from __future__ import annotations

from specdecode.server.app import create_app, default_model_name
from specdecode.server.run import serve

__all__ = ["create_app", "default_model_name", "serve"]
