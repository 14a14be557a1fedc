"""Leases in a cluster: each item sent to its user's owner.

A cluster node answers an item for a user whose slot it does not own with
``UNAVAILABLE`` and a ``NotOwner`` naming the owner (C2). :class:`ClusterLeases`
keeps a :class:`LeaseChannel` per node it has been sent to, and the owner of
each slot as the refusals name it (the owner of the highest epoch seen wins:
an older refusal arriving late never takes a slot back). An item goes to its
slot's known owner, or to a seed; a refusal naming an owner sends it there at
once; one naming none (the slot is between owners, in a move or a takeover)
waits with backoff and jitter and tries again, within ``move_budget``
seconds, after which the refusal is the caller's. A node that does not
answer (``UNAVAILABLE`` without a ``NotOwner``: down, or cut off) loses the
slots routed to it, so that the next item goes to a seed, whose refusal names
the owner etcd gives them next; the item itself fails, and a session's next
beat renews it.

It has the methods of a :class:`LeaseChannel` that a :class:`Session` uses, so
a session registers through it as through one channel.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import grpc

from presenced._proto.presence.v1 import presence_pb2 as pb
from presenced.errors import PresenceError
from presenced.leases import RESPONSE_TIMEOUT, LeaseChannel

#: The cluster's slot count when none is given (`presenced serve --slots`' default).
DEFAULT_SLOTS = 1024
#: How long an item waits out a slot with no owner before its refusal is the caller's.
MOVE_BUDGET = 5.0
#: Owners followed for one item before giving up (a map changing under it).
MAX_HOPS = 5

T = TypeVar("T")


def slot_of(user_id: str, slots: int) -> int:
    """The user's slot: 32-bit FNV-1a of its UTF-8 bytes, modulo ``slots`` (as the server computes it)."""
    hash_ = 0x811C9DC5
    for byte in user_id.encode():
        hash_ = ((hash_ ^ byte) * 0x01000193) & 0xFFFFFFFF
    return hash_ % max(slots, 1)


class ClusterLeases:
    """Lease items routed to their users' owners; ``seeds`` are node addresses."""

    def __init__(
        self,
        seeds: Sequence[str],
        *,
        slots: int = DEFAULT_SLOTS,
        token: str | None = None,
        gateway_id: str | None = None,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        move_budget: float = MOVE_BUDGET,
        response_timeout: float = RESPONSE_TIMEOUT,
    ) -> None:
        if not seeds:
            raise ValueError("seeds: give at least one node's address")
        self.seeds = list(seeds)
        self.slots = slots
        self.move_budget = move_budget
        self.response_timeout = response_timeout
        self._token, self._gateway_id = token, gateway_id
        self._tls = (ca, cert, key)
        self._channels: dict[str, LeaseChannel] = {}
        #: Each slot's owner as last named: (epoch, address).
        self.owners: dict[int, tuple[int, str]] = {}
        #: Items sent again to the owner a refusal named.
        self.redirected = 0

    async def __aenter__(self) -> ClusterLeases:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def channel(self, address: str) -> LeaseChannel:
        if address not in self._channels:
            ca, cert, key = self._tls
            self._channels[address] = LeaseChannel(
                address,
                token=self._token,
                gateway_id=self._gateway_id,
                ca=ca,
                cert=cert,
                key=key,
                response_timeout=self.response_timeout,
            )
        return self._channels[address]

    def _learn(self, owner: pb.NotOwner) -> None:
        known = self.owners.get(owner.slot)
        if owner.owner_addr and (known is None or owner.epoch >= known[0]):
            self.owners[owner.slot] = (owner.epoch, owner.owner_addr)

    def _forget(self, address: str) -> None:
        for slot in [slot for slot, (_, owner) in self.owners.items() if owner == address]:
            del self.owners[slot]

    async def _routed(self, user_id: str, send: Callable[[LeaseChannel], Awaitable[T]]) -> T:
        slot = slot_of(user_id, self.slots)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.move_budget
        waits = 0
        hops = 0
        while True:
            known = self.owners.get(slot)
            address = known[1] if known else self.seeds[slot % len(self.seeds)]
            try:
                return await send(self.channel(address))
            except PresenceError as err:
                if err.code == grpc.StatusCode.UNAVAILABLE and err.not_owner is None:
                    self._forget(address)
                    raise
                if err.code != grpc.StatusCode.UNAVAILABLE or err.not_owner is None:
                    raise
                if err.not_owner.owner_addr:
                    self._learn(err.not_owner)
                    hops += 1
                    self.redirected += 1
                    if hops > MAX_HOPS:
                        raise
                    continue
                # The slot has no owner right now: wait it out, within the budget.
                self.owners.pop(slot, None)
                waits += 1
                pause = random.uniform(0, min(0.5, 0.02 * 2**waits))
                if loop.time() + pause > deadline:
                    raise
                await asyncio.sleep(pause)

    async def register(
        self,
        user_id: str,
        session_id: str,
        *,
        ttl_ms: int,
        gateway_id: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> pb.RegisterResponse:
        return await self._routed(
            user_id,
            lambda channel: channel.register(
                user_id, session_id, ttl_ms=ttl_ms, gateway_id=gateway_id, metadata=metadata
            ),
        )

    async def renew(self, user_id: str, session_id: str, generation: int, *, ttl_ms: int) -> pb.RenewResponse:
        return await self._routed(
            user_id, lambda channel: channel.renew(user_id, session_id, generation, ttl_ms=ttl_ms)
        )

    async def unregister(
        self, user_id: str, session_id: str, generation: int, *, linger_ms: int = 0
    ) -> pb.UnregisterResponse:
        return await self._routed(
            user_id, lambda channel: channel.unregister(user_id, session_id, generation, linger_ms=linger_ms)
        )

    async def join(
        self, user_id: str, session_id: str, generation: int, room_id: str, metadata: Mapping[str, str] | None = None
    ) -> pb.JoinResponse:
        return await self._routed(
            user_id, lambda channel: channel.join(user_id, session_id, generation, room_id, metadata)
        )

    async def leave(self, user_id: str, session_id: str, generation: int, room_id: str) -> pb.LeaveResponse:
        return await self._routed(user_id, lambda channel: channel.leave(user_id, session_id, generation, room_id))

    async def signal(
        self, user_id: str, session_id: str, generation: int, room_id: str, kind: str, *, ttl_ms: int = 0
    ) -> pb.SignalResponse:
        return await self._routed(
            user_id, lambda channel: channel.signal(user_id, session_id, generation, room_id, kind, ttl_ms=ttl_ms)
        )
