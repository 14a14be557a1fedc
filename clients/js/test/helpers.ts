/**
 * What the tests share: a real `presenced serve` as a child process, found at
 * `PRESENCED_BIN` (default `../../target/debug/presenced` from this package),
 * on a port it picks (it prints `listening on ADDR` first on stdout), and
 * waits that are conditions with a deadline; over TLS with certificates of
 * the repository's `tests/certs.mjs`, which every JavaScript suite shares.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { existsSync, mkdtempSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath, pathToFileURL } from "node:url";

import { createClient, type Client, type Transport } from "@connectrpc/connect";

import { Backoff, LeaseChannel, Presence, type LeaseChannelOptions } from "../src/index.js";
import { type ClientTlsOptions, type Http2LeaseWireOptions, connectLeaseChannel, nodeTransport } from "../src/node.js";
import type * as Certs from "../../../tests/certs.mjs";

/** How long any one condition may take before the test fails. */
export const PATIENCE_MS = 10_000;

/** How long a whole test may take: a wait with no deadline of its own cannot hang the run. */
export const TEST_TIMEOUT_MS = 60_000;

/** This package's directory (tests run compiled, from dist/test). */
const packageDir = fileURLToPath(new URL("../../", import.meta.url));

/** The repository's `target/` directory. */
export const TARGET = join(packageDir, "..", "..", "target");

export const BINARY = process.env.PRESENCED_BIN ?? join(TARGET, "debug", "presenced");

/**
 * Certificates made with the `openssl` CLI (`tests/certs.mjs`, shared with the
 * example gateway's and the browser's tests): loaded from the repository at
 * run time, since the compiled tests run from `dist/test`.
 */
export const certs: typeof Certs = await import(pathToFileURL(join(packageDir, "..", "..", "tests", "certs.mjs")).href);

/**
 * The two ways a gateway builds a LeaseChannel: `connectLeaseChannel` (the
 * `node:http2` wire and its codec) and a channel through a connect transport.
 * Tests of what both must do run over each. (TLS settings, in `options.tls`,
 * are for the `node:http2` wire: the other goes through `transport`, which
 * has its own.)
 */
export const WIRES: [string, (url: string, transport: Transport, options?: LeaseChannelOptions & Http2LeaseWireOptions) => LeaseChannel][] = [
  ["node:http2 wire", (url, _transport, options) => connectLeaseChannel(url, options)],
  ["connect transport", (_url, transport, options) => new LeaseChannel(transport, options)],
];

/** Reconnects quick enough for tests. */
export const fastReconnect = (): Backoff => new Backoff({ initialMs: 20, maxMs: 200 });

/** A running `presenced serve`. */
export class Server {
  readonly url: string;
  readonly transport: Transport;
  readonly client: Client<typeof Presence>;
  private exited: Promise<number | null>;

  private constructor(
    readonly child: ChildProcess,
    readonly addr: string,
    /** Where `--metrics-listen` serves, when asked for. */
    readonly metricsAddr: string | undefined,
    tls: ClientTlsOptions | undefined,
  ) {
    this.url = `${tls === undefined ? "http" : "https"}://${addr}`;
    this.transport = nodeTransport(this.url, { tls });
    this.client = createClient(Presence, this.transport);
    this.exited = new Promise((resolve) => child.once("exit", (code) => resolve(code)));
  }

