// The web console (O4) in a real browser: Debian's chromium, driven by
// playwright-core, loads http://ADDR/console/ from a real presenced and follows
// users over gRPC-Web while a gateway process registers, renews and dies; and
// the same from https://ADDR/console/ when presenced serves TLS (T1).
import assert from "node:assert/strict";
import { mkdirSync, writeFileSync } from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { pathToFileURL } from "node:url";

import { Pki, tlsFlags } from "../certs.mjs";
import { CLIENT, OUT, PATIENCE_MS, launchBrowser, quantile, screenshot, startGateway, startServer } from "./harness.mjs";

const TTL_MS = 2_000;
const row = (userId, state) => `#users-table tr[data-user="${userId}"]${state ? `[data-state="${state}"]` : ""}`;

test("the console shows a user go ONLINE when a gateway registers and OFFLINE within TTL + 1 s after its renewals stop", async (t) => {
  const server = await startServer();
  t.after(server.stop);
  const browser = await launchBrowser();
  t.after(() => browser.close());
  const page = await browser.newPage();
  await page.goto(`${server.url}/console/?users=alice,bob`);
  await page.locator(row("alice", "OFFLINE")).waitFor({ timeout: PATIENCE_MS });
  assert.equal(await page.locator(row("alice")).getAttribute("data-version"), "0", "a user never seen is OFFLINE at version 0");

  const gateway = await startGateway(server.url, [{ userId: "alice", sessionId: "tab-1" }], { ttlMs: TTL_MS, heartbeatMs: 500 });
  t.after(gateway.stop);
  await page.locator(row("alice", "ONLINE")).waitFor({ timeout: PATIENCE_MS });
  const onlineVersion = await page.locator(row("alice")).getAttribute("data-version");
  // The service's figures come in over gRPC-Web too.
  await page.locator('#stats dd[data-figure="sessions"]', { hasText: /^1$/ }).waitFor({ timeout: PATIENCE_MS });
  await page.locator('#stats dd[data-figure="online users"]', { hasText: /^1$/ }).waitFor({ timeout: PATIENCE_MS });
  await screenshot(page, "console-online");

  // The renewals go on for longer than a TTL: nothing changes meanwhile. (A
  // wait for something not to happen has no condition to await.)
  await page.waitForTimeout(TTL_MS + 500);
  assert.equal(await page.locator(row("alice")).getAttribute("data-state"), "ONLINE");
  assert.equal(await page.locator(row("alice")).getAttribute("data-version"), onlineVersion);

  const killedAt = Date.now();
  await gateway.kill();
  await page.locator(row("alice", "OFFLINE")).waitFor({ timeout: PATIENCE_MS });
  const offlineAfterMs = Date.now() - killedAt;
  assert.ok(offlineAfterMs <= TTL_MS + 1_000, `OFFLINE ${offlineAfterMs} ms after the gateway died (TTL ${TTL_MS} ms)`);
  assert.ok(
    BigInt(await page.locator(row("alice")).getAttribute("data-version")) > BigInt(onlineVersion),
    "the OFFLINE carries a newer version",
  );
  assert.equal(await page.locator(row("bob")).getAttribute("data-state"), "OFFLINE");
  await screenshot(page, "console-offline");
});

test("over https: the console loads from presenced's TLS port in a chromium that trusts only that certificate's key, and follows a user's flips over gRPC-Web on the same origin", async (t) => {
  const pki = new Pki("server");
  const certificate = pki.issue("server", ["localhost", "127.0.0.1"]);
  const server = await startServer(tlsFlags(certificate), { tls: true });
  t.after(server.stop);
  assert.match(server.url, /^https:\/\/127\.0\.0\.1:\d+$/);
  const browser = await launchBrowser({ trust: [certificate.certPem] });
  t.after(() => browser.close());
  const page = await browser.newPage();
  const calls = [];
  page.on("request", (request) => {
    if (request.url().includes("/presence.v1.Presence/")) calls.push(request.url());
  });

  const response = await page.goto(`${server.url}/console/?users=alice`);
  assert.equal(response.status(), 200);
  const security = await response.securityDetails();
  assert.ok(security, "the page came over TLS");
  assert.match(security.protocol, /^TLS 1\.[23]$/);
  assert.equal(security.subjectName, "localhost", "the certificate presenced was given");
  assert.equal(await page.evaluate(() => performance.getEntriesByType("navigation")[0].nextHopProtocol), "h2", "HTTP/2, chosen by ALPN");
  await page.locator(row("alice", "OFFLINE")).waitFor({ timeout: PATIENCE_MS });

  const gateway = await startGateway(server.url, [{ userId: "alice", sessionId: "tab-1" }], { ttlMs: TTL_MS, heartbeatMs: 500, ca: pki.caPath });
  t.after(gateway.stop);
  await page.locator(row("alice", "ONLINE")).waitFor({ timeout: PATIENCE_MS });
  await page.locator('#stats dd[data-figure="online users"]', { hasText: /^1$/ }).waitFor({ timeout: PATIENCE_MS });
  await screenshot(page, "console-https");
  await gateway.kill();
  await page.locator(row("alice", "OFFLINE")).waitFor({ timeout: PATIENCE_MS });
  assert.ok(calls.length > 0, "the page called presenced");
  const others = calls.filter((url) => !url.startsWith(`${server.url}/presence.v1.Presence/`));
  assert.deepEqual(others, [], "every gRPC-Web call went to the page's own https:// origin");

  // A server whose certificate's key chromium was not told of is refused: the trust is that one key's.
  const stranger = await startServer(tlsFlags(new Pki("stranger").issue("server", ["localhost", "127.0.0.1"])), { tls: true });
  t.after(stranger.stop);
  await assert.rejects(page.goto(`${stranger.url}/console/`), /net::ERR_CERT_AUTHORITY_INVALID/);
});

