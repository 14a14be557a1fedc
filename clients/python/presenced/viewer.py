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

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from presenced._proto.presence.v1 import presence_pb2 as pb
from presenced.channel import Target
from presenced.streams import Metadata, ReopeningWatch, Token


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


class Watcher(ReopeningWatch[pb.WatchEvent]):
    """A Watch of ``user_ids`` that reopens itself, feeding a :class:`ViewerStore`,
    resuming with the versions it holds (``known_versions``).

    ``on_change(store, event)`` is called after each event is applied. A
    refusal no reopening fixes (a fixed token's expiry, a viewer that may not
    watch) ends it: :meth:`ready` raises it as a :class:`~presenced.PresenceError`,
    and ``last_error`` holds it. Stop it with :meth:`close` (or ``async with``).
    """

    _name = "the Watch"

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
        super().__init__(target, token=token, ca=ca, cert=cert, key=key)
        self.user_ids = list(dict.fromkeys(user_ids))
        self.viewer_id = viewer_id
        self.store = store if store is not None else ViewerStore()
        self.on_change = on_change

    def _open(self, metadata: Metadata) -> Any:
        request = pb.WatchRequest(
            user_ids=self.user_ids, viewer_id=self.viewer_id, known_versions=self.store.known_versions()
        )
        return self._stub.Watch(request, metadata=metadata, wait_for_ready=True)

    def _received(self, message: pb.WatchEvent, first: bool) -> None:
        self.store.apply(message, watched=self.user_ids)
        if self.on_change is not None:
            self.on_change(self.store, message)


def snapshot_map(users: Iterable[pb.UserPresence]) -> Mapping[str, pb.UserPresence]:
    """Users by id."""
    return {user.user_id: user for user in users}
