/** Rooms against a real presenced: joins, member events, signals, counts, the counts of many rooms (R7). */
import assert from "node:assert/strict";
import { createHmac } from "node:crypto";
import { test } from "node:test";

import {
  RoomCountWatcher,
  RoomCountsWatcher,
  RoomWatcher,
  Session,
  pb,
  type RoomCountsEvent,
  type RoomWatcherEvent,
} from "../src/index.js";
import { connectLeaseChannel } from "../src/node.js";
import { TEST_TIMEOUT_MS, Server, fastReconnect, freePort, withDeadline } from "./helpers.js";

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

// ---- the counts of many rooms (R7) -------------------------------------------

/** The next change a room counts watcher reports, within the deadline. */
const nextCounts = async (watcher: RoomCountsWatcher, what: string): Promise<RoomCountsEvent> => {
  const event = await withDeadline(watcher.next(), what);
  assert.ok(event !== undefined, `${what}: the watch ended (${watcher.lastError?.message})`);
  return event;
};

/** The rooms of the next `counts` a watcher reports (failing on a resync). */
const changedRooms = async (watcher: RoomCountsWatcher, what: string): Promise<pb.RoomCount[]> => {
  const event = await nextCounts(watcher, what);
  assert.equal(event.kind, "counts", `${what}: ${event.kind}`);
  return (event as { counts: pb.RoomCount[] }).counts;
};

/**
 * Watchers and sessions a test opened, closed when it ends however it ends
 * (one left open would keep reconnecting or renewing, and the run would not end).
 */
const opened: RoomCountsWatcher[] = [];
const sessions: Session[] = [];
const openCounts = async (...args: Parameters<typeof RoomCountsWatcher.open>): Promise<RoomCountsWatcher> => {
  const watcher = await RoomCountsWatcher.open(...args);
  opened.push(watcher);
  return watcher;
};
const register = async (channel: Parameters<typeof Session.register>[0], userId: string, sessionId = "tab-1"): Promise<Session> => {
  const session = await Session.register(channel, { userId, sessionId, gatewayId: "g" });
  sessions.push(session);
  return session;
};
const closeAll = async (): Promise<void> => {
  for (const watcher of opened.splice(0)) watcher.close();
  await Promise.allSettled(sessions.splice(0).map((session) => withDeadline(session.close(), "a session's unregister")));
};

/** `[users, sessions]` of a count, or of none. */
const tally = (count: pb.RoomCount | undefined): [number, number] | undefined =>
  count === undefined ? undefined : [count.users, count.sessions];

test("R7: RoomCounts answers in request order, a room named twice twice, and a room the viewer may not read as an unknown one", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url);
  try {
    const tab1 = await register(channel, "ann");
    const tab2 = await register(channel, "ann", "tab-2");
    const joined = await tab1.join("doc");
    await tab2.join("doc");

    const answer = await server.client.roomCounts({ roomIds: ["empty", "doc", "doc"] });
    assert.deepEqual(
      answer.counts.map((count) => [count.roomId, count.version, count.users, count.sessions]),
      [
        ["empty", 0n, 0, 0],
        ["doc", answer.counts[1]!.version, 1, 2],
        ["doc", answer.counts[1]!.version, 1, 2],
      ],
    );
    assert.ok(answer.counts[1]!.version >= joined.roomVersion, "the room's version");
    assert.equal(answer.watchId, "", "a read names no stream");

    const stranger = await server.client.roomCounts({ roomIds: ["doc", "empty"], viewerId: "stranger" });
    assert.deepEqual(
      stranger.counts.map((count) => [count.roomId, count.version, count.users, count.sessions]),
      [
        ["doc", 0n, 0, 0],
        ["empty", 0n, 0, 0],
      ],
      "a MEMBERS room a viewer is not in is counted as an unknown room",
    );
    const member = await server.client.roomCounts({ roomIds: ["doc"], viewerId: "ann" });
    assert.deepEqual(tally(member.counts[0]), [1, 2], "a member reads it");
    await server.client.setRoomAccess({ roomId: "doc", access: pb.RoomAccess.PUBLIC });
    const open = await server.client.roomCounts({ roomIds: ["doc"], viewerId: "stranger" });
    assert.deepEqual(tally(open.counts[0]), [1, 2], "anyone reads a PUBLIC room");
  } finally {
    await closeAll();
    channel.close();
    await server.kill();
  }
});

