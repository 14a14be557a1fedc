"""The gateway side: leases kept on one ``Leases`` stream, and sessions that
keep themselves alive.

A gateway holds one :class:`LeaseChannel` per presenced node. Every
register, renewal, unregister, join, leave and signal of every session goes
as an item onto its one ``Leases`` stream, batched: a thousand sessions
renewing cost a few messages, not a thousand calls. The queue in front of
the stream is bounded; when it is full, renewals are shed first (a shed
renewal keeps its session: the next beat renews it), and what cannot be shed
is refused at once rather than waited for. A broken stream is reopened with
backoff and jitter, and the items it had not answered are sent again on the
new one, each answered to its caller once. An item not answered within
``response_timeout`` (a node that is down, or one that stopped answering)
fails with ``UNAVAILABLE``: it may or may not have been applied, and nothing
waits on a dead node for ever.

A :class:`Session` is one connection of a user: it registers, renews at a
jittered fraction of its TTL, registers again with a new generation when the
server no longer knows its lease (``NOT_FOUND``), stops for good when a newer
registration superseded it (``FAILED_PRECONDITION``), and unregisters on
close, lingering if asked (a quick reconnect then shows no flip).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import random
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from presenced._proto.presence.v1 import presence_pb2 as pb
from presenced.channel import Target, open_channel, presence_stub
from presenced.errors import PresenceError, status_code

log = logging.getLogger("presenced")

#: The most items in one batch (the server takes more; a batch this size
#: already makes a renewal's share of a message negligible).
MAX_BATCH = 512
#: Items waiting to be sent, at most; past it renewals are shed first.
MAX_QUEUED = 20_000
#: The first wait before reopening a broken stream, and the longest.
BACKOFF_FIRST = 0.05
BACKOFF_MAX = 5.0
#: How long an item waits for its answer before it fails with ``UNAVAILABLE``.
RESPONSE_TIMEOUT = 10.0


@dataclass
class _Item:
    item: pb.LeaseItem
    answer: asyncio.Future[pb.LeaseResult]
    renewal: bool = field(default=False)


class LeaseChannel:
    """One ``Leases`` stream to one node, shared by every session of a gateway.

    ``target`` is an address (``host:port``, or ``https://host:port`` for TLS
    with ``ca``/``cert``/``key``) or an open ``grpc.aio.Channel``; ``token``
    is the gateway's credential (the ``gateway`` scope); ``gateway_id``
    names this gateway in every registration that names none (the host and
    process by default), which is how presenced tells whose sessions died
    together.
    """

    def __init__(
        self,
        target: Target,
        *,
        token: str | None = None,
        gateway_id: str | None = None,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        max_batch: int = MAX_BATCH,
        max_queued: int = MAX_QUEUED,
        response_timeout: float = RESPONSE_TIMEOUT,
    ) -> None:
        if max_batch < 1 or max_queued < 1:
            raise ValueError("max_batch and max_queued must be at least 1")
        if response_timeout <= 0:
            raise ValueError("response_timeout must be positive")
        self._response_timeout = response_timeout
        self.target = target if isinstance(target, str) else "the given channel"
        self._channel, self._owns_channel = open_channel(target, ca=ca, cert=cert, key=key)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.gateway_id = gateway_id or f"{socket.gethostname()}-{os.getpid()}"
        self._stub = presence_stub(self._channel)
        self._max_batch = max_batch
        self._max_queued = max_queued
        self._queue: collections.deque[_Item] = collections.deque()
        self._queued = asyncio.Event()
        self._in_flight: dict[int, list[_Item]] = {}
        self._next_batch = 1
        self._failures = 0
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        #: Renewals shed by this client's full queue, since the start.
        self.shed_renewals = 0
        #: Times the stream was reopened after it broke.
        self.reopened = 0

    async def __aenter__(self) -> LeaseChannel:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        """Opens the stream (done by the first item if not called)."""
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="presenced-leases")

    async def close(self) -> None:
        """Stops the stream; items not yet answered fail with ``CANCELLED``."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all(PresenceError(grpc.StatusCode.CANCELLED, "the lease channel was closed"))
        if self._owns_channel:
            await self._channel.close()

    # The items, each answered with its result message or a PresenceError.

    async def register(
        self,
        user_id: str,
        session_id: str,
        *,
        ttl_ms: int,
        gateway_id: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> pb.RegisterResponse:
        request = pb.RegisterRequest(
            user_id=user_id,
            session_id=session_id,
            gateway_id=gateway_id or self.gateway_id,
            ttl_ms=ttl_ms,
            metadata=metadata or {},
        )
        result = await self._send(pb.LeaseItem(register=request))
        return result.register

    async def renew(self, user_id: str, session_id: str, generation: int, *, ttl_ms: int) -> pb.RenewResponse:
        request = pb.RenewRequest(user_id=user_id, session_id=session_id, generation=generation, ttl_ms=ttl_ms)
        result = await self._send(pb.LeaseItem(renew=request), renewal=True)
        return result.renew

    async def unregister(
        self, user_id: str, session_id: str, generation: int, *, linger_ms: int = 0
    ) -> pb.UnregisterResponse:
        request = pb.UnregisterRequest(
            user_id=user_id, session_id=session_id, generation=generation, linger_ms=linger_ms
        )
        result = await self._send(pb.LeaseItem(unregister=request))
        return result.unregister

    async def join(
        self, user_id: str, session_id: str, generation: int, room_id: str, metadata: Mapping[str, str] | None = None
    ) -> pb.JoinResponse:
        request = pb.JoinRequest(
            user_id=user_id, session_id=session_id, generation=generation, room_id=room_id, metadata=metadata or {}
        )
        return (await self._send(pb.LeaseItem(join=request))).join

    async def leave(self, user_id: str, session_id: str, generation: int, room_id: str) -> pb.LeaveResponse:
        request = pb.LeaveRequest(user_id=user_id, session_id=session_id, generation=generation, room_id=room_id)
        return (await self._send(pb.LeaseItem(leave=request))).leave

    async def signal(
        self, user_id: str, session_id: str, generation: int, room_id: str, kind: str, *, ttl_ms: int = 0
    ) -> pb.SignalResponse:
        request = pb.SignalRequest(
            user_id=user_id, session_id=session_id, generation=generation, room_id=room_id, kind=kind, ttl_ms=ttl_ms
        )
        return (await self._send(pb.LeaseItem(signal=request))).signal

    @property
    def queued(self) -> int:
        """Items waiting to be sent."""
        return len(self._queue)

    async def _send(self, item: pb.LeaseItem, renewal: bool = False) -> pb.LeaseResult:
        if self._closed:
            raise PresenceError(grpc.StatusCode.CANCELLED, "the lease channel is closed")
        self.start()
        answer: asyncio.Future[pb.LeaseResult] = asyncio.get_running_loop().create_future()
        queued = _Item(item, answer, renewal)
        if len(self._queue) >= self._max_queued and not self._shed_for(queued):
            raise PresenceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the lease channel's queue is full ({self._max_queued} items) and holds no renewal to shed",
            )
        self._queue.append(queued)
        self._queued.set()
        try:
            result = await asyncio.wait_for(asyncio.shield(answer), self._response_timeout)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
            # Answered now, so that the writer skips it and a late answer is dropped.
            if not answer.done():
                answer.set_exception(PresenceError(grpc.StatusCode.UNAVAILABLE, "no answer"))
                answer.exception()
            raise PresenceError(
                grpc.StatusCode.UNAVAILABLE,
                f"presenced at {self.target} did not answer within {self._response_timeout} s",
            ) from None
        if result.code != 0:
            not_owner = result.not_owner if result.HasField("not_owner") else None
            raise PresenceError(status_code(result.code), result.message, not_owner)
        return result

    def _shed_for(self, newcomer: _Item) -> bool:
        """Makes room for ``newcomer`` by shedding the oldest queued renewal
        (or the newcomer itself, if it is one): whether there is room."""
        shed = PresenceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "renewal shed: the lease channel's queue is full")
        for index, waiting in enumerate(self._queue):
            if waiting.renewal:
                del self._queue[index]
                self.shed_renewals += 1
                waiting.answer.set_exception(shed)
                return True
        if newcomer.renewal:
            self.shed_renewals += 1
            raise shed
        return False

    async def _run(self) -> None:
        while not self._closed:
            call = self._stub.Leases(metadata=self._metadata, wait_for_ready=True)
            writer = asyncio.get_running_loop().create_task(self._write(call))
            try:
                # The reader sees the stream break (the writer only stops writing).
                await self._read(call)
            except grpc.aio.AioRpcError as err:
                log.warning("the Leases stream broke (%s: %s); reopening", err.code().name, err.details())
                if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    # A credential's refusal is every item's answer: no retry fixes it.
                    self._fail_all(PresenceError(err.code(), err.details() or ""))
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
                call.cancel()
            if self._closed:
                return
            # What the broken stream did not answer goes again, first, on the next.
            unanswered = [item for batch in self._in_flight.values() for item in batch if not item.answer.done()]
            self._in_flight.clear()
            self._queue.extendleft(reversed(unanswered))
            self.reopened += 1
            self._failures += 1
            # Full jitter: gateways that lost the same node do not all come back at once.
            await asyncio.sleep(random.uniform(0, min(BACKOFF_MAX, BACKOFF_FIRST * 2**self._failures)))
            if self._queue:
                self._queued.set()

    async def _write(self, call: Any) -> None:
        while True:
            await self._queued.wait()
            self._queued.clear()
            while self._queue:
                batch: list[_Item] = []
                while self._queue and len(batch) < self._max_batch:
                    item = self._queue.popleft()
                    if not item.answer.done():
                        batch.append(item)
                if not batch:
                    continue
                batch_id = self._next_batch
                self._next_batch += 1
                self._in_flight[batch_id] = batch
                try:
                    await call.write(pb.LeaseBatch(batch_id=batch_id, items=[item.item for item in batch]))
                except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
                    # The stream ended: the batch is in flight, and goes
                    # again on the next stream once the reader has seen why.
                    return

    async def _read(self, call: Any) -> None:
        while True:
            results = await call.read()
            if results is grpc.aio.EOF:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "the server ended the stream"
                )
            self._failures = 0
            batch = self._in_flight.pop(results.batch_id, [])
            for item, result in zip(batch, results.results):
                if not item.answer.done():
                    item.answer.set_result(result)

    def _fail_all(self, error: PresenceError) -> None:
        for batch in self._in_flight.values():
            for item in batch:
                if not item.answer.done():
                    item.answer.set_exception(error)
        self._in_flight.clear()
        while self._queue:
            item = self._queue.popleft()
            if not item.answer.done():
                item.answer.set_exception(error)


