"""The room side of a viewer: what it holds of a room and of many rooms'
counts, and ``WatchRoom`` and ``WatchRoomCounts`` streams that survive
disconnects. The same design as the TypeScript client's ``room.ts`` and
``roomCounts.ts``.

:class:`RoomView` holds one room as a member-mode watcher sees it (R2, R3,
S3): the members by user id, the set of signalling users per kind, and the
room version. A change of one member (or one signal kind) is applied only if
its version is greater than that of the last change applied for that member
(or kind) and than the snapshot's: the check keeps a delayed or repeated one
from undoing a newer one. A snapshot is a resync that replaces everything.

:class:`RoomCountsView` holds, per watched room, the last count applied. A
stream's first message replaces everything held, even at lower versions (a
resync); a later message holds only the rooms that changed, and a count is
applied only if its room version is not lower than the one held, so that a
delayed count never takes a room back. A count at version 0 is taken as it
comes: the server counts a room it holds nothing of (emptied and dropped,
R2) and a room the caller may no longer read (R4) as an unknown room,
version 0 and no one in it, which is what is true now.

:class:`RoomWatcher` feeds a view from a member-mode ``WatchRoom``, and
:class:`RoomCountsWatcher` one from a ``WatchRoomCounts`` whose rooms
:meth:`RoomCountsWatcher.update` changes on the open stream (by its
``watch_id``). Both reopen a broken stream with backoff and jitter (the
counts watcher with the rooms it watches then) and start again from what the
new stream opens with. A ``token`` may be a callable: it is asked again at
each opening, and a stream the server ended for its credentials
(``UNAUTHENTICATED``) is reopened at once with a fresh one. A refusal a retry
cannot fix ends them: ``NOT_FOUND`` (the room is not readable by this
caller), ``FAILED_PRECONDITION`` (past the server's member cap: watch the
counts instead), bad input or credentials; :meth:`~RoomWatcher.ready` raises
it as a :class:`~presenced.PresenceError`, and ``last_error`` holds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc

from presenced._proto.presence.v1 import presence_pb2 as pb
from presenced.channel import Target
from presenced.errors import PresenceError
from presenced.streams import Metadata, ReopeningWatch, Token, refusal

#: The most rooms one ``RoomCounts`` call or ``WatchRoomCounts`` stream takes (R7).
MAX_WATCHED_ROOMS = 10_000

class RoomView:
    """One room as a member-mode watcher holds it."""

    def __init__(self, room_id: str) -> None:
        self._room_id = room_id
        #: The highest room version applied: the snapshot's, or a later change's.
        self._version = 0
        #: The version of the snapshot held: a change not newer than it is in it.
        self._floor = 0
        self._members: dict[str, pb.RoomMember] = {}
        # The version of the last change applied per user, members and users
        # who left since the snapshot alike, so that a delayed join cannot
        # bring back a user whose leave was applied. Cleared by every snapshot.
        self._member_versions: dict[str, int] = {}
        # The last set applied per signal kind, empty ones included (for their version).
        self._signals: dict[str, pb.SignalSet] = {}

    def apply_snapshot(self, snapshot: pb.RoomSnapshot) -> None:
        """Replaces everything held with ``snapshot``: a resync, authoritative even at a lower version."""
        self._room_id = snapshot.room_id
        self._version = snapshot.version
        self._floor = snapshot.version
        self._members = {member.user_id: member for member in snapshot.members}
        self._member_versions.clear()
        self._signals = {signals.kind: signals for signals in snapshot.signals}

    def apply_change(self, change: pb.RoomMemberChange) -> bool:
        """Applies a member's join, leave or update. True if newer than what
        is held of that member; False for a stale or repeated change, or one
        without a member or a known kind, which changes nothing."""
        if not change.HasField("member") or change.kind not in (
            pb.ROOM_CHANGE_JOINED,
            pb.ROOM_CHANGE_LEFT,
            pb.ROOM_CHANGE_UPDATED,
        ):
            return False
        user_id = change.member.user_id
        if change.version <= self._floor or change.version <= self._member_versions.get(user_id, 0):
            return False
        self._member_versions[user_id] = change.version
        if change.kind == pb.ROOM_CHANGE_LEFT:
            self._members.pop(user_id, None)
        else:
            self._members[user_id] = change.member
        self._version = max(self._version, change.version)
        return True

    def apply_signals(self, signals: pb.SignalSet) -> bool:
        """Applies a kind's new set of signalling users. True if newer than the set held of that kind."""
        held = self._signals.get(signals.kind)
        if signals.version <= self._floor or (held is not None and signals.version <= held.version):
            return False
        self._signals[signals.kind] = signals
        self._version = max(self._version, signals.version)
        return True

    def apply(self, event: pb.RoomEvent) -> bool:
        """Applies a member-mode ``WatchRoom`` event: True if it changed what
        is held (a snapshot always does; a count, of count mode, never)."""
        kind = event.WhichOneof("event")
        if kind == "snapshot":
            self.apply_snapshot(event.snapshot)
            return True
        if kind == "change":
            return self.apply_change(event.change)
        if kind == "signals":
            return self.apply_signals(event.signals)
        return False

    @property
    def room_id(self) -> str:
        return self._room_id

    @property
    def version(self) -> int:
        """The newest room version held."""
        return self._version

    def member(self, user_id: str) -> pb.RoomMember | None:
        """A member with its shown metadata; None if not in the room (or not listed to this watcher)."""
        return self._members.get(user_id)

    def members(self) -> list[pb.RoomMember]:
        """Every member held, in no particular order."""
        return list(self._members.values())

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, user_id: object) -> bool:
        return user_id in self._members

    def signalling(self, kind: str) -> list[str]:
        """The users signalling ``kind`` now (at most the server's cap of them; see :meth:`signal_count`)."""
        held = self._signals.get(kind)
        return list(held.user_ids) if held is not None else []

    def signal_count(self, kind: str) -> int:
        """How many users signal ``kind`` now."""
        held = self._signals.get(kind)
        return held.count if held is not None else 0

    def signals(self) -> list[pb.SignalSet]:
        """The sets of every kind someone signals now."""
        return [held for held in self._signals.values() if held.count > 0]


