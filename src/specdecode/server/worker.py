"""One generation thread behind a bounded queue: the engine runs one request at a time.

The engine holds one KV cache and is not thread-safe, so every generation runs
on a single worker thread. HTTP handlers `submit` jobs (429 via QueueFull
when `max_queue` requests already wait behind the one generating) and read the
job's chunks from an asyncio queue. `cancel` frees a waiting job's slot at
once; a running job stops between engine steps (one target pass, well under a
second), so a client that goes away never holds the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from specdecode.llm import LLM, TextChunk
from specdecode.sampling import SamplingParams
from specdecode.server.metrics import Metrics

log = logging.getLogger("specdecode.server")


class QueueFull(Exception):
    """No room for another request."""


class GenerationFailed(Exception):
    """The engine raised while generating; the message is safe to show."""


class ShuttingDown(Exception):
    """The server is stopping: no new work, and this job ran past the drain deadline."""


_END = object()


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None
    loop: asyncio.AbstractEventLoop
    state: str = "waiting"  # waiting -> running -> done, or waiting -> cancelled
    stop: threading.Event = field(default_factory=threading.Event)
    items: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: object) -> None:
        """From the worker thread: hand an item to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.stop.set()

    async def chunks(self) -> AsyncIterator[TextChunk]:
        """The chunks in order; raises GenerationFailed if the engine failed."""
        while True:
            item = await self.items.get()
            if item is _END:
                return
            if isinstance(item, (GenerationFailed, ShuttingDown)):
                raise item
            yield item


class Worker:
    def __init__(self, llm: LLM, max_queue: int = 16, metrics: Metrics | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.llm, self.max_queue, self.metrics = llm, max_queue, metrics
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0  # waiting + running
        self._running = False
        self._thread: threading.Thread | None = None
        self._jobs_in_flight: set[Job] = set()
        self.draining = False
        if metrics is not None:
            metrics.watch_queue(lambda: self.waiting, lambda: self.in_flight)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        return self._in_flight - int(self._running)

    def start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="specdecode-engine",
                                                daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._jobs.put(None)
            thread.join(timeout)

    def submit(self, prompt_ids: list[int], params: SamplingParams, seed: int | None) -> Job:
        """Queue a generation (from the event loop); QueueFull if there is no room."""
        self.start()
        job = Job(list(prompt_ids), params, seed, asyncio.get_running_loop())
        with self._lock:
            if self.draining:
                raise ShuttingDown("the server is shutting down; retry on another instance")
            if self._in_flight > self.max_queue:
                raise QueueFull(f"the server is busy: {self.waiting} requests are waiting "
                                f"(--max-queue {self.max_queue}); retry later")
            self._in_flight += 1
            self._jobs_in_flight.add(job)
        self._jobs.put(job)
        return job

    def drain(self, seconds: float) -> None:
        """Refuse new jobs (ShuttingDown) from now on; jobs still in flight after
        `seconds` are stopped and told ShuttingDown (their clients get a 503 or a final
        error event). Safe to call from a signal handler; idempotent."""
        with self._lock:
            if self.draining:
                return
            self.draining = True
        timer = threading.Timer(seconds, self.abort_all)
        timer.daemon = True
        timer.start()

    def abort_all(self) -> None:
        """Stop every job in flight now, each told ShuttingDown."""
        with self._lock:
            jobs = list(self._jobs_in_flight)
        for job in jobs:
            job.put(ShuttingDown("the server shut down before this request finished"))
            self.cancel(job)

    def cancel(self, job: Job) -> None:
        """The client went away or the request ended: free the slot. Idempotent."""
        with self._lock:
            if job.state == "waiting":
                job.state = "cancelled"
                self._in_flight -= 1
                self._jobs_in_flight.discard(job)
                if self.metrics is not None:
                    self.metrics.generations.labels("cancelled").inc()
            elif job.state == "running":
                job.stop.set()

    # -- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                if job.state != "waiting":
                    continue
                job.state, self._running = "running", True
            outcome, tokens, stats = "error", 0, None
            try:
                outcome, tokens, stats = self._generate(job)
            except Exception as e:  # report to the client, log the traceback here
                log.exception("generation failed")
                message = str(e) if isinstance(e, ValueError) else "internal error in generation"
                job.put(GenerationFailed(message))
            finally:
                with self._lock:
                    job.state, self._running = "done", False
                    self._in_flight -= 1
                    self._jobs_in_flight.discard(job)
                if self.metrics is not None:
                    self.metrics.observe_generation(outcome, len(job.prompt_ids), tokens, stats)
                job.put(_END)  # after the slot is free: a finished client may resubmit at once

    def _generate(self, job: Job):
        tokens, stats = 0, None
        stream = self.llm.stream(job.prompt_ids, job.params, job.seed)
        with contextlib.closing(stream):
            for chunk in stream:
                tokens, stats = tokens + len(chunk.token_ids), chunk.stats
                if job.stop.is_set():
                    return "cancelled", tokens, stats
                job.put(chunk)
                if job.stop.is_set():
                    return "cancelled", tokens, stats
        return "finished", tokens, stats
