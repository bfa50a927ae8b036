"""The server's periodic stats line: every N seconds while there is work, what the engine
did since the line before (requests, throughput, acceptance, KV use), as vLLM logs it."""
from __future__ import annotations

import asyncio
import logging
import time

from onespec.serve.async_engine import EngineLoop

logger = logging.getLogger("onespec.serve")


def path_totals(stats: dict) -> tuple[int, int]:
    """(request-steps that verified drafts, drafts they accepted), from llm.stats()."""
    counts = stats.get("accepted_path_length_counts", [])
    return sum(counts), sum(j * c for j, c in enumerate(counts))


class StatsLogger:
    def __init__(self, loop: EngineLoop, interval: float):
        if not interval > 0:
            raise ValueError(f"the stats interval must be > 0 seconds, got {interval!r}")
        self.loop, self.interval = loop, interval
        self._last = self._reading()

    def _reading(self) -> tuple[float, int, int, int, int]:
        steps, accepted = path_totals(self.loop.snapshot.stats)
        return (time.monotonic(), self.loop.num_prompt_tokens, self.loop.num_generated_tokens,
                steps, accepted)

    def line(self) -> str | None:
        """The line for the time since the last call; None when nothing ran or waits."""
        now = self._reading()
        (t0, prompt0, gen0, steps0, acc0), self._last = self._last, now
        t, prompt, gen, steps, accepted = now
        snap = self.loop.snapshot
        if gen == gen0 and prompt == prompt0 and not snap.num_running and not snap.num_waiting:
            return None
        seconds = max(t - t0, 1e-9)
        used = snap.num_blocks - snap.num_free_blocks
        text = (f"engine: {snap.num_running} running, {snap.num_waiting} waiting; prompt "
                f"{(prompt - prompt0) / seconds:.1f} tokens/s, generation "
                f"{(gen - gen0) / seconds:.1f} tokens/s")
        if steps > steps0:
            text += f"; acceptance length {1 + (accepted - acc0) / (steps - steps0):.2f}"
        return text + (f"; KV cache {100 * used / max(snap.num_blocks, 1):.1f}% used ({used} of "
                       f"{snap.num_blocks} blocks)")

    async def run(self):
        while True:
            await asyncio.sleep(self.interval)
            text = self.line()
            if text is not None:
                logger.info("%s", text)
