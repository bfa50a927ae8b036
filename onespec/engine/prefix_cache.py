"""Prefix caching: full KV blocks addressed by their content, reused across requests.

A full block's key is its tokens, plus, when a drafter keeps KV, the one token after the
block: the drafter's KV at position p is computed from the target's hidden state at p and
token p + 1 (docs/DECODING.md, "draft loop"), so the block's last position depends on the
next block's first token. Its hash chains the parent block's hash with the key
(SHA-256), so equal tokens under different prefixes never share a hash.

A request's `cache_salt` (vLLM's name) starts its chain: the first block's parent hash is
the salt's, and its record keeps the salt, so requests with different salts never share a
block, and the number of cached tokens reported to a client says nothing about prompts
in another namespace.

A hash is never trusted alone. A cached block's record keeps its key and its parent's
record; a lookup walks a request's blocks from the first and accepts a record only if its
key equals the request's and its parent is the record accepted one block before, so even a
colliding hash function could not alias two prefixes (tests use one).

Cached blocks that no request holds are "parked": free for the pool's accounting, reused
least recently released first (a request releases its blocks last-first, so a prefix's
tail goes before its head) and only when no never-cached block is left.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from onespec.engine.request import Request

HashFn = Callable[[bytes | None, tuple[int, ...]], bytes]


def block_hash(parent: bytes | None, key: tuple[int, ...]) -> bytes:
    """SHA-256 of the parent block's hash (none for a first block) and the key's tokens."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", key).tobytes())
    return h.digest()


@dataclass(eq=False)
class CachedBlock:
    """A block whose KV is registered under `hash`; parent: the record of the block before."""
    block_id: int
    hash: bytes
    key: tuple[int, ...]
    parent: CachedBlock | None
    salt: str | None = None            # a first block's namespace (cache_salt)


def salt_hash(salt: str | None) -> bytes | None:
    """The parent hash of a salted request's first block (None: unsalted)."""
    return None if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode()).digest()


class PrefixCache:
    """The content index of a block pool (engine/kv_cache.py asks it, never the scheduler).

    lookahead: tokens past a block its KV depends on (1 with a drafter that keeps KV).
    prompt_only: register blocks of prompt tokens only (forced acceptance emits tokens whose
    KV was computed for other tokens: a benchmark mode)."""

    def __init__(self, block_size: int, lookahead: int = 0, prompt_only: bool = False,
                 hash_fn: HashFn = block_hash):
        self.block_size, self.lookahead, self.prompt_only = block_size, lookahead, prompt_only
        self.hash_fn = hash_fn
        self.table: dict[bytes, CachedBlock] = {}
        self.records: dict[int, CachedBlock] = {}            # block id -> its record
        self.parked: OrderedDict[int, None] = OrderedDict()  # unused cached blocks, LRU first

    # ---- keys and hashes ---------------------------------------------------------------
    def _key(self, tokens: list[int], b: int) -> tuple[int, ...]:
        start = b * self.block_size
        return tuple(tokens[start:start + self.block_size + self.lookahead])

    def _hashes(self, req: Request, tokens: list[int], num_blocks: int) -> list[bytes]:
        """Hashes of req's first num_blocks blocks (each computed once: blocks are immutable);
        tokens: req.token_ids."""
        hashes = req.block_hashes
        for b in range(len(hashes), num_blocks):
            parent = hashes[b - 1] if b else salt_hash(req.cache_salt)
            hashes.append(self.hash_fn(parent, self._key(tokens, b)))
        return hashes[:num_blocks]

    @staticmethod
    def _is(rec: CachedBlock, parent: CachedBlock | None, key: tuple[int, ...],
            req: Request) -> bool:
        """Whether rec is the record of the block with this parent and key for req."""
        return rec.parent is parent and rec.key == key and \
            (parent is not None or rec.salt == req.cache_salt)

    # ---- lookup ------------------------------------------------------------------------
    def match(self, req: Request) -> list[CachedBlock]:
        """The longest run of cached blocks that starts req's tokens, leaving at least its
        last token to compute (its logits give the next token)."""
        tokens = req.token_ids
        hits: list[CachedBlock] = []
        for b, h in enumerate(self._hashes(req, tokens, (len(tokens) - 1) // self.block_size)):
            rec = self.table.get(h)
            if rec is None or not self._is(rec, hits[-1] if hits else None,
                                           self._key(tokens, b), req):
                break
            hits.append(rec)
        return hits

    # ---- registration ------------------------------------------------------------------
    def register(self, req: Request):
        """Registers req's blocks that are full and final: target and draft KV written for
        every position (num_computed) and the lookahead token known."""
        ready = min(req.num_computed, req.num_tokens - self.lookahead)
        if self.prompt_only:
            ready = min(ready, len(req.prompt_token_ids) - self.lookahead)
        num, chain = max(ready, 0) // self.block_size, req.prefix_chain
        if num <= len(chain):
            return                            # (the common case: no block completed)
        tokens = req.token_ids
        for b, h in enumerate(self._hashes(req, tokens, num)[len(chain):], start=len(chain)):
            parent = chain[-1] if chain else None
            key = self._key(tokens, b)
            rec = self.table.get(h)
            if rec is not None and self._is(rec, parent, key, req):
                chain.append(rec)             # cached already (req's own block is a copy)
                continue
            if b < req.released_blocks:
                return                        # released behind a sliding window unregistered
            if rec is not None and self._reachable(rec):
                return                        # a true hash collision: keep the first one
            # (a record under an evicted parent, which no lookup reaches, is replaced; its
            # block stays cached until evicted)
            rec = CachedBlock(req.block_table[b], h, key, parent,
                              req.cache_salt if parent is None else None)
            self.table[h] = self.records[rec.block_id] = rec
            chain.append(rec)

    def _reachable(self, rec: CachedBlock) -> bool:
        """Whether a lookup can reach rec: its parent is still the record of its hash."""
        return rec.parent is None or self.table.get(rec.parent.hash) is rec.parent

    # ---- the pool's side ---------------------------------------------------------------
    def holds(self, block_id: int) -> bool:
        return block_id in self.records

    def park(self, block_id: int):
        """A cached block no request holds any longer: most recently used from now."""
        self.parked[block_id] = None

    def unpark(self, block_id: int):
        self.parked.pop(block_id, None)

    def is_parked(self, block_id: int) -> bool:
        return block_id in self.parked

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    def evict(self) -> int:
        """Frees the least recently used parked block for reuse; returns its id."""
        block_id, _ = self.parked.popitem(last=False)
        rec = self.records.pop(block_id)
        if self.table.get(rec.hash) is rec:
            del self.table[rec.hash]
        rec.parent = None         # records under it keep only it alive, not its ancestors
        return block_id
