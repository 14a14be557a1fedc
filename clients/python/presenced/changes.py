"""The change feed's resumable consumer (F1, F2): ``Changes`` read in
batches, each batch's cursor saved to a store the caller provides once the
caller has processed the batch, and every reopen resuming after the cursor
saved last. The same design as the Rust client's ``ChangesConsumer`` and the
TypeScript client's.

Delivery is at least once, identified by cursor: a batch is handed out again
until it is committed, so a consumer that dies (or fails) between processing
a batch and committing it sees that batch again, with the same cursors, and
nothing that was committed. Processing made idempotent by cursor (or by user
and version) is then exactly once.

A cursor the feed no longer retains is not retried: it is a
:class:`ChangesOutOfRange` with the oldest cursor the feed holds, for the
caller to resync from a ``Snapshot`` and :meth:`ChangesConsumer.resume_from`
it. A ``gap`` (changes the feed lost) is an event like the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Union

import grpc
from google.protobuf import any_pb2

from presenced._proto.presence.v1 import presence_pb2 as pb
from presenced.channel import Target, open_channel, presence_stub
from presenced.errors import PresenceError
from presenced.streams import (
    MAX_REFUSED_FRESH_CREDENTIALS,
    PERMANENT_CODES,
    Token,
    bearer_metadata,
    log,
    refusal,
    reopen_delay,
)

#: The type URL of the ``ChangesOutOfRange`` detail of an ``OUT_OF_RANGE`` refusal.
OUT_OF_RANGE_TYPE_URL = "type.googleapis.com/presence.v1.ChangesOutOfRange"

#: Where a consumer starts while its store holds no cursor: after the last
#: change made before it opened, at the oldest change retained, or after a cursor.
Start = Union[Literal["now", "oldest"], bytes]


class CursorStore(Protocol):
    """Where a consumer keeps the cursor of the last batch it processed. A
    store that saves to where the processing writes (a row of the database
    the consumer updates, in the same transaction) makes processing and
    cursor one step."""

    async def load(self) -> bytes | None:
        """The cursor saved last, or None when none ever was."""
        ...

    async def save(self, cursor: bytes) -> None:
        """Saves ``cursor`` in place of the one before; once it returned, a
        load (here or in a later process) returns it."""
        ...


class MemoryCursorStore:
    """A cursor in memory: for a consumer whose process keeps it, and for tests."""

    def __init__(self, cursor: bytes | None = None) -> None:
        #: The cursor saved last.
        self.cursor = cursor

    async def load(self) -> bytes | None:
        return self.cursor

    async def save(self, cursor: bytes) -> None:
        self.cursor = cursor


def cursor_to_hex(cursor: bytes) -> str:
    """A cursor as text: lowercase hex. What ``presenced changes`` prints and
    its ``--from`` takes, and what the file stores (this client's, the Rust
    and the TypeScript clients') write."""
    return cursor.hex()


_HEX = re.compile(r"[0-9a-fA-F]*")


def cursor_from_hex(text: str) -> bytes:
    """A cursor from its text form (:func:`cursor_to_hex`; upper case is
    taken too); ``ValueError`` on anything else."""
    if not text:
        raise ValueError("not a cursor: empty")
    if len(text) % 2:
        raise ValueError("not a cursor: an odd number of hex digits")
    if not _HEX.fullmatch(text):
        raise ValueError("not a cursor: only hex digits (0-9, a-f) make one")
    return bytes.fromhex(text)


class FileCursorStore:
    """The cursor in ``path``, as one line of hex (what ``presenced changes
    --cursor-file`` and the other clients' file stores read and write):
    written to ``PATH.tmp``, synced, renamed over the file, and the
    directory synced, so that a crash leaves the old cursor or the new one,
    never a torn one. A missing or empty file holds no cursor; one holding
    anything else is refused (``ValueError``), naming the file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)

    async def load(self) -> bytes | None:
        return await asyncio.to_thread(self._read)

    async def save(self, cursor: bytes) -> None:
        await asyncio.to_thread(self._write, cursor)

    def _read(self) -> bytes | None:
        try:
            text = self.path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        if not text:
            return None
        try:
            return cursor_from_hex(text)
        except ValueError as err:
            raise ValueError(f"{self.path}: {err}") from None

    def _write(self, cursor: bytes) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(temporary, "w", encoding="utf-8") as file:
                file.write(cursor_to_hex(cursor) + "\n")
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        # The rename is durable once the directory that holds the name is synced.
        if os.name == "posix":
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)


class ChangesOutOfRange(PresenceError):
    """The feed refused a cursor older than the oldest change it retains (or
    not one of its own: another server's, or from before its data directory
    was replaced); also a stream that fell behind what retention keeps. Not
    retried: resync what matters with a ``Snapshot``, then
    :meth:`ChangesConsumer.resume_from` ``oldest_cursor``."""

    def __init__(self, oldest_cursor: bytes, message: str) -> None:
        super().__init__(grpc.StatusCode.OUT_OF_RANGE, message)
        #: Resumes at the oldest change the feed holds (the refusal's ``ChangesOutOfRange`` detail).
        self.oldest_cursor = oldest_cursor

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}; the oldest cursor is {cursor_to_hex(self.oldest_cursor)}"


def status_details(err: grpc.aio.AioRpcError) -> list[any_pb2.Any]:
    """The details of a refusal: the ``google.rpc.Status`` in its
    ``grpc-status-details-bin`` trailer (read here without the googleapis
    protos: its field 3 is the repeated ``Any``)."""
    raw = next(
        (value for key, value in err.trailing_metadata() or () if key == "grpc-status-details-bin"),
        None,
    )
    if not isinstance(raw, bytes):
        return []
    details: list[any_pb2.Any] = []
    try:
        at = 0
        while at < len(raw):
            tag, at = _varint(raw, at)
            number, wire = tag >> 3, tag & 7
            if wire == 0:
                _, at = _varint(raw, at)
            elif wire == 2:
                size, at = _varint(raw, at)
                if at + size > len(raw):
                    raise ValueError("truncated")
                if number == 3:
                    details.append(any_pb2.Any.FromString(raw[at : at + size]))
                at += size
            elif wire in (1, 5):
                at += 8 if wire == 1 else 4
            else:
                raise ValueError(f"wire type {wire}")
    except Exception:  # noqa: BLE001 - a garbled trailer has no details
        return details
    return details


def _varint(raw: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(raw) or shift > 63:
            raise ValueError("a bad varint")
        byte = raw[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def changes_refusal(err: grpc.aio.AioRpcError) -> PresenceError:
    """The server's refusal of the feed: :class:`ChangesOutOfRange` with its
    oldest cursor for ``OUT_OF_RANGE``, else a :class:`~presenced.PresenceError`."""
    if err.code() == grpc.StatusCode.OUT_OF_RANGE:
        for detail in status_details(err):
            if detail.type_url == OUT_OF_RANGE_TYPE_URL:
                oldest = pb.ChangesOutOfRange.FromString(detail.value).oldest_cursor
                return ChangesOutOfRange(oldest, err.details() or "")
    return refusal(err)


@dataclass
class ChangeBatch:
    """Events that arrived together, to process and then commit as one."""

    #: In feed order: flips, status changes, room occupancy changes, and gaps
    #: (resync what matters on one); never empty. Progress events are left
    #: out, their cursors kept in ``cursor``.
    events: list[pb.ChangeEvent] = field(default_factory=list)
    #: Where the feed resumes once this batch is committed: its last event's
    #: cursor, or a later progress event's.
    cursor: bytes = b""


@dataclass
class _Ended:
    """The end of a stream, in its queue: why it broke (None: it ended)."""

    error: grpc.aio.AioRpcError | None


_Item = Union[pb.ChangeEvent, _Ended]


class _Stream:
    """One open ``Changes`` call and the task that moves what it receives
    into a bounded queue (the stream is read no faster than batches are
    taken), its end last."""

    def __init__(self, call: Any, capacity: int) -> None:
        self.call = call
        self.queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=capacity)
        #: An item taken from the queue and put back for the next batch.
        self.held: _Item | None = None
        #: Whether the stream delivered anything (it opened).
        self.delivered = False
        self.reader = asyncio.get_running_loop().create_task(self._read(), name="presenced-changes")

    async def _read(self) -> None:
        try:
            async for event in self.call:
                await self.queue.put(event)
            await self.queue.put(_Ended(None))
        except grpc.aio.AioRpcError as err:
            await self.queue.put(_Ended(err))
        except Exception:  # noqa: BLE001 - whatever else broke the stream: reopened
            log.exception("reading the change feed failed; reopening")
            await self.queue.put(_Ended(None))

    def take_ready(self) -> _Item | None:
        """An item already there, or None."""
        held, self.held = self.held, None
        if held is not None:
            return held
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def close(self) -> None:
        self.reader.cancel()
        self.call.cancel()


class ChangesConsumer:
    """A ``Changes`` consumer that resumes where its caller's processing got to.

    It opens the feed after the cursor its :class:`CursorStore` holds (or as
    ``start`` says, when the store holds none: ``"now"``, ``"oldest"``, or
    after a cursor), hands out the events that arrived together as a
    :class:`ChangeBatch` (:meth:`next_batch`), and saves the batch's cursor
    once the caller :meth:`commit`\\ s it (:meth:`run` does both around a
    handler, and ``async for`` hands out batches too). A stream that breaks
    or ends is reopened with backoff and jitter after the committed cursor;
    with a callable ``token``, one the server ended for its credentials is
    reopened at once with a fresh token. A batch handed out and not
    committed is handed out again by the next :meth:`next_batch`.

    Progress events are not handed out: a batch of nothing but progress is
    saved at once, which keeps a narrowly filtered consumer's cursor fresh.

    ``kinds``, ``id_prefix`` and ``slots`` filter the feed as
    ``ChangesRequest`` does; ``token`` is a service token with the ``feed``
    scope (or a function giving the current one, asked at each opening).

    Until the first cursor is saved, a reopen starts as ``start`` says: a
    consumer started from ``"now"`` that breaks before its first commit
    misses what happened while it was away. Start from a stored cursor (or
    ``"oldest"``) where that matters. One task at a time may use a consumer.
    """

    def __init__(
        self,
        target: Target,
        store: CursorStore,
        *,
        token: Token = None,
        start: Start = "now",
        kinds: Iterable[pb.ChangeKind] = (),
        id_prefix: str = "",
        slots: Iterable[int] = (),
        max_batch: int = 1000,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if not isinstance(start, bytes) and start not in ("now", "oldest"):
            raise ValueError(f'start is "now", "oldest" or a cursor, not {start!r}')
        self._channel, self._owns_channel = open_channel(target, ca=ca, cert=cert, key=key)
        self._stub = presence_stub(self._channel)
        self.store = store
        self.token = token
        self.start = start
        self.kinds = list(kinds)
        self.id_prefix = id_prefix
        self.slots = list(slots)
        self.max_batch = max_batch
        #: Streams opened, the first included.
        self.opened = 0
        self._loaded = False
        self._committed: bytes | None = None
        self._uncommitted: ChangeBatch | None = None
        self._stream: _Stream | None = None
        self._failures = 0
        self._refused_fresh = 0
        self._wait_before_open = False
        self._closed = False
        self._closing = asyncio.Event()

    async def __aenter__(self) -> ChangesConsumer:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __aiter__(self) -> ChangesConsumer:
        return self

    async def __anext__(self) -> ChangeBatch:
        """The next batch (commit each once processed); the loop ends once the consumer is closed."""
        if self._closed:
            raise StopAsyncIteration
        try:
            return await self.next_batch()
        except PresenceError as err:
            if self._closed and err.code == grpc.StatusCode.CANCELLED:
                raise StopAsyncIteration from None
            raise

    @property
    def committed_cursor(self) -> bytes | None:
        """The cursor the store holds, as this consumer last loaded or saved it."""
        return self._committed

    async def open(self) -> None:
        """Loads the stored cursor and opens the feed, waiting for the
        server's answer to begin: from then on, a consumer started ``"now"``
        sees every later change. Done by the first :meth:`next_batch` if not
        called; a refusal comes from :meth:`next_batch`."""
        self._check_open()
        await self._load()
        if self._stream is None:
            await self._reopen()

    async def next_batch(self) -> ChangeBatch:
        """The next batch: the events that arrived together (at most
        ``max_batch``), waiting for the first. If the batch handed out
        before was not committed, it is handed out again. Raises
        :class:`ChangesOutOfRange`, a :class:`~presenced.PresenceError` the
        server refused the feed with (bad input, credentials) or ``CANCELLED``
        once closed, or the store's error; a later call tries again."""
        self._check_open()
        await self._load()
        if self._uncommitted is not None:
            return self._uncommitted
        while True:
            stream = self._stream
            if stream is None:
                await self._reopen()
                continue
            item = await self._next_item(stream)
            if isinstance(item, _Ended):
                self._broke(stream, item.error)
                continue
            stream.delivered = True
            self._failures = self._refused_fresh = 0
            batch = await self._gather(stream, item)
            if not batch.events:
                # Nothing but progress: nothing to process, so saved now.
                if batch.cursor:
                    await self._save(batch.cursor)
                continue
            self._uncommitted = batch
            return batch

    async def commit(self) -> None:
        """Saves the cursor of the batch handed out last: the caller has
        processed it, and no later consumer of this store sees it again. If
        the store fails, the batch stays uncommitted (and is handed out again)."""
        batch = self._uncommitted
        if batch is None:
            return
        await self.store.save(batch.cursor)
        self._committed = batch.cursor
        if self._uncommitted is batch:
            self._uncommitted = None

    async def resume_from(self, cursor: bytes) -> None:
        """Saves ``cursor`` as the committed one and resumes after it: after a
        :class:`ChangesOutOfRange`, once the caller has resynced from a
        ``Snapshot``, with its ``oldest_cursor``. A batch handed out and not
        committed is dropped."""
        self._check_open()
        self._loaded = True
        self._uncommitted = None
        await self._save(cursor)
        self._drop_stream()
        self._wait_before_open = False

    async def run(self, handler: Callable[[ChangeBatch], Awaitable[None] | None]) -> None:
        """Hands every batch to ``handler`` and commits it once ``handler`` is
        done, until the consumer is closed (it returns) or something fails
        (it raises): the handler (its batch is not committed), a refusal, a
        :class:`ChangesOutOfRange`, or the store. Calling it again goes on,
        from the uncommitted batch if there is one."""
        async for batch in self:
            done = handler(batch)
            if isinstance(done, Awaitable):
                await done
            await self.commit()

    async def close(self) -> None:
        """Ends the consumer: a waiting :meth:`next_batch` raises ``CANCELLED``, and so does every later one."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._drop_stream()
        if self._owns_channel:
            await self._channel.close()

    def _check_open(self) -> None:
        if self._closed:
            raise PresenceError(grpc.StatusCode.CANCELLED, "the change feed consumer is closed")

    async def _load(self) -> None:
        if not self._loaded:
            self._committed = await self.store.load()
            self._loaded = True

    async def _save(self, cursor: bytes) -> None:
        await self.store.save(cursor)
        self._committed = cursor

    async def _until_closed(self, work: Awaitable[Any]) -> Any:
        """``work``'s result, or ``CANCELLED`` once the consumer is closed meanwhile."""
        task = asyncio.ensure_future(work)
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({task, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        self._check_open()
        raise PresenceError(grpc.StatusCode.CANCELLED, "the change feed consumer is closed")

    async def _next_item(self, stream: _Stream) -> _Item:
        ready = stream.take_ready()
        if ready is not None:
            return ready
        item: _Item = await self._until_closed(stream.queue.get())
        return item

    async def _gather(self, stream: _Stream, first: pb.ChangeEvent) -> ChangeBatch:
        """``first`` and the events that arrived with it, up to ``max_batch``;
        the stream's end, met on the way, is kept for the next call."""
        batch = ChangeBatch()
        event = first
        while True:
            if event.cursor:
                batch.cursor = event.cursor
            if event.WhichOneof("event") != "progress":
                batch.events.append(event)
            if len(batch.events) >= self.max_batch:
                return batch
            ready = stream.take_ready()
            if ready is None:
                # Only what is there already: what has not come by the next
                # turn of the event loop starts the next batch.
                await asyncio.sleep(0)
                ready = stream.take_ready()
            if ready is None:
                return batch
            if isinstance(ready, _Ended):
                stream.held = ready
                return batch
            event = ready

    async def _reopen(self) -> None:
        """Opens a stream after the committed cursor (or as ``start`` says,
        before the first commit), after a backoff if the last one broke."""
        if self._wait_before_open:
            await self._until_closed(asyncio.sleep(reopen_delay(self._failures)))
            self._failures += 1
        self._wait_before_open = True
        metadata = await self._until_closed(bearer_metadata(self.token))
        self._check_open()
        request = pb.ChangesRequest(kinds=self.kinds, id_prefix=self.id_prefix, slots=self.slots)
        start = self._committed if self._committed is not None else self.start
        if start == "now":
            setattr(request, "from", pb.CHANGES_FROM_NOW)
        elif start == "oldest":
            setattr(request, "from", pb.CHANGES_FROM_OLDEST)
        else:
            assert isinstance(start, bytes)
            setattr(request, "from", pb.CHANGES_FROM_CURSOR)
            request.cursor = start
        call = self._stub.Changes(request, metadata=metadata, wait_for_ready=True)
        self._stream = stream = _Stream(call, self.max_batch)
        self.opened += 1
        # The server answers (headers, or its refusal) once the stream is in place.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._until_closed(call.initial_metadata())
        if not call.done():
            # Open (a refusal ends the call with its answer): the next break
            # waits its backoff from the first attempt again.
            self._failures = 0

    def _broke(self, stream: _Stream, error: grpc.aio.AioRpcError | None) -> None:
        """The stream ended (``error`` None) or broke: reopen (at once, for a
        spent token), or raise the refusal."""
        delivered = stream.delivered
        self._drop_stream()
        if error is None:
            log.info("presenced ended the change feed; reopening")
            return
        code = error.code()
        if code == grpc.StatusCode.UNAUTHENTICATED and callable(self.token):
            if self._refused_fresh < MAX_REFUSED_FRESH_CREDENTIALS:
                # Ended for its credentials: a fresh token, at once; a fresh
                # one refused is retried with backoff.
                if delivered:
                    self._wait_before_open = False
                else:
                    self._refused_fresh += 1
                log.info("the change feed needs a fresh token (%s); reopening", error.details())
                return
            self._refused_fresh = 0
        if code in PERMANENT_CODES:
            log.info("the change feed was refused (%s: %s)", code.name, error.details())
            # A later call asks again, at once.
            self._wait_before_open = False
            raise changes_refusal(error)
        log.info("the change feed broke (%s: %s); reopening", code.name, error.details())

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