test("the console asks for a token when the server has credentials, and works once given one", async (t) => {
  const server = await startServer(["--service-token", "console-secret"]);
  t.after(server.stop);
  const browser = await launchBrowser();
  t.after(() => browser.close());
  const page = await browser.newPage();
  await page.goto(`${server.url}/console/?users=carol`);
  const dialog = page.locator("#token-dialog[open]");
  await dialog.waitFor({ timeout: PATIENCE_MS });
  assert.match(await page.locator("#token-reason").textContent(), /UNAUTHENTICATED|Unauthenticated/i);
  await page.fill("#token-input", "console-secret");
  await page.click("#token-save");
  await page.locator(row("carol", "OFFLINE")).waitFor({ timeout: PATIENCE_MS });
  await page.locator('#stats dd[data-figure="sessions"]', { hasText: /^0$/ }).waitFor({ timeout: PATIENCE_MS });
});

test("figure: time from a flip to the dot changing in the console", async (t) => {
  const flips = Number(process.env.CONSOLE_FLIPS ?? 200);
  const server = await startServer();
  t.after(server.stop);
  const browser = await launchBrowser();
  t.after(() => browser.close());
  const page = await browser.newPage();
  await page.goto(`${server.url}/console/?users=dave`);
  await page.locator(row("dave", "OFFLINE")).waitFor({ timeout: PATIENCE_MS });
  // The page notes when each change of the dot's state reached the DOM.
  await page.evaluate(() => {
    window.dotChanges = [];
    const observer = new MutationObserver((records) => {
      for (const record of records) {
        if (record.attributeName === "data-state" && record.target.dataset?.user === "dave") {
          window.dotChanges.push({ state: record.target.dataset.state, at: Date.now() });
        }
      }
    });
    observer.observe(document.querySelector("#users-table tbody"), { attributes: true, subtree: true, attributeFilter: ["data-state"] });
  });

  const { connectLeaseChannel } = await import(pathToFileURL(path.join(CLIENT, "node.js")).href);
  const channel = connectLeaseChannel(server.url);
  t.after(() => channel.close());
  const latencies = [];
  let generation = 0n;
  for (let i = 0; i < flips; i++) {
    const online = i % 2 === 0;
    const sentAt = Date.now();
    if (online) {
      generation = (await channel.register({ userId: "dave", sessionId: "s", gatewayId: "browser-test", ttlMs: 60_000 })).generation;
    } else {
      await channel.unregister({ userId: "dave", sessionId: "s", generation, lingerMs: 0 });
    }
    const change = await page.waitForFunction((count) => window.dotChanges.length > count && window.dotChanges[count], i, {
      timeout: PATIENCE_MS,
      polling: "raf",
    });
    const { state, at } = await change.jsonValue();
    assert.equal(state, online ? "ONLINE" : "OFFLINE", `flip ${i}`);
    latencies.push(at - sentAt);
  }
  const figures = {
    flips,
    p50_ms: quantile(latencies, 0.5),
    p99_ms: quantile(latencies, 0.99),
    max_ms: Math.max(...latencies),
    measured: "from before the Register/Unregister call to the dot's data-state changing in the DOM (Date.now() on both sides, one machine)",
    date: new Date().toISOString(),
  };
  mkdirSync(OUT, { recursive: true });
  writeFileSync(path.join(OUT, "console-latency.json"), JSON.stringify(figures, null, 2) + "\n");
  console.log(`flip to dot: ${JSON.stringify(figures)}`);
});

