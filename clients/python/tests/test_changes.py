"""The change feed's consumer against a real presenced: flips in order, a
resume from the stored cursor across consumers, an uncommitted batch handed
out again, and a cursor past retention refused with the oldest cursor."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator

import grpc
import pytest

from conftest import SERVICE_TOKEN, Server, eventually
from presenced import (
    ChangeBatch,
    ChangesConsumer,
    ChangesOutOfRange,
    FileCursorStore,
    LeaseChannel,
    MemoryCursorStore,
    PresenceError,
    cursor_from_hex,
    cursor_to_hex,
    pb,
)
from presenced.channel import presence_stub

ONLINE, OFFLINE = pb.STATE_ONLINE, pb.STATE_OFFLINE


def flips(batch: ChangeBatch) -> list[tuple[str, int]]:
    return [(event.flip.user_id, event.flip.state) for event in batch.events if event.WhichOneof("event") == "flip"]


async def flips_until(consumer: ChangesConsumer, count: int, within: float = 10.0) -> list[tuple[str, int]]:
    """Batches, each committed, until ``count`` flips came (no more)."""
    seen: list[tuple[str, int]] = []
    while len(seen) < count:
        batch = await asyncio.wait_for(consumer.next_batch(), within)
        assert batch.events and batch.cursor >= batch.events[-1].cursor
        cursors = [event.cursor for event in batch.events]
        assert cursors == sorted(cursors) and len(set(cursors)) == len(cursors), "in cursor order"
        seen += flips(batch)
        await consumer.commit()
    assert len(seen) == count, seen
    return seen


async def no_batch(consumer: ChangesConsumer, wait: float = 0.5) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(consumer.next_batch(), wait)


async def online(leases: LeaseChannel, *users: str) -> dict[str, int]:
    """Registers one session of each user, one after the other: their generations."""
    return {user: (await leases.register(user, "s", ttl_ms=60_000)).generation for user in users}


def test_a_cursor_reads_back_from_its_hex_and_other_text_is_refused() -> None:
    cursor = bytes(range(13))
    assert cursor_from_hex(cursor_to_hex(cursor)) == cursor
    assert cursor_from_hex(cursor_to_hex(cursor).upper()) == cursor
    for text in ("", "abc", "zz", "0 1"):
        with pytest.raises(ValueError):
            cursor_from_hex(text)


async def test_a_file_store_holds_nothing_until_a_save_then_the_last_cursor(tmp_path: pathlib.Path) -> None:
    store = FileCursorStore(tmp_path / "cursor")
    assert await store.load() is None
    await store.save(b"\x01\x02")
    await store.save(b"\xab\xcd\xef")
    assert (tmp_path / "cursor").read_text() == "abcdef\n"
    assert await store.load() == b"\xab\xcd\xef"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cursor"], "no temporary file left"
    (tmp_path / "cursor").write_text("not hex\n")
    with pytest.raises(ValueError, match="cursor"):
        await store.load()


async def test_flips_come_in_order_and_a_new_consumer_resumes_after_the_committed_cursor(
    server: Server, tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "cursor"
    async with LeaseChannel(server.addr) as leases:
        # Open (the server answered) before the flips: "now" is before them.
        async with ChangesConsumer(server.addr, FileCursorStore(path), kinds=[pb.CHANGE_KIND_FLIP]) as consumer:
            generations = await online(leases, "alice", "bob", "carol")
            await leases.unregister("alice", "s", generations["alice"])
            seen = await flips_until(consumer, 4)
            assert seen == [("alice", ONLINE), ("bob", ONLINE), ("carol", ONLINE), ("alice", OFFLINE)]
            assert consumer.committed_cursor is not None
            assert cursor_from_hex(path.read_text().strip()) == consumer.committed_cursor
        # While no consumer reads.
        await leases.unregister("bob", "s", generations["bob"])
        await leases.unregister("carol", "s", generations["carol"])
        async with ChangesConsumer(server.addr, FileCursorStore(path), kinds=[pb.CHANGE_KIND_FLIP]) as resumed:
            assert await flips_until(resumed, 2) == [("bob", OFFLINE), ("carol", OFFLINE)], "nothing committed again"
            await no_batch(resumed)


async def test_an_uncommitted_batch_is_handed_out_again_here_and_to_the_next_consumer(server: Server) -> None:
    store = MemoryCursorStore()
    async with LeaseChannel(server.addr) as leases:
        consumer = ChangesConsumer(server.addr, store, start="oldest", kinds=[pb.CHANGE_KIND_FLIP])
        await online(leases, "u1", "u2")
        assert await flips_until(consumer, 2) == [("u1", ONLINE), ("u2", ONLINE)]
        committed = store.cursor
        await online(leases, "u3")
        batch = await asyncio.wait_for(consumer.next_batch(), 10)
        assert flips(batch) == [("u3", ONLINE)]
        again = await asyncio.wait_for(consumer.next_batch(), 10)
        assert (again.events, again.cursor) == (batch.events, batch.cursor), "not committed: the same batch"
        assert store.cursor == committed
        await consumer.close()
        with pytest.raises(Exception, match="closed"):
            await consumer.next_batch()

        async with ChangesConsumer(server.addr, store, kinds=[pb.CHANGE_KIND_FLIP]) as successor:
            redelivered = await asyncio.wait_for(successor.next_batch(), 10)
            assert redelivered.events[0] == batch.events[0], "the same event, with its cursor"
            await successor.commit()
            assert store.cursor == redelivered.cursor
            await online(leases, "u4")
            assert await flips_until(successor, 1) == [("u4", ONLINE)]


async def test_a_consumer_in_a_loop_ends_when_closed(server: Server) -> None:
    consumer = ChangesConsumer(server.addr, MemoryCursorStore(), kinds=[pb.CHANGE_KIND_FLIP])
    seen: list[tuple[str, int]] = []

    async def handle(batch: ChangeBatch) -> None:
        seen.extend(flips(batch))

    running = asyncio.ensure_future(consumer.run(handle))
    async with LeaseChannel(server.addr) as leases:

        async def delivered() -> bool:
            # From "now": flips made before the stream opened are not seen.
            await online(leases, f"loop-{len(seen)}-{asyncio.get_running_loop().time()}")
            return bool(seen)

        await eventually(delivered, "a flip handled by run")
    await consumer.close()
    await asyncio.wait_for(running, 5)


async def test_a_consumer_reopens_after_its_cursor_and_a_restarted_in_memory_node_refuses_it(server: Server) -> None:
    store = MemoryCursorStore()
    async with LeaseChannel(server.addr) as leases, ChangesConsumer(server.addr, store) as consumer:
        await online(leases, "alice")
        await flips_until(consumer, 1)
        await server.restart()
        # The server ends the feed as it stops; the reopen, after the
        # committed cursor, reaches a node whose feed began after it.
        with pytest.raises(ChangesOutOfRange) as refused:
            await asyncio.wait_for(consumer.next_batch(), 20)
        assert consumer.opened >= 2
        await consumer.resume_from(refused.value.oldest_cursor)
        await online(leases, "bob")
        assert await flips_until(consumer, 1) == [("bob", ONLINE)]


async def test_a_wrong_token_is_refused_and_a_token_function_is_asked_again(secured: Server) -> None:
    refused = ChangesConsumer(secured.addr, MemoryCursorStore(), token="not-the-token")
    with pytest.raises(PresenceError) as refusal:
        await asyncio.wait_for(refused.next_batch(), 10)
    assert refusal.value.code == grpc.StatusCode.UNAUTHENTICATED
    await refused.close()

    asked: list[str] = []

    async def token() -> str:
        # A stale token first: refused, then asked again.
        asked.append("not-the-token" if not asked else SERVICE_TOKEN)
        return asked[-1]

    async with LeaseChannel(secured.addr, token=SERVICE_TOKEN) as leases:
        consumer = ChangesConsumer(secured.addr, MemoryCursorStore(), token=token, start="oldest")
        await online(leases, "alice")
        assert await flips_until(consumer, 1) == [("alice", ONLINE)]
        assert asked == ["not-the-token", SERVICE_TOKEN]
        await consumer.close()


@pytest.fixture
async def short_feed() -> AsyncIterator[Server]:
    # Without a data directory the feed is in memory; 4 KiB holds a few dozen changes.
    running = Server("--feed-retention-bytes", "4096")
    await running.start()
    yield running
    await running.stop()


async def test_a_cursor_past_retention_is_refused_naming_the_oldest_cursor(short_feed: Server) -> None:
    store = MemoryCursorStore()
    async with LeaseChannel(short_feed.addr) as leases:
        async with ChangesConsumer(short_feed.addr, store) as consumer:
            await online(leases, "first")
            await flips_until(consumer, 1)
        assert store.cursor is not None
        stale = store.cursor

        users = [f"user-{i:03}" for i in range(150)]
        generations = await asyncio.gather(*(leases.register(user, "s", ttl_ms=60_000) for user in users))
        await asyncio.gather(
            *(leases.unregister(user, "s", answer.generation) for user, answer in zip(users, generations))
        )
        # The feed is in order: once a flip made after them is seen, they are all in it.
        async with ChangesConsumer(short_feed.addr, MemoryCursorStore(), id_prefix="sentinel") as sentinel:
            await online(leases, "sentinel")
            await flips_until(sentinel, 1)

    consumer = ChangesConsumer(short_feed.addr, store)
    with pytest.raises(ChangesOutOfRange) as refused:
        await asyncio.wait_for(consumer.next_batch(), 10)
    assert refused.value.code == grpc.StatusCode.OUT_OF_RANGE
    oldest = refused.value.oldest_cursor
    assert len(oldest) == len(stale) and oldest > stale
    assert cursor_to_hex(oldest) in str(refused.value)
    with pytest.raises(ChangesOutOfRange):
        await asyncio.wait_for(consumer.next_batch(), 10)  # not retried: asked again, the same answer
    assert store.cursor == stale, "nothing saved"

    # The caller resyncs (a Snapshot), then resumes at the oldest change retained.
    await consumer.resume_from(oldest)
    assert store.cursor == oldest
    resumed = await asyncio.wait_for(consumer.next_batch(), 10)
    channel = grpc.aio.insecure_channel(short_feed.addr)
    from_oldest = pb.ChangesRequest()
    setattr(from_oldest, "from", pb.CHANGES_FROM_OLDEST)
    raw = presence_stub(channel).Changes(from_oldest)
    first_retained = await asyncio.wait_for(raw.read(), 10)
    raw.cancel()
    await channel.close()
    assert resumed.events[0] == first_retained, "at the oldest change retained"
    await consumer.close()
