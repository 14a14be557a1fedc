"""The viewer side: what a viewer holds of the users it watches, and a Watch
that keeps it current through broken streams.

:class:`ViewerStore` keeps each user at its highest version: an update at or
below the version held is stale and dropped; a resync snapshot replaces
what the store holds (a partial one, after a resume, keeps the users it left
out: their versions were current). :class:`Watcher` opens ``Watch`` as a
viewer (a viewer's token, or a service token naming the viewer) and, when
the stream breaks, opens it again with backoff and jitter, resuming with the
versions held (``known_versions``) so that only what changed is sent again.
A ``token`` may be a callable: it is asked again at each opening, so a
viewer's short-lived token is refreshed when the server ends a stream at its
expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Union

import grpc

from presenced._proto.presence.v1 import presence_pb2 as pb
from presenced.channel import Target, open_channel, presence_stub

log = logging.getLogger("presenced")

#: A token, or a function giving the current one (asked at each opening).
Token = Union[str, Callable[[], str], Callable[[], Awaitable[str]], None]

BACKOFF_FIRST = 0.05
BACKOFF_MAX = 5.0


class ViewerStore:
    """Users by id, each at the highest version seen."""

    def __init__(self) -> None:
        self.users: dict[str, pb.UserPresence] = {}
        #: Updates dropped because the store held that version or a newer one.
        self.dropped = 0

    def get(self, user_id: str) -> pb.UserPresence | None:
        return self.users.get(user_id)

    def online(self, user_id: str) -> bool:
        user = self.users.get(user_id)
        return user is not None and user.state == pb.STATE_ONLINE

    def known_versions(self) -> dict[str, int]:
        """What to resume a Watch with."""
        return {user_id: user.version for user_id, user in self.users.items() if user.version > 0}

    def apply_update(self, user: pb.UserPresence) -> bool:
        """Takes ``user`` if newer than what is held: whether it was."""
        held = self.users.get(user.user_id)
        if held is not None and user.version <= held.version:
            self.dropped += 1
            return False
        self.users[user.user_id] = user
        return True

    def apply_snapshot(self, snapshot: pb.Snapshot, *, watched: Iterable[str] | None = None) -> None:
        """A resync: the store becomes the snapshot. With ``partial`` set, the
        users of ``watched`` the snapshot left out are kept as held (the
        server confirmed their versions)."""
        kept: dict[str, pb.UserPresence] = {}
        if snapshot.partial and watched is not None:
            kept = {user_id: self.users[user_id] for user_id in watched if user_id in self.users}
        kept.update({user.user_id: user for user in snapshot.users})
        self.users = kept

    def apply_added(self, snapshot: pb.Snapshot) -> None:
        """Users an UpdateWatch added: taken, others untouched."""
        for user in snapshot.users:
            self.apply_update(user)

    def apply(self, event: pb.WatchEvent, *, watched: Iterable[str] | None = None) -> None:
        kind = event.WhichOneof("event")
        if kind == "snapshot":
            self.apply_snapshot(event.snapshot, watched=watched)
        elif kind == "update":
            self.apply_update(event.update)
        elif kind == "updates":
            for user in event.updates.users:
                self.apply_update(user)
        elif kind == "added":
            self.apply_added(event.added)


class Watcher:
    """A Watch of ``user_ids`` that reopens itself, feeding a :class:`ViewerStore`.

    ``on_change(store, event)`` is called after each event is applied.
    Stop it with :meth:`close` (or ``async with``).
    """

    def __init__(
        self,
        target: Target,
        user_ids: Iterable[str],
        *,
        token: Token = None,
        viewer_id: str = "",
        store: ViewerStore | None = None,
        on_change: Callable[[ViewerStore, pb.WatchEvent], None] | None = None,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> None:
        self._channel, self._owns_channel = open_channel(target, ca=ca, cert=cert, key=key)
        self._stub = presence_stub(self._channel)
        self.user_ids = list(dict.fromkeys(user_ids))
        self.viewer_id = viewer_id
        self.token = token
        self.store = store if store is not None else ViewerStore()
        self.on_change = on_change
        #: Streams opened, the first included.
        self.opened = 0
        self._task: asyncio.Task[None] | None = None
        self._first_snapshot = asyncio.Event()

    async def __aenter__(self) -> Watcher:
        self.start()
        await self.ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="presenced-watch")

    async def ready(self, timeout: float | None = 10.0) -> None:
        """Waits for the first snapshot (a stopped watch's error is raised)."""
        waiting = asyncio.ensure_future(self._first_snapshot.wait())
        assert self._task is not None, "start() first"
        done, _ = await asyncio.wait({waiting, self._task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            waiting.cancel()
            self._task.result()
        if waiting not in done:
            waiting.cancel()
            raise TimeoutError("no snapshot from the Watch in time")

    async def close(self) -> None:
        """Stops the Watch (a refusal that stopped it already was raised by :meth:`ready`)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self._task
        if self._owns_channel:
            await self._channel.close()

    async def _metadata(self) -> tuple[tuple[str, str], ...]:
        token = self.token
        if callable(token):
            given = token()
            token = await given if isinstance(given, Awaitable) else given
        return (("authorization", f"Bearer {token}"),) if token else ()

    async def _run(self) -> None:
        failures = 0
        while True:
            request = pb.WatchRequest(
                user_ids=self.user_ids, viewer_id=self.viewer_id, known_versions=self.store.known_versions()
            )
            try:
                call = self._stub.Watch(request, metadata=await self._metadata(), wait_for_ready=True)
                self.opened += 1
                async for event in call:
                    failures = 0
                    self.store.apply(event, watched=self.user_ids)
                    if event.WhichOneof("event") == "snapshot":
                        self._first_snapshot.set()
                    if self.on_change is not None:
                        self.on_change(self.store, event)
                log.info("the Watch ended; reopening")
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.PERMISSION_DENIED or (
                    err.code() == grpc.StatusCode.UNAUTHENTICATED and not callable(self.token)
                ):
                    # A refusal no reopening fixes (a fixed token's expiry included).
                    raise
                log.info("the Watch broke (%s: %s); reopening", err.code().name, err.details())
            failures += 1
            await asyncio.sleep(random.uniform(0, min(BACKOFF_MAX, BACKOFF_FIRST * 2**failures)))


def snapshot_map(users: Iterable[pb.UserPresence]) -> Mapping[str, pb.UserPresence]:
    """Users by id."""
    return {user.user_id: user for user in users}
