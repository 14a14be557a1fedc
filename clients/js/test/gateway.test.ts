/** The gateway side against a real presenced: batching, sessions, restarts, generations, credentials. */
import assert from "node:assert/strict";
import { test } from "node:test";

import { Code, ConnectError } from "@connectrpc/connect";

import { Session, Watcher, pb } from "../src/index.js";
import { connectLeaseChannel } from "../src/node.js";
import { TEST_TIMEOUT_MS, Server, WIRES, fastReconnect, freePort, until, withDeadline } from "./helpers.js";

const RENEWALS_OK = 'presenced_renewals_total{result="ok"}';
/** One observation per Leases batch (and per unary Renew, which these tests do not send). */
const BATCHES = "presenced_renewal_duration_seconds_count";

const online = async (server: Server, userId: string): Promise<boolean> => {
  const answer = await server.client.snapshot({ userIds: [userId] });
  return answer.users[0]?.state === pb.State.ONLINE;
};

const codeOf = (code: Code) => (err: unknown) => ConnectError.from(err).code === code;

for (const [wire, open] of WIRES) {
  test(`L8: the renewals of many sessions share batches on one Leases stream (${wire})`, { timeout: TEST_TIMEOUT_MS }, async () => {
    const server = await Server.start(["--min-renew-interval-ms", "0"], { metrics: true });
    const channel = open(server.url, server.transport, { maxDelayMs: 10 });
    try {
      const sessions = await Promise.all(
        Array.from({ length: 500 }, (_, i) =>
          Session.register(channel, { userId: `u${i}`, sessionId: "s", gatewayId: "g" }, { heartbeatMs: 200, ttlMs: 5000 }),
        ),
      );
      const registered = channel.stats();
      assert.ok(registered.batchesSent <= 50, `500 registers went in ${registered.batchesSent} batches`);
      await until("3000 renewals", async () => (await server.sample(RENEWALS_OK)) >= 3000);
      const metrics = await server.metrics();
      const renewals = Number(/presenced_renewals_total\{result="ok"\} (\d+)/.exec(metrics)![1]);
      const batches = Number(new RegExp(`${BATCHES} (\\d+)`).exec(metrics)![1]);
      assert.ok(renewals / batches >= 10, `the server applied ${renewals} renewals in ${batches} batches`);
      const stats = channel.stats();
      assert.equal(stats.streamsOpened, 1, "one stream for every session");
      assert.ok(stats.itemsSent / stats.batchesSent >= 10, `the channel sent ${stats.itemsSent} items in ${stats.batchesSent} batches`);
      assert.ok(sessions.every((s) => s.state.kind === "live"));
      const closed = await Promise.all(sessions.map((s) => s.close()));
      assert.ok(closed.every((c) => c.outcome === pb.UnregisterOutcome.REMOVED));
      assert.equal(await online(server, "u7"), false);
    } finally {
      channel.close();
      await server.kill();
    }
  });

  test(`L8: a burst of single calls is coalesced into batches of at most maxBatch, each answered per item (${wire})`, { timeout: TEST_TIMEOUT_MS }, async () => {
    const server = await Server.start([], { metrics: true });
    const channel = open(server.url, server.transport, { maxBatch: 100 });
    try {
      const registered = await Promise.all(
        Array.from({ length: 1000 }, (_, i) => channel.register({ userId: `b${i}`, sessionId: "s", gatewayId: "g" })),
      );
      assert.ok(
        registered.every((r, i) => r.presence?.userId === `b${i}`),
        "every caller got its own item's result",
      );
      // A renewal of an unknown lease fails alone; the items beside it in its batch succeed.
      const mixed = await Promise.allSettled([
        channel.renew({ userId: "b1", sessionId: "s", generation: registered[1]!.generation }),
        channel.renew({ userId: "nobody", sessionId: "s", generation: 1n }),
        channel.renew({ userId: "b2", sessionId: "s", generation: registered[2]!.generation }),
      ]);
      assert.deepEqual(mixed.map((m) => m.status), ["fulfilled", "rejected", "fulfilled"]);
      assert.ok(codeOf(Code.NotFound)((mixed[1] as PromiseRejectedResult).reason));
      const stats = channel.stats();
      assert.ok(stats.batchesSent >= 10 && stats.batchesSent <= 20, `1003 items in ${stats.batchesSent} batches of at most 100`);
      await until("the server counts as many batches as were sent", async () => (await server.sample(BATCHES)) === stats.batchesSent);
    } finally {
      channel.close();
      await server.kill();
    }
  });
}

