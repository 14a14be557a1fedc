"""The Python client's driver of the client conformance suite.

``python driver.py RUN_FILE``: reads the run file, does what its ``client``
section says with the client's public API only (``from presenced import
...``), and prints its report as the last line of stdout, one JSON object.
Exit status 0, or 1 with ``{"error": "..."}`` when it could not do it. The
protocol and the kinds are in ``clients/conformance/README.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from presenced import (
    ChangesConsumer,
    ChangesOutOfRange,
    ClusterLeases,
    LeaseChannel,
    MemoryCursorStore,
    PresenceError,
    Session,
    Watcher,
    pb,
)

#: How often the session's generation is looked at.
POLL = 0.01
#: The longest the driver waits for its channels to close before it reports anyway.
CLOSE_WAIT = 3.0
#: The gateway every registration names (the suite checks none).
GATEWAY_ID = "conformance-python"

Report = dict[str, Any]


class Failed(Exception):
    """What the driver could not do: the report's ``error``, with what it saw before (``seen``)."""

    def __init__(self, message: str, seen: Report | None = None) -> None:
        super().__init__(message)
        self.seen = seen or {}


def address(target: str) -> str:
    """``host:port``: the Python client takes an address without ``http://``."""
    return target.removeprefix("http://").rstrip("/")


def token_provider(tokens: Sequence[str]) -> Callable[[], str]:
    """The first token at the first call, the next at each call after, the last for ever."""
    given = 0

    def token() -> str:
        nonlocal given
        chosen = tokens[min(given, len(tokens) - 1)]
        given += 1
        return chosen

    return token


def field(section: dict[str, Any], name: str) -> Any:
    if name not in section:
        raise Failed(f"client.{name} is missing")
    return section[name]


async def closing(close: Callable[[], Any]) -> None:
    """Closes something of the client within ``CLOSE_WAIT``; a failure only logged."""
    try:
        await asyncio.wait_for(close(), CLOSE_WAIT)
    except Exception as err:  # noqa: BLE001 - closing must not hide the report
        print(f"closing failed: {err!r}", file=sys.stderr)


async def run_session(target: str, tokens: Sequence[str], client: dict[str, Any]) -> Report:
    run = float(field(client, "run_ms")) / 1000
    channel = LeaseChannel(address(target), token=tokens[0] if tokens else None, gateway_id=GATEWAY_ID)
    ended = asyncio.Event()

    def on_closed(reason: str) -> None:
        print(f"the session ended by itself: {reason}", file=sys.stderr)
        ended.set()

    session = Session(
        channel,
        str(field(client, "user_id")),
        str(field(client, "session_id")),
        ttl_ms=int(field(client, "ttl_ms")),
        renew_every=float(field(client, "renew_every_ms")) / 1000,
        jitter=0.0,
        on_closed=on_closed,
    )
    generations: list[int] = []

    def look() -> None:
        if session.generation and (not generations or generations[-1] != session.generation):
            generations.append(session.generation)

    closed_by_driver = False
    try:
        try:
            await session.open()
        except PresenceError as err:
            raise Failed(f"the session's registration failed: {err}") from err
        look()
        deadline = time.monotonic() + run
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(POLL, left))
            look()
        look()
        if client.get("close"):
            closed_by_driver = True
            try:
                await session.close()
            except PresenceError as err:
                # Closed all the same (it renews no more); the unregistration's refusal is told.
                print(f"the session's unregistration failed: {err}", file=sys.stderr)
            look()
    finally:
        # Without `close` the lease is left to expire: the renewals stop with the channel.
        await closing(channel.close)
    closed = closed_by_driver or ended.is_set() or session.closed_reason is not None
    return {"state": "closed" if closed else "open", "generations": generations}


async def run_cluster_items(target: str, tokens: Sequence[str], client: dict[str, Any]) -> Report:
    leases = ClusterLeases(
        [address(target)],
        slots=int(field(client, "slots")),
        move_budget=float(field(client, "move_wait_ms")) / 1000,
        token=tokens[0] if tokens else None,
        gateway_id=GATEWAY_ID,
    )
    results: list[Report] = []
    try:
        for item in field(client, "items"):
            try:
                answer = await leases.register(
                    str(item["user_id"]), str(item["session_id"]), ttl_ms=int(item["ttl_ms"])
                )
            except PresenceError as err:
                results.append({"code": err.code.name})
            else:
                results.append({"code": "OK", "generation": answer.generation})
    finally:
        await closing(leases.close)
    return {"results": results}