const roomRow = (roomId) => `#rooms-table tr[data-room="${roomId}"]`;

test("the console's Rooms list shows every room's count, follows joins live, changes its rooms in place, and caps a list at 10,000", async (t) => {
  // After hooks run in the order they are added: the sessions unregister, and
  // the channel they use closes, before the server stops.
  let channel;
  const sessions = [];
  t.after(async () => {
    for (const session of sessions) await session.close();
    channel?.close();
  });
  const server = await startServer();
  t.after(server.stop);
  const browser = await launchBrowser();
  t.after(() => browser.close());
  const { connectLeaseChannel } = await import(pathToFileURL(path.join(CLIENT, "node.js")).href);
  const { Session } = await import(pathToFileURL(path.join(CLIENT, "index.js")).href);
  channel = connectLeaseChannel(server.url);
  const ann = await Session.register(channel, { userId: "ann", sessionId: "tab-1", gatewayId: "browser-test" });
  sessions.push(ann);
  await ann.join("lobby");

  const page = await browser.newPage();
  const calls = [];
  page.on("request", (request) => {
    if (request.url().includes("/presence.v1.Presence/")) calls.push(new URL(request.url()).pathname);
  });
  await page.goto(`${server.url}/console/?rooms=lobby,doc-1,doc-2`);
  await page.locator(`${roomRow("lobby")}[data-users="1"]`).waitFor({ timeout: PATIENCE_MS });
  assert.deepEqual(await page.locator("#rooms-table tbody tr").evaluateAll((rows) => rows.map((r) => [...r.cells].map((c) => c.textContent))), [
    ["lobby", "1", "1", await page.locator(roomRow("lobby")).getAttribute("data-version")],
    ["doc-1", "0", "0", "0"],
    ["doc-2", "0", "0", "0"],
  ]);
  assert.match(await page.locator("#rooms-summary").textContent(), /^3 rooms, 1 with someone in it$/);

  const bob = await Session.register(channel, { userId: "bob", sessionId: "tab-1", gatewayId: "browser-test" });
  sessions.push(bob);
  const joined = await bob.join("doc-2");
  await page.locator(`${roomRow("doc-2")}[data-users="1"]`).waitFor({ timeout: PATIENCE_MS });
  assert.equal(await page.locator(roomRow("doc-2")).getAttribute("data-version"), String(joined.roomVersion));
  await screenshot(page, "console-rooms");

  // A new list changes the open watch in place: one WatchRoomCounts stream in all.
  await page.fill("#rooms-input", "doc-2, doc-3\nlobby");
  await page.click("#rooms-form button");
  await page.locator(roomRow("doc-1")).waitFor({ state: "detached", timeout: PATIENCE_MS });
  assert.deepEqual(await page.locator("#rooms-table tbody tr").evaluateAll((rows) => rows.map((r) => r.dataset.room)), ["doc-2", "doc-3", "lobby"]);
  await bob.join("doc-3");
  await page.locator(`${roomRow("doc-3")}[data-users="1"]`).waitFor({ timeout: PATIENCE_MS });
  assert.equal(calls.filter((p) => p.endsWith("/WatchRoomCounts")).length, 1, calls.join(" "));
  assert.equal(calls.filter((p) => p.endsWith("/UpdateWatchRoomCounts")).length, 1, calls.join(" "));

  // Past the cap: the first 10,000 are watched, and the page says how many were left out.
  const many = Array.from({ length: 10_005 }, (_, i) => `room-${i}`).join("\n");
  await page.locator("#rooms-input").evaluate((input, text) => (input.value = text), many); // as a paste would
  await page.click("#rooms-form button");
  await page.locator("#rooms-cap:not([hidden])").waitFor({ timeout: PATIENCE_MS });
  assert.match(await page.locator("#rooms-cap").textContent(), /10,005 rooms given.*first 10,000 are shown, the last 5 left out/);
  await page.locator(`${roomRow("room-9999")}[data-counted="true"]`).waitFor({ timeout: PATIENCE_MS });
  assert.equal(await page.locator("#rooms-table tbody tr").count(), 10_000);
  await bob.join("room-9999");
  await page.locator(`${roomRow("room-9999")}[data-users="1"]`).waitFor({ timeout: PATIENCE_MS });
  assert.match(await page.locator("#rooms-summary").textContent(), /^10,000 rooms, 1 with someone in it$/);
});
