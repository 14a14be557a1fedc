"""Room watchers: the views' ordering rules, a room watcher that follows a
join, a signal and a leave on a real presenced, and a room counts watcher
that follows counts, adds and removes rooms, and reopens after the server
restarts."""

from __future__ import annotations

import grpc
import pytest

from conftest import Server, eventually
from presenced import (
    LeaseChannel,
    PresenceError,
    RoomCountsView,
    RoomCountsWatcher,
    RoomView,
    RoomWatcher,
    pb,
)


def member_change(user_id: str, kind: int, version: int) -> pb.RoomMemberChange:
    return pb.RoomMemberChange(
        room_id="r", version=version, kind=kind, member=pb.RoomMember(user_id=user_id, sessions=1)  # type: ignore[arg-type]
    )


def count(room_id: str, version: int, users: int) -> pb.RoomCount:
    return pb.RoomCount(room_id=room_id, version=version, users=users, sessions=users)


def test_a_room_view_applies_changes_newer_than_what_it_holds() -> None:
    view = RoomView("r")
    view.apply_snapshot(pb.RoomSnapshot(room_id="r", version=10, members=[pb.RoomMember(user_id="alice")]))
    assert not view.apply_change(member_change("bob", pb.ROOM_CHANGE_JOINED, 10)), "in the snapshot already"
    assert view.apply_change(member_change("bob", pb.ROOM_CHANGE_JOINED, 12))
    assert view.apply_change(member_change("bob", pb.ROOM_CHANGE_LEFT, 13))
    assert not view.apply_change(member_change("bob", pb.ROOM_CHANGE_JOINED, 12)), "a delayed join after the leave"
    assert view.member("bob") is None and view.member("alice") is not None and view.version == 13
    typing = pb.SignalSet(room_id="r", version=14, kind="typing", user_ids=["alice"], count=1)
    assert view.apply_signals(typing)
    assert not view.apply_signals(pb.SignalSet(room_id="r", version=11, kind="typing"))
    assert view.signalling("typing") == ["alice"] and view.signal_count("typing") == 1
    # A resync is authoritative even at a lower version (a restarted node).
    view.apply(pb.RoomEvent(snapshot=pb.RoomSnapshot(room_id="r", version=2)))
    assert len(view) == 0 and view.version == 2 and view.signals() == []
    assert view.apply_change(member_change("bob", pb.ROOM_CHANGE_JOINED, 3))


def test_a_room_counts_view_never_goes_back_but_takes_an_unknown_room() -> None:
    view = RoomCountsView(["a", "b"])
    view.replace([count("a", 5, 2), count("z", 1, 1)])
    assert view.get("a") == count("a", 5, 2) and view.get("z") is None and view.get("b") is None
    assert view.merge([count("a", 4, 9), count("a", 5, 2), count("b", 1, 1)]) == [count("b", 1, 1)]
    assert view.apply(count("a", 0, 0)), "version 0: an unknown room, as it is now"
    view.remove(["b"])
    assert not view.apply(count("b", 9, 9)) and view.room_ids == ["a"]
    view.replace([count("a", 1, 1)])
    assert view.get("a") == count("a", 1, 1), "a resync replaces at a lower version"


async def test_a_room_watcher_sees_a_join_a_signal_and_a_leave(server: Server) -> None:
    events: list[str] = []
    async with RoomWatcher(
        server.addr, "lobby", on_change=lambda view, event: events.append(str(event.WhichOneof("event")))
    ) as watcher:
        assert len(watcher.view) == 0 and events == ["snapshot"]
        async with LeaseChannel(server.addr) as leases:
            generation = (await leases.register("alice", "s1", ttl_ms=30_000)).generation
            await leases.join("alice", "s1", generation, "lobby", {"cursor": "p3"})

            async def joined() -> pb.RoomMember | None:
                return watcher.view.member("alice")

            member = await eventually(joined, "alice shown in the room")
            assert dict(member.metadata) == {"cursor": "p3"} and member.sessions == 1
            await leases.signal("alice", "s1", generation, "lobby", "typing", ttl_ms=5_000)

            async def typing() -> bool:
                return watcher.view.signalling("typing") == ["alice"]

            await eventually(typing, "alice shown typing")
            await leases.leave("alice", "s1", generation, "lobby")

            async def left() -> bool:
                return "alice" not in watcher.view

            await eventually(left, "alice's leave shown")
            assert events[:2] == ["snapshot", "change"] and events.count("change") >= 2
            assert watcher.opened == 1 and watcher.running


async def test_a_room_counts_watcher_follows_counts_and_reopens_after_the_server_restarts(server: Server) -> None:
    resyncs: list[int] = []
    watcher = RoomCountsWatcher(
        server.addr,
        ["a", "b"],
        count_interval_ms=100,
        on_change=lambda view, counts, resynced: resyncs.append(len(counts)) if resynced else None,
    )
    async with watcher:
        assert watcher.watch_id and resyncs == [2]

        def users(room_id: str) -> int | None:
            held = watcher.view.get(room_id)
            return held.users if held is not None else None

        async with LeaseChannel(server.addr) as leases:
            alice = (await leases.register("alice", "s1", ttl_ms=30_000)).generation
            bob = (await leases.register("bob", "s1", ttl_ms=30_000)).generation
            await leases.join("alice", "s1", alice, "a")
            await leases.join("bob", "s1", bob, "a")
            await leases.join("bob", "s1", bob, "c")

            async def two_in_a() -> bool:
                return users("a") == 2 and users("b") == 0

            await eventually(two_in_a, "two users counted in room a")
            await watcher.update(add=["c"], remove=["b"])
            assert watcher.room_ids == ["a", "c"] and not watcher.view.watches("b")

            async def one_in_c() -> bool:
                return users("c") == 1

            await eventually(one_in_c, "the added room's count")
            assert watcher.opened == 1, "updated on the open stream, not reopened"
            await leases.leave("alice", "s1", alice, "a")

            async def one_in_a() -> bool:
                return users("a") == 1

            await eventually(one_in_a, "alice's leave counted")

            first_watch = watcher.watch_id
            await server.restart()
            # The restarted node (in memory) holds nobody: the reopened
            # stream's first message, with the rooms watched now, replaces the view.

            async def reopened() -> bool:
                return watcher.opened >= 2 and users("a") == 0 and users("c") == 0

            await eventually(reopened, "the watch reopened on the restarted node", within=20)
            assert watcher.watch_id != first_watch and watcher.view.get("b") is None
            alice = (await leases.register("alice", "s1", ttl_ms=30_000)).generation
            await leases.join("alice", "s1", alice, "c")

            async def counted_again() -> bool:
                return users("c") == 1

            await eventually(counted_again, "a join counted on the reopened watch", within=20)
            with pytest.raises(PresenceError) as refused:
                await watcher.update(remove=["a", "c"])
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert watcher.room_ids == ["a", "c"]


async def test_a_refused_room_counts_watch_raises_from_ready(server: Server) -> None:
    watcher = RoomCountsWatcher(server.addr, ["a"], count_interval_ms=5)  # below the least interval
    watcher.start()
    with pytest.raises(PresenceError) as refused:
        await watcher.ready()
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert watcher.last_error is refused.value and not watcher.running
    await watcher.close()