test("R7: a room counts watcher opens with every room, and a join changes only that room's count in a later message", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url);
  const raw = new AbortController();
  try {
    const ann = await register(channel, "ann");
    await ann.join("a");
    const watcher = await openCounts(server.transport, ["a", "b", "c"], { countIntervalMs: 100, reconnect: fastReconnect() });
    assert.notEqual(watcher.watchId, "", "the first message names the stream");
    assert.deepEqual(tally(watcher.view.get("a")), [1, 1]);
    assert.deepEqual(tally(watcher.view.get("b")), [0, 0]);
    assert.deepEqual(tally(watcher.view.get("c")), [0, 0]);
    assert.equal(watcher.view.size, 3, "every room in the first message");
    const a = watcher.view.get("a");

    // The same from the wire: the first message holds every room, the next one only the room that changed.
    const stream = server.client.watchRoomCounts({ roomIds: ["a", "b", "c"], countIntervalMs: 100 }, { signal: raw.signal })[Symbol.asyncIterator]();
    const first = (await withDeadline(stream.next(), "the raw stream's first message")).value as pb.RoomCounts;
    assert.deepEqual(first.counts.map((count) => count.roomId).sort(), ["a", "b", "c"]);
    assert.notEqual(first.watchId, "");

    const bob = await register(channel, "bob");
    const joined = await bob.join("b");
    const changed = await changedRooms(watcher, "b's count");
    assert.deepEqual(changed.map((count) => [count.roomId, count.users, count.sessions]), [["b", 1, 1]], "only the room that changed");
    assert.equal(changed[0]!.version, joined.roomVersion, "with the room's version");
    assert.equal(watcher.view.get("a"), a, "the other rooms as they were");
    assert.deepEqual(tally(watcher.view.get("c")), [0, 0]);
    const second = (await withDeadline(stream.next(), "the raw stream's second message")).value as pb.RoomCounts;
    assert.deepEqual(second.counts.map((count) => [count.roomId, count.users]), [["b", 1]]);
    assert.equal(second.watchId, "", "only the first message names the stream");

    // The room empties: its count comes as the server has it then (version 0 once the room is dropped, R2).
    await bob.leave("b");
    const emptied = await changedRooms(watcher, "b emptied");
    assert.deepEqual(emptied.map((count) => [count.roomId, count.users, count.sessions]), [["b", 0, 0]]);
    assert.deepEqual(tally(watcher.view.get("b")), [0, 0], "the watcher holds the room as empty");
  } finally {
    raw.abort();
    await closeAll();
    channel.close();
    await server.kill();
  }
});

test("R7: update adds and removes rooms on the open stream, added rooms' counts come at once, and a removed room sends nothing more", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url);
  try {
    const ann = await register(channel, "ann");
    await ann.join("x");
    // An interval long enough that a count coming within it came with the update, not with a tick.
    const watcher = await openCounts(server.transport, ["a"], { countIntervalMs: 5_000, reconnect: fastReconnect() });
    const watchId = watcher.watchId;
    const started = performance.now();
    await watcher.update({ add: ["x"], remove: ["a"] });
    const added = await changedRooms(watcher, "x's count");
    assert.ok(performance.now() - started < 4_000, "at once, not at the next interval");
    assert.deepEqual(added.map((count) => [count.roomId, count.users]), [["x", 1]]);
    assert.deepEqual(watcher.roomIds, ["x"]);
    assert.equal(watcher.view.get("a"), undefined, "a removed room is forgotten");
    assert.equal(watcher.watchId, watchId, "the same stream");

    // Joins into both: only the watched room's count comes.
    const short = await openCounts(server.transport, ["a"], { countIntervalMs: 100, reconnect: fastReconnect() });
    await short.update({ add: ["x"], remove: ["a"] });
    assert.deepEqual((await changedRooms(short, "x's count")).map((count) => count.roomId), ["x"]);
    const bob = await register(channel, "bob");
    await bob.join("a");
    await bob.join("x");
    const after = await changedRooms(short, "x's count after bob's joins");
    assert.deepEqual(after.map((count) => [count.roomId, count.users]), [["x", 2]], "nothing of the removed room");
    assert.equal(short.view.get("a"), undefined);

    // A room added back comes back with its count.
    await short.update({ add: ["a"] });
    assert.deepEqual((await changedRooms(short, "a's count")).map((count) => [count.roomId, count.users]), [["a", 1]]);
    assert.deepEqual(short.roomIds, ["x", "a"]);
  } finally {
    await closeAll();
    channel.close();
    await server.kill();
  }
});

