"""Host-side batch building ahead of the step, on a background thread (``train.prefetch``).

A training batch is a pure function of ``(seed, epoch, step)`` (batching.py), so building it on
another thread, ahead of the step that consumes it, cannot change it: a prefetched run is bitwise
the synchronous run (tests/data/test_prefetch.py). What moves off the step's critical path is the
numpy work of a batch: the user plan and sequence gathering, negatives (``R`` draws per token),
dropout masks, the rank split and its balancing. numpy's bulk draws and copies and torch's kernels
release the GIL, so on two or more cores the build overlaps the step's compute.

What stays on the main thread, by design: the id-to-row mapping of a replicated row-sparse
table (``EmbeddingHost.prepare``). It is stateful (inserts, evictions), and a checkpoint must hold
the table state of the last *trained* step. What a row-sharded table's step does move here
(``execution.RankSteps``): its id dedup, the rewrite to local indices and the id exchange with the
owners (``ShardedTable.route``: an id's owner is a function of the id), on a process group of the
worker's own; and with ``embedding.staleness >= 1`` a second worker (``Worker``) maps and looks
up the next step's ids while a step computes, checkpoints reading the hash table as it was
before that mapping (``HashTable.before``, from an undo record).

``Prefetch.stats`` measures how much of the build was hidden: ``build_s`` (time the worker spent
producing items), ``wait_s`` (time the consumer spent blocked on the queue); ``hidden`` =
``1 - wait_s / build_s``.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterable, Iterator

_DONE = object()


class PrefetchStats:
    """Seconds spent building items on the worker and waiting for them on the consumer."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.build_s = 0.0
        self.wait_s = 0.0
        self.items = 0

    @property
    def hidden(self) -> float:
        """Share of the build time the consumer did not wait for (0 = none hidden, 1 = all)."""
        return max(0.0, 1.0 - self.wait_s / self.build_s) if self.build_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"items": self.items, "build_s": self.build_s, "wait_s": self.wait_s, "hidden": self.hidden}


def timed(items: Iterable, stats: PrefetchStats | None) -> Iterator:
    """``items`` built on the caller's thread, each build counted as built and waited for (the
    synchronous path's figures, comparable with ``Prefetch``'s)."""
    it = iter(items)
    try:
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            if stats is not None:
                dt = time.perf_counter() - t0
                stats.build_s += dt
                stats.wait_s += dt
                stats.items += 1
            yield item
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetch:
    """Iterate ``items`` on a daemon thread, at most ``depth`` items ahead of the consumer.

    Items come out in order; an exception raised while building an item is re-raised by the
    consumer at that item. ``close()`` (also on garbage collection of an abandoned iterator, and
    on leaving a ``with`` block) stops the worker after the item it is building."""

    def __init__(self, items: Iterable, depth: int, stats: PrefetchStats | None = None, name: str = "grf-prefetch"):
        if depth < 1:
            raise ValueError(f"Prefetch depth must be >= 1, got {depth}")
        self.stats = stats if stats is not None else PrefetchStats()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(iter(items),), name=name, daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, it: Iterator) -> None:
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    break
                self.stats.build_s += time.perf_counter() - t0
                if not self._put(item):
                    return
            self._put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(_Failure(exc))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def __iter__(self):
        return self

    def __next__(self):
        if self._stop.is_set():
            raise StopIteration
        t0 = time.perf_counter()
        item = self._queue.get()
        self.stats.wait_s += time.perf_counter() - t0
        if item is _DONE:
            self._stop.set()
            raise StopIteration
        if isinstance(item, _Failure):
            self._stop.set()
            raise item.exc
        self.stats.items += 1
        return item

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a worker waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._stop.set()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class Worker:
    """One daemon thread running submitted functions in order (``submit(fn) -> Future``): the
    sparse side of a pipelined step (``execution.RankSteps``). A daemon, so a function blocked in a
    collective whose peer died never holds the process at exit (the watchdog reports the peer)."""

    def __init__(self, name: str = "grf-worker"):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            fn, future = self._queue.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def submit(self, fn: Callable) -> Future:
        future: Future = Future()
        self._queue.put((fn, future))
        return future