test("L2: a session registers again after a server restart that lost its lease, and rejoins its rooms (R6)", { timeout: TEST_TIMEOUT_MS }, async () => {
  const listen = `127.0.0.1:${await freePort()}`;
  let server = await Server.start([], { listen });
  const channel = connectLeaseChannel(server.url, { reconnect: fastReconnect() });
  try {
    const session = await Session.register(
      channel,
      { userId: "r", sessionId: "phone", gatewayId: "g" },
      { heartbeatMs: 100, ttlMs: 3000 },
    );
    await session.join("doc-1", { tab: "one" });
    const first = session.generation;
    const states: string[] = [];
    session.onState((state) => states.push(state.kind));
    await server.kill();
    // A fresh server (no data directory) knows nothing: the renewals answer NOT_FOUND.
    server = await Server.start([], { listen });
    await until("the session re-registers", () => session.state.kind === "reregistered");
    assert.ok(session.generation !== first, "a new generation");
    assert.ok(await online(server, "r"));
    const room = await server.client.roomSnapshot({ roomId: "doc-1" });
    assert.deepEqual(
      room.members.map((m) => [m.userId, m.metadata["tab"]]),
      [["r", "one"]],
      "joined again with the same metadata before reporting reregistered",
    );
    assert.ok(states.includes("reregistered"));
    assert.ok(channel.stats().streamsOpened >= 2, "the stream was reopened");
    await session.close();
  } finally {
    channel.close();
    await server.kill();
  }
});

test("L3: a late unregister of an old generation changes nothing, and a superseded session stops", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start(["--min-renew-interval-ms", "0"]);
  const channel = connectLeaseChannel(server.url);
  try {
    const old = await Session.register(channel, { userId: "g", sessionId: "tab", gatewayId: "a" }, { heartbeatMs: 50 });
    // The same session reconnects through another gateway: a newer generation owns it.
    const newer = await Session.register(channel, { userId: "g", sessionId: "tab", gatewayId: "b" }, { heartbeatMs: 50 });
    assert.ok(newer.generation > old.generation);
    await until("the old session learns it is superseded", () => old.state.kind === "superseded");
    const late = await old.close();
    assert.equal(late.outcome, pb.UnregisterOutcome.STALE_GENERATION);
    assert.equal(late.removed, false);
    assert.ok(await online(server, "g"), "the newer connection keeps the user online");
    const gone = await newer.close();
    assert.equal(gone.outcome, pb.UnregisterOutcome.REMOVED);
    assert.equal(await online(server, "g"), false);
  } finally {
    channel.close();
    await server.kill();
  }
});

test("L3: close with linger shortens the lease instead of deleting it", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url);
  try {
    const session = await Session.register(channel, { userId: "l", sessionId: "s", gatewayId: "g" }, { lingerMs: 5000 });
    const closed = await session.close();
    assert.equal(closed.outcome, pb.UnregisterOutcome.LINGERING);
    assert.ok(await online(server, "l"), "still online while it lingers");
    assert.equal(session.state.kind, "closed");
  } finally {
    channel.close();
    await server.kill();
  }
});

test("the node:http2 wire's pings notice a server that stops answering without closing, and the channel reopens", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start();
  const channel = connectLeaseChannel(server.url, { reconnect: fastReconnect(), pingIntervalMs: 200, pingTimeoutMs: 300 });
  try {
    await channel.register({ userId: "p", sessionId: "s", gatewayId: "g" });
    // The stream is open and idle: no batch waits for an answer, so only the pings can tell.
    server.child.kill("SIGSTOP");
    const stoppedAt = performance.now();
    await until("the stream is taken as broken", () => channel.stats().streamsBroken === 1);
    const noticedMs = performance.now() - stoppedAt;
    assert.ok(noticedMs < 2_000, `noticed after ${noticedMs.toFixed(0)} ms (pings every 200 ms, 300 ms to answer)`);
    server.child.kill("SIGCONT");
    const again = await channel.register({ userId: "p", sessionId: "s2", gatewayId: "g" });
    assert.ok(again.generation > 0n);
    assert.equal(channel.stats().streamsOpened, 2, "a new stream, on a new connection");
  } finally {
    server.child.kill("SIGCONT");
    channel.close();
    await server.kill();
  }
});

