"""The sha256 of a checkpoint file, computed beside its transfer instead of after it."""

from __future__ import annotations

import hashlib
import queue
import threading


class Hasher:
    """The sha256 of a file being read or written, computed on a thread of its own: hashing
    overlaps the reads (a piece behind them) or the writes (of the same staged bytes), since
    both release the GIL, so the transfer and its hash take about as long as the slower of
    the two, not their sum.

    ``update`` takes views of memory that nothing writes to any more.
    """

    def __init__(self, name: str) -> None:
        self._sha = hashlib.sha256()
        self._pieces: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._abandoned = False
        self._done = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def update(self, data: memoryview) -> None:
        self._pieces.put(data)

    def _run(self) -> None:
        while (data := self._pieces.get()) is not None:
            if not self._abandoned:
                self._sha.update(data)

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._pieces.put(None)
            self._thread.join()

    def hexdigest(self) -> str:
        """Wait for the pieces given so far to be hashed; their digest."""
        self._finish()
        return self._sha.hexdigest()

    def abandon(self) -> None:
        """Stop hashing (the read failed): skip what is queued and end the thread."""
        self._abandoned = True
        self._finish()