class RoomCountsView:
    """What a viewer holds of many rooms: per watched room, the newest count applied."""

    def __init__(self, room_ids: Iterable[str] = ()) -> None:
        self._counts: dict[str, pb.RoomCount] = {}
        # An ordered set: the rooms in the order they were first watched.
        self._watched: dict[str, None] = dict.fromkeys(room_ids)

    def replace(self, counts: Iterable[pb.RoomCount]) -> None:
        """A stream's first message: replaces every count held, even at lower
        versions (a resync). Counts of rooms not watched are left out; a
        watched room it does not carry holds nothing until its count comes."""
        self._counts = {count.room_id: count for count in counts if count.room_id in self._watched}

    def merge(self, counts: Iterable[pb.RoomCount]) -> list[pb.RoomCount]:
        """A later message: applies each count as :meth:`apply` does. The
        counts applied, in message order (empty: nothing changed)."""
        return [count for count in counts if self.apply(count)]

    def apply(self, count: pb.RoomCount) -> bool:
        """Applies the count of a watched room whose version is not lower
        than the one held (or is 0: the room as an unknown one) and that
        differs from it; True if it changed what is held."""
        if count.room_id not in self._watched:
            return False
        held = self._counts.get(count.room_id)
        if held is not None:
            # Version 0: emptied and dropped, or no longer readable; never a delayed count.
            if count.version < held.version and count.version != 0:
                return False
            if (count.version, count.users, count.sessions) == (held.version, held.users, held.sessions):
                return False
        self._counts[count.room_id] = count
        return True

    def add(self, room_ids: Iterable[str]) -> None:
        """Watches ``room_ids`` too; their counts are applied from now on."""
        for room_id in room_ids:
            self._watched.setdefault(room_id, None)

    def remove(self, room_ids: Iterable[str]) -> None:
        """Stops watching ``room_ids`` and forgets their counts; counts of them that still come are dropped."""
        for room_id in room_ids:
            self._watched.pop(room_id, None)
            self._counts.pop(room_id, None)

    def watches(self, room_id: str) -> bool:
        return room_id in self._watched

    @property
    def room_ids(self) -> list[str]:
        """The rooms watched, in the order they were first watched."""
        return list(self._watched)

    def get(self, room_id: str) -> pb.RoomCount | None:
        """The count held of ``room_id``; None before its first count, or when not watched."""
        return self._counts.get(room_id)

    def __len__(self) -> int:
        """Rooms with a count held."""
        return len(self._counts)

    def values(self) -> list[pb.RoomCount]:
        """Every count held, in no particular order."""
        return list(self._counts.values())

    def __iter__(self) -> Iterator[pb.RoomCount]:
        return iter(list(self._counts.values()))


