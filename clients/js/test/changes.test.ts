/**
 * The change feed's consumer against a real presenced: a consumer closed
 * mid-stream resumes from its cursor file, seeing each committed event once
 * and only its uncommitted batch again; it reopens after the server
 * restarts; a cursor past retention is a ChangesOutOfRangeError with the
 * oldest cursor, which it resumes from; a token provider carries it across
 * a credential's rotation; the file store and the cursor's text.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { readFileSync, readdirSync, renameSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import {
  type ChangeBatch,
  ChangesConsumer,
  ChangesOutOfRangeError,
  Code,
  type LeaseChannel,
  MemoryCursorStore,
  cursorFromHex,
  cursorToHex,
  pb,
} from "../src/index.js";
import { FileCursorStore, connectLeaseChannel } from "../src/node.js";
import { BINARY, Server, TEST_TIMEOUT_MS, fastReconnect, freePort, scratchDir, until, withDeadline } from "./helpers.js";

const FLIPS = [pb.ChangeKind.FLIP];

/** The next batch, within the deadline. */
async function next(consumer: ChangesConsumer, what: string): Promise<ChangeBatch> {
  const batch = await withDeadline(consumer.nextBatch(), what);
  assert.ok(batch !== undefined, `${what}: the consumer was closed`);
  return batch;
}

/** The user and state of a flip. */
function flip(event: pb.ChangeEvent): [string, pb.State] {
  assert.equal(event.event.case, "flip", `a flip, not ${event.event.case}`);
  const user = event.event.value as pb.UserPresence;
  return [user.userId, user.state];
}

/** Batches, each committed, until one holds a flip of `last` (to `state`, if given). */
async function untilFlipOf(consumer: ChangesConsumer, last: string, state?: pb.State): Promise<pb.ChangeEvent[]> {
  const events: pb.ChangeEvent[] = [];
  const isLast = ([user, to]: [string, pb.State]): boolean => user === last && (state === undefined || to === state);
  while (!events.some((event) => isLast(flip(event)))) {
    events.push(...(await next(consumer, `a flip of ${last}`)).events);
    await consumer.commit();
  }
  return events;
}

/** Each of `users` ONLINE then OFFLINE, one call at a time. */
async function flipOnAndOff(channel: LeaseChannel, users: string[]): Promise<void> {
  for (const userId of users) {
    const registered = await channel.register({ userId, sessionId: "s", gatewayId: "g", ttlMs: 60_000 });
    await channel.unregister({ userId, sessionId: "s", generation: registered.generation });
  }
}

/**
 * Returns once every change made before it is in the feed: a stream from
 * now, open (its headers are in), sees a flip made after it.
 */
async function settled(server: Server, channel: LeaseChannel): Promise<void> {
  const abort = new AbortController();
  let opened: () => void = () => undefined;
  const headers = new Promise<void>((resolve) => (opened = resolve));
  const request = { from: pb.ChangesFrom.NOW, idPrefix: "sentinel", kinds: FLIPS };
  const stream = server.client.changes(request, { signal: abort.signal, onHeader: () => opened() })[Symbol.asyncIterator]();
  const first = stream.next();
  try {
    await withDeadline(headers, "the sentinel's stream open");
    await channel.register({ userId: "sentinel", sessionId: "s", gatewayId: "g", ttlMs: 60_000 });
    const event = (await withDeadline(first, "the sentinel's flip")).value as pb.ChangeEvent;
    assert.deepEqual(flip(event), ["sentinel", pb.State.ONLINE]);
  } finally {
    abort.abort();
    await first.catch(() => undefined);
  }
}

/** Byte order of two cursors: the feed's order. */
function compare(a: Uint8Array, b: Uint8Array): number {
  for (let i = 0; i < Math.min(a.length, b.length); i++) if (a[i] !== b[i]) return a[i]! - b[i]!;
  return a.length - b.length;
}

