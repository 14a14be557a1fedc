/** The viewer side against a real presenced: following changes, resume, hidden users, changing the set. */
import assert from "node:assert/strict";
import { createHmac } from "node:crypto";
import { test } from "node:test";

import { Code, ConnectError } from "@connectrpc/connect";

import { Watcher, pb, type WatcherEvent } from "../src/index.js";
import { connectLeaseChannel } from "../src/node.js";
import { TEST_TIMEOUT_MS, Server, fastReconnect, freePort, scratchDir, withDeadline } from "./helpers.js";

/** The next event the watcher reports, within the deadline. */
const next = async (watcher: Watcher, what: string): Promise<WatcherEvent> => {
  const event = await withDeadline(watcher.next(), what);
  assert.ok(event !== undefined, `${what}: the watch ended (${watcher.lastError?.message})`);
  return event;
};

const update = async (watcher: Watcher, what: string): Promise<pb.UserPresence> => {
  const event = await next(watcher, what);
  assert.equal(event.kind, "update", `${what}: ${event.kind}`);
  return (event as { user: pb.UserPresence }).user;
};

test("a watcher follows ONLINE and OFFLINE in version order", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url);
  try {
    const watcher = await Watcher.open(server.transport, ["w", "never"], { reconnect: fastReconnect() });
    assert.equal(watcher.store.get("w")?.state, pb.State.OFFLINE);
    assert.equal(watcher.store.get("never")?.version, 0n, "a user never seen: OFFLINE, version 0");
    const registered = await channel.register({ userId: "w", sessionId: "s", gatewayId: "g" });
    const up = await update(watcher, "ONLINE");
    assert.deepEqual([up.userId, up.state], ["w", pb.State.ONLINE]);
    await channel.unregister({ userId: "w", sessionId: "s", generation: registered.generation });
    const down = await update(watcher, "OFFLINE");
    assert.equal(down.state, pb.State.OFFLINE);
    assert.ok(down.version > up.version);
    assert.equal(watcher.store.get("w"), down);
    watcher.close();
    assert.equal(await watcher.next(), undefined, "a closed watcher reports nothing more");
  } finally {
    channel.close();
    await server.kill();
  }
});

test("a watch of bad input is refused when it opens", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  try {
    await assert.rejects(
      Watcher.open(server.transport, [""]),
      (err: unknown) => ConnectError.from(err).code === Code.InvalidArgument,
    );
  } finally {
    await server.kill();
  }
});

test("E8: a watcher resumes after a restart with the versions it holds, and the server leaves those out", { timeout: TEST_TIMEOUT_MS }, async () => {
  const dataDir = scratchDir("resume");
  const listen = `127.0.0.1:${await freePort()}`;
  const args = ["--data-dir", dataDir, "--shutdown-grace-ms", "200"];
  let server = await Server.start(args, { listen });
  let channel = connectLeaseChannel(server.url);
  try {
    await channel.register({ userId: "a", sessionId: "s", gatewayId: "g", ttlMs: 60_000 });
    await channel.register({ userId: "b", sessionId: "s", gatewayId: "g", ttlMs: 60_000 });
    const watcher = await Watcher.open(server.transport, ["a", "b"], { reconnect: fastReconnect() });
    const versions = watcher.store.versions(["a", "b"]);
    assert.equal(watcher.resumed, false, "a first open sends nothing to resume");

    // Straight from the wire: a resume naming the version held of a leaves a out.
    const rawAbort = new AbortController();
    const raw = server.client.watch({ userIds: ["a", "b"], knownVersions: { a: versions["a"]! } }, { signal: rawAbort.signal });
    const first = (await raw[Symbol.asyncIterator]().next()).value as pb.WatchEvent;
    rawAbort.abort();
    assert.equal(first.event.case, "snapshot");
    const snapshot = first.event.value as pb.Snapshot;
    assert.equal(snapshot.partial, true);
    assert.deepEqual(snapshot.users.map((u) => u.userId), ["b"]);

    // The server restarts from its data directory: the leases and versions survive.
    channel.close();
    await server.stop();
    server = await Server.start(args, { listen });
    channel = connectLeaseChannel(server.url);
    const event = await next(watcher, "the watcher reconnects");
    assert.equal(event.kind, "resynced");
    assert.equal(watcher.resumed, true, "the reopen said which versions it held and the server left them out");
    assert.deepEqual(watcher.store.versions(["a", "b"]), versions, "nothing changed meanwhile: the store kept what it held");
    assert.equal(watcher.store.get("a")?.state, pb.State.ONLINE);
    watcher.close();
  } finally {
    channel.close();
    await server.kill();
  }
});

