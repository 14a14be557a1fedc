"""One server stream that survives disconnects: what every watcher of the
client shares (:class:`~presenced.Watcher`, the room watchers, the change
feed's consumer reuses its helpers). A stream is opened with a token asked
again at each opening, reopened with backoff and full jitter when it ends or
breaks, at once when the server ended it for a callable token's credentials,
and ended for good by a refusal no retry fixes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar, Union

import grpc

from presenced.channel import Target, open_channel, presence_stub
from presenced.errors import PresenceError

log = logging.getLogger("presenced")

#: A token, or a function giving the current one (asked at each opening).
Token = Union[str, Callable[[], str], Callable[[], Awaitable[str]], None]

#: The first wait before reopening a stream, and the longest.
BACKOFF_FIRST = 0.05
BACKOFF_MAX = 5.0

#: Reopens in a row refused ``UNAUTHENTICATED`` despite a fresh token before a stream gives up.
MAX_REFUSED_FRESH_CREDENTIALS = 3

#: Codes a retry cannot fix: the request or the caller is refused as such.
PERMANENT_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)

Metadata = tuple[tuple[str, str], ...]


async def bearer_metadata(token: Token) -> Metadata:
    """The ``authorization`` metadata for ``token``: a string, or a callable
    (plain or async) asked now, as :class:`~presenced.Watcher` asks it at
    each opening."""
    if callable(token):
        given = token()
        token = await given if isinstance(given, Awaitable) else given
    return (("authorization", f"Bearer {token}"),) if token else ()


def reopen_delay(failures: int) -> float:
    """Seconds to wait before reopen attempt ``failures`` (0-based): full
    jitter under a cap that doubles from :data:`~presenced.viewer.BACKOFF_FIRST`
    up to :data:`~presenced.viewer.BACKOFF_MAX`, as the Watch does."""
    return random.uniform(0, min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** min(failures, 32)))


def refusal(err: grpc.aio.AioRpcError) -> PresenceError:
    """A call's failure as a :class:`~presenced.PresenceError`."""
    return PresenceError(err.code(), err.details() or "")


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled (known from Python 3.11 on)."""
    task = asyncio.current_task()
    return sys.version_info >= (3, 11) and task is not None and task.cancelling() > 0


M = TypeVar("M")
W = TypeVar("W", bound="ReopeningWatch[Any]")


class ReopeningWatch(Generic[M]):
    """One server-streaming watch that survives disconnects. A task opens the call (the request built again for
    every opening, the token asked again), hands each message to
    :meth:`_received`, and when the stream ends or breaks, reopens it with
    backoff and full jitter; at once when :meth:`_drop` asked for it or the
    server ended it for a callable token's credentials. A refusal a retry
    cannot fix ends it, in :attr:`last_error`."""

    _name = "the watch"

    def __init__(self, target: Target, *, token: Token, ca: str | None, cert: str | None, key: str | None) -> None:
        self._channel, self._owns_channel = open_channel(target, ca=ca, cert=cert, key=key)
        self._stub = presence_stub(self._channel)
        self.token = token
        #: Streams that delivered their first message, the first included.
        self.opened = 0
        self._metadata: Metadata = ()
        self._task: asyncio.Task[None] | None = None
        self._first_message = asyncio.Event()
        self._call: Any = None
        self._dropped: Any = None
        self._closing = False
        self._error: PresenceError | None = None

    async def __aenter__(self: W) -> W:
        self.start()
        await self.ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        """Opens the stream, in a task of its own."""
        if self._task is None and not self._closing:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"presenced-{type(self).__name__}")

    async def ready(self, timeout: float | None = 10.0) -> None:
        """Waits for the first message (its view holds the room(s) then); a
        refusal that ended the watch is raised as a :class:`~presenced.PresenceError`."""
        assert self._task is not None, "start() first"
        waiting = asyncio.ensure_future(self._first_message.wait())
        done, _ = await asyncio.wait({waiting, self._task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if self._first_message.is_set():
            return
        if self._error is not None:
            raise self._error
        if self._task in done:
            if not self._task.cancelled():
                self._task.result()
            raise PresenceError(grpc.StatusCode.CANCELLED, f"{self._name} was closed")
        raise TimeoutError(f"no first message from {self._name} in time")

    @property
    def last_error(self) -> PresenceError | None:
        """The refusal that ended the watch, if one did."""
        return self._error

    @property
    def running(self) -> bool:
        """Whether the watch goes on: started, and neither closed nor ended by a refusal."""
        return self._task is not None and not self._task.done()

    async def close(self) -> None:
        """Stops the watch."""
        self._closing = True
        try:
            if self._task is not None:
                self._task.cancel()
                # An ``on_change`` that raised ended the watch: raised here.
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        finally:
            if self._owns_channel:
                await self._channel.close()

    def _open(self, metadata: Metadata) -> Any:
        """Makes the call (with ``wait_for_ready``), its request as it is now."""
        raise NotImplementedError

    def _received(self, message: M, first: bool) -> None:
        """A message of the open stream; ``first`` for the first one of a stream."""
        raise NotImplementedError

    def _drop(self) -> None:
        """Drops the open stream: it is reopened at once, with the request as it is then."""
        if self._call is not None and not self._closing:
            self._dropped = self._call
            self._call.cancel()

    async def _run(self) -> None:
        failures = 0
        refused_fresh = 0
        at_once = True
        while True:
            if not at_once:
                await asyncio.sleep(reopen_delay(failures))
                failures += 1
            at_once = False
            call: Any = None
            delivered = False
            try:
                self._metadata = await bearer_metadata(self.token)
                call = self._call = self._open(self._metadata)
                async for message in call:
                    first = not delivered
                    if first:
                        delivered = True
                        failures = refused_fresh = 0
                        self.opened += 1
                    self._received(message, first)
                    if first:
                        self._first_message.set()
                log.info("%s ended; reopening", self._name)
            except asyncio.CancelledError:
                if call is None or call is not self._dropped or self._closing or _cancelling():
                    raise
                log.info("%s was dropped; reopening", self._name)
                at_once = True
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if (
                    code == grpc.StatusCode.UNAUTHENTICATED
                    and callable(self.token)
                    and refused_fresh < MAX_REFUSED_FRESH_CREDENTIALS
                ):
                    # Ended for its credentials: a fresh token, at once, so the
                    # viewer sees no gap; a fresh one refused is retried with backoff.
                    if delivered:
                        at_once = True
                    else:
                        refused_fresh += 1
                    log.info("%s needs a fresh token (%s); reopening", self._name, err.details())
                elif code in PERMANENT_CODES:
                    log.warning("%s was refused (%s: %s)", self._name, code.name, err.details())
                    self._error = refusal(err)
                    return
                else:
                    log.info("%s broke (%s: %s); reopening", self._name, code.name, err.details())
            finally:
                self._call = None