test("F2: a consumer closed mid-stream resumes from its cursor file: committed events once, its uncommitted batch again", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url);
  const dir = scratchDir("changes-resume");
  const path = join(dir, "cursor");
  let flipping = Promise.resolve();
  try {
    const options = { from: "oldest" as const, kinds: FLIPS, maxBatch: 25, reconnect: fastReconnect() };
    const first = await ChangesConsumer.open(server.transport, new FileCursorStore(path), options);
    // 200 users flip on and off (400 flips) while the first consumer reads.
    const users = Array.from({ length: 200 }, (_, i) => `user-${String(i).padStart(3, "0")}`);
    flipping = flipOnAndOff(channel, users);
    const committed: pb.ChangeEvent[] = [];
    while (committed.length < 150) {
      const batch = await next(first, "the first consumer's batches");
      assert.ok(batch.events.length <= 25, `at most maxBatch events: ${batch.events.length}`);
      assert.deepEqual(batch.cursor, batch.events.at(-1)!.cursor, "a batch resumes after its last event");
      committed.push(...batch.events);
      await first.commit();
    }
    assert.equal(readFileSync(path, "utf8"), `${cursorToHex(committed.at(-1)!.cursor)}\n`, "the file holds the last committed cursor");

    // One more batch is handed out and not committed; a handler that fails
    // leaves it so, and is handed it again; then the consumer goes away.
    const uncommitted = await next(first, "a batch never committed");
    const handed: Uint8Array[] = [];
    await assert.rejects(
      first.run((batch) => {
        handed.push(batch.events[0]!.cursor);
        throw new Error("the push service is down");
      }),
      /the push service is down/,
    );
    assert.deepEqual(handed, [uncommitted.events[0]!.cursor], "the uncommitted batch again");
    first.close();
    assert.equal(await first.nextBatch(), undefined, "a closed consumer hands out nothing more");
    await flipping;
    await channel.register({ userId: "sentinel", sessionId: "s", gatewayId: "g", ttlMs: 60_000 });

    const second = await ChangesConsumer.open(server.transport, new FileCursorStore(path), { ...options, from: "now" });
    const resumed = await untilFlipOf(second, "sentinel");
    second.close();
    assert.deepEqual(resumed.slice(0, uncommitted.events.length), uncommitted.events, "the uncommitted batch comes again first");
    const all = [...committed, ...resumed];
    assert.equal(new Set(all.map((event) => cursorToHex(event.cursor))).size, all.length, "no committed event twice");
    for (let i = 1; i < all.length; i++) assert.ok(compare(all[i - 1]!.cursor, all[i]!.cursor) < 0, "in feed order");
    assert.equal(all.length, 401, "every flip: 200 users on and off, and the sentinel");
    users.forEach((user, i) => {
      assert.deepEqual([flip(all[2 * i]!), flip(all[2 * i + 1]!)], [[user, pb.State.ONLINE], [user, pb.State.OFFLINE]]);
    });
  } finally {
    // A failure above leaves the flips running: they end before the channel closes.
    await flipping.catch(() => undefined);
    channel.close();
    await server.kill();
    rmSync(dir, { recursive: true, force: true });
  }
});

test("F2: a consumer reopens after the server restarts and goes on after its cursor", { timeout: TEST_TIMEOUT_MS }, async () => {
  const dataDir = scratchDir("changes-restart");
  const listen = `127.0.0.1:${await freePort()}`;
  const args = ["--data-dir", dataDir, "--shutdown-grace-ms", "200"];
  let server = await Server.start(args, { listen });
  let channel = connectLeaseChannel(server.url);
  try {
    const store = new MemoryCursorStore();
    const consumer = await ChangesConsumer.open(server.transport, store, { from: "oldest", kinds: FLIPS, reconnect: fastReconnect() });
    await flipOnAndOff(channel, ["before-0", "before-1"]);
    const before = await untilFlipOf(consumer, "before-1", pb.State.OFFLINE);
    assert.equal(before.length, 4);

    channel.close();
    await server.stop();
    server = await Server.start(args, { listen });
    channel = connectLeaseChannel(server.url);
    await flipOnAndOff(channel, ["after-0", "after-1"]);
    const after = await untilFlipOf(consumer, "after-1", pb.State.OFFLINE);
    consumer.close();
    assert.deepEqual(
      after.map((event) => flip(event)[0]),
      ["after-0", "after-0", "after-1", "after-1"],
      "the new process's flips, each once, and nothing from before the restart again",
    );
    assert.ok(compare(after[0]!.cursor, before.at(-1)!.cursor) > 0);
    assert.deepEqual(store.cursor, after.at(-1)!.cursor);
  } finally {
    channel.close();
    await server.kill();
    rmSync(dataDir, { recursive: true, force: true });
  }
});

test("F2: a cursor past retention is a ChangesOutOfRangeError with the oldest cursor, and resumeFrom goes on there", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start(["--feed-retention-bytes", "65536"]);
  const channel = connectLeaseChannel(server.url);
  try {
    const store = new MemoryCursorStore();
    const first = await ChangesConsumer.open(server.transport, store, { from: "oldest" });
    await channel.register({ userId: "first", sessionId: "s", gatewayId: "g", ttlMs: 60_000 });
    await untilFlipOf(first, "first");
    first.close();
    // About 80 bytes a flip: 5,000 flips are far more than 64 KiB.
    const users = Array.from({ length: 2_500 }, (_, i) => `user-${i}`);
    const registered = await Promise.all(users.map((userId) => channel.register({ userId, sessionId: "s", gatewayId: "g", ttlMs: 60_000 })));
    await Promise.all(users.map((userId, i) => channel.unregister({ userId, sessionId: "s", generation: registered[i]!.generation })));

    // Once they are all in the feed, retention has passed the stored cursor for good.
    await settled(server, channel);

    const consumer = await ChangesConsumer.open(server.transport, store, { reconnect: fastReconnect() });
    const refused = await withDeadline(consumer.nextBatch(), "the refusal").then(
      (batch) => assert.fail(`out of range, not a batch of ${batch?.events.length}`),
      (err: unknown) => err,
    );
    assert.ok(refused instanceof ChangesOutOfRangeError, `out of range, not ${refused}`);
    assert.equal(refused.refusal.code, Code.OutOfRange);
    assert.match(refused.message, /^cursor: older than the oldest change/);
    await assert.rejects(consumer.nextBatch(), ChangesOutOfRangeError, "not retried: asked again, the same answer");

    // The caller resyncs (a Snapshot), then resumes at the oldest change retained.
    await consumer.resumeFrom(refused.oldestCursor);
    assert.deepEqual(store.cursor, refused.oldestCursor, "the oldest cursor is the committed one now");
    const resumed = await next(consumer!, "the feed from the oldest cursor");
    consumer.close();
    const raw = server.client.changes({ from: pb.ChangesFrom.OLDEST })[Symbol.asyncIterator]();
    const fromOldest = (await raw.next()).value as pb.ChangeEvent;
    await raw.return?.();
    assert.ok(compare(resumed.events[0]!.cursor, refused.oldestCursor) > 0, "resumes just after the oldest cursor");
    assert.deepEqual(resumed.events[0], fromOldest, "at the oldest change retained");
  } finally {
    channel.close();
    await server.kill();
  }
});

