/** What needs no server: backoff, the version rules of ViewerStore and RoomView, the bounded queue. */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { createServer, type AddressInfo, type Socket } from "node:net";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { create } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";

import { Backoff, ClusterLeases, RoomView, ViewerStore, leaseResult, pb, slotOf } from "../src/index.js";
import type { LeaseChannel } from "../src/leaseChannel.js";
import { nodeTransport } from "../src/node.js";
import { TEST_TIMEOUT_MS, WIRES, withDeadline } from "./helpers.js";

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
