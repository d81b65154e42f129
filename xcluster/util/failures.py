"""Raising a worker thread's failure without a reference cycle.

A future keeps its exception, and the exception its traceback. Raised from a frame that still
reaches the future (a local, a list of futures, a closure cell), it is a cycle, and every frame
up the stack (``f_back``) stays with it, locals and all (a publisher's: the caller's weights),
until the cycle collector happens to run. :func:`raise_first_failure` empties the list and holds
no reference of its own.
"""

from __future__ import annotations

from concurrent.futures import Future

__all__ = ["raise_first_failure"]


def raise_first_failure(futures: list[Future], *, done_only: bool = False, cancel_pending: bool = False) -> None:
    """Raise the exception of the first future in ``futures`` that failed, in list order, waiting
    for each in turn (``done_only``: among those already done). ``cancel_pending`` first cancels
    those that have not started (and implies ``done_only``). On a failure the list is emptied
    (the running ones go on: the caller's executor waits for them)."""
    if cancel_pending:
        for f in futures:
            f.cancel()
    failure = _first_failure(futures, done_only or cancel_pending)
    if failure is None:
        return
    futures.clear()
    try:
        raise failure
    finally:
        del failure  # this frame is on its traceback


def _first_failure(futures: list[Future], done_only: bool) -> BaseException | None:
    for f in futures:
        if f.cancelled() or (done_only and not f.done()):
            continue
        exc = f.exception()
        if exc is not None:
            return exc
    return None
