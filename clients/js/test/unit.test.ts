/** What needs no server: backoff, the version rules of ViewerStore, RoomView and RoomCountsView, the bounded queue, a RoomCountsWatcher over a stand-in service. */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { createServer, type AddressInfo, type Socket } from "node:net";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, createRouterTransport } from "@connectrpc/connect";

import {
  Backoff,
  ClusterLeases,
  MAX_WATCHED_ROOMS,
  RoomCountsView,
  RoomCountsWatcher,
  RoomView,
  ViewerStore,
  leaseResult,
  pb,
  slotOf,
  type RoomCountsEvent,
} from "../src/index.js";
import type { LeaseChannel } from "../src/leaseChannel.js";
import { nodeTransport } from "../src/node.js";
import { watchAttention } from "../src/web.js";
import { TEST_TIMEOUT_MS, WIRES, fastReconnect, until, withDeadline } from "./helpers.js";

const presence = (userId: string, state: pb.State, version: bigint): pb.UserPresence =>
  create(pb.UserPresenceSchema, { userId, state, version });

const held = (store: ViewerStore, userId: string): [pb.State, bigint] | undefined => {
  const user = store.get(userId);
  return user === undefined ? undefined : [user.state, user.version];
};

test("backoff caps grow by the factor until the max, and delays stay within zero and the cap", { timeout: TEST_TIMEOUT_MS }, () => {
  const backoff = new Backoff({ initialMs: 50, maxMs: 5000, factor: 2 });
  assert.deepEqual(
    Array.from({ length: 10 }, (_, n) => backoff.cap(n)),
    [50, 100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000],
  );
  assert.equal(backoff.cap(100_000), 5000, "a huge attempt is capped, not infinite");
  assert.equal(new Backoff({ factor: 0.5 }).cap(7), 50, "a factor below 1 never shrinks the delay");
  assert.equal(new Backoff({ factor: Number.NaN }).cap(7), 50);
  assert.equal(backoff.delayAt(3, 0), 0);
  assert.equal(backoff.delayAt(3, 1), 400);
  assert.equal(backoff.delayAt(3, 7), 400, "clamped");
  assert.equal(backoff.delayAt(3, Number.NaN), 0);
  for (let attempt = 0; attempt < 12; attempt++) {
    const cap = backoff.cap(attempt);
    const delays = Array.from({ length: 2000 }, () => backoff.delay(attempt));
    assert.ok(delays.every((d) => d >= 0 && d <= cap), `attempt ${attempt} within [0, ${cap}]`);
    // Full jitter spreads over the whole range, not just near the cap.
    assert.ok(Math.min(...delays) < cap / 10 && Math.max(...delays) > (cap * 9) / 10, `attempt ${attempt} spread`);
  }
});

test("an OFFLINE v2 arriving before the ONLINE v1 stays OFFLINE (seed 000, reordered events)", { timeout: TEST_TIMEOUT_MS }, () => {
  const store = new ViewerStore();
  store.applySnapshot([presence("42", pb.State.OFFLINE, 0n)]);
  assert.equal(store.applyEvent(presence("42", pb.State.OFFLINE, 2n)), true);
  assert.equal(store.applyEvent(presence("42", pb.State.ONLINE, 1n)), false, "a delayed event is stale");
  assert.deepEqual(held(store, "42"), [pb.State.OFFLINE, 2n]);
});

test("duplicates and equal versions are ignored", { timeout: TEST_TIMEOUT_MS }, () => {
  const store = new ViewerStore();
  assert.equal(store.applyEvent(presence("a", pb.State.ONLINE, 5n)), true);
  assert.equal(store.applyEvent(presence("a", pb.State.ONLINE, 5n)), false, "exact duplicate");
  assert.equal(store.applyEvent(presence("a", pb.State.OFFLINE, 5n)), false, "same version, other state");
  assert.equal(store.applyEvent(presence("a", pb.State.OFFLINE, 4n)), false);
  assert.deepEqual(held(store, "a"), [pb.State.ONLINE, 5n]);
  assert.equal(store.applyEvent(presence("a", pb.State.OFFLINE, 6n)), true);
  assert.deepEqual(held(store, "a"), [pb.State.OFFLINE, 6n]);
});