def state_name(state: int) -> str:
    """``ONLINE``, ``OFFLINE`` (``UNSPECIFIED`` should never be held)."""
    return pb.State.Name(state).removeprefix("STATE_")


async def run_watch(target: str, tokens: Sequence[str], client: dict[str, Any]) -> Report:
    run = float(field(client, "run_ms")) / 1000
    watcher = Watcher(
        address(target),
        [str(user_id) for user_id in field(client, "user_ids")],
        token=token_provider(tokens) if tokens else None,
        viewer_id=str(client.get("viewer_id", "")),
    )
    deadline = time.monotonic() + run
    try:
        watcher.start()
        try:
            await watcher.ready(timeout=run)
        except TimeoutError:
            print(f"no snapshot within run_ms ({run} s)", file=sys.stderr)
        except PresenceError:
            pass  # in last_error, below
        left = deadline - time.monotonic()
        if watcher.running and left > 0:
            await asyncio.sleep(left)
        stopped = watcher.last_error
        users = {
            user_id: {"state": state_name(user.state), "version": user.version}
            for user_id, user in sorted(watcher.store.users.items())
        }
    finally:
        await closing(watcher.close)
    if stopped is not None:
        # A watch the client gave up on did not stay open for run_ms: a failure, with what it held.
        raise Failed(f"the Watch stopped: {stopped.code.name}: {stopped.message}", {"users": users})
    return {"users": users}


async def run_feed(target: str, tokens: Sequence[str], client: dict[str, Any]) -> Report:
    run = float(field(client, "run_ms")) / 1000
    cursor_hex = client.get("cursor_hex")
    store = MemoryCursorStore(bytes.fromhex(cursor_hex) if cursor_hex else None)
    consumer = ChangesConsumer(address(target), store, token=token_provider(tokens) if tokens else None)
    events = 0
    deadline = time.monotonic() + run
    report: Report = {}
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                batch = await asyncio.wait_for(consumer.next_batch(), left)
            except asyncio.TimeoutError:
                break
            except ChangesOutOfRange as err:
                # Being told is the required reaction: a report, not a failure.
                report["error"] = {"code": "OUT_OF_RANGE", "oldest_cursor_hex": err.oldest_cursor.hex()}
                break
            except PresenceError as err:
                raise Failed(f"the feed failed: {err}", {"events": events}) from err
            events += len(batch.events)
            await consumer.commit()
    finally:
        await closing(consumer.close)
    return {"events": events, **report}


KINDS = {
    "session": run_session,
    "cluster_items": run_cluster_items,
    "watch": run_watch,
    "feed": run_feed,
}


async def drive(run: dict[str, Any]) -> Report:
    client = run.get("client")
    if not isinstance(client, dict):
        raise Failed("the run file has no client section")
    kind = client.get("kind")
    if kind not in KINDS:
        raise Failed(f"client.kind {kind!r} is not one of {sorted(KINDS)}")
    target = run.get("target")
    if not isinstance(target, str):
        raise Failed("the run file has no target")
    tokens = [str(token) for token in run.get("tokens") or []]
    return await KINDS[kind](target, tokens, client)


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    if len(argv) != 2:
        print(json.dumps({"error": f"usage: {argv[0] if argv else 'driver.py'} RUN_FILE"}))
        return 1
    try:
        with open(argv[1], encoding="utf-8") as file:
            run = json.load(file)
        if not isinstance(run, dict):
            raise Failed("the run file is not a JSON object")
        report = asyncio.run(drive(run))
        status = 0
    except Failed as err:
        report, status = {**err.seen, "error": str(err)}, 1
    except Exception as err:  # noqa: BLE001 - every failure is a report
        report, status = {"error": f"{type(err).__name__}: {err}"}, 1
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps(report), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