test("P3/P4: a user hidden from an open watch turns OFFLINE in the never-seen shape, newer, and comes back when revealed", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start(["--default-visibility", "everyone"]);
  const channel = connectLeaseChannel(server.url);
  try {
    await channel.register({ userId: "h", sessionId: "s", gatewayId: "g" });
    await server.client.setStatus({ userId: "h", status: { availability: pb.Availability.AWAY, text: "lunch" } });
    const watcher = await Watcher.open(server.transport, ["h"], { viewerId: "viewer", reconnect: fastReconnect() });
    const shown = watcher.store.get("h")!;
    assert.equal(shown.state, pb.State.ONLINE);
    assert.equal(shown.status?.text, "lunch");

    await server.client.setVisibility({ userId: "h", visibility: pb.Visibility.NOBODY });
    const hidden = await update(watcher, "the hide");
    assert.equal(hidden.state, pb.State.OFFLINE);
    assert.ok(hidden.version > shown.version, "the hide carries a fresh version, so the store takes it");
    assert.equal(hidden.status, undefined, "nothing else about a hidden user");
    assert.equal(watcher.store.get("h"), hidden);

    await server.client.setVisibility({ userId: "h", visibility: pb.Visibility.EVERYONE });
    const revealed = await update(watcher, "the reveal");
    assert.equal(revealed.state, pb.State.ONLINE);
    assert.ok(revealed.version > hidden.version);
    assert.equal(revealed.status?.text, "lunch");
    watcher.close();
  } finally {
    channel.close();
    await server.kill();
  }
});

test("E7: update adds users with their presence and forgets removed ones, without reopening", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url);
  try {
    await channel.register({ userId: "c", sessionId: "s", gatewayId: "g" });
    const watcher = await Watcher.open(server.transport, ["a", "b"], { reconnect: fastReconnect() });
    const watchId = watcher.watchId;
    assert.notEqual(watchId, "");
    await watcher.update(["c"], ["b"]);
    const added = await update(watcher, "c added");
    assert.deepEqual([added.userId, added.state], ["c", pb.State.ONLINE]);
    assert.deepEqual(watcher.userIds, ["a", "c"]);
    assert.equal(watcher.store.get("b"), undefined, "a removed user is forgotten");
    assert.equal(watcher.watchId, watchId, "the same stream");
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

test("T3: a watcher with a token provider reopens at each expiry and misses no flip", { timeout: TEST_TIMEOUT_MS }, async () => {
  const secret = "a-js-test-only-hs256-secret-of-32-bytes-or-more";
  const service = "service-token-for-js-token-provider-tests";
  const server = await Server.start(["--service-token", service, "--viewer-jwt-hs256-secret", secret]);
  const channel = connectLeaseChannel(server.url, { bearerToken: service });
  let fetched = 0;
  const tokenProvider = async (): Promise<string> => {
    fetched++;
    return viewerJwt(secret, "alice", 2);
  };
  try {
    const watcher = await Watcher.open(server.transport, ["alice"], { reconnect: fastReconnect(), tokenProvider });
    // alice flips every 100 ms for five seconds: across two or three expiries.
    const flipping = (async () => {
      const started = Date.now();
      while (Date.now() - started < 5_000) {
        const registered = await channel.register({ userId: "alice", sessionId: "s", gatewayId: "g" });
        await new Promise((resolve) => setTimeout(resolve, 50));
        await channel.unregister({ userId: "alice", sessionId: "s", generation: registered.generation });
        await new Promise((resolve) => setTimeout(resolve, 50));
      }
    })();
    let done = false;
    void flipping.then(() => (done = true));
    const seen: bigint[] = [];
    let resyncs = 0;
    while (!done) {
      const event = await Promise.race([watcher.next(), new Promise<"tick">((resolve) => setTimeout(() => resolve("tick"), 200))]);
      if (event === "tick") continue;
      assert.ok(event !== undefined, `the watch ended: ${watcher.lastError?.message}`);
      if (event.kind === "update") seen.push(event.user.version);
      else {
        resyncs++;
        const held = watcher.store.get("alice");
        if (held !== undefined) seen.push(held.version);
      }
    }
    await flipping;
    const truth = (await server.client.snapshot({ userIds: ["alice"] }, { headers: { authorization: `Bearer ${service}` } })).users[0];
    while (watcher.store.get("alice")?.version !== truth.version) {
      const event = await next(watcher, "the server's last version of alice");
      if (event.kind === "update") seen.push(event.user.version);
    }
    assert.equal(watcher.store.get("alice")?.state, truth.state);
    for (let i = 1; i < seen.length; i++) assert.ok(seen[i - 1] <= seen[i], `versions never go back: ${seen.join(",")}`);
    assert.ok(resyncs >= 2, `the watch reopened at each expiry: ${resyncs} reopens`);
    assert.ok(fetched >= 3, `a token for the opening and one per expiry: ${fetched}`);
    watcher.close();
  } finally {
    channel.close();
    await server.kill();
  }
});