test("any arrival order of one user's events ends on the newest version", { timeout: TEST_TIMEOUT_MS }, () => {
  const events = [
    presence("u", pb.State.ONLINE, 10n),
    presence("u", pb.State.OFFLINE, 11n),
    presence("u", pb.State.ONLINE, 12n),
    presence("u", pb.State.OFFLINE, 13n),
  ];
  const permutations = (items: number[]): number[][] =>
    items.length <= 1 ? [items] : items.flatMap((x, i) => permutations(items.filter((_, j) => j !== i)).map((p) => [x, ...p]));
  const orders = permutations([0, 1, 2, 3]);
  assert.equal(orders.length, 24);
  for (const order of orders) {
    const store = new ViewerStore();
    const accepted = order.filter((i) => store.applyEvent(events[i]!)).map((i) => events[i]!.version);
    assert.deepEqual(held(store, "u"), [pb.State.OFFLINE, 13n], `order ${order}`);
    assert.ok(accepted.every((v, i) => i === 0 || accepted[i - 1]! < v), `accepted versions only grow: ${accepted}`);
  }
});

test("a snapshot replaces everything, even at a lower version, and forgets others", { timeout: TEST_TIMEOUT_MS }, () => {
  const store = new ViewerStore();
  store.applySnapshot([presence("a", pb.State.ONLINE, 7n), presence("b", pb.State.ONLINE, 3n)]);
  assert.equal(store.applyEvent(presence("c", pb.State.ONLINE, 1n)), true);
  assert.equal(store.size, 3);
  store.applySnapshot([presence("a", pb.State.OFFLINE, 2n)]);
  assert.equal(store.size, 1);
  assert.deepEqual(held(store, "a"), [pb.State.OFFLINE, 2n]);
  assert.equal(store.get("b"), undefined);
  assert.equal(store.applyEvent(presence("a", pb.State.ONLINE, 3n)), true);
});

test("E8: a resumed snapshot replaces only the users it carries", { timeout: TEST_TIMEOUT_MS }, () => {
  const store = new ViewerStore();
  store.applySnapshot([presence("a", pb.State.ONLINE, 7n), presence("b", pb.State.ONLINE, 3n)]);
  store.applyEvent(presence("gone", pb.State.ONLINE, 1n));
  const watched = ["a", "b", "c"];
  assert.deepEqual(store.versions(watched), { a: 7n, b: 3n });
  // b changed while the viewer was away; a did not; c is new; "gone" is no longer watched.
  store.applyPartialSnapshot([presence("b", pb.State.OFFLINE, 4n), presence("c", pb.State.ONLINE, 2n)], watched);
  assert.deepEqual(held(store, "a"), [pb.State.ONLINE, 7n], "kept: the server left it out as unchanged");
  assert.deepEqual(held(store, "b"), [pb.State.OFFLINE, 4n]);
  assert.deepEqual(held(store, "c"), [pb.State.ONLINE, 2n]);
  assert.equal(store.get("gone"), undefined);
});

test("a room view drops stale changes and a delayed join cannot undo a leave", { timeout: TEST_TIMEOUT_MS }, () => {
  const member = (userId: string, tab: string) => create(pb.RoomMemberSchema, { userId, metadata: { tab }, sessions: 1 });
  const change = (version: bigint, kind: pb.RoomChangeKind, userId: string, tab = "t") =>
    create(pb.RoomMemberChangeSchema, { roomId: "r", version, kind, member: member(userId, tab) });
  const view = new RoomView("r");
  view.applySnapshot(create(pb.RoomSnapshotSchema, { roomId: "r", version: 10n, members: [member("a", "one")] }));
  assert.equal(view.applyChange(change(9n, pb.RoomChangeKind.ROOM_CHANGE_LEFT, "a")), false, "older than the snapshot");
  assert.equal(view.member("a")?.metadata["tab"], "one");
  assert.equal(view.applyChange(change(12n, pb.RoomChangeKind.ROOM_CHANGE_LEFT, "a")), true);
  assert.equal(view.applyChange(change(11n, pb.RoomChangeKind.ROOM_CHANGE_JOINED, "a")), false, "a delayed join");
  assert.equal(view.member("a"), undefined);
  assert.equal(view.applyChange(change(13n, pb.RoomChangeKind.ROOM_CHANGE_UNSPECIFIED, "b")), false);
  assert.equal(view.applyChange(change(14n, pb.RoomChangeKind.ROOM_CHANGE_JOINED, "b", "two")), true);
  assert.equal(view.version, 14n);
  const typing = (version: bigint, userIds: string[]) =>
    create(pb.SignalSetSchema, { roomId: "r", version, kind: "typing", userIds, count: userIds.length });
  assert.equal(view.applySignals(typing(16n, ["b"])), true);
  assert.equal(view.applySignals(typing(15n, [])), false, "a stale signal set");
  assert.deepEqual(view.signalling("typing"), ["b"]);
  assert.equal(view.signalCount("typing"), 1);
  view.applySnapshot(create(pb.RoomSnapshotSchema, { roomId: "r", version: 3n }));
  assert.equal(view.size, 0, "a snapshot is a resync, even at a lower version");
  assert.deepEqual(view.signalling("typing"), []);
});

