// examples/node-gateway's page in a real browser: two tabs on the example
// gateway, each a user's socket; one watches the other's dot.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync } from "node:fs";
import path from "node:path";
import { createInterface } from "node:readline";
import { test } from "node:test";

import { PATIENCE_MS, REPO, launchBrowser, screenshot, startServer } from "./harness.mjs";

const EXAMPLE = path.join(REPO, "examples", "node-gateway");

async function startExampleGateway(presencedUrl) {
  assert.ok(existsSync(path.join(EXAMPLE, "node_modules")), "install the example first: `npm ci --prefix examples/node-gateway`");
  const child = spawn(process.execPath, [path.join(EXAMPLE, "gateway.mjs")], {
    stdio: ["ignore", "pipe", "inherit"],
    env: { ...process.env, PRESENCED_URL: presencedUrl, PORT: "0", TTL_MS: "2000", HEARTBEAT_MS: "500" },
  });
  const url = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error("the example gateway did not start")), PATIENCE_MS);
    createInterface({ input: child.stdout }).on("line", (line) => {
      const match = /listening on (\S+)/.exec(line);
      if (match) {
        clearTimeout(timer);
        resolve(match[1]);
      }
    });
  });
  return { url, stop: () => (child.exitCode === null ? (child.kill("SIGTERM"), new Promise((r) => child.once("exit", r))) : undefined) };
}

test("the example page shows another user's dot go ONLINE when their tab opens and OFFLINE when it closes", async (t) => {
  const server = await startServer();
  t.after(server.stop);
  const gateway = await startExampleGateway(server.url);
  t.after(gateway.stop);
  const browser = await launchBrowser();
  t.after(() => browser.close());

  const alice = await browser.newPage();
  await alice.goto(`${gateway.url}/?user=alice&watch=bob&room=lobby`);
  const bobDot = alice.locator('#watched li[data-user="bob"]');
  await alice.locator('#watched li[data-user="bob"][data-state="offline"]').waitFor({ timeout: PATIENCE_MS });

  const bob = await browser.newPage();
  await bob.goto(`${gateway.url}/?user=bob&watch=alice&room=lobby`);
  await alice.locator('#watched li[data-user="bob"][data-state="online"]').waitFor({ timeout: PATIENCE_MS });
  await bob.locator('#watched li[data-user="alice"][data-state="online"]').waitFor({ timeout: PATIENCE_MS });
  await alice.locator('#room li[data-user="bob"]').waitFor({ timeout: PATIENCE_MS });
  await screenshot(alice, "example-online");
  const onlineVersion = BigInt(await bobDot.getAttribute("data-version"));

  await bob.close(); // the tab closes: a close frame, an unregister
  await alice.locator('#watched li[data-user="bob"][data-state="offline"]').waitFor({ timeout: PATIENCE_MS });
  assert.ok(BigInt(await bobDot.getAttribute("data-version")) > onlineVersion);
  await alice.locator('#room li[data-user="bob"]').waitFor({ state: "detached", timeout: PATIENCE_MS });
  await screenshot(alice, "example-offline");
});
