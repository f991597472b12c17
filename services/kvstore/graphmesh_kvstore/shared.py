"""The shared tier: encoded KV entries in Redis or Valkey (one protocol), seen by every kvstore replica using it.

This module moves bytes only; what they mean and whether they can be trusted is the store's business (it
checks every value's header and checksum). The tier is a cache in front of recomputation, so it must never
fail a request: every call has short socket timeouts and no retries, and an error marks the tier down for
`retry_s`, during which it is skipped without a round trip (a slow or dead Redis costs one timeout per
`retry_s`, not one per lookup). The first call after that tries again, so hits resume when Redis is back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger("graphmesh.kvstore")

DEFAULT_PREFIX = "graphmesh:kv:"
_PIPELINE_BYTES = 8 << 20  # per round trip of a put: bounds what one pipeline buffers


class SharedTier:
    """Thread-safe (redis-py's connection pool is); `up` and the counters are guarded by a small lock."""

    def __init__(self, url: str, *, password_file: Path | None = None, ttl_s: float = 0.0, timeout_s: float = 0.25,
                 retry_s: float = 1.0, prefix: str = DEFAULT_PREFIX) -> None:
        """url: redis://[user@]host:port/db or rediss:// (TLS); password_file: read once here, so the password
        never appears in a command line; ttl_s: expiry of every entry (0: none, Redis's maxmemory policy
        bounds it); timeout_s: connect and socket timeout of each call."""
        kwargs: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                                  "retry": Retry(NoBackoff(), 0), "health_check_interval": 0}
        if password_file is not None:
            kwargs["password"] = password_file.read_text().strip()
        self.url = url
        self._client = redis.Redis.from_url(url, **kwargs)
        self.ttl_ms = int(ttl_s * 1000)
        self.retry_s = retry_s
        self.prefix = prefix
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self.errors = 0

    # -- state ----------------------------------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        with self._lock:
            return not self._down

    def _usable(self) -> bool:
        with self._lock:
            return not self._down or time.monotonic() >= self._down_until

    def _failed(self, what: str, error: Exception) -> None:
        with self._lock:
            self.errors += 1
            was_down, self._down = self._down, True
            self._down_until = time.monotonic() + self.retry_s
        if not was_down:  # one line per outage, not one per call
            log.warning("shared KV tier unavailable; serving misses until it is back",
                        extra={"url": _redacted(self.url), "during": what, "error": f"{type(error).__name__}: {error}"})

    def _succeeded(self) -> None:
        with self._lock:
            was_down, self._down = self._down, False
        if was_down:
            log.warning("shared KV tier reachable again", extra={"url": _redacted(self.url)})

    # -- operations (None: the tier is unavailable, which callers treat as a miss) ---------------------------------

    def name(self, space: bytes, layer: int, key: bytes) -> str:
        """The Redis key of one entry: its namespace and layer first, so Evict can find them with SCAN."""
        return f"{self.prefix}{space.hex()}:{layer}:{key.hex()}"

    def get(self, names: Sequence[str]) -> list[bytes | None] | None:
        """The values of `names` (None where absent), in one round trip; a TTL is refreshed by a read."""
        if not names or not self._usable():
            return None
        try:
            if self.ttl_ms:
                pipe = self._client.pipeline(transaction=False)
                for n in names:
                    pipe.getex(n, px=self.ttl_ms)
                values = pipe.execute()
            else:
                values = self._client.mget(list(names))
        except redis.RedisError as e:
            self._failed("get", e)
            return None
        self._succeeded()
        return [v if isinstance(v, bytes) else None for v in values]

    def put(self, items: Sequence[tuple[str, bytes]]) -> list[bool | None] | None:
        """Stores each (name, value) unless the name exists (the first writer's entry is kept, as in the other
        tiers); per item True (stored), False (was there) or None (refused, e.g. out of memory under a
        noeviction policy)."""
        if not items or not self._usable():
            return None
        out: list[bool | None] = []
        try:
            start = 0
            while start < len(items):
                pipe = self._client.pipeline(transaction=False)
                end, size = start, 0
                while end < len(items) and (end == start or size + len(items[end][1]) <= _PIPELINE_BYTES):
                    name, value = items[end]
                    pipe.set(name, value, nx=True, px=self.ttl_ms or None)
                    size += len(value)
                    end += 1
                for result in pipe.execute(raise_on_error=False):
                    if isinstance(result, redis.ConnectionError | redis.TimeoutError):
                        raise result
                    out.append(None if isinstance(result, Exception) else bool(result))
                start = end
        except redis.RedisError as e:
            self._failed("put", e)
            return None
        self._succeeded()
        if None in out:
            log.warning("shared KV tier refused entries", extra={"refused": out.count(None), "of": len(out)})
        return out

    def delete(self, names: Sequence[str]) -> None:
        """Drops entries found corrupt, best effort: a failure leaves them to be found corrupt again."""
        if not names or not self._usable():
            return
        try:
            self._client.delete(*names)
        except redis.RedisError as e:
            self._failed("delete", e)

    def delete_matching(self, patterns: Sequence[str]) -> int:
        """Drops every entry whose name matches one of the glob `patterns` (under the prefix); returns how many."""
        if not self._usable():
            return 0
        dropped = 0
        try:
            for pattern in patterns:
                batch: list[bytes] = []
                for name in self._client.scan_iter(match=self.prefix + pattern, count=1000):
                    batch.append(name)
                    if len(batch) >= 1000:
                        dropped += int(self._client.delete(*batch))
                        batch = []
                if batch:
                    dropped += int(self._client.delete(*batch))
        except redis.RedisError as e:
            self._failed("evict", e)
        return dropped

    def close(self) -> None:
        self._client.close()


def _redacted(url: str) -> str:
    """The URL without a password (redis://:secret@host -> redis://***@host)."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.rsplit('@', 1)[1]}"
