"""presenced's Python client (asyncio, on grpcio's ``grpc.aio``).

Gateway side: :class:`LeaseChannel` (every lease item of a gateway on one
``Leases`` stream, batched, with a bounded queue that sheds renewals first)
and :class:`Session` (one connection of a user, renewed with jitter,
registered again when the server lost its lease, closed when superseded).

In a cluster, :class:`ClusterLeases` sends each item to its user's owner,
following the ``NotOwner`` refusals and waiting out a slot between owners.

Viewer side: :class:`ViewerStore` (users at their highest version) and
:class:`Watcher` (a Watch that reopens itself, resuming with the versions held);
:class:`RoomWatcher` (a room's members and signals, in a :class:`RoomView`) and
:class:`RoomCountsWatcher` (many rooms' counts, in a :class:`RoomCountsView`).

The change feed: :class:`ChangesConsumer` (batches handed out until committed,
resuming after the cursor a :class:`CursorStore` holds).

The messages and the raw stub are ``presenced.pb`` and ``presenced.PresenceStub``.
"""

from presenced._proto.presence.v1 import presence_pb2 as pb
from presenced._proto.presence.v1.presence_pb2_grpc import PresenceStub
from presenced.channel import open_channel
from presenced.errors import PresenceError
from presenced.changes import (
    ChangeBatch,
    ChangesConsumer,
    ChangesOutOfRange,
    CursorStore,
    FileCursorStore,
    MemoryCursorStore,
    cursor_from_hex,
    cursor_to_hex,
)
from presenced.cluster import ClusterLeases, slot_of
from presenced.leases import LeaseChannel, Leases, Session
from presenced.rooms import MAX_WATCHED_ROOMS, RoomCountsView, RoomCountsWatcher, RoomView, RoomWatcher
from presenced.viewer import ViewerStore, Watcher

__all__ = [
    "MAX_WATCHED_ROOMS",
    "ChangeBatch",
    "ChangesConsumer",
    "ChangesOutOfRange",
    "ClusterLeases",
    "CursorStore",
    "FileCursorStore",
    "LeaseChannel",
    "Leases",
    "MemoryCursorStore",
    "PresenceError",
    "PresenceStub",
    "RoomCountsView",
    "RoomCountsWatcher",
    "RoomView",
    "RoomWatcher",
    "Session",
    "ViewerStore",
    "Watcher",
    "cursor_from_hex",
    "cursor_to_hex",
    "open_channel",
    "slot_of",
    "pb",
]
