"""The server's grammar compiles, in worker processes with a time limit.

xgrammar cannot be interrupted inside a compile, and a hostile schema (thousands of
optional properties, an enum of 100k strings) can compile for minutes and take a gigabyte.
So the server never compiles on a thread it needs: each compile is sent to one of
`num_workers` worker processes (structured/compile_worker.py) and raced against the
request's time limit and its client's disconnect; if either comes first the worker is
killed (its memory with it) and a fresh one started. A compile that waits longer than the
time limit for a free worker is refused as busy. Results come back as xgrammar's JSON, which
the caller deserializes against its own TokenizerInfo (GrammarBackend.add_serialized).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pipe

from onespec.structured import compile_worker

logger = logging.getLogger("onespec.serve")

POLL_S = 0.05                  # how often a waiting compile checks for its cancellation
STARTUP_TIMEOUT_S = 120.0      # a worker's start: importing xgrammar, reading the vocabulary


class CompileTimeout(Exception):
    """The compile ran past the time limit; its worker was killed."""


class CompileBusy(Exception):
    """No worker came free within the time limit."""


class CompileCancelled(Exception):
    """The caller gave up (its client went away); the worker was killed."""


class _Worker:
    """One compile process and the parent's end of its pipe."""

    def __init__(self, info_file: str):
        self.info_file = info_file
        self.proc: subprocess.Popen | None = None
        self.conn = None
        self.ready = False

    def start(self):
        """Starts the process; it reads the vocabulary from info_file and then says it is
        ready (nothing here waits for that)."""
        parent, child = Pipe()
        self.proc = subprocess.Popen(
            [sys.executable, compile_worker.__file__, str(child.fileno()), self.info_file],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        child.close()
        self.conn, self.ready = parent, False

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None
        self.ready = False

    def _receive(self, deadline: float, cancel: threading.Event):
        """The worker's next message; None when the deadline passed or cancel was set."""
        while time.monotonic() < deadline and not cancel.is_set():
            if self.conn.poll(POLL_S):
                return self.conn.recv()
            if self.proc.poll() is not None:
                raise RuntimeError(f"the grammar compile worker exited with status "
                                   f"{self.proc.returncode}")
        return None

    def compile(self, job: tuple[str, str, int], timeout_s: float,
                cancel: threading.Event) -> tuple[str, str]:
        """(status, payload) from compile_worker; raises CompileTimeout / CompileCancelled
        after killing the process."""
        if self.proc is None:
            self.start()
        if not self.ready:
            msg = self._receive(time.monotonic() + STARTUP_TIMEOUT_S, cancel)
            if msg is None:
                raise CompileCancelled() if cancel.is_set() else \
                    RuntimeError("the grammar compile worker did not start in time")
            self.ready = True
        self.conn.send(job)
        result = self._receive(time.monotonic() + timeout_s, cancel)
        if result is None:
            raise CompileCancelled() if cancel.is_set() else CompileTimeout()
        return result


class GrammarCompilePool:
    """`num_workers` compile processes shared by all requests (started on first use)."""

    def __init__(self, tokenizer_info_json: str, num_workers: int = 1,
                 timeout_s: float = 10.0, max_grammar_bytes: int = 64 << 20):
        if not (isinstance(num_workers, int) and num_workers >= 1):
            raise ValueError(f"grammar compile workers must be an integer >= 1, "
                             f"got {num_workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"the grammar compile timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s, self.max_grammar_bytes = timeout_s, max_grammar_bytes
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="onespec-vocab-",
                                         delete=False) as f:
            f.write(tokenizer_info_json)
        self._info_file = f.name
        self._idle = [_Worker(f.name) for _ in range(num_workers)]
        self._slots = asyncio.Semaphore(num_workers)
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="onespec-grammar")
        self.num_running = 0               # compiles under way now (for /health)
        self.num_killed = 0                # workers killed for time or cancellation

    async def compile(self, kind: str, text: str) -> tuple[str, str]:
        """Compiles one (kind, canonical text) spec in a worker: ("ok", grammar JSON),
        ("invalid", compiler message), ("empty" | "too_big", why). Raises CompileBusy,
        CompileTimeout; cancelling the awaiting task kills the compile."""
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            raise CompileBusy() from None
        cancel = threading.Event()
        worker = self._idle.pop()
        self.num_running += 1
        job = asyncio.get_running_loop().run_in_executor(
            self._threads, self._run, worker, (kind, text, self.max_grammar_bytes), cancel)
        job.add_done_callback(lambda _: self._release(worker, job))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            cancel.set()                       # the thread kills the worker within POLL_S
            raise

    def _release(self, worker: _Worker, job: asyncio.Future):
        """The worker is idle again once its thread is done (killed and restarted too)."""
        if not job.cancelled():
            job.exception()                    # retrieved here: the caller may be gone
        self.num_running -= 1
        self._idle.append(worker)
        self._slots.release()

    def _run(self, worker: _Worker, job: tuple[str, str, int], cancel: threading.Event):
        try:
            return worker.compile(job, self.timeout_s, cancel)
        except BaseException:
            worker.kill()
            self.num_killed += 1
            if not cancel.is_set():
                logger.info("grammar compile of a %s spec (%d characters) stopped: worker "
                            "killed", job[0], len(job[1]))
            worker.start()                     # warm again for the next compile
            raise

    def close(self):
        for worker in self._idle:
            worker.kill()
        self._threads.shutdown(wait=False)
        with contextlib.suppress(OSError):
            os.unlink(self._info_file)