test("R7: a room's version never goes back on a room counts watcher while members come and go", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url);
  try {
    // ann stays, so the room is never dropped; bob comes and goes.
    const ann = await register(channel, "ann");
    await ann.join("r");
    const watcher = await openCounts(server.transport, ["r", "s"], { countIntervalMs: 100, reconnect: fastReconnect() });
    const versions = [watcher.view.get("r")!.version];
    const bob = await register(channel, "bob");
    for (let i = 0; i < 5; i++) {
      await bob.join("r");
      while (watcher.view.get("r")?.users !== 2) for (const count of await changedRooms(watcher, `bob's join ${i}`)) versions.push(count.version);
      await bob.leave("r");
      while (watcher.view.get("r")?.users !== 1) for (const count of await changedRooms(watcher, `bob's leave ${i}`)) versions.push(count.version);
    }
    assert.ok(versions.length >= 11, `a count per change: ${versions.join(",")}`);
    for (let i = 1; i < versions.length; i++) assert.ok(versions[i - 1]! < versions[i]!, `versions only grow: ${versions.join(",")}`);
    assert.deepEqual(tally(watcher.view.get("s")), [0, 0], "a room nothing happened in");
  } finally {
    await closeAll();
    channel.close();
    await server.kill();
  }
});

test("R7: a room counts watcher reopens with its rooms after the server ends the stream, and the new first message replaces everything", { timeout: TEST_TIMEOUT_MS }, async () => {
  const listen = `127.0.0.1:${await freePort()}`;
  const args = ["--shutdown-grace-ms", "200"];
  let server = await Server.start(args, { listen });
  let channel = connectLeaseChannel(server.url);
  try {
    // A lease, not a Session: nothing renews it against the server that replaces this one.
    const { generation } = await channel.register({ userId: "ann", sessionId: "tab-1", gatewayId: "g", ttlMs: 60_000 });
    await channel.join({ userId: "ann", sessionId: "tab-1", generation, roomId: "a" });
    const watcher = await openCounts(server.transport, ["a", "b"], { countIntervalMs: 100, reconnect: fastReconnect() });
    await watcher.update({ add: ["c"] });
    assert.deepEqual((await changedRooms(watcher, "c's count")).map((count) => count.roomId), ["c"]);
    const before = watcher.view.get("a")!;
    assert.deepEqual(tally(before), [1, 1]);
    assert.ok(before.version > 0n);

    // A restart with no data directory: the stream ends (UNAVAILABLE), and the rooms' history is gone.
    channel.close();
    await server.stop();
    server = await Server.start(args, { listen });
    channel = connectLeaseChannel(server.url);
    const event = await nextCounts(watcher, "the reopen");
    assert.equal(event.kind, "resynced");
    assert.deepEqual(watcher.roomIds, ["a", "b", "c"], "reopened with its rooms, the added one too");
    assert.equal(watcher.view.size, 3, "every room in the new first message");
    assert.deepEqual([watcher.view.get("a")?.version, ...(tally(watcher.view.get("a")) ?? [])], [0n, 0, 0], "replaced, at a lower version too");
    assert.notEqual(watcher.watchId, "");

    // The new stream follows changes and takes updates under its own watch id.
    const bob = await register(channel, "bob");
    await bob.join("c");
    assert.deepEqual((await changedRooms(watcher, "c's count on the new stream")).map((count) => [count.roomId, count.users]), [["c", 1]]);
    await watcher.update({ remove: ["b"] });
    assert.deepEqual(watcher.roomIds, ["a", "c"]);
    await bob.join("a");
    assert.deepEqual((await changedRooms(watcher, "a's count on the new stream")).map((count) => [count.roomId, count.users]), [["a", 1]]);
  } finally {
    await closeAll();
    channel.close();
    await server.kill();
  }
});

test("R7/R4: a viewer's room counts watch counts a room as an unknown one once the viewer may no longer read it, and again once it may", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url);
  try {
    const ann = await register(channel, "ann");
    const bob = await register(channel, "bob");
    await ann.join("doc");
    await bob.join("doc");
    // A service watching for ann: she reads the MEMBERS room while she is in it.
    const watcher = await openCounts(server.transport, ["doc"], { viewerId: "ann", countIntervalMs: 100, reconnect: fastReconnect() });
    const held = watcher.view.get("doc")!;
    assert.deepEqual(tally(held), [2, 2]);
    assert.ok(held.version > 0n);

    await ann.leave("doc");
    const hidden = await changedRooms(watcher, "doc once ann left");
    assert.deepEqual(
      hidden.map((count) => [count.roomId, count.version, count.users, count.sessions]),
      [["doc", 0n, 0, 0]],
      "counted as an unknown room: not bob's 1, and not the room's version",
    );
    assert.deepEqual([watcher.view.get("doc")?.version, ...(tally(watcher.view.get("doc")) ?? [])], [0n, 0, 0], "taken, version 0 and all");

    const back = await ann.join("doc");
    const shown = await changedRooms(watcher, "doc once ann is back");
    assert.deepEqual(shown.map((count) => [count.roomId, count.version, count.users]), [["doc", back.roomVersion, 2]]);
  } finally {
    await closeAll();
    channel.close();
    await server.kill();
  }
});
