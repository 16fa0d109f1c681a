"""Run the app with uvicorn (the `specdecode serve` command ends here)."""

from __future__ import annotations

import logging

from specdecode.llm import LLM
from specdecode.server.app import create_app


def serve(
    llm: LLM,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue: int = 16,
    model_name: str | None = None,
    log_level: str = "info",
) -> None:
    """Serve until interrupted. Binds loopback by default: pass host="0.0.0.0"
    (and an api_key) to accept other machines."""
    import uvicorn

    app = create_app(llm, api_key=api_key, max_queue=max_queue, model_name=model_name)
    logging.getLogger("specdecode.server").setLevel(log_level.upper())
    ctx = app.state.ctx
    print(f"specdecode: serving '{ctx.model_name}' on http://{host}:{port} "
          f"(drafter {llm.info.drafter}, k={llm.k}, context {ctx.context_length}, "
          f"auth {'on' if api_key else 'off'}, max queue {max_queue})", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
