"""The gateway side against a real presenced: leases on one stream, sessions
that renew, take their lease again, stop when superseded, shed renewals
first when the queue is full, and a stream that reopens."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from conftest import SERVICE_TOKEN, Server, eventually
from presenced import LeaseChannel, PresenceError, Session, open_channel, pb
from presenced.channel import presence_stub


async def state_of(server: Server, user: str, token: str | None = None) -> pb.UserPresence:
    channel, _ = open_channel(server.addr)
    async with channel:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        answer = await presence_stub(channel).Snapshot(pb.SnapshotRequest(user_ids=[user]), metadata=metadata)
        user_presence: pb.UserPresence = answer.users[0]
        return user_presence


async def test_items_on_one_stream_register_renew_and_unregister(server: Server) -> None:
    async with LeaseChannel(server.addr) as leases:
        registered = await leases.register("alice", "s1", ttl_ms=30_000, gateway_id="gw-py")
        assert registered.changed and registered.generation > 0
        assert (await state_of(server, "alice")).state == pb.STATE_ONLINE
        # Many items at once go as few batches; each is answered to its caller.
        renewals = await asyncio.gather(
            *(leases.renew("alice", "s1", registered.generation, ttl_ms=30_000) for _ in range(200))
        )
        assert len(renewals) == 200
        gone = await leases.unregister("alice", "s1", registered.generation)
        assert gone.removed and gone.changed
        assert (await state_of(server, "alice")).state == pb.STATE_OFFLINE
        with pytest.raises(PresenceError) as unknown:
            await leases.renew("alice", "s1", registered.generation, ttl_ms=30_000)
        assert unknown.value.code == grpc.StatusCode.NOT_FOUND and unknown.value.lease_lost


async def test_a_bad_item_is_refused_naming_the_field_and_the_stream_serves_on(server: Server) -> None:
    async with LeaseChannel(server.addr) as leases:
        with pytest.raises(PresenceError) as refused:
            await leases.register("", "s1", ttl_ms=30_000)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "user_id" in refused.value.message
        assert (await leases.register("bob", "s1", ttl_ms=30_000)).changed


async def test_a_session_keeps_its_user_online_past_its_ttl_and_closes(server: Server) -> None:
    async with LeaseChannel(server.addr) as leases:
        session = Session(leases, "carol", "tab-1", ttl_ms=600)
        await session.open()
        await asyncio.sleep(1.5)
        assert (await state_of(server, "carol")).state == pb.STATE_ONLINE, "renewed within its TTL"
        closed = await session.close()
        assert closed is not None and closed.removed
        assert (await state_of(server, "carol")).state == pb.STATE_OFFLINE


async def test_a_lost_lease_is_taken_again_with_a_new_generation_and_its_rooms(server: Server) -> None:
    async with LeaseChannel(server.addr) as leases:
        session = Session(leases, "dave", "tab-1", ttl_ms=900)
        await session.open()
        await session.join("lobby")
        first = session.generation
        channel, _ = open_channel(server.addr)
        async with channel:
            stub = presence_stub(channel)
            await stub.Revoke(pb.RevokeRequest(user_id="dave"))

            async def taken_again() -> bool:
                return session.reregistered == 1 and (await state_of(server, "dave")).state == pb.STATE_ONLINE

            await eventually(taken_again, "the session registered again")
            assert session.generation != first
            room = await stub.RoomSnapshot(pb.RoomSnapshotRequest(room_id="lobby"))
            assert [member.user_id for member in room.members] == ["dave"], "its room joined again"
        await session.close()


async def test_a_superseded_session_stops_and_never_retries(server: Server) -> None:
    told: list[str] = []
    async with LeaseChannel(server.addr) as leases:
        session = Session(leases, "erin", "tab-1", ttl_ms=600, on_closed=told.append)
        await session.open()
        # Another registration of the same session (a reconnect elsewhere) takes the lease over.
        newer = await leases.register("erin", "tab-1", ttl_ms=30_000)

        async def stopped() -> bool:
            return session.closed_reason is not None

        await eventually(stopped, "the superseded session stopped")
        assert session.closed_reason is not None and "FAILED_PRECONDITION" in session.closed_reason
        assert told == [session.closed_reason]
        assert await session.close() is None, "nothing to unregister: the newer registration holds the lease"
        sessions = await presence_stub(leases._channel).ListSessions(pb.ListSessionsRequest(user_id="erin"))
        assert [s.generation for s in sessions.sessions] == [newer.generation], "the newer lease stands"


async def test_a_full_queue_sheds_renewals_first_and_refuses_what_it_cannot_shed() -> None:
    # A node that does not answer: the first batch waits to be written,
    # every item after it waits in the queue.
    leases = LeaseChannel("127.0.0.1:9", max_queued=2)
    plug = asyncio.ensure_future(leases.register("u", "s0", ttl_ms=1000))
    await asyncio.sleep(0.05)
    waiting = [
        asyncio.ensure_future(leases.renew("u", "s", 1, ttl_ms=1000)),
        asyncio.ensure_future(leases.register("u", "s2", ttl_ms=1000)),
    ]
    await asyncio.sleep(0.05)
    # A register when full: the queued renewal is shed to make room.
    third = asyncio.ensure_future(leases.register("u", "s3", ttl_ms=1000))
    await asyncio.sleep(0.05)
    with pytest.raises(PresenceError) as shed:
        await waiting[0]
    assert shed.value.shed
    # A renewal when full of registers: the renewal itself is shed.
    with pytest.raises(PresenceError) as newcomer:
        await leases.renew("u", "s", 1, ttl_ms=1000)
    assert newcomer.value.shed
    # A register when full of registers: refused at once, never waited on.
    with pytest.raises(PresenceError) as refused:
        await leases.register("u", "s4", ttl_ms=1000)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "no renewal to shed" in refused.value.message
    assert leases.shed_renewals == 2 and leases.queued == 2
    await leases.close()
    for queued in (plug, waiting[1], third):
        with pytest.raises(PresenceError) as cancelled:
            await queued
        assert cancelled.value.code == grpc.StatusCode.CANCELLED


async def test_a_broken_stream_reopens_and_what_it_did_not_answer_is_answered_once(server: Server) -> None:
    async with LeaseChannel(server.addr) as leases:
        await leases.register("frank", "s1", ttl_ms=30_000)
        await server.stop()
        # Sent while the node is down: answered once it is back.
        pending = asyncio.ensure_future(leases.register("frank", "s2", ttl_ms=30_000))
        await asyncio.sleep(0.3)
        await server.start()
        answer = await asyncio.wait_for(pending, 15)
        assert answer.changed, "the restarted node (in memory) had frank offline"
        assert leases.reopened >= 1
        assert (await state_of(server, "frank")).state == pb.STATE_ONLINE


async def test_an_item_a_node_never_answers_fails_unavailable_within_the_response_timeout() -> None:
    # Nothing listens on port 9: the stream waits to connect, and the item
    # must not wait with it for ever.
    async with LeaseChannel("127.0.0.1:9", response_timeout=0.3) as leases:
        started = asyncio.get_running_loop().time()
        with pytest.raises(PresenceError) as unanswered:
            await leases.register("hana", "s1", ttl_ms=30_000)
        assert unanswered.value.code == grpc.StatusCode.UNAVAILABLE
        assert "did not answer within 0.3 s" in unanswered.value.message
        assert asyncio.get_running_loop().time() - started < 2


async def test_a_gateway_without_its_credential_is_refused(secured: Server) -> None:
    async with LeaseChannel(secured.addr, token="not-the-token") as leases:
        with pytest.raises(PresenceError) as refused:
            await leases.register("gina", "s1", ttl_ms=30_000)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    async with LeaseChannel(secured.addr, token=SERVICE_TOKEN) as leases:
        assert (await leases.register("gina", "s1", ttl_ms=30_000)).changed
