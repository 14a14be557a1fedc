// What the browser tests share: a real `presenced serve` (PRESENCED_BIN, by
// default the workspace's target/debug/presenced), Debian's chromium driven by
// playwright-core (CHROMIUM, by default /usr/bin/chromium), gateways as child
// processes (so that one can be killed like a crashed gateway), and waits that
// are conditions with a deadline. Screenshots and figures go to
// target/browser/. Over TLS, certificates come from the repository's
// tests/certs.mjs (openssl), and chromium is told to trust exactly the
// server's key.
import { spawn } from "node:child_process";
import { X509Certificate, createHash } from "node:crypto";
import { existsSync, mkdirSync } from "node:fs";
import path from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

import { chromium } from "playwright-core";

const here = path.dirname(fileURLToPath(import.meta.url));
export const REPO = path.join(here, "..", "..");
export const OUT = path.join(REPO, "target", "browser");
export const CLIENT = path.join(REPO, "clients", "js", "dist", "src");
const BINARY = process.env.PRESENCED_BIN ?? path.join(REPO, "target", "debug", "presenced");
const CHROMIUM = process.env.CHROMIUM ?? "/usr/bin/chromium";

/** How long any one condition may take before a test fails. */
export const PATIENCE_MS = 15_000;

function need(file, what) {
  if (!existsSync(file)) throw new Error(`${file} is missing: ${what}`);
}

/** Lines of a child's stdout, one promise at a time. */
function lines(child) {
  const reader = createInterface({ input: child.stdout });
  const queue = [];
  const waiting = [];
  reader.on("line", (line) => (waiting.length > 0 ? waiting.shift()(line) : queue.push(line)));
  reader.on("close", () => waiting.splice(0).forEach((resolve) => resolve(undefined)));
  return () => (queue.length > 0 ? Promise.resolve(queue.shift()) : new Promise((resolve) => waiting.push(resolve)));
}

/** Resolves with the first line of `child` matching `pattern`, or rejects at the deadline. */
async function firstLine(child, pattern, what) {
  const next = lines(child);
  const deadline = new Promise((_, reject) =>
    setTimeout(() => reject(new Error(`no ${what} within ${PATIENCE_MS} ms`)), PATIENCE_MS).unref(),
  );
  const found = (async () => {
    for (;;) {
      const line = await next();
      if (line === undefined) throw new Error(`${what}: the process ended first`);
      const match = pattern.exec(line);
      if (match) return match;
    }
  })();
  return Promise.race([found, deadline]);
}

/**
 * `presenced serve --listen 127.0.0.1:0 ARGS...`, until `stop()`; its `url`
 * is `https://` when `tls` (ARGS carry `--tls-cert` and `--tls-key`).
 */
export async function startServer(args = [], { tls = false } = {}) {
  need(BINARY, "build it with `cargo build -p presenced` (or set PRESENCED_BIN)");
  const child = spawn(BINARY, ["serve", "--listen", "127.0.0.1:0", ...args], {
    stdio: ["ignore", "pipe", "inherit"],
    env: { ...process.env, RUST_LOG: process.env.RUST_LOG ?? "warn" },
  });
  const [, addr] = await firstLine(child, /listening on (\S+)/, "listening line from presenced");
  return {
    addr,
    url: `${tls ? "https" : "http"}://${addr}`,
    stop: () => stopChild(child),
  };
}

/**
 * A gateway in its own Node process (gateway.mjs): it registers `sessions`
 * through the TypeScript client's LeaseChannel and renews them until it is
 * killed. Resolves once every session is registered. `options.ca`: the file
 * of the CA that issued an https:// server's certificate.
 */
export async function startGateway(serverUrl, sessions, options = {}) {
  need(path.join(CLIENT, "index.js"), "build the TypeScript client: `npm --prefix clients/js ci && npm --prefix clients/js run build`");
  const child = spawn(process.execPath, [path.join(here, "gateway.mjs")], {
    stdio: ["ignore", "pipe", "inherit"],
    env: {
      ...process.env,
      PRESENCED_URL: serverUrl,
      GATEWAY_SESSIONS: JSON.stringify(sessions),
      GATEWAY_TTL_MS: String(options.ttlMs ?? 2_000),
      GATEWAY_HEARTBEAT_MS: String(options.heartbeatMs ?? 500),
      ...(options.ca ? { PRESENCED_CA: options.ca } : {}),
    },
  });
  await firstLine(child, /^registered/, "registration from the gateway");
  return {
    child,
    /** Dies as a crashed gateway does: no unregister, its renewals just stop. */
    kill: () => {
      child.kill("SIGKILL");
      return new Promise((resolve) => (child.exitCode !== null ? resolve() : child.once("exit", resolve)));
    },
    stop: () => stopChild(child),
  };
}

function stopChild(child) {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve();
  child.kill("SIGTERM");
  return new Promise((resolve) => child.once("exit", resolve));
}

/**
 * Debian's chromium, headless. It trusts the keys of `trust` (PEM
 * certificates) and no other untrusted certificate: chromium's
 * `--ignore-certificate-errors-spki-list` pins each one's public key, so a
 * test's server certificate is accepted without trusting everything (as
 * `ignoreHTTPSErrors` would).
 */
export async function launchBrowser({ trust = [] } = {}) {
  need(CHROMIUM, "install it with `bash .ci/install-browser` (Debian's chromium), or set CHROMIUM");
  const args = ["--no-sandbox", "--disable-gpu"];
  if (trust.length > 0) args.push(`--ignore-certificate-errors-spki-list=${trust.map(spkiPin).join(",")}`);
  return chromium.launch({ executablePath: CHROMIUM, headless: true, args });
}

/** The base64 SHA-256 of a PEM certificate's SubjectPublicKeyInfo: the form chromium's SPKI list takes. */
export function spkiPin(certificatePem) {
  const spki = new X509Certificate(certificatePem).publicKey.export({ type: "spki", format: "der" });
  return createHash("sha256").update(spki).digest("base64");
}

/** Saves a screenshot of `page` as target/browser/NAME.png, for people to look at. */
export async function screenshot(page, name) {
  mkdirSync(OUT, { recursive: true });
  const file = path.join(OUT, `${name}.png`);
  await page.screenshot({ path: file, fullPage: true });
  return file;
}

/** The q-quantile of `values` (nearest rank). */
export function quantile(values, q) {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))];
}