const roomCount = (roomId: string, version: bigint, users: number, sessions = users): pb.RoomCount =>
  create(pb.RoomCountSchema, { roomId, version, users, sessions });

const countsHeld = (view: RoomCountsView): Record<string, [bigint, number, number]> =>
  Object.fromEntries([...view.values()].map((count) => [count.roomId, [count.version, count.users, count.sessions]]));

test("R7: a room counts view replaces everything with a first message, merges later ones, and never takes a room's version back", { timeout: TEST_TIMEOUT_MS }, () => {
  const view = new RoomCountsView(["a", "b", "c", "a"]);
  assert.deepEqual(view.roomIds, ["a", "b", "c"], "a room named twice is watched once");
  view.replace([roomCount("a", 5n, 1), roomCount("b", 0n, 0), roomCount("c", 9n, 2), roomCount("x", 3n, 1)]);
  assert.deepEqual(countsHeld(view), { a: [5n, 1, 1], b: [0n, 0, 0], c: [9n, 2, 2] }, "a room not watched is left out");

  const b = roomCount("b", 4n, 1);
  assert.deepEqual(view.merge([b]), [b], "only the room that changed");
  assert.deepEqual(countsHeld(view), { a: [5n, 1, 1], b: [4n, 1, 1], c: [9n, 2, 2] });
  assert.deepEqual(view.merge([roomCount("b", 3n, 7)]), [], "a lower version is stale");
  assert.deepEqual(view.merge([roomCount("b", 4n, 1)]), [], "a repeated count changes nothing");
  const hidden = roomCount("c", 9n, 1, 1);
  assert.deepEqual(view.merge([hidden]), [hidden], "the same version with other counts (a member hidden) is taken: it is not older");
  assert.deepEqual(view.merge([roomCount("x", 99n, 5)]), [], "a room not watched");
  const mixed = [roomCount("a", 4n, 0), roomCount("a", 6n, 0), roomCount("c", 8n, 0)];
  assert.deepEqual(view.merge(mixed), [mixed[1]], "each count on its own");
  assert.deepEqual(countsHeld(view), { a: [6n, 0, 0], b: [4n, 1, 1], c: [9n, 1, 1] });

  const emptied = roomCount("a", 0n, 0);
  assert.deepEqual(view.merge([emptied]), [emptied], "version 0: the room emptied and was dropped, or may no longer be read");
  assert.deepEqual(view.merge([roomCount("a", 6n, 0)]), [roomCount("a", 6n, 0)], "and its next version comes after it");

  view.remove(["b"]);
  assert.equal(view.get("b"), undefined, "a removed room is forgotten");
  assert.deepEqual(view.merge([roomCount("b", 10n, 3)]), [], "and what still comes of it dropped");
  view.add(["d", "b"]);
  const back = roomCount("b", 2n, 1);
  assert.deepEqual(view.merge([back]), [back], "a room added again takes its first count whatever its version");

  // A reopened stream (a restart that lost the rooms): authoritative even at lower versions.
  view.replace([roomCount("a", 0n, 0), roomCount("b", 1n, 0), roomCount("c", 2n, 0)]);
  assert.deepEqual(countsHeld(view), { a: [0n, 0, 0], b: [1n, 0, 0], c: [2n, 0, 0] });
  assert.equal(view.get("d"), undefined, "a room the first message does not carry holds nothing until its count comes");
  assert.equal(view.size, 3);
});

/**
 * A `Presence` service in this process with just the room counts calls: each
 * stream opens with the counts of `rooms` (a room not there: version 0, no
 * one) and a fresh watch id; the test sends what follows and ends streams;
 * updates are recorded and the added rooms' counts sent at once, as the server does.
 */
class StandIn {
  readonly rooms = new Map<string, pb.RoomCount>();
  readonly requests: pb.WatchRoomCountsRequest[] = [];
  readonly updates: pb.UpdateWatchRoomCountsRequest[] = [];
  /** What the next update is answered with. */
  refuseUpdate: ConnectError | undefined;
  /** Holds back the next stream's first message until it resolves. */
  gate: Promise<void> | undefined;
  private readonly streams = new Map<string, { queue: (pb.RoomCounts | Error | null)[]; wake: () => void }>();
  private opened = 0;
  readonly transport = createRouterTransport(({ service }) =>
    service(pb.Presence, {
      watchRoomCounts: (request, context) => this.watch(request, context.signal),
      updateWatchRoomCounts: async (request) => {
        this.updates.push(request);
        const refusal = this.refuseUpdate;
        this.refuseUpdate = undefined;
        if (refusal !== undefined) throw refusal;
        if (!this.streams.has(request.watchId)) throw new ConnectError("no such watch", Code.NotFound);
        if (request.addRoomIds.length > 0) this.send(request.addRoomIds.map((roomId) => this.count(roomId)), request.watchId);
        return {};
      },
    }),
  );

