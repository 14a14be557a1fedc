/**
 * TLS and mutual TLS (contract T1, T2) against a real `presenced serve
 * --tls-cert ...`, with certificates made by `openssl` (tests/certs.mjs):
 * what a client with the server's CA gets over both lease wires and the
 * viewer's transport, what each kind of wrong client sees, and what a client
 * certificate makes of its holder.
 */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { Code, ConnectError, createClient, type Transport } from "@connectrpc/connect";

import { Presence, Session, Watcher, pb } from "../src/index.js";
import { type ClientTlsOptions, connectLeaseChannel, nodeTransport } from "../src/node.js";
import { TEST_TIMEOUT_MS, Server, WIRES, certs, withDeadline } from "./helpers.js";

const SERVICE_TOKEN = "tls-test-service-token";
const GATEWAY_IDENTITY = "spiffe://example.org/gateway";

/** A CA and a server certificate from it for `names` (localhost and 127.0.0.1 unless told). */
function serverPki(names = ["localhost", "127.0.0.1"]) {
  const pki = new certs.Pki("server");
  return { pki, server: pki.issue("server", names) };
}

/** The error `promise` rejects with, within the deadline; fails the test if it resolves. */
async function refusal(promise: Promise<unknown>, what: string): Promise<ConnectError> {
  const refused = await withDeadline(
    promise.then(
      () => undefined,
      (err: unknown) => ConnectError.from(err),
    ),
    what,
  );
  assert.ok(refused !== undefined, `${what}: expected a refusal, and it was let through`);
  return refused;
}

/** The next update of `userId` the watcher reports, within the deadline. */
async function nextUpdate(watcher: Watcher, userId: string): Promise<pb.UserPresence> {
  const event = await withDeadline(watcher.next(), `an update of ${userId}`);
  assert.ok(event !== undefined, `the watch ended: ${watcher.lastError?.message}`);
  assert.equal(event.kind, "update");
  const user = (event as { user: pb.UserPresence }).user;
  assert.equal(user.userId, userId);
  return user;
}

const register = (userId: string) => ({ userId, sessionId: "s", gatewayId: "tls-gateway" });

for (const [wire, open] of WIRES) {
  test(`T1: over https with the server's CA, a gateway registers and a viewer watches and snapshots (${wire})`, { timeout: TEST_TIMEOUT_MS }, async () => {
    const { pki, server } = serverPki();
    // The CA as PEM text for the viewer's transport, as a file's bytes for the lease wire.
    const presenced = await Server.start(certs.tlsFlags(server), { tls: { ca: pki.ca } });
    assert.match(presenced.url, /^https:\/\/127\.0\.0\.1:\d+$/);
    const channel = open(presenced.url, presenced.transport, { tls: { ca: readFileSync(pki.caPath) } });
    try {
      const watcher = await Watcher.open(presenced.transport, ["alice"]);
      assert.equal(watcher.store.get("alice")?.state, pb.State.OFFLINE);
      const registered = await channel.register(register("alice"));
      const online = await nextUpdate(watcher, "alice");
      assert.equal(online.state, pb.State.ONLINE);
      const snapshot = await presenced.client.snapshot({ userIds: ["alice"] });
      assert.equal(snapshot.users[0]?.state, pb.State.ONLINE, "a unary call over TLS");
      await channel.unregister({ userId: "alice", sessionId: "s", generation: registered.generation });
      const offline = await nextUpdate(watcher, "alice");
      assert.equal(offline.state, pb.State.OFFLINE);
      assert.ok(offline.version > online.version);
      watcher.close();
    } finally {
      channel.close();
      await presenced.kill();
    }
  });

  test(`T1: a client that does not trust the server's CA is refused, and the error says the certificate could not be verified (${wire})`, { timeout: TEST_TIMEOUT_MS }, async () => {
    const { pki, server } = serverPki();
    const presenced = await Server.start(certs.tlsFlags(server), { tls: { ca: pki.ca } });
    const other = new certs.Pki("other");
    try {
      // Another CA, and Node's own roots (no `ca`): neither issued the server's certificate.
      for (const [who, tls] of [["another CA", { ca: other.ca }], ["Node's roots", {}]] as [string, ClientTlsOptions][]) {
        const transport = nodeTransport(presenced.url, { tls });
        const channel = open(presenced.url, transport, { tls });
        try {
          const leases = await refusal(channel.register(register("mallory")), `a register trusting ${who}`);
          assert.match(leases.message, /unable to verify the first certificate/, `a register trusting ${who}`);
          const viewer = await refusal(createClient(Presence, transport).snapshot({ userIds: ["mallory"] }), `a snapshot trusting ${who}`);
          assert.match(viewer.message, /unable to verify the first certificate/, `a snapshot trusting ${who}`);
        } finally {
          channel.close();
        }
      }
      // Nothing got through.
      assert.equal((await presenced.client.snapshot({ userIds: ["mallory"] })).users[0]?.state, pb.State.OFFLINE);
    } finally {
      await presenced.kill();
    }
  });
}

