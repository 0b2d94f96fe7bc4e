"""The queue in front of ``memgas serve``'s one model: one request generates at a time, at most ``max_waiting``
wait behind it, and a request leaves the queue (or stops generating) as soon as its client has gone or the
server is stopping.

A request past the bound is refused at once (503 with ``Retry-After``, :class:`QueueFull`), a waiting request whose
client has gone leaves the queue, and a running generation whose client has gone stops at its next decoding step
(the handler gives the backend a callback that it calls between steps). Without these, every request waits for
the model lock in turn, a client's hang-up included: 24 abandoned 256-token requests held the next one for minutes.
"""

from __future__ import annotations

import math
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: Requests that may wait for the model behind the one it runs (``memgas serve --max-queue``). Each waits for
#: every generation ahead of it; on the CPU model a 256-token answer takes ~10 s, so a longer queue mostly
#: holds clients past their own timeouts. OpenAI's client and memgas's own (``llm.concurrency`` 8) retry a 503.
MAX_QUEUE = 16
#: Seconds between a waiting request's looks at its client (a gone client leaves the queue within this).
WAIT_POLL_S = 0.25
#: Most seconds a ``Retry-After`` asks a refused client to wait (the estimate is the queue's expected drain time).
MAX_RETRY_AFTER_S = 60


class QueueFull(Exception):
    """No room behind the model: ``retry_after_s`` is when a place is likely free again."""

    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"the model is busy and {waiting} requests wait for it, the most this server queues "
                         f"(memgas serve --max-queue); retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    """The server is stopping (SIGTERM or Ctrl-C): no new generation starts, the running one is cancelled."""


class ClientGone(Exception):
    """The request's client closed its connection while the request waited: nobody is left to answer."""


def client_gone(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` has closed it (an end of stream or a reset waiting to be read). Bytes the
    client sent meanwhile (a pipelined request) are left unread: only peeked at."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLPRI)
        if not poller.poll(0):
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):  # reset, or already closed on this side
        return True


class ModelQueue:
    """One request at a time holds the model; at most ``max_waiting`` wait for it. ``stopping`` is set when the
    server stops: waiting requests leave with :class:`ShuttingDown`, and a running generation is cancelled."""

    def __init__(self, max_waiting: int = MAX_QUEUE) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self.stopping = threading.Event()
        self.refused = 0
        self._model = threading.Lock()
        self._state = threading.Condition()
        self._queued = 0  # requests inside :meth:`turn`: the one generating and those waiting for it
        self._busy = False
        self._active = 0  # requests inside :meth:`handling`
        self._last_s = 0.0  # seconds the last generation took (the Retry-After estimate)

    @property
    def waiting(self) -> int:
        """Requests waiting for the model (the one generating not counted)."""
        return self._queued - self._busy

    def _retry_after(self) -> int:
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(self._last_s * self._queued))))

    @contextmanager
    def turn(self, gone: Callable[[], bool]) -> Iterator[None]:
        """Hold the model for the body of the ``with``. Raises :class:`QueueFull` at once when the model is taken
        and ``max_waiting`` requests already wait, :class:`ClientGone` when ``gone()`` turns true while this one
        waits, :class:`ShuttingDown` when the server stops before its turn."""
        with self._state:
            if self.stopping.is_set():
                raise ShuttingDown()
            # counted with the one generating (or about to): requests that arrive together are bounded as well
            if self._queued >= self.max_waiting + 1:
                self.refused += 1
                raise QueueFull(self._queued - 1, self._retry_after())
            self._queued += 1
        try:
            while not self._model.acquire(timeout=WAIT_POLL_S):
                if self.stopping.is_set():
                    raise ShuttingDown()
                if gone():
                    raise ClientGone()
            try:
                if self.stopping.is_set():
                    raise ShuttingDown()
                if gone():
                    raise ClientGone()
                with self._state:
                    self._busy = True
                t0 = time.monotonic()
                try:
                    yield
                finally:
                    self._last_s = time.monotonic() - t0
                    with self._state:
                        self._busy = False
            finally:
                self._model.release()
        finally:
            with self._state:
                self._queued -= 1

    @contextmanager
    def handling(self) -> Iterator[None]:
        """Count a request as in progress, from its body read to its answer written: :meth:`stop` waits for it."""
        with self._state:
            self._active += 1
        try:
            yield
        finally:
            with self._state:
                self._active -= 1
                self._state.notify_all()

    def stop(self, timeout_s: float) -> bool:
        """Stop: refuse new turns, cancel the running one, and wait up to ``timeout_s`` for every request being
        handled to be answered. False when some are still going (a backend that cannot be cancelled)."""
        self.stopping.set()
        deadline = time.monotonic() + timeout_s
        with self._state:
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._state.wait(left)
        return True