  count(roomId: string): pb.RoomCount {
    return this.rooms.get(roomId) ?? roomCount(roomId, 0n, 0);
  }

  /** The watch id of the stream opened last. */
  get watchId(): string {
    return `w${this.opened}`;
  }

  /** Sends `counts` on a stream (the last one opened, by default). */
  send(counts: pb.RoomCount[], watchId = this.watchId): void {
    const stream = this.streams.get(watchId);
    assert.ok(stream !== undefined, `no open stream ${watchId}`);
    stream.queue.push(create(pb.RoomCountsSchema, { counts }));
    stream.wake();
  }

  /** Ends the last stream opened: cleanly, or with `error`. */
  end(error?: ConnectError): void {
    const stream = this.streams.get(this.watchId);
    assert.ok(stream !== undefined, "no open stream");
    stream.queue.push(error ?? null);
    stream.wake();
  }

  private async *watch(request: pb.WatchRoomCountsRequest, signal: AbortSignal): AsyncIterable<pb.RoomCounts> {
    this.requests.push(request);
    const gate = this.gate;
    this.gate = undefined;
    if (gate !== undefined) await gate;
    const watchId = `w${++this.opened}`;
    const stream = { queue: [] as (pb.RoomCounts | Error | null)[], wake: () => {} };
    this.streams.set(watchId, stream);
    signal.addEventListener("abort", () => stream.wake());
    try {
      yield create(pb.RoomCountsSchema, { watchId, counts: request.roomIds.map((roomId) => this.count(roomId)) });
      for (;;) {
        while (stream.queue.length === 0 && !signal.aborted) await new Promise<void>((resolve) => (stream.wake = resolve));
        const item = stream.queue.shift();
        if (item === undefined || item === null) return;
        if (item instanceof Error) throw item;
        yield item;
      }
    } finally {
      this.streams.delete(watchId);
    }
  }
}

const nextCounts = async (watcher: RoomCountsWatcher, what: string): Promise<RoomCountsEvent> => {
  const event = await withDeadline(watcher.next(), what);
  assert.ok(event !== undefined, `${what}: the watch ended (${watcher.lastError?.message})`);
  return event;
};

test("R7: a room counts watcher opens with every room, reports only the rooms that changed, and drops stale counts", { timeout: TEST_TIMEOUT_MS }, async () => {
  const standIn = new StandIn();
  standIn.rooms.set("a", roomCount("a", 5n, 2, 3));
  const watcher = await RoomCountsWatcher.open(standIn.transport, ["a", "b", "a"], { countIntervalMs: 250, reconnect: fastReconnect() });
  try {
    assert.deepEqual(standIn.requests.map((r) => [r.roomIds, r.countIntervalMs]), [[["a", "b"], 250]], "distinct rooms, the interval");
    assert.equal(watcher.watchId, "w1");
    assert.deepEqual(countsHeld(watcher.view), { a: [5n, 2, 3], b: [0n, 0, 0] });

    standIn.send([roomCount("a", 4n, 9), roomCount("b", 0n, 0)]);
    standIn.send([roomCount("b", 7n, 1)]);
    const event = await nextCounts(watcher, "b's count");
    assert.equal(event.kind, "counts");
    assert.deepEqual(
      (event as { counts: pb.RoomCount[] }).counts.map((count) => count.roomId),
      ["b"],
      "a message with only a stale and a repeated count is not reported",
    );
    assert.deepEqual(countsHeld(watcher.view), { a: [5n, 2, 3], b: [7n, 1, 1] });
  } finally {
    watcher.close();
  }
  assert.equal(await watcher.next(), undefined, "a closed watcher reports nothing more");
});

