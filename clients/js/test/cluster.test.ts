/**
 * C2 through the TypeScript client: three real presenced nodes joined by a
 * real etcd (`etcd` from PATH or `PRESENCED_ETCD_BIN`; `.ci/install-etcd`),
 * and one ClusterLeases seeded with one of them.
 */
import assert from "node:assert/strict";
import { type ChildProcess, spawn } from "node:child_process";
import { rmSync } from "node:fs";
import { test } from "node:test";

import { Session, slotOf, pb } from "../src/index.js";
import { connectClusterLeases } from "../src/node.js";
import { BINARY, TEST_TIMEOUT_MS, Server, freePort, scratchDir, until } from "./helpers.js";

const SLOTS = 64;
const PREFIX = "/js/";

/** One etcd member on loopback ports, with its own data directory. */
class Etcd {
  private constructor(
    readonly endpoint: string,
    private readonly child: ChildProcess,
    private readonly dir: string,
  ) {}

  static async start(): Promise<Etcd> {
    const [client, peer] = [await freePort(), await freePort()];
    const endpoint = `http://127.0.0.1:${client}`;
    const peerUrl = `http://127.0.0.1:${peer}`;
    const dir = scratchDir("etcd");
    const binary = process.env.PRESENCED_ETCD_BIN ?? "etcd";
    const child = spawn(
      binary,
      ["--name", "test", "--data-dir", dir, "--listen-client-urls", endpoint, "--advertise-client-urls", endpoint,
        "--listen-peer-urls", peerUrl, "--initial-advertise-peer-urls", peerUrl, "--initial-cluster", `test=${peerUrl}`,
        "--heartbeat-interval", "10", "--election-timeout", "50"],
      { stdio: "ignore" },
    );
    child.once("error", (error) => {
      throw new Error(`cannot start ${binary} (${error.message}): install etcd (bash .ci/install-etcd) or set PRESENCED_ETCD_BIN`);
    });
    const etcd = new Etcd(endpoint, child, dir);
    await until("etcd answers", async () => {
      try {
        return (await fetch(`${endpoint}/health`)).ok;
      } catch {
        return false;
      }
    });
    return etcd;
  }

  /** The slot map as etcd holds it (through its JSON gateway): slot → owning node. */
  async owners(): Promise<Map<number, string>> {
    const b64 = (text: string) => Buffer.from(text).toString("base64");
    // Every key from `${PREFIX}slots/` up to the next prefix ('/' + 1 is '0').
    const range = { key: b64(`${PREFIX}slots/`), range_end: b64(`${PREFIX}slots0`) };
    const response = await fetch(`${this.endpoint}/v3/kv/range`, { method: "POST", body: JSON.stringify(range) });
    const body = (await response.json()) as { kvs?: { key: string; value: string }[] };
    const owners = new Map<number, string>();
    for (const kv of body.kvs ?? []) {
      const slot = Number(Buffer.from(kv.key, "base64").toString().slice(`${PREFIX}slots/`.length));
      owners.set(slot, Buffer.from(kv.value, "base64").toString());
    }
    return owners;
  }