class RoomWatcher(ReopeningWatch[pb.RoomEvent]):
    """A member-mode ``WatchRoom`` of ``room_id`` that reopens itself, feeding a :class:`RoomView`.

    ``on_change(view, event)`` is called after an event changed the view (a
    snapshot, first or a resync, always does: re-render the room whole); a
    stale or repeated change is dropped, never reported. ``viewer_id`` names
    the viewer a service watches for. Stop it with :meth:`close` (or ``async with``,
    which also waits for the first snapshot).
    """

    _name = "the room watch"

    def __init__(
        self,
        target: Target,
        room_id: str,
        *,
        token: Token = None,
        viewer_id: str = "",
        on_change: Callable[[RoomView, pb.RoomEvent], None] | None = None,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(target, token=token, ca=ca, cert=cert, key=key)
        self.room_id = room_id
        self.viewer_id = viewer_id
        self.view = RoomView(room_id)
        self.on_change = on_change

    def _open(self, metadata: Metadata) -> Any:
        request = pb.WatchRoomRequest(room_id=self.room_id, viewer_id=self.viewer_id, mode=pb.ROOM_WATCH_MEMBERS)
        return self._stub.WatchRoom(request, metadata=metadata, wait_for_ready=True)

    def _received(self, message: pb.RoomEvent, first: bool) -> None:
        if self.view.apply(message) and self.on_change is not None:
            self.on_change(self.view, message)


class RoomCountsWatcher(ReopeningWatch[pb.RoomCounts]):
    """A ``WatchRoomCounts`` of ``room_ids`` (1 to :data:`MAX_WATCHED_ROOMS`; a
    room named twice is watched once) that reopens itself, feeding a
    :class:`RoomCountsView`: the rooms that changed, at most once per
    ``count_interval_ms`` (100 to 60000; 0: the server's 1000).

    ``on_change(view, counts, resynced)`` is called after a message changed
    the view: ``counts`` are the counts applied, and ``resynced`` says the
    view was replaced by a (re)opened stream's first message (re-render it
    whole). A room the caller may not read is answered as an unknown one
    (version 0, no one in it, R4).
    """

    _name = "the room counts watch"

    def __init__(
        self,
        target: Target,
        room_ids: Iterable[str],
        *,
        token: Token = None,
        viewer_id: str = "",
        count_interval_ms: int = 0,
        on_change: Callable[[RoomCountsView, list[pb.RoomCount], bool], None] | None = None,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(target, token=token, ca=ca, cert=cert, key=key)
        self.viewer_id = viewer_id
        self.count_interval_ms = count_interval_ms
        self.on_change = on_change
        #: The rooms asked for (an ordered set): what every (re)open names.
        self._rooms: dict[str, None] = dict.fromkeys(room_ids)
        self.view = RoomCountsView(self._rooms)
        # What the open stream's server watches: its request's rooms, with the
        # updates sent on it since (counted from when they are sent, so that
        # two updates in flight never send the same room twice).
        self._server_rooms: set[str] = set()
        self._watch_id = ""
        #: Updates on their way to the server.
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def room_ids(self) -> list[str]:
        """The rooms watched: those of the open stream once its updates are through, and of every reopen."""
        return list(self._rooms)

    @property
    def watch_id(self) -> str:
        """The open stream's name for ``UpdateWatchRoomCounts`` (from its first message); empty while none is open."""
        return self._watch_id

    async def update(self, add: Iterable[str] = (), remove: Iterable[str] = ()) -> None:
        """Adds rooms to the watch and removes others without reopening it
        (``UpdateWatchRoomCounts`` with the open stream's ``watch_id``): the
        added rooms' counts arrive at once; removed rooms are forgotten once
        the server took the update, and whatever still comes of them is
        dropped. A room both added and removed is removed. While no stream
        is open only the rooms of the next opening change. Raises
        :class:`~presenced.PresenceError` without changing anything when the
        watch would hold no room or more than :data:`MAX_WATCHED_ROOMS`, or
        when the server refused the update."""
        removing = set(remove)
        added = [room_id for room_id in dict.fromkeys(add) if room_id not in removing and room_id not in self._rooms]
        removed = [room_id for room_id in removing if room_id in self._rooms]
        size = len(self._rooms) + len(added) - len(removed)
        if size == 0 or size > MAX_WATCHED_ROOMS:
            raise PresenceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a room counts watch holds 1 to {MAX_WATCHED_ROOMS} rooms; this update would leave {size}",
            )
        if not added and not removed:
            return
        before = list(self._rooms)
        for room_id in added:
            self._rooms[room_id] = None
        for room_id in removed:
            del self._rooms[room_id]
        # Before the call: an added room's count may come on the stream before its answer does.
        self.view.add(added)
        try:
            await self._track(self._send(added, removed))
        except BaseException:
            # Refused: the watch stays as it was, in its order, with what other
            # updates changed meanwhile (a reopen meanwhile is put right below).
            was_added, was_removed, had = set(added), set(removed), set(before)
            restored = [room_id for room_id in before if room_id in self._rooms or room_id in was_removed]
            restored += [room_id for room_id in self._rooms if room_id not in had and room_id not in was_added]
            self._rooms = dict.fromkeys(restored)
            self.view.remove(added)
            raise
        finally:
            self._reconcile()
        self.view.remove(removed)

    async def settled(self) -> None:
        """Returns once every update sent so far has been answered (or has dropped the stream to reopen it)."""
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def close(self) -> None:
        self._closing = True
        for task in list(self._pending):
            task.cancel()
        await super().close()

    def _open(self, metadata: Metadata) -> Any:
        room_ids = list(self._rooms)
        self._server_rooms = set(room_ids)
        # A stream being (re)opened has no name until its first message.
        self._watch_id = ""
        request = pb.WatchRoomCountsRequest(
            room_ids=room_ids, viewer_id=self.viewer_id, count_interval_ms=self.count_interval_ms
        )
        return self._stub.WatchRoomCounts(request, metadata=metadata, wait_for_ready=True)

    def _received(self, message: pb.RoomCounts, first: bool) -> None:
        if first:
            if message.watch_id:
                self._watch_id = message.watch_id
            self.view.replace(message.counts)
            # Rooms added or removed while its request was on its way: sent on this stream.
            self._reconcile()
            if self.on_change is not None:
                self.on_change(self.view, self.view.values(), True)
            return
        applied = self.view.merge(message.counts)
        if applied and self.on_change is not None:
            self.on_change(self.view, applied, False)

    def _reconcile(self) -> None:
        """Sends the rooms asked for that the open stream's server does not
        watch, and those it watches that are not asked for."""
        if self._closing:
            return
        add = [room_id for room_id in self._rooms if room_id not in self._server_rooms]
        remove = [room_id for room_id in self._server_rooms if room_id not in self._rooms]
        if add or remove:
            self._track(self._send_or_drop(add, remove))

    async def _send_or_drop(self, add: list[str], remove: list[str]) -> None:
        try:
            await self._send(add, remove)
        except PresenceError:
            # Refused: reopen with the rooms asked for rather than follow others.
            self._drop()

    async def _send(self, add: list[str], remove: list[str]) -> None:
        """``UpdateWatchRoomCounts`` on the open stream. With no stream open
        there is nothing to send: the reopen names the rooms asked for. An
        unknown or ended stream (``NOT_FOUND``) is dropped and reopened with them."""
        watch_id = self._watch_id
        if self._call is None or not watch_id:
            return
        self._server_rooms.update(add)
        self._server_rooms.difference_update(remove)
        request = pb.UpdateWatchRoomCountsRequest(
            watch_id=watch_id, add_room_ids=add, remove_room_ids=remove, viewer_id=self.viewer_id
        )
        try:
            await self._stub.UpdateWatchRoomCounts(request, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            if self._watch_id != watch_id:
                return  # another stream by now, opened with the rooms asked for
            if err.code() == grpc.StatusCode.NOT_FOUND:
                # The stream ended meanwhile: the reopen names the rooms asked for.
                self._drop()
                return
            self._server_rooms.difference_update(add)
            self._server_rooms.update(remove)
            raise refusal(err) from err

    def _track(self, work: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task
