"""Driving an :class:`Engine` from a background thread, for servers.

``EngineLoop`` owns the engine; other threads ``submit`` requests with a sink (called with each
output, from the loop thread) and ``abort`` them (``abort_soon`` from an event loop). Every engine
call runs under the loop's lock, so the cache is never used by two threads at once. A step that
raises aborts every unfinished request (its sink gets the exception); the loop keeps serving.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections import deque
from typing import Any, Callable

from .engine import Engine
from .request import RequestOutput
from .sampling import SamplingParams

log = logging.getLogger("vmkv.engine")

Sink = Callable[[RequestOutput | BaseException], None]


class EngineLoop:
    """Runs ``engine.step()`` on a daemon thread; thread-safe submit, abort and stats.

    Args:
        engine: the engine to drive (owned by the loop from now on).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._sinks: dict[str, Sink] = {}
        self._aborts: deque[str] = deque()  # abort_soon's requests, aborted before the next step
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="vmkv-engine", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a loop left open stops between steps at exit, and closes its engine

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids of ``prompt`` if the engine would accept it with ``params`` (else raises as ``add_request``)."""
        with self._lock:
            return self.engine.check_request(prompt, params)

    def submit(self, prompt: str | list[int], params: SamplingParams, sink: Sink, request_id: str | None = None) -> str:
        """Queue a request; ``sink`` gets its outputs. Raises as :meth:`Engine.add_request`."""
        with self._lock:
            request_id = self.engine.add_request(prompt, params, request_id)
            self._sinks[request_id] = sink
            self._wake.notify()
        return request_id

    def abort(self, request_id: str) -> bool:
        """Abort a request now (its pages are freed before this returns; waits for the current step)."""
        with self._lock:
            self._sinks.pop(request_id, None)
            return self.engine.abort(request_id)

    def abort_soon(self, request_id: str) -> None:
        """Abort a request before the engine's next step without waiting (an event loop may call it);
        outputs of the running step may still reach the sink.
        """
        self._aborts.append(request_id)  # deque.append is atomic: no lock needed

    def stats(self) -> dict[str, Any]:
        """``engine.stats()``, taken between steps."""
        with self._lock:
            return self.engine.stats()

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` between steps (e.g. ``lambda e: e.cache.trim()``)."""
        with self._lock:
            return fn(self.engine)

    def close(self) -> None:
        """Stop the thread, abort what is left and close the engine (at interpreter exit at the latest).
        Idempotent.
        """
        atexit.unregister(self.close)
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        self.engine.close()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._abort_queued()
                while not self._closing and not self.engine.has_unfinished():
                    self._wake.wait()
                    self._abort_queued()
                if self._closing:
                    return
                deliveries = self._step()
            for sink, output in deliveries:
                try:
                    sink(output)
                except Exception:  # e.g. the client's event loop has closed: its request is moot
                    log.exception("vmkv engine: delivering an output failed")

    def _abort_queued(self) -> None:
        """Abort the requests ``abort_soon`` queued (under the lock)."""
        while self._aborts:
            request_id = self._aborts.popleft()
            self._sinks.pop(request_id, None)
            self.engine.abort(request_id)

    def _step(self) -> list[tuple[Sink, RequestOutput | BaseException]]:
        """One engine step under the lock; what to deliver to which sink."""
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug or a device error: fail the requests in flight, keep serving
            log.exception("vmkv engine step failed; aborting %d requests", len(self._sinks))
            failed = [(sink, exc) for sink in self._sinks.values()]
            for request_id in list(self._sinks):
                self.engine.abort(request_id)
            self._sinks.clear()
            return failed
        deliveries: list[tuple[Sink, RequestOutput | BaseException]] = []
        for output in outputs:
            sink = self._sinks.pop(output.request_id) if output.finished else self._sinks.get(output.request_id)
            if sink is not None:
                deliveries.append((sink, output))
        return deliveries