test("T1: a certificate that does not name the host dialled is refused; servername names the one it carries", { timeout: TEST_TIMEOUT_MS }, async () => {
  // A certificate for a DNS name only, dialled at 127.0.0.1.
  const { pki, server } = serverPki(["presence.internal"]);
  const presenced = await Server.start(certs.tlsFlags(server), { tls: { ca: pki.ca, servername: "presence.internal" } });
  const wrongName = connectLeaseChannel(presenced.url, { tls: { ca: pki.ca } });
  const named = connectLeaseChannel(presenced.url, { tls: { ca: pki.ca, servername: "presence.internal" } });
  try {
    const refused = await refusal(wrongName.register(register("bob")), "a register to a certificate of another name");
    assert.match(refused.message, /IP: 127\.0\.0\.1 is not in the cert's list/);
    const viewer = await refusal(
      createClient(Presence, nodeTransport(presenced.url, { tls: { ca: pki.ca } })).snapshot({}),
      "a snapshot to a certificate of another name",
    );
    assert.match(viewer.message, /IP: 127\.0\.0\.1 is not in the cert's list/);
    await named.register(register("bob"));
    // The helper's own transport names it too.
    assert.equal((await presenced.client.snapshot({ userIds: ["bob"] })).users[0]?.state, pb.State.ONLINE);
  } finally {
    wrongName.close();
    named.close();
    await presenced.kill();
  }
});

test("T1: a plaintext lease channel on the TLS port is told to connect with https://", { timeout: TEST_TIMEOUT_MS }, async () => {
  const { pki, server } = serverPki();
  const presenced = await Server.start(certs.tlsFlags(server), { tls: { ca: pki.ca } });
  const plaintext = connectLeaseChannel(presenced.url.replace("https://", "http://"));
  try {
    const refused = await refusal(plaintext.register(register("carol")), "a plaintext register");
    assert.match(refused.message, /this port speaks TLS; connect with https:\/\//);
  } finally {
    plaintext.close();
    await presenced.kill();
  }
});

test("T2: under mutual TLS, no client certificate or one of another CA is refused in the handshake, and the error says which", { timeout: TEST_TIMEOUT_MS }, async () => {
  const { pki, server } = serverPki();
  const clients = new certs.Pki("clients");
  const presenced = await Server.start([...certs.tlsFlags(server), "--tls-client-ca", clients.caPath], {
    tls: { ca: pki.ca, ...certified(clients.issue("tester", ["tester.internal"])) },
  });
  const stranger = new certs.Pki("stranger").issue("stranger", ["gateway.internal"]);
  const cases: [string, ClientTlsOptions, RegExp][] = [
    ["no client certificate", { ca: pki.ca }, /alert certificate required/],
    ["a certificate of another CA", { ca: pki.ca, ...certified(stranger) }, /alert unknown ca/],
  ];
  try {
    for (const [who, tls, says] of cases) {
      const channel = connectLeaseChannel(presenced.url, { tls });
      try {
        const leases = await refusal(channel.register(register("dave")), `a register with ${who}`);
        assert.match(leases.message, says, `a register with ${who}`);
      } finally {
        channel.close();
      }
      const viewer = await refusal(createClient(Presence, nodeTransport(presenced.url, { tls })).snapshot({}), `a snapshot with ${who}`);
      assert.match(viewer.message, says, `a snapshot with ${who}`);
    }
    // A certificate of the clients' CA is let in (no credentials are configured: any caller is a service).
    await presenced.client.snapshot({ userIds: ["dave"] });
  } finally {
    await presenced.kill();
  }
});

test("T2: a client certificate with a listed --tls-service-identity registers without a token; one without is UNAUTHENTICATED", { timeout: TEST_TIMEOUT_MS }, async () => {
  const { pki, server } = serverPki();
  const clients = new certs.Pki("clients");
  const gateway = clients.issue("gateway", ["gateway.internal", GATEWAY_IDENTITY]);
  const browser = clients.issue("browser", ["browser.internal"]);
  const presenced = await Server.start(
    [
      ...certs.tlsFlags(server),
      "--tls-client-ca",
      clients.caPath,
      "--tls-service-identity",
      GATEWAY_IDENTITY,
      "--service-token",
      SERVICE_TOKEN,
    ],
    { tls: { ca: pki.ca, ...certified(gateway) } },
  );
  // The key and certificate as files' bytes.
  const asGateway: ClientTlsOptions = { ca: pki.ca, cert: readFileSync(gateway.cert), key: readFileSync(gateway.key) };
  const channel = connectLeaseChannel(presenced.url, { tls: asGateway });
  const unlisted = connectLeaseChannel(presenced.url, { tls: { ca: pki.ca, ...certified(browser) } });
  try {
    const watcher = await Watcher.open(presenced.transport, ["erin"]);
    const session = await Session.register(channel, register("erin"), { heartbeatMs: 200 });
    assert.equal((await nextUpdate(watcher, "erin")).state, pb.State.ONLINE, "the gateway's register, by its certificate alone");
    const refused = await refusal(unlisted.register(register("frank")), "a register with an unlisted certificate and no token");
    assert.equal(refused.code, Code.Unauthenticated, refused.message);
    // The same unlisted certificate with the service token: the token decides.
    const withToken = connectLeaseChannel(presenced.url, { tls: { ca: pki.ca, ...certified(browser) }, bearerToken: SERVICE_TOKEN });
    try {
      await withToken.register(register("frank"));
    } finally {
      withToken.close();
    }
    await session.close();
    assert.equal((await nextUpdate(watcher, "erin")).state, pb.State.OFFLINE);
    watcher.close();
  } finally {
    channel.close();
    unlisted.close();
    await presenced.kill();
  }
});

test("TLS settings for an http:// URL, or half a client certificate, are refused when the client is made", { timeout: TEST_TIMEOUT_MS }, () => {
  const invalid = (what: string, says: RegExp) => (err: unknown) => {
    const error = ConnectError.from(err);
    assert.equal(error.code, Code.InvalidArgument, what);
    assert.match(error.message, says, what);
    return true;
  };
  const ca = "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n";
  const makers: [string, (url: string, tls: ClientTlsOptions) => unknown][] = [
    ["connectLeaseChannel", (url, tls) => connectLeaseChannel(url, { tls }).close()],
    ["nodeTransport", (url, tls): Transport => nodeTransport(url, { tls })],
  ];
  for (const [maker, make] of makers) {
    assert.throws(() => make("http://127.0.0.1:1", { ca }), invalid(`${maker}: http://`, /need an https:\/\/ base URL/));
    assert.throws(() => make("https://127.0.0.1:1", { ca, cert: ca }), invalid(`${maker}: no key`, /needs both cert and key/));
    assert.throws(() => make("https://127.0.0.1:1", { key: ca }), invalid(`${maker}: no cert`, /needs both cert and key/));
  }
});

/** The client-certificate half of TLS settings: `issued`'s certificate and key, as PEM text. */
function certified(issued: { certPem: string; keyPem: string }): ClientTlsOptions {
  return { cert: issued.certPem, key: issued.keyPem };
}