/** A fresh token of `scope` from `presenced token new`, and its credentials file entry. */
function credential(name: string, scope: string): { token: string; entry: string } {
  // The entry is stdout, the token stderr: `token new ... >> file` appends no secret.
  const made = spawnSync(BINARY, ["token", "new", "--scope", scope, name], { encoding: "utf8" });
  if (made.status !== 0) throw new Error(`token new: ${made.stderr}`);
  return { token: made.stderr.trim(), entry: made.stdout };
}

test("T3: a consumer with a token provider reopens with a fresh token when its credential is removed", { timeout: TEST_TIMEOUT_MS }, async () => {
  const dir = scratchDir("changes-tokens");
  const path = join(dir, "credentials.toml");
  const [gateway, oldFeed, newFeed] = [credential("gw", "gateway"), credential("feed-old", "feed"), credential("feed-new", "feed")];
  writeFileSync(path, gateway.entry + oldFeed.entry);
  const server = await Server.start(["--credentials", path]);
  const channel = connectLeaseChannel(server.url, { bearerToken: gateway.token });
  let current = oldFeed.token;
  let asked = 0;
  const tokenProvider = async (): Promise<string> => {
    asked++;
    return current;
  };
  try {
    const options = { from: "oldest" as const, kinds: FLIPS, reconnect: fastReconnect(), tokenProvider };
    const consumer = await ChangesConsumer.open(server.transport, new MemoryCursorStore(), options);
    await channel.register({ userId: "before", sessionId: "s", gatewayId: "g", ttlMs: 60_000 });
    await untilFlipOf(consumer, "before", pb.State.ONLINE);

    // The credential rotates: the provider gives the new token from now on,
    // and the old one is removed, which ends the open stream; a flip made
    // once the consumer asked for the fresh token comes on the new stream.
    current = newFeed.token;
    writeFileSync(`${path}.next`, gateway.entry + newFeed.entry);
    renameSync(`${path}.next`, path);
    const after = untilFlipOf(consumer, "after", pb.State.ONLINE);
    await until("a fresh token asked for", () => asked >= 2);
    await channel.register({ userId: "after", sessionId: "s", gatewayId: "g", ttlMs: 60_000 });
    assert.deepEqual((await after).map((event) => flip(event)[0]), ["after"], "nothing missed, nothing twice");
    assert.equal(asked, 2, "asked at the open and once when the old token was refused");
    consumer.close();
  } finally {
    channel.close();
    await server.kill();
    rmSync(dir, { recursive: true, force: true });
  }
});

test("a file store holds nothing until a save, then the last cursor saved, whole; a cursor's text reads back", async () => {
  const dir = scratchDir("cursor-file");
  try {
    const path = join(dir, "cursor");
    const store = new FileCursorStore(path);
    assert.equal(await store.load(), undefined, "no file: no cursor");
    await store.save(new Uint8Array([1, 2, 3]));
    await store.save(new Uint8Array([4, 5]));
    assert.equal(readFileSync(path, "utf8"), "0405\n");
    assert.deepEqual(await new FileCursorStore(path).load(), new Uint8Array([4, 5]), "a later process reads it");
    assert.deepEqual(readdirSync(dir), ["cursor"], "no temporary file left behind");
    writeFileSync(path, "");
    assert.equal(await store.load(), undefined, "an empty file holds no cursor");
    writeFileSync(path, "not hex\n");
    await assert.rejects(store.load(), (err: Error) => err.message.startsWith(`${path}: not a cursor`));
    await assert.rejects(new FileCursorStore(join(dir, "missing-dir", "cursor")).save(new Uint8Array([1])), /missing-dir/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
  assert.equal(cursorToHex(new Uint8Array([1, 0, 0x30, 0xff])), "010030ff");
  assert.deepEqual(cursorFromHex("010030FF"), new Uint8Array([1, 0, 0x30, 0xff]));
  assert.throws(() => cursorFromHex("abc"), /an odd number of hex digits/);
  assert.throws(() => cursorFromHex("now!"), /only hex digits/);
});