  /**
   * Starts `presenced serve --listen LISTEN ARGS...` (LISTEN defaults to port 0),
   * with `--metrics-listen` on a free port when `metrics` is set. With `tls`
   * (a server started with `--tls-cert` in ARGS), `url` is `https://` and
   * `transport` and `client` connect with those TLS settings.
   */
  static async start(
    args: string[] = [],
    options: { listen?: string; metrics?: boolean; binary?: string; tls?: ClientTlsOptions } = {},
  ): Promise<Server> {
    const binary = options.binary ?? BINARY;
    if (!existsSync(binary)) {
      const profile = binary.includes("release") ? " --release" : "";
      throw new Error(
        `no presenced binary at ${binary}: run \`cargo build${profile} -p presenced\` in the repository (or set PRESENCED_BIN)`,
      );
    }
    const metricsAddr = options.metrics ? `127.0.0.1:${await freePort()}` : undefined;
    const all = ["serve", "--listen", options.listen ?? "127.0.0.1:0", ...(metricsAddr ? ["--metrics-listen", metricsAddr] : []), ...args];
    const child = spawn(binary, all, {
      stdio: ["ignore", "pipe", "inherit"],
      env: { ...process.env, RUST_LOG: process.env.PRESENCED_TEST_LOG ?? "warn" },
    });
    const firstLine = await new Promise<string>((resolve, reject) => {
      const lines = createInterface({ input: child.stdout! });
      const timer = setTimeout(() => reject(new Error("presenced printed no `listening on ADDR` line")), PATIENCE_MS);
      lines.once("line", (line) => {
        clearTimeout(timer);
        lines.close();
        resolve(line);
      });
      child.once("exit", (code) => {
        clearTimeout(timer);
        reject(new Error(`presenced exited (${code}) before listening: ${all.join(" ")}`));
      });
    });
    const prefix = "listening on ";
    if (!firstLine.startsWith(prefix)) throw new Error(`first stdout line must be \`listening on ADDR\`, got ${firstLine}`);
    // The rest of stdout is not read: let it drain so that the child never blocks on it.
    child.stdout!.resume();
    return new Server(child, firstLine.slice(prefix.length).trim(), metricsAddr, options.tls);
  }

  /** SIGTERM, and waits for a clean exit (a graceful shutdown writes the final checkpoint). */
  async stop(): Promise<void> {
    if (this.child.exitCode !== null) return;
    this.child.kill("SIGTERM");
    const code = await withDeadline(this.exited, "presenced to exit after SIGTERM");
    if (code !== 0) throw new Error(`graceful shutdown exits 0, got ${code}`);
  }

  /** SIGKILL: no shutdown at all. */
  async kill(): Promise<void> {
    if (this.child.exitCode !== null || this.child.signalCode !== null) return;
    this.child.kill("SIGKILL");
    await withDeadline(this.exited, "presenced to die after SIGKILL");
  }

  /** `GET /metrics`. */
  async metrics(): Promise<string> {
    if (this.metricsAddr === undefined) throw new Error("started without metrics");
    const response = await fetch(`http://${this.metricsAddr}/metrics`);
    return response.text();
  }

  /** One sample, `name{labels} value`, of the metrics now (0 when absent). */
  async sample(series: string): Promise<number> {
    return sample(await this.metrics(), series);
  }
}

/** The value of one sample line, `name{labels} value`; 0 when the series is absent. */
export function sample(metrics: string, series: string): number {
  for (const line of metrics.split("\n")) {
    if (line.startsWith(series + " ")) return Number(line.slice(series.length).trim());
  }
  return 0;
}

/** A free loopback port, for a listener that must be told one. */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      server.close(() => resolve(typeof address === "object" && address !== null ? address.port : 0));
    });
  });
}

/** A fresh scratch directory. */
export function scratchDir(name: string): string {
  return mkdtempSync(join(tmpdir(), `presenced-js-${name}-`));
}

/** Waits until `condition` holds, checking every 10 ms, failing after `ms`. */
export async function until(what: string, condition: () => boolean | Promise<boolean>, ms = PATIENCE_MS): Promise<void> {
  const deadline = performance.now() + ms;
  for (;;) {
    if (await condition()) return;
    if (performance.now() > deadline) throw new Error(`${what}: not within ${ms} ms`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

/** `promise`, or a failure naming `what` after `ms`. */
export async function withDeadline<T>(promise: Promise<T>, what: string, ms = PATIENCE_MS): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: not within ${ms} ms`)), ms);
  });
  try {
    return await Promise.race([promise, late]);
  } finally {
    clearTimeout(timer);
  }
}
