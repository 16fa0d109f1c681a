"""Run the app with uvicorn (the `specdecode serve` command ends here).

SIGTERM or Ctrl-C shuts down gracefully: the server stops accepting
connections and new jobs (503), lets the requests in flight finish for up to
DRAIN_SECONDS, then stops the rest with a 503 in the API's error shape
(non-streaming) or a final error event (streams), and exits.
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from specdecode.llm import LLM
from specdecode.server.app import PREFIX_STORE_MB, create_app
from specdecode.server.worker import Worker

DRAIN_SECONDS = 5.0
SEND_SECONDS = 5.0  # after the drain: time for the 503s and final events to go out


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signal first drains the generation worker."""

    def __init__(self, config: uvicorn.Config, worker: Worker, drain_seconds: float) -> None:
        super().__init__(config)
        self.worker, self.drain_seconds = worker, drain_seconds

    def handle_exit(self, sig: int, frame) -> None:
        self.worker.drain(self.drain_seconds)
        super().handle_exit(sig, frame)


def serve(
    llm: LLM,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue: int = 16,
    model_name: str | None = None,
    log_level: str = "info",
    drain_seconds: float = DRAIN_SECONDS,
    prefix_store_mb: int = PREFIX_STORE_MB,
) -> None:
    """Serve until interrupted. Binds loopback by default: pass host="0.0.0.0"
    (and an api_key) to accept other machines."""
    app = create_app(llm, api_key=api_key, max_queue=max_queue, model_name=model_name,
                     prefix_store_mb=prefix_store_mb)
    logging.getLogger("specdecode.server").setLevel(log_level.upper())
    ctx = app.state.ctx
    print(f"specdecode: serving '{ctx.model_name}' on http://{host}:{port} "
          f"(drafter {llm.info.drafter}, k={llm.k}, context {ctx.context_length}, "
          f"auth {'on' if api_key else 'off'}, max queue {max_queue}, "
          f"prefix store {prefix_store_mb} MB)", flush=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(drain_seconds + SEND_SECONDS))
    server = DrainingServer(config, ctx.worker, drain_seconds)
    server.run()
    if not server.started:
        sys.exit(3)  # as uvicorn.run: it could not start (e.g. the port is in use)