test("R7: update adds and removes rooms on the open stream by its watch id, and what still comes of a removed room is dropped", { timeout: TEST_TIMEOUT_MS }, async () => {
  const standIn = new StandIn();
  standIn.rooms.set("c", roomCount("c", 3n, 1));
  const watcher = await RoomCountsWatcher.open(standIn.transport, ["a", "b"], { reconnect: fastReconnect() });
  try {
    const b = standIn.watchId;
    await watcher.update({ add: ["c", "a"], remove: ["b"] });
    assert.deepEqual(
      standIn.updates.map((u) => [u.watchId, u.addRoomIds, u.removeRoomIds]),
      [[b, ["c"], ["b"]]],
      "only what changes, named by the stream's watch id",
    );
    assert.deepEqual(watcher.roomIds, ["a", "c"]);
    assert.equal(watcher.view.get("b"), undefined, "a removed room is forgotten");
    const added = await nextCounts(watcher, "c's count");
    assert.deepEqual((added as { counts: pb.RoomCount[] }).counts, [standIn.count("c")]);
    standIn.send([roomCount("b", 9n, 4), roomCount("a", 1n, 1)]);
    const after = await nextCounts(watcher, "a's count");
    assert.deepEqual((after as { counts: pb.RoomCount[] }).counts.map((count) => count.roomId), ["a"], "b's count, late, is dropped");
    assert.equal(watcher.view.get("b"), undefined);

    standIn.refuseUpdate = new ConnectError("room_ids: too long", Code.InvalidArgument);
    await assert.rejects(watcher.update({ add: ["d"], remove: ["a"] }), (err: unknown) => ConnectError.from(err).code === Code.InvalidArgument);
    assert.deepEqual(watcher.roomIds, ["a", "c"], "a refused update changes nothing");
    assert.deepEqual(countsHeld(watcher.view), { a: [1n, 1, 1], c: [3n, 1, 1] });

    const calls = standIn.updates.length;
    await assert.rejects(watcher.update({ remove: ["a", "c"] }), /1 to 10000 rooms/, "no room left");
    const many = Array.from({ length: MAX_WATCHED_ROOMS - 1 }, (_, i) => `room-${i}`);
    await assert.rejects(watcher.update({ add: many }), /1 to 10000 rooms; this update would leave 10001/, "past the cap");
    assert.equal(standIn.updates.length, calls, "refused before any call");
    await watcher.update({ add: ["a"], remove: ["zzz"] });
    assert.equal(standIn.updates.length, calls, "nothing to change: no call");
  } finally {
    watcher.close();
  }
});

test("R7: a room counts watcher reopens with its rooms when the stream ends, and the new first message replaces everything, even at lower versions", { timeout: TEST_TIMEOUT_MS }, async () => {
  const standIn = new StandIn();
  standIn.rooms.set("a", roomCount("a", 8n, 2));
  const watcher = await RoomCountsWatcher.open(standIn.transport, ["a", "b"], { countIntervalMs: 100, reconnect: fastReconnect() });
  try {
    // The stream ends cleanly (a server going away), and the server lost the rooms' history meanwhile.
    standIn.end();
    standIn.rooms.set("a", roomCount("a", 2n, 1));
    const resynced = await nextCounts(watcher, "the reopen");
    assert.equal(resynced.kind, "resynced");
    assert.deepEqual(standIn.requests.map((r) => [r.roomIds, r.countIntervalMs]).at(-1), [["a", "b"], 100]);
    assert.equal(watcher.watchId, "w2");
    assert.deepEqual(countsHeld(watcher.view), { a: [2n, 1, 1], b: [0n, 0, 0] }, "the first message replaces, lower versions too");
    standIn.send([roomCount("a", 1n, 0)]);
    standIn.send([roomCount("b", 1n, 1)]);
    const b = await nextCounts(watcher, "b's count");
    assert.deepEqual((b as { counts: pb.RoomCount[] }).counts.map((count) => count.roomId), ["b"], "and on the new stream, versions go on from it");

    // Broken with an error a retry can fix: reopened with the rooms of the last update.
    await watcher.update({ add: ["c"], remove: ["b"] });
    standIn.rooms.set("c", roomCount("c", 4n, 4));
    standIn.end(new ConnectError("going away", Code.Unavailable));
    let again = await nextCounts(watcher, "the second reopen");
    if (again.kind === "counts") again = await nextCounts(watcher, "the second reopen"); // c's count from the update, first
    assert.equal(again.kind, "resynced");
    assert.deepEqual(standIn.requests.at(-1)?.roomIds, ["a", "c"]);
    assert.deepEqual(countsHeld(watcher.view), { a: [2n, 1, 1], c: [4n, 4, 4] });

    // The server lost the stream (NOT_FOUND for its watch id): the update reopens it with the new set.
    const opened = standIn.requests.length;
    standIn.refuseUpdate = new ConnectError("no watch w3", Code.NotFound);
    await watcher.update({ add: ["d"] });
    assert.deepEqual(watcher.roomIds, ["a", "c", "d"]);
    assert.equal((await nextCounts(watcher, "the reopen after NOT_FOUND")).kind, "resynced");
    assert.equal(standIn.requests.length, opened + 1);
    assert.deepEqual(standIn.requests.at(-1)?.roomIds, ["a", "c", "d"]);
    assert.equal(watcher.watchId, standIn.watchId);
  } finally {
    watcher.close();
  }
});