  stop(): void {
    this.child.kill("SIGKILL");
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/**
 * One etcd and three nodes (node-a, node-b, node-c) on loopback, stopped
 * after `t`; resolves once every slot has an owner and every node some.
 */
async function threeNodes(t: { after(fn: () => unknown): void }) {
  const etcd = await Etcd.start();
  t.after(() => etcd.stop());
  const names = ["node-a", "node-b", "node-c"];
  const nodes = await Promise.all(
    names.map(async (name) => {
      const port = await freePort();
      const args = ["--etcd", etcd.endpoint, "--node-id", name, "--advertise", `127.0.0.1:${port}`, "--slots", `${SLOTS}`,
        "--etcd-prefix", PREFIX, "--etcd-lease-ttl-ms", "2000", "--cluster-settle-ms", "500"];
      return Server.start(args, { listen: `127.0.0.1:${port}` });
    }),
  );
  t.after(() => Promise.all(nodes.map((node) => node.kill())));
  const urlOf = new Map(names.map((name, i) => [name, nodes[i]!.url]));
  let owners = new Map<number, string>();
  await until("every slot has an owner and every node some", async () => {
    owners = await etcd.owners();
    return owners.size === SLOTS && names.every((name) => [...owners.values()].includes(name));
  });
  return { etcd, nodes, urlOf, owners };
}

test("C2: a ClusterLeases seeded with one node sends every user's items to its owner", { timeout: TEST_TIMEOUT_MS }, async (t) => {
  const { etcd, nodes, urlOf, owners: shared } = await threeNodes(t);
  let owners = shared;

  const leases = connectClusterLeases(nodes[0]!.url, SLOTS);
  t.after(() => leases.close());
  const users = Array.from({ length: 200 }, (_, i) => `user-${i}`);
  const registered = await leases.submitBatch(
    users.map((userId) => ({ op: { case: "register", value: { userId, sessionId: "s", gatewayId: "gw", ttlMs: 30_000 } } })),
  );
  const generations = new Map<string, bigint>();
  registered.forEach((result, i) => {
    assert.equal(result.code, 0, `${users[i]}: ${result.message}`);
    assert.equal(result.result.case, "register");
    if (result.result.case === "register") generations.set(users[i]!, result.result.value.generation);
  });
  assert.ok(leases.knownSlots() > 0, "owners were learned from the refusals");
  for (const user of users) {
    const owner = owners.get(slotOf(user, SLOTS))!;
    assert.equal(leases.routeOf(user), urlOf.get(owner), `${user} is routed to its owner ${owner}`);
  }

  const renewed = await leases.submitBatch(
    users.map((userId) => ({ op: { case: "renew", value: { userId, sessionId: "s", generation: generations.get(userId)!, ttlMs: 30_000 } } })),
  );
  renewed.forEach((result, i) => assert.equal(result.code, 0, `${users[i]}: ${result.message}`));
  const gone = users.filter((_, i) => i % 2 === 0);
  for (const userId of gone) {
    const answer = await leases.unregister({ userId, sessionId: "s", generation: generations.get(userId)! });
    assert.ok(answer.changed, userId);
  }
  // Any node answers a Snapshot of everyone, asking the owners.
  const { users: seen } = await nodes[2]!.client.snapshot({ userIds: users });
  assert.deepEqual(
    seen.map((user) => [user.userId, user.state]),
    users.map((user) => [user, gone.includes(user) ? pb.State.OFFLINE : pb.State.ONLINE]),
  );

  // C3: a node stopped with SIGTERM hands its slots over, sessions and all;
  // the client forgets it and its users' renewals carry on at their new owners.
  const staying = users.filter((user) => !gone.includes(user));
  const onB = staying.filter((user) => owners.get(slotOf(user, SLOTS)) === "node-b");
  assert.ok(onB.length > 0, "node-b owns some of the users");
  const versions = new Map(seen.map((user) => [user.userId, user.version]));
  await nodes[1]!.stop();
  await until("node-b's slots went to the others", async () => {
    owners = await etcd.owners();
    return owners.size === SLOTS && ![...owners.values()].includes("node-b");
  });
  const carriedOn = await leases.submitBatch(
    staying.map((userId) => ({ op: { case: "renew", value: { userId, sessionId: "s", generation: generations.get(userId)!, ttlMs: 30_000 } } })),
  );
  carriedOn.forEach((result, i) => assert.equal(result.code, 0, `${staying[i]}: ${result.message}`));
  for (const user of onB) assert.notEqual(leases.routeOf(user), urlOf.get("node-b"), `${user} is routed away from node-b`);
  const { users: after } = await nodes[2]!.client.snapshot({ userIds: staying });
  for (const user of after) {
    assert.equal(user.state, pb.State.ONLINE, user.userId);
    assert.equal(user.version, versions.get(user.userId), `${user.userId}: no flip, the same version`);
  }
});

test("C2: a ClusterLeases following etcd routes to every owner before any refusal, and learns a drain from etcd", { timeout: TEST_TIMEOUT_MS }, async (t) => {
  const { etcd, nodes, urlOf, owners: shared } = await threeNodes(t);
  let owners = shared;

  const leases = connectClusterLeases(nodes[0]!.url, SLOTS);
  t.after(() => leases.close());
  await leases.followEtcd([etcd.endpoint], PREFIX);
  assert.equal(leases.knownSlots(), SLOTS, "every owner known from etcd, before any batch");
  const users = Array.from({ length: 200 }, (_, i) => `follower-${i}`);
  for (const user of users) {
    assert.equal(leases.routeOf(user), urlOf.get(owners.get(slotOf(user, SLOTS))!), `${user} is routed to its owner`);
  }

  // node-b drains on SIGTERM: the client learns the new owners from etcd, with no item sent.
  const onB = users.filter((user) => owners.get(slotOf(user, SLOTS)) === "node-b");
  assert.ok(onB.length > 0, "node-b owns some of the users");
  await nodes[1]!.stop();
  await until("node-b's users are routed elsewhere", async () => {
    owners = await etcd.owners();
    return onB.every((user) => leases.routeOf(user) === urlOf.get(owners.get(slotOf(user, SLOTS))!) && owners.get(slotOf(user, SLOTS)) !== "node-b");
  });

  // No etcd to follow is a clear error naming where it was looked for.
  const alone = connectClusterLeases(nodes[0]!.url, SLOTS);
  t.after(() => alone.close());
  await assert.rejects(alone.followEtcd(["http://127.0.0.1:1"], PREFIX), /cannot read the slot map from etcd \(http:\/\/127\.0\.0\.1:1: /);
  assert.equal(alone.knownSlots(), 0);
});

test("C3: Sessions over a ClusterLeases renew at their users' owners and carry on through a drain", { timeout: TEST_TIMEOUT_MS }, async (t) => {
  const { etcd, nodes, owners } = await threeNodes(t);
  const leases = connectClusterLeases(nodes[2]!.url, SLOTS);
  t.after(() => leases.close());
  await leases.followEtcd([etcd.endpoint], PREFIX);
  const users = Array.from({ length: 60 }, (_, i) => `socket-${i}`);
  const onB = users.filter((user) => owners.get(slotOf(user, SLOTS)) === "node-b");
  assert.ok(onB.length > 0, "node-b owns some of the users");
  const sessions = await Promise.all(
    users.map((userId) => Session.register(leases, { userId, sessionId: "tab", gatewayId: "gw" }, { ttlMs: 1_500, heartbeatMs: 300 })),
  );
  t.after(() => Promise.all(sessions.map((session) => session.close().catch(() => undefined))));
  for (const session of sessions) await session.join("lobby", { seat: "1" });
  const listed = await nodes[1]!.client.listSessions({ userId: onB[0]! });
  assert.deepEqual(listed.sessions[0]!.rooms, ["lobby"], "the session and its room are at its user's owner");
  const { users: before } = await nodes[0]!.client.snapshot({ userIds: users });

  // node-b drains on SIGTERM; the sessions renew at the new owners, with no re-register, over five TTLs.
  await nodes[1]!.stop();
  await new Promise((resolve) => setTimeout(resolve, 7_500));
  sessions.forEach((session, i) => {
    assert.deepEqual(session.state, { kind: "live", generation: session.generation }, `${users[i]}: renewed all along`);
  });
  const { users: after } = await nodes[0]!.client.snapshot({ userIds: users });
  after.forEach((user, i) => {
    assert.equal(user.state, pb.State.ONLINE, user.userId);
    assert.equal(user.version, before[i]!.version, `${user.userId}: no flip, the same version`);
  });
  const closed = await sessions[users.indexOf(onB[0]!)]!.close();
  assert.ok(closed.removed && closed.changed, "closed at its owner, wherever that is now");
});

test("C7: a ClusterLeases waits out a move to a target that answers late by time, and no renewal is refused", { timeout: TEST_TIMEOUT_MS }, async (t) => {
  // The target of a move is frozen (SIGSTOP) for 1.2 s, within its lease
  // TTL: all that time the source refuses the slot's requests and names no
  // owner. ClusterLeases waits such refusals out by time (MOVE_WAIT_MS, 3 s),
  // not by a count of tries (five, about 0.75 s, before).
  const { etcd, nodes, owners } = await threeNodes(t);
  const leases = connectClusterLeases(nodes[0]!.url, SLOTS);
  t.after(() => leases.close());
  const users = Array.from({ length: 200 }, (_, i) => `late-${i}`);
  const registered = await leases.submitBatch(
    users.map((userId) => ({ op: { case: "register", value: { userId, sessionId: "s", gatewayId: "gw", ttlMs: 30_000 } } })),
  );
  const generations = registered.map((result, i) => {
    assert.equal(result.result.case, "register", `${users[i]}: ${result.message}`);
    return result.result.case === "register" ? result.result.value.generation : 0n;
  });
  const slot = [...new Set(users.map((user) => slotOf(user, SLOTS)))].find((slot) => owners.get(slot) === "node-a");
  assert.ok(slot !== undefined, "node-a owns some of the users");
  const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));
  const refused: string[] = [];
  let renewing = true;
  const renewer = (async () => {
    while (renewing) {
      const results = await leases.submitBatch(
        users.map((userId, i) => ({ op: { case: "renew", value: { userId, sessionId: "s", generation: generations[i]!, ttlMs: 30_000 } } })),
      );
      results.forEach((result, i) => {
        if (result.code !== 0) refused.push(`${users[i]}: ${result.message}`);
      });
      await sleep(200);
    }
  })();
  await sleep(500);
  const target = nodes[1]!.child;
  target.kill("SIGSTOP");
  t.after(() => target.kill("SIGCONT"));
  const move = spawn(BINARY, ["cluster", "move", `${slot}`, "node-b", "--etcd", etcd.endpoint, "--etcd-prefix", PREFIX, "--slots", `${SLOTS}`], {
    stdio: ["ignore", "ignore", "inherit"],
  });
  const moved = new Promise<number | null>((resolve) => move.once("exit", resolve));
  await sleep(1_200);
  target.kill("SIGCONT");
  assert.equal(await moved, 0, "the move completes once the target answers");
  await until("the slot at node-b", async () => (await etcd.owners()).get(slot) === "node-b");
  await sleep(1_000);
  renewing = false;
  await renewer;
  assert.deepEqual(refused.slice(0, 3), [], `${refused.length} renewals were refused`);
});
