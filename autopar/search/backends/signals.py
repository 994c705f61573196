"""Signals during a search: SIGINT and SIGTERM held while a step must not be
cut off half-way (``interrupts_held``), or noted so that the run loop ends at
its next step (``interrupts_noted``); both put Python's handlers back after."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def signals_to(make):
    """While the block runs, SIGINT and SIGTERM go to ``make(handler)``
    instead of their handler (where it is Python's, in the main thread)."""
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(sig)
            if callable(handler):
                saved[sig] = handler
                signal.signal(sig, make(handler))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def interrupts_held():
    """Hold SIGINT and SIGTERM until the block ends, then deliver the first
    that arrived to its handler (which raises KeyboardInterrupt): the block
    is never cut off half-way."""
    arrived = []
    try:
        with signals_to(lambda handler: lambda signum, frame:
                         arrived.append((handler, signum, frame))):
            yield
    finally:
        if arrived:
            handler, signum, frame = arrived[0]
            handler(signum, frame)


@contextlib.contextmanager
def interrupts_noted():
    """The first SIGINT or SIGTERM while the block runs is noted in the list
    yielded, and the run loop ends at its next step (not wherever the signal
    lands: Python prints and drops a KeyboardInterrupt raised in a library's
    destructor or callback, and a run once went on after its SIGTERM until
    a second one came); a second signal goes to its handler, which raises
    KeyboardInterrupt at once."""
    noted: list[int] = []

    def noting(handler):
        def note(signum, frame):
            noted.append(signum)
            if len(noted) > 1:
                handler(signum, frame)
        return note
    with signals_to(noting):
        yield noted