test("R7: rooms added or removed while a reopen is on its way are sent on the new stream", { timeout: TEST_TIMEOUT_MS }, async () => {
  const standIn = new StandIn();
  const watcher = await RoomCountsWatcher.open(standIn.transport, ["a", "b"], { reconnect: fastReconnect() });
  try {
    let release!: () => void;
    standIn.gate = new Promise<void>((resolve) => (release = resolve));
    standIn.end();
    const reopened = watcher.next();
    await until("the reopen's request", () => standIn.requests.length === 2);
    // The request named a and b; the stream has no first message yet.
    await watcher.update({ add: ["c"], remove: ["a"] });
    assert.equal(standIn.updates.length, 0, "no stream open: nothing to send yet");
    release();
    assert.equal((await withDeadline(reopened, "the reopen"))?.kind, "resynced");
    await watcher.settled();
    assert.deepEqual(
      standIn.updates.map((u) => [u.watchId, u.addRoomIds, u.removeRoomIds]),
      [["w2", ["c"], ["a"]]],
      "the difference, on the new stream",
    );
    assert.deepEqual(countsHeld(watcher.view), { b: [0n, 0, 0] });
    const c = await nextCounts(watcher, "c's count");
    assert.deepEqual((c as { counts: pb.RoomCount[] }).counts.map((count) => count.roomId), ["c"]);
  } finally {
    watcher.close();
  }
});

test("R7: a refusal a retry cannot fix ends a room counts watcher, with the error", { timeout: TEST_TIMEOUT_MS }, async () => {
  const standIn = new StandIn();
  const watcher = await RoomCountsWatcher.open(standIn.transport, ["a"], { reconnect: fastReconnect() });
  standIn.end(new ConnectError("bad token", Code.Unauthenticated));
  assert.equal(await withDeadline(watcher.next(), "the end"), undefined);
  assert.equal(watcher.lastError?.code, Code.Unauthenticated);
});

test("an item's refusal becomes the ConnectError a unary call would have answered", { timeout: TEST_TIMEOUT_MS }, () => {
  const refused = create(pb.LeaseResultSchema, { code: Code.NotFound, message: "no live lease" });
  assert.throws(
    () => leaseResult(refused),
    (err: unknown) => err instanceof ConnectError && err.code === Code.NotFound && err.rawMessage === "no live lease",
  );
  const ok = create(pb.LeaseResultSchema, { result: { case: "renew", value: { expiresAtMs: 5n } } });
  assert.equal(leaseResult(ok).case, "renew");
  assert.throws(() => leaseResult(create(pb.LeaseResultSchema, {})), (err: unknown) => ConnectError.from(err).code === Code.Internal);
});

for (const [wire, open] of WIRES) {
  test(`a full queue refuses at once instead of growing, and close fails what waits (${wire})`, { timeout: TEST_TIMEOUT_MS }, async () => {
    // A peer that accepts connections and never answers, as a stalled server:
    // the first batch stays in flight and the rest waits behind it.
    const sockets: Socket[] = [];
    const silent = createServer((socket) => sockets.push(socket));
    await new Promise<void>((resolve) => silent.listen(0, "127.0.0.1", resolve));
    const port = (silent.address() as AddressInfo).port;
    try {
      const url = `http://127.0.0.1:${port}`;
      const channel = open(url, nodeTransport(url), {
        maxBatch: 4,
        // Batches leave only when full, however slowly this test runs.
        maxDelayMs: 60_000,
        maxQueued: 8,
        maxInFlightBatches: 1,
      });
      const renew = (i: number) => channel.renew({ userId: `u${i}`, sessionId: "s", generation: 1n });
      const calls = Array.from({ length: 12 }, (_, i) => renew(i));
      await assert.rejects(renew(99), (err: unknown) => ConnectError.from(err).code === Code.ResourceExhausted);
      assert.equal(channel.stats().rejected, 1);
      assert.deepEqual([channel.stats().batchesSent, channel.stats().itemsSent], [1, 4], "one batch in flight, 8 items queued");
      channel.close();
      for (const call of calls) {
        await assert.rejects(withDeadline(call, "a queued call settles on close"), (err: unknown) => ConnectError.from(err).code === Code.Canceled);
      }
      await assert.rejects(renew(100), (err: unknown) => ConnectError.from(err).code === Code.Canceled);
    } finally {
      for (const socket of sockets) socket.destroy();
      silent.close();
    }
  });
}