test("touch renews at once unless the last renewal is younger than the throttle", { timeout: TEST_TIMEOUT_MS }, async () => {
  const server = await Server.start(["--min-renew-interval-ms", "0"]);
  const channel = connectLeaseChannel(server.url);
  try {
    const probe = await channel.register({ userId: "probe", sessionId: "s", gatewayId: "g" });
    const registeredAt = performance.now();
    const session = await Session.register(
      channel,
      { userId: "t", sessionId: "s", gatewayId: "g" },
      { heartbeatMs: 600_000, minRenewIntervalMs: 300 },
    );
    const sent = () => channel.stats().itemsSent;
    // A renewal that a touch starts is queued within the same turn as the probe
    // sent right after it (microtasks run before the batch's 1 ms timer), so it
    // rides in the probe's batch: once the probe is answered, the count of items
    // sent says whether the touch renewed.
    const touchThenProbe = async (): Promise<number> => {
      const before = sent();
      session.touch();
      session.touch();
      await channel.renew({ userId: "probe", sessionId: "s", generation: probe.generation });
      return sent() - before;
    };
    assert.equal(await touchThenProbe(), 1, "the register counts as a renewal: touches right after it send nothing");
    await until("the throttle window passes", () => performance.now() - registeredAt >= 300);
    assert.equal(await touchThenProbe(), 2, "a touch past the window renews, once");
    assert.equal(await touchThenProbe(), 1, "and the next touch is throttled again");
    await session.close();
  } finally {
    channel.close();
    await server.kill();
  }
});

test("credentials: a bad or missing token is refused UNAUTHENTICATED, the service token works", { timeout: TEST_TIMEOUT_MS }, async () => {
  const token = "service-token-for-js-tests";
  const server = await Server.start(["--service-token", token]);
  const wrong = connectLeaseChannel(server.url, { bearerToken: "not-the-token" });
  const none = connectLeaseChannel(server.url);
  const right = connectLeaseChannel(server.url, { bearerToken: token });
  try {
    await assert.rejects(wrong.register({ userId: "c", sessionId: "s", gatewayId: "g" }), codeOf(Code.Unauthenticated));
    await assert.rejects(none.register({ userId: "c", sessionId: "s", gatewayId: "g" }), codeOf(Code.Unauthenticated));
    const session = await Session.register(right, { userId: "c", sessionId: "s", gatewayId: "g" });
    await assert.rejects(Watcher.open(server.transport, ["c"], { bearerToken: "not-the-token" }), codeOf(Code.Unauthenticated));
    const watcher = await Watcher.open(server.transport, ["c"], { bearerToken: token });
    assert.equal(watcher.store.get("c")?.state, pb.State.ONLINE);
    watcher.close();
    await withDeadline(session.close(), "close");
  } finally {
    for (const channel of [wrong, none, right]) channel.close();
    await server.kill();
  }
});

test("A1: a session says its attention at once, and says it again with the register after a lost lease", { timeout: TEST_TIMEOUT_MS }, async () => {
  // No active window: AWAY as soon as nothing is active, so each change shows.
  const server = await Server.start(["--min-renew-interval-ms", "0", "--active-window-ms", "0"]);
  const channel = connectLeaseChannel(server.url);
  try {
    const identity = { userId: "att", sessionId: "laptop", gatewayId: "g" };
    const session = await Session.register(channel, identity, { heartbeatMs: 50, deviceKind: pb.DeviceKind.DEVICE_DESKTOP });
    const availability = async () => (await server.client.snapshot({ userIds: ["att"] })).users[0]?.availability;
    assert.equal(await availability(), pb.Availability.UNSPECIFIED, "nothing said yet");
    await session.setAttention(pb.Attention.ACTIVE);
    assert.equal(await availability(), pb.Availability.ACTIVE);
    await session.focus("doc-7");
    const reason = async () =>
      (await server.client.notifyTargets({ userIds: ["att"], roomId: "doc-7" })).targets[0]?.reason;
    assert.equal(await reason(), pb.NotifyReason.ROOM_OPEN);
    await session.setAttention(pb.Attention.BACKGROUND);
    assert.equal(await availability(), pb.Availability.AWAY);
    await server.client.revoke({ userId: "att", sessionId: "laptop" });
    await until("the session registers again", () => session.state.kind === "reregistered");
    // Said again with the register: background, so AWAY and no attended session (not UNKNOWN_FAIL_OPEN).
    assert.equal(await availability(), pb.Availability.AWAY);
    assert.equal(await reason(), pb.NotifyReason.NO_ATTENDED_SESSION);
    await session.close();
  } finally {
    channel.close();
    await server.kill();
  }
});