class Leases(Protocol):
    """Where a :class:`Session` sends its items: a :class:`LeaseChannel`, or
    a ``ClusterLeases`` routing each to its user's owner."""

    async def register(
        self,
        user_id: str,
        session_id: str,
        *,
        ttl_ms: int,
        gateway_id: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> pb.RegisterResponse: ...

    async def renew(self, user_id: str, session_id: str, generation: int, *, ttl_ms: int) -> pb.RenewResponse: ...

    async def unregister(
        self, user_id: str, session_id: str, generation: int, *, linger_ms: int = 0
    ) -> pb.UnregisterResponse: ...

    async def join(
        self, user_id: str, session_id: str, generation: int, room_id: str, metadata: Mapping[str, str] | None = None
    ) -> pb.JoinResponse: ...

    async def leave(self, user_id: str, session_id: str, generation: int, room_id: str) -> pb.LeaveResponse: ...

    async def signal(
        self, user_id: str, session_id: str, generation: int, room_id: str, kind: str, *, ttl_ms: int = 0
    ) -> pb.SignalResponse: ...


class Session:
    """One connection of a user, kept alive on a :class:`LeaseChannel` (or any :class:`Leases`).

    ``renew_every`` defaults to a third of ``ttl_ms``: two renewals may be
    lost before the lease ends. Each wait is jittered by ``jitter`` either way
    so that sessions opened together do not renew together.
    ``on_closed(reason)`` is called once when the session stops by itself
    (superseded, or its user's credential refused).
    """

    def __init__(
        self,
        leases: Leases,
        user_id: str,
        session_id: str,
        *,
        ttl_ms: int = 30_000,
        gateway_id: str = "",
        metadata: Mapping[str, str] | None = None,
        renew_every: float | None = None,
        jitter: float = 0.1,
        on_closed: Callable[[str], Awaitable[None] | None] | None = None,
    ) -> None:
        if ttl_ms <= 0:
            raise ValueError("ttl_ms must be positive")
        if not 0 <= jitter < 1:
            raise ValueError("jitter must be in [0, 1)")
        self.leases = leases
        self.user_id = user_id
        self.session_id = session_id
        self.ttl_ms = ttl_ms
        self.gateway_id = gateway_id
        self.metadata = dict(metadata or {})
        self.renew_every = renew_every if renew_every is not None else ttl_ms / 3000
        self.jitter = jitter
        self.on_closed = on_closed
        #: The generation of the lease held, 0 before the first registration.
        self.generation = 0
        #: Rooms joined, joined again after a new registration.
        self.rooms: dict[str, dict[str, str]] = {}
        #: Why the session stopped by itself, if it did.
        self.closed_reason: str | None = None
        #: Registrations after the first (the lease was lost and taken again).
        self.reregistered = 0
        #: Renewals shed (by the server or the channel's full queue).
        self.shed = 0
        self._beats: asyncio.Task[None] | None = None
        self._closing = False

    async def __aenter__(self) -> Session:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def open_now(self) -> bool:
        return self._beats is not None and self.closed_reason is None and not self._closing

    async def open(self) -> pb.RegisterResponse:
        """Registers, and renews from then on until :meth:`close`."""
        answer = await self._register()
        self._beats = asyncio.get_running_loop().create_task(self._renew_forever(), name=f"presenced-{self.session_id}")
        return answer

    async def close(self, *, linger_ms: int = 0) -> pb.UnregisterResponse | None:
        """Stops renewing and unregisters (after ``linger_ms``, server side: a
        reconnect within it shows no flip). ``None`` if it had stopped already."""
        self._closing = True
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats
        if self.closed_reason is not None or self.generation == 0:
            return None
        try:
            return await self.leases.unregister(self.user_id, self.session_id, self.generation, linger_ms=linger_ms)
        except PresenceError as err:
            if err.lease_lost or err.superseded:
                return None
            raise

    async def join(self, room_id: str, metadata: Mapping[str, str] | None = None) -> pb.JoinResponse:
        self.rooms[room_id] = dict(metadata or {})
        return await self.leases.join(self.user_id, self.session_id, self.generation, room_id, metadata)

    async def leave(self, room_id: str) -> pb.LeaveResponse:
        self.rooms.pop(room_id, None)
        return await self.leases.leave(self.user_id, self.session_id, self.generation, room_id)

    async def signal(self, room_id: str, kind: str, *, ttl_ms: int = 0) -> pb.SignalResponse:
        return await self.leases.signal(self.user_id, self.session_id, self.generation, room_id, kind, ttl_ms=ttl_ms)

    async def _register(self) -> pb.RegisterResponse:
        answer = await self.leases.register(
            self.user_id, self.session_id, ttl_ms=self.ttl_ms, gateway_id=self.gateway_id, metadata=self.metadata
        )
        self.generation = answer.generation
        return answer

    def _next_beat(self) -> float:
        return self.renew_every * random.uniform(1 - self.jitter, 1 + self.jitter)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._next_beat())
            try:
                await self.leases.renew(self.user_id, self.session_id, self.generation, ttl_ms=self.ttl_ms)
            except PresenceError as err:
                if err.shed:
                    # The lease stands; the next beat renews it.
                    self.shed += 1
                elif err.lease_lost:
                    await self._take_again()
                elif err.superseded or err.code in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                ):
                    await self._stop(f"{err.code.name}: {err.message}")
                    return
                else:
                    # UNAVAILABLE and the like: the next beat tries again,
                    # well within the TTL (a third of it by default).
                    log.info("renewal of %s/%s failed: %s", self.user_id, self.session_id, err)

    async def _take_again(self) -> None:
        """The server lost the lease: a new registration (a new generation),
        and the rooms joined again."""
        try:
            await self._register()
            self.reregistered += 1
            for room_id, metadata in self.rooms.items():
                await self.leases.join(self.user_id, self.session_id, self.generation, room_id, metadata)
        except PresenceError as err:
            log.info("registering %s/%s again failed: %s; trying at the next beat", self.user_id, self.session_id, err)

    async def _stop(self, reason: str) -> None:
        self.closed_reason = reason
        if self.on_closed is not None:
            outcome = self.on_closed(reason)
            if outcome is not None:
                await outcome


__all__: Sequence[str] = ["LeaseChannel", "Leases", "Session", "MAX_BATCH", "MAX_QUEUED"]