test("the main entry point imports nothing of Node's, so a page can bundle it", { timeout: TEST_TIMEOUT_MS }, () => {
  // Walks the compiled modules reachable from dist/src/index.js by their relative imports.
  const seen = new Set<string>();
  const outside = new Set<string>();
  const visit = (file: string): void => {
    if (seen.has(file)) return;
    seen.add(file);
    const source = readFileSync(file, "utf8");
    for (const [, specifier] of source.matchAll(/(?:import|export)[^"']*?from\s*["']([^"']+)["']/g)) {
      if (specifier!.startsWith(".")) visit(join(dirname(file), specifier!));
      else outside.add(specifier!);
    }
  };
  visit(fileURLToPath(new URL("../src/index.js", import.meta.url)));
  assert.ok(seen.size > 5, `walked ${[...seen].join(", ")}`);
  assert.deepEqual([...outside].sort(), ["@bufbuild/protobuf", "@bufbuild/protobuf/codegenv2", "@connectrpc/connect"]);
});

test("slotOf is the server's slot function: FNV-1a-32 of the UTF-8 bytes modulo the slot count", { timeout: TEST_TIMEOUT_MS }, () => {
  // The vectors crates/presence-core/src/slots.rs pins for every implementation.
  const vectors: [string, number][] = [["", 453], ["a", 300], ["alice", 999], ["user-42", 939], ["ユーザー", 766], ["room:doc-7", 330]];
  for (const [id, slot] of vectors) assert.equal(slotOf(id, 1024), slot, id);
  assert.equal(slotOf("alice", 0xffffffff), 0x872213e7, "the whole hash, below 2^32 - 1");
  assert.equal(slotOf("alice", 1), 0);
  assert.equal(slotOf("alice", 0), 0, "no slots is taken as one");
});

test("ClusterLeases does not route to a node it could not reach for a second, whatever refusals name it", { timeout: TEST_TIMEOUT_MS }, async () => {
  // node-b names node-a (dead, its lease not expired yet) as the owner of every slot.
  const sent: string[] = [];
  const open = (url: string) =>
    ({
      submitBatch: async (items: pb.LeaseItem[]) => {
        sent.push(url);
        if (url === "http://a:1") throw new ConnectError("connection refused", Code.Unavailable);
        return items.map((item) =>
          create(pb.LeaseResultSchema, {
            code: Code.Unavailable,
            message: "not mine",
            notOwner: { slot: slotOf(item.op.value?.userId ?? "", 16), epoch: 7n, ownerId: "node-a", ownerAddr: "a:1" },
          }),
        );
      },
      close: () => {},
    }) as unknown as LeaseChannel;
  const leases = new ClusterLeases("http://b:1", 16, open);
  const renew = { op: { case: "renew" as const, value: { userId: "u", sessionId: "s", generation: 1n } } };
  const [first] = await leases.submitBatch([renew]);
  assert.equal(first!.code, Code.Unavailable);
  assert.deepEqual(sent.slice(0, 2), ["http://b:1", "http://a:1"], "sent to the seed, then to the owner it named");
  assert.equal(sent.filter((url) => url === "http://a:1").length, 1, "node-a is tried once, then shunned");
  sent.length = 0;
  await leases.submitBatch([renew]);
  assert.ok(!sent.includes("http://a:1"), `within the second, nothing goes to node-a: ${sent}`);
  await new Promise((resolve) => setTimeout(resolve, 1100));
  sent.length = 0;
  await leases.submitBatch([renew]);
  assert.ok(sent.includes("http://a:1"), "after it, node-a is tried again");
});

test("ClusterLeases routes to a node it could not reach at once when it is given a slot after that (D1)", { timeout: TEST_TIMEOUT_MS }, async () => {
  // node-a stopped (refused), started again, and etcd gave it the slot back at
  // a later epoch (8) than any known when it was found unreachable (7).
  const sent: string[] = [];
  let aIsBack = false;
  let epoch = 7n;
  const open = (url: string) =>
    ({
      submitBatch: async (items: pb.LeaseItem[]) => {
        sent.push(url);
        if (url === "http://a:1" && !aIsBack) throw new ConnectError("connection refused", Code.Unavailable);
        if (url === "http://a:1") return items.map(() => create(pb.LeaseResultSchema, { code: 0 }));
        return items.map((item) =>
          create(pb.LeaseResultSchema, {
            code: Code.Unavailable,
            message: "not mine",
            notOwner: { slot: slotOf(item.op.value?.userId ?? "", 16), epoch, ownerId: "node-a", ownerAddr: "a:1" },
          }),
        );
      },
      close: () => {},
    }) as unknown as LeaseChannel;
  const leases = new ClusterLeases("http://b:1", 16, open);
  const renew = { op: { case: "renew" as const, value: { userId: "u", sessionId: "s", generation: 1n } } };
  await leases.submitBatch([renew]);
  aIsBack = true;
  sent.length = 0;
  const [shunned] = await leases.submitBatch([renew]);
  assert.equal(shunned!.code, Code.Unavailable, "an ownership known when node-a was unreachable still goes elsewhere");
  assert.ok(!sent.includes("http://a:1"), `${sent}`);
  epoch = 8n;
  sent.length = 0;
  const [renewed] = await leases.submitBatch([renew]);
  assert.equal(renewed!.code, 0, "within the second, routed to node-a for its new ownership");
  assert.ok(sent.includes("http://a:1"), `${sent}`);
});

test("C7: a ClusterLeases with no move wait sends nothing refused for a slot with no owner again; by default it waits the move out", { timeout: TEST_TIMEOUT_MS }, async () => {
  // The node refuses the first two sends naming no owner (a freeze past its wait), then answers.
  let sends = 0;
  const open = () =>
    ({
      submitBatch: async (items: pb.LeaseItem[]) => {
        sends += 1;
        if (sends > 2) return items.map(() => create(pb.LeaseResultSchema, { code: 0 }));
        return items.map((item) =>
          create(pb.LeaseResultSchema, {
            code: Code.Unavailable,
            message: "moving",
            notOwner: { slot: slotOf(item.op.value?.userId ?? "", 16), epoch: 3n, ownerId: "", ownerAddr: "" },
          }),
        );
      },
      close: () => {},
    }) as unknown as LeaseChannel;
  const renew = { op: { case: "renew" as const, value: { userId: "u", sessionId: "s", generation: 1n } } };
  const once = new ClusterLeases("http://b:1", 16, open).withMoveWait(0);
  const [refused] = await once.submitBatch([renew]);
  assert.equal(refused!.code, Code.Unavailable, "the refusal is the result");
  assert.equal(sends, 1, "sent once");
  sends = 0;
  const [renewed] = await new ClusterLeases("http://b:1", 16, open).submitBatch([renew]);
  assert.equal(renewed!.code, 0, "waited out by time");
  assert.equal(sends, 3);
});

/** A page for watchAttention: its visibility and its listeners, driven by the test. */
class FakePage {
  visibilityState = "visible";
  private readonly listeners = new Map<string, Set<() => void>>();
  addEventListener(type: string, listener: () => void): void {
    if (!this.listeners.has(type)) this.listeners.set(type, new Set());
    this.listeners.get(type)?.add(listener);
  }
  removeEventListener(type: string, listener: () => void): void {
    this.listeners.get(type)?.delete(listener);
  }
  fire(type: string): void {
    for (const listener of [...(this.listeners.get(type) ?? [])]) listener();
  }
  get listening(): number {
    return [...this.listeners.values()].reduce((sum, set) => sum + set.size, 0);
  }
}

test("watchAttention reports a page's attention on changes only: active, idle without input, background while hidden", { timeout: TEST_TIMEOUT_MS }, async () => {
  const page = new FakePage();
  const reported: pb.Attention[] = [];
  const stop = watchAttention((attention) => reported.push(attention), { document: page, idleMs: 60 });
  assert.deepEqual(reported, [pb.Attention.ACTIVE], "at once");
  for (let i = 0; i < 5; i++) page.fire("keydown");
  assert.deepEqual(reported, [pb.Attention.ACTIVE], "input while active reports nothing");
  await until("idle after 60 ms without input", () => reported.length === 2);
  assert.equal(reported[1], pb.Attention.IDLE);
  page.fire("pointerdown");
  assert.deepEqual(reported.slice(2), [pb.Attention.ACTIVE], "input after idle");
  page.visibilityState = "hidden";
  page.fire("visibilitychange");
  page.fire("pointermove"); // a hidden page's input events change nothing
  assert.deepEqual(reported.slice(3), [pb.Attention.BACKGROUND]);
  page.visibilityState = "visible";
  page.fire("visibilitychange");
  assert.deepEqual(reported.slice(4), [pb.Attention.ACTIVE], "back: active, the input just before still recent");
  stop();
  assert.equal(page.listening, 0, "stop removes every listener");
  await new Promise((resolve) => setTimeout(resolve, 100));
  assert.equal(reported.length, 5, "nothing after stop");
});
