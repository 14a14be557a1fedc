/** Rooms against a real presenced: joins, member events, signals, counts. */
import assert from "node:assert/strict";
import { createHmac } from "node:crypto";
import { test } from "node:test";

import { RoomCountWatcher, RoomWatcher, Session, pb, type RoomWatcherEvent } from "../src/index.js";
import { connectLeaseChannel } from "../src/node.js";
import { TEST_TIMEOUT_MS, Server, fastReconnect, withDeadline } from "./helpers.js";

const next = async (watcher: RoomWatcher, what: string): Promise<RoomWatcherEvent> => {
  const event = await withDeadline(watcher.next(), what);
  assert.ok(event !== undefined, `${what}: the watch ended (${watcher.lastError?.message})`);
  return event;
};

test("R1/S3: a session joins, signals and leaves, and a room watcher sees each step", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url);
  try {
    const watcher = await RoomWatcher.open(server.transport, "doc-7", { reconnect: fastReconnect() });
    assert.equal(watcher.view.size, 0);
    const counts = await RoomCountWatcher.open(server.transport, "doc-7", 100, { reconnect: fastReconnect() });
    const session = await Session.register(channel, { userId: "ann", sessionId: "tab-1", gatewayId: "g" });

    const joined = await session.join("doc-7", { cursor: "p3" });
    assert.equal(joined.changed, true);
    assert.deepEqual(session.rooms(), ["doc-7"]);
    const join = await next(watcher, "the join");
    assert.equal(join.kind, "change");
    const change = (join as { change: pb.RoomMemberChange }).change;
    assert.equal(change.kind, pb.RoomChangeKind.ROOM_CHANGE_JOINED);
    assert.equal(watcher.view.member("ann")?.metadata["cursor"], "p3");
    assert.equal(watcher.view.version, joined.roomVersion);
    const counted = await withDeadline(counts.next(), "a count of one");
    assert.deepEqual([counted?.users, counted?.sessions], [1, 1]);

    await session.signal("doc-7", "typing", 3000);
    const typing = await next(watcher, "the signal");
    assert.equal(typing.kind, "signals");
    assert.deepEqual(watcher.view.signalling("typing"), ["ann"]);

    const left = await session.leave("doc-7");
    assert.deepEqual([left.removed, left.changed], [true, true]);
    assert.deepEqual(session.rooms(), []);
    // Leaving clears the member's signals too; wait for the member itself to go.
    for (;;) {
      const event = await next(watcher, "the leave");
      if (event.kind === "change") {
        assert.equal(event.change.kind, pb.RoomChangeKind.ROOM_CHANGE_LEFT);
        break;
      }
    }
    assert.equal(watcher.view.member("ann"), undefined);
    const emptied = await withDeadline(counts.next(), "a count of zero");
    assert.deepEqual([emptied?.users, emptied?.sessions], [0, 0]);
    watcher.close();
    counts.close();
    await session.close();
  } finally {
    channel.close();
    await server.kill();
  }
});

test("R1: a session whose lease ends leaves its rooms, and the watcher sees it go", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url);
  try {
    const watcher = await RoomWatcher.open(server.transport, "lobby", { reconnect: fastReconnect() });
    const session = await Session.register(channel, { userId: "bo", sessionId: "s", gatewayId: "g" });
    await session.join("lobby");
    assert.equal((await next(watcher, "the join")).kind, "change");
    await session.close();
    const gone = await next(watcher, "the leave");
    assert.equal(gone.kind, "change");
    assert.equal(watcher.view.size, 0);
    watcher.close();
  } finally {
    channel.close();
    await server.kill();
  }
});

/** A viewer's HS256 JWT for `sub`, expiring `secs` from now. */
const viewerJwt = (secret: string, sub: string, secs: number): string => {
  const encode = (value: object): string => Buffer.from(JSON.stringify(value)).toString("base64url");
  const body = `${encode({ alg: "HS256", typ: "JWT" })}.${encode({ sub, exp: Math.floor(Date.now() / 1000) + secs })}`;
  return `${body}.${createHmac("sha256", secret).update(body).digest("base64url")}`;
};

test("T3: a room watcher with a token provider outlives its tokens", { timeout: TEST_TIMEOUT_MS }, async () => {
  const secret = "a-js-test-only-hs256-secret-of-32-bytes-or-more";
  const service = "service-token-for-js-room-token-tests";
  const server = await Server.start(["--service-token", service, "--viewer-jwt-hs256-secret", secret]);
  const channel = connectLeaseChannel(server.url, { bearerToken: service });
  let fetched = 0;
  const tokenProvider = async (): Promise<string> => {
    fetched++;
    return viewerJwt(secret, "ann", 1);
  };
  try {
    const ann = await Session.register(channel, { userId: "ann", sessionId: "tab-1", gatewayId: "g" });
    await ann.join("doc-9");
    const watcher = await RoomWatcher.open(server.transport, "doc-9", { reconnect: fastReconnect(), tokenProvider });
    assert.ok(watcher.view.member("ann") !== undefined, "ann sees herself in the room");
    // Past two expiries, the watch is still open and sees a newcomer.
    await new Promise((resolve) => setTimeout(resolve, 2_500));
    const everyone = { userId: "bob", visibility: pb.Visibility.EVERYONE };
    await server.client.setVisibility(everyone, { headers: { authorization: `Bearer ${service}` } });
    const bob = await Session.register(channel, { userId: "bob", sessionId: "tab-1", gatewayId: "g" });
    await bob.join("doc-9");
    // As a change, or in the snapshot of a reopen that came after the join.
    while (watcher.view.member("bob") === undefined) await next(watcher, "bob's join");
    assert.ok(fetched >= 2, `a token for the opening, and a fresh one after the expiry: ${fetched}`);
    watcher.close();
    await bob.close();
    await ann.close();
  } finally {
    channel.close();
    await server.kill();
  }
});
