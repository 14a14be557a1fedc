#!/usr/bin/env node
// Runs every scenario of clients/conformance/scenarios against every client
// given (`--client NAME=COMMAND`): for each, a fresh presenced, the front
// before it, the scenario's timeline played on presenced directly, the
// client's driver pointed at the front; then the scenario's checks. Exits 1
// if any client missed any scenario. See clients/conformance/README.md.
import { spawn } from "node:child_process";
import { createHmac } from "node:crypto";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import readline from "node:readline";
import { fileURLToPath } from "node:url";

import { create } from "../../js/node_modules/@bufbuild/protobuf/dist/esm/index.js";
import {
  RegisterRequestSchema,
  RegisterResponseSchema,
  SetVisibilityRequestSchema,
  SetVisibilityResponseSchema,
  SnapshotRequestSchema,
  SnapshotResponseSchema,
  State,
  Visibility,
} from "../../js/dist/src/gen/presence/v1/presence_pb.js";
import { CODE_NAMES, connect, unary } from "./grpc.mjs";
import { Front } from "./front.mjs";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const ROOT = path.resolve(HERE, "../../..");
const SCENARIOS = path.resolve(HERE, "../scenarios");
const SERVICE_TOKEN = "conformance-service-token";
const JWT_SECRET = "conformance-hs256-secret-of-at-least-32-bytes";
/** How long a driver may take past its scenario's own run before it counts as hung. */
const DRIVER_GRACE_MS = 20_000;

function parseArgs(argv) {
  const clients = [];
  let only;
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--client") {
      const [name, ...command] = (argv[++i] ?? "").split("=");
      if (!name || command.length === 0) throw new Error("--client takes NAME=COMMAND");
      clients.push({ name, command: command.join("=") });
    } else if (argv[i] === "--only") {
      only = argv[++i];
    } else {
      throw new Error(`unknown argument ${argv[i]}: give --client NAME=COMMAND (and --only SCENARIO)`);
    }
  }
  if (clients.length === 0) throw new Error("give at least one --client NAME=COMMAND");
  return { clients, only };
}

/** An HS256 JWT for viewer `subject`, expiring `expiresInMs` from now. */
function viewerToken(subject, expiresInMs) {
  const part = (value) => Buffer.from(JSON.stringify(value)).toString("base64url");
  const body = `${part({ alg: "HS256", typ: "JWT" })}.${part({ sub: subject, exp: Math.floor((Date.now() + expiresInMs) / 1000) })}`;
  return `${body}.${createHmac("sha256", JWT_SECRET).update(body).digest("base64url")}`;
}

/** A fresh in-memory presenced on a free loopback port; resolves {address, process}. */
function startPresenced(secured) {
  const binary = process.env.PRESENCED_BIN ?? path.join(ROOT, "target/debug/presenced");
  const args = ["serve", "--listen", "127.0.0.1:0", "--min-ttl-ms", "100"];
  if (secured) args.push("--service-token", SERVICE_TOKEN, "--viewer-jwt-hs256-secret", JWT_SECRET);
  const child = spawn(binary, args, { stdio: ["ignore", "pipe", "inherit"], env: { ...process.env, RUST_LOG: "error" } });
  return new Promise((resolve, reject) => {
    const lines = readline.createInterface({ input: child.stdout });
    lines.once("line", (line) => {
      const match = /^listening on (.+)$/.exec(line);
      if (match) resolve({ address: match[1], process: child });
      else reject(new Error(`presenced did not start: ${line}`));
    });
    child.once("error", (error) => reject(new Error(`cannot start ${binary}: ${error.message} (set PRESENCED_BIN)`)));
    child.once("exit", (code) => reject(new Error(`presenced exited (${code}) before listening`)));
  });
}

/** The scenario's timeline, played on presenced directly as a service would, at each step's `at_ms`. */
async function playTimeline(session, steps, metadata) {
  const started = Date.now();
  for (const step of steps ?? []) {
    const wait = started + (step.at_ms ?? 0) - Date.now();
    if (wait > 0) await new Promise((resolve) => setTimeout(resolve, wait));
    if (step.register) {
      const request = create(RegisterRequestSchema, { gatewayId: "conformance", ...camel(step.register), ttlMs: step.register.ttl_ms });
      await unary(session, "/presence.v1.Presence/Register", RegisterRequestSchema, request, RegisterResponseSchema, metadata);
    }
    if (step.visible_to_everyone) {
      const request = create(SetVisibilityRequestSchema, { userId: step.visible_to_everyone, visibility: Visibility.EVERYONE });
      await unary(session, "/presence.v1.Presence/SetVisibility", SetVisibilityRequestSchema, request, SetVisibilityResponseSchema, metadata);
    }
  }
}

function camel(fields) {
  return { userId: fields.user_id, sessionId: fields.session_id };
}

/** Runs the driver on `runFile`; resolves {report, exitCode, stdout, stderr, ms}. */
function runDriver(command, runFile, timeoutMs) {
  return new Promise((resolve) => {
    const started = Date.now();
    const child = spawn(`${command} ${JSON.stringify(runFile)}`, { shell: true, cwd: ROOT, stdio: ["ignore", "pipe", "pipe"] });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (chunk) => (stdout += chunk));
    child.stderr.on("data", (chunk) => (stderr += chunk));
    const timer = setTimeout(() => child.kill("SIGKILL"), timeoutMs);
    child.on("close", (exitCode, signal) => {
      clearTimeout(timer);
      const last = stdout.trim().split("\n").pop() ?? "";
      let report;
      try {
        // Generations and versions are 64-bit: kept as decimal strings, exact.
        report = JSON.parse(last.replace(/([:[,]\s*)(-?\d{16,})(?=\s*[,}\]])/g, '$1"$2"'));
      } catch {
        report = { error: signal === "SIGKILL" ? `the driver did not finish within ${timeoutMs} ms` : `no report: ${last}` };
      }
      resolve({ report, exitCode, stdout, stderr, ms: Date.now() - started });
    });
  });
}

/**
 * The checks a scenario's `expect` names. Each takes the run's facts
 * ({report, record, online, scenario, param}) and returns undefined when it
 * holds, else what was seen instead.
 */
const CHECKS = {
  // The driver reported no error.
  no_error: ({ report }) => (report.error === undefined || typeof report.error === "object" ? undefined : report.error),
  // The session is still open at the end / ended.
  session_open: ({ report }) => (report.state === "open" ? undefined : `state ${report.state}`),
  session_closed: ({ report }) => (report.state === "closed" ? undefined : `state ${report.state}`),
  // The session held exactly one generation (never registered again).
  one_generation: ({ report }) => (report.generations?.length === 1 ? undefined : `generations ${JSON.stringify(report.generations)}`),
  // It registered again after losing its lease: a newer generation than the first.
  newer_generation: ({ report }) => {
    const held = (report.generations ?? []).map((generation) => BigInt(generation));
    const rising = held.every((generation, i) => i === 0 || generation > held[i - 1]);
    return held.length >= 2 && rising ? undefined : `generations ${held.join(", ")}`;
  },
  // The first item the client sent after the faulted one was a register of the same session.
  registers_after_fault: ({ record }) => {
    const [fault, next] = afterFault(record);
    if (fault === undefined) return "the fault never matched";
    return next?.kind === "register" && next.session_id === fault.session_id ? undefined : `next item ${JSON.stringify(next)}`;
  },
  // After the faulted item, the session sent no register and no renewal (it stopped for good).
  nothing_after_fault: ({ record, report }) => {
    const [fault] = afterFault(record);
    if (fault === undefined) return "the fault never matched";
    const later = record.items.filter((item) => item.t > fault.t && item.session_id === fault.session_id && item.kind !== "unregister");
    return later.length === 0 ? undefined : `${later.length} items after it, first ${JSON.stringify(later[0])} (state ${report.state})`;
  },
  // After the faulted (shed) renewal: no register, and the next renewal about one beat later.
  next_beat_on_schedule: ({ record, scenario }) => {
    const [fault] = afterFault(record);
    if (fault === undefined) return "the fault never matched";
    const later = record.items.filter((item) => item.t > fault.t && item.session_id === fault.session_id);
    if (later.some((item) => item.kind === "register")) return "registered again after a shed renewal";
    const next = later.find((item) => item.kind === "renew");
    const beat = scenario.client.renew_every_ms;
    if (next === undefined) return "no renewal after the shed one";
    const gap = next.t - fault.t;
    return gap >= beat * 0.5 && gap <= beat * 1.8 ? undefined : `the next renewal ${gap} ms later, the beat is ${beat} ms`;
  },
  // Every item the driver sent was answered OK.
  results_ok: ({ report }) => {
    const results = report.results ?? [];
    return results.length > 0 && results.every((result) => result.code === "OK") ? undefined : JSON.stringify(results);
  },
  // Every item was refused UNAVAILABLE (the move outlasted the wait).
  results_unavailable: ({ report }) => {
    const results = report.results ?? [];
    return results.length > 0 && results.every((result) => result.code === "UNAVAILABLE") ? undefined : JSON.stringify(results);
  },
  // The refused item reached the owner the refusal named.
  reached_named_owner: ({ record }) =>
    record.items.some((item) => item.listener === "second" && item.kind === "register") ? undefined : "nothing reached the named owner",
  // The items refused during the move were sent again, and one after the move was answered.
  waited_out_move: ({ record, scenario }) => {
    const fault = scenario.server.find((entry) => entry.not_owner?.owner === "");
    const registers = record.items.filter((item) => item.kind === "register");
    const first = registers[0]?.t ?? 0;
    const after = registers.filter((item) => item.t >= first + fault.for_ms && item.answer === "PASSED");
    return registers.length >= 2 && after.length >= 1 ? undefined : `registers at ${registers.map((item) => `${item.t}:${item.answer}`).join(", ")}`;
  },
  // Gave up within the wait it was given, not much later.
  gave_up_within_wait: ({ record, scenario, ms }) => {
    const wait = scenario.client.move_wait_ms;
    const registers = record.items.filter((item) => item.kind === "register");
    const span = registers.length ? registers[registers.length - 1].t - registers[0].t : 0;
    return span <= wait + 500 ? undefined : `kept sending for ${span} ms (wait ${wait} ms, driver ${ms} ms)`;
  },
  // The Leases stream was opened again after the front broke it.
  stream_reopened: ({ record }) => {
    const leases = record.streams.filter((stream) => stream.path.endsWith("/Leases"));
    return leases.length >= 2 ? undefined : `${leases.length} Leases streams`;
  },
  // No register of one session reached presenced twice (nothing doubled by a resend).
  no_register_doubled: ({ record }) => {
    const passed = record.items.filter((item) => item.kind === "register" && item.answer === "PASSED");
    const keys = passed.map((item) => `${item.user_id}/${item.session_id}`);
    return new Set(keys).size === keys.length ? undefined : `registers passed on: ${keys.join(", ")}`;
  },
  // Renewals went on after the reopen.
  renewals_after_reopen: ({ record }) => {
    const leases = record.streams.filter((stream) => stream.path.endsWith("/Leases"));
    const last = leases[leases.length - 1]?.stream;
    return record.items.some((item) => item.kind === "renew" && item.stream === last && item.answer === "PASSED")
      ? undefined
      : "no renewal on the reopened stream";
  },
  // presenced holds the scenario's user ONLINE at the end.
  online_at_end: ({ online }) => (online ? undefined : "OFFLINE at presenced"),
  // The watcher's store holds exactly `param` (users, states, versions).
  store_is: ({ report, param }) => {
    const exact = (users) => sorted(Object.fromEntries(Object.entries(users).map(([id, user]) => [id, { state: user.state, version: String(user.version) }])));
    const seen = JSON.stringify(exact(report.users ?? {}));
    return seen === JSON.stringify(exact(param)) ? undefined : `store ${seen}`;
  },
  // The watcher's store holds these users ONLINE (any version).
  store_online: ({ report, param }) => {
    const off = param.filter((user) => report.users?.[user]?.state !== "ONLINE");
    return off.length === 0 ? undefined : `not ONLINE: ${off.join(", ")} (store ${JSON.stringify(report.users)})`;
  },
  // The Watch was opened again with another token, resuming with the versions held.
  watch_reopened_with_new_token: ({ record }) => {
    const watches = record.streams.filter((stream) => stream.path.endsWith("/Watch"));
    if (watches.length < 2) return `${watches.length} Watch openings`;
    if (watches[1].authorization === watches[0].authorization) return "the second opening carried the first token";
    return Object.keys(watches[1].known_versions ?? {}).length > 0 ? undefined : "the reopening resumed with no known_versions";
  },
  // The consumer was told the cursor is out of range, with the oldest cursor, and got no event.
  told_out_of_range: ({ report, scenario }) => {
    const fault = scenario.server.find((entry) => entry.refuse === "OUT_OF_RANGE");
    if (report.error?.code !== "OUT_OF_RANGE") return `error ${JSON.stringify(report.error)}`;
    if (report.error.oldest_cursor_hex !== fault.oldest_cursor_hex) return `oldest cursor ${report.error.oldest_cursor_hex}`;
    return report.events === 0 ? undefined : `${report.events} events handed out`;
  },
  // The refused cursor was not asked for again.
  not_retried: ({ record }) => {
    const opens = record.streams.filter((stream) => stream.path.endsWith("/Changes"));
    return opens.length === 1 ? undefined : `${opens.length} Changes openings`;
  },
  // The feed was opened from the cursor the store held.
  resumed_from_store: ({ record, scenario }) => {
    const open = record.streams.find((stream) => stream.path.endsWith("/Changes"));
    return open?.cursor_hex === scenario.client.cursor_hex ? undefined : `opened at ${open?.cursor_hex}`;
  },
};

function sorted(object) {
  return Object.fromEntries(Object.entries(object).sort(([a], [b]) => a.localeCompare(b)));
}

/** The item a fault answered, and the first item of the same session after it. */
function afterFault(record) {
  const index = record.items.findIndex((item) => item.answer !== "PASSED" && item.answer !== "BROKEN");
  if (index < 0) return [undefined, undefined];
  const fault = record.items[index];
  const next = record.items.slice(index + 1).find((item) => item.session_id === fault.session_id);
  return [fault, next];
}

async function runOne(scenario, client, workDir) {
  const record = { items: [], streams: [] };
  const server = await startPresenced(scenario.secured === true);
  const front = new Front({ upstream: server.address, faults: scenario.server ?? [], slots: scenario.client.slots ?? 64, record });
  const session = connect(server.address);
  const metadata = scenario.secured ? { authorization: `Bearer ${SERVICE_TOKEN}` } : {};
  try {
    const target = await front.listen("main");
    front.secondAddress = await front.listen("second");
    const tokens = scenario.tokens?.map((token) => viewerToken(token.subject, token.expires_in_ms));
    const runFile = path.join(workDir, `${scenario.name}.${client.name}.json`);
    fs.writeFileSync(runFile, JSON.stringify({ scenario: scenario.name, target: `http://${target}`, client: scenario.client, ...(tokens ? { tokens } : {}) }, null, 2));
    const timeline = playTimeline(session, scenario.timeline, metadata);
    const driven = await runDriver(client.command, runFile, (scenario.client.run_ms ?? 0) + (scenario.client.move_wait_ms ?? 0) + DRIVER_GRACE_MS);
    await timeline;
    let online = false;
    const user = scenario.client.user_id;
    if (user !== undefined) {
      const request = create(SnapshotRequestSchema, { userIds: [user] });
      const answer = await unary(session, "/presence.v1.Presence/Snapshot", SnapshotRequestSchema, request, SnapshotResponseSchema, metadata);
      online = answer.users[0]?.state === State.ONLINE;
    }
    const failures = [];
    if (driven.exitCode !== 0) failures.push(`the driver exited ${driven.exitCode}: ${JSON.stringify(driven.report)}`);
    for (const expectation of scenario.expect) {
      const [name, param] = typeof expectation === "string" ? [expectation, undefined] : Object.entries(expectation)[0];
      const check = CHECKS[name];
      if (check === undefined) throw new Error(`${scenario.name}: no check named ${name}`);
      const seen = check({ report: driven.report, record, online, scenario, param, ms: driven.ms });
      if (seen !== undefined) failures.push(`${name}: ${seen}`);
    }
    return { failures, driven, record };
  } finally {
    front.close();
    session.destroy();
    server.process.kill("SIGKILL");
  }
}

async function main() {
  const { clients, only } = parseArgs(process.argv.slice(2));
  const files = fs.readdirSync(SCENARIOS).filter((file) => file.endsWith(".json")).sort();
  const scenarios = files.map((file) => JSON.parse(fs.readFileSync(path.join(SCENARIOS, file), "utf8")));
  const chosen = scenarios.filter((scenario) => only === undefined || scenario.name === only);
  if (chosen.length === 0) throw new Error(`no scenario named ${only}`);
  const workDir = fs.mkdtempSync(path.join(os.tmpdir(), "presenced-conformance-"));
  let missed = 0;
  for (const scenario of chosen) {
    for (const client of clients) {
      const { failures, driven, record } = await runOne(scenario, client, workDir);
      const line = `${failures.length ? "MISSED" : "ok    "} ${client.name.padEnd(10)} ${scenario.name} (${scenario.rule}, ${driven.ms} ms)`;
      console.log(line);
      if (failures.length) {
        missed++;
        for (const failure of failures) console.log(`         ${failure}`);
        if (process.env.CONFORMANCE_VERBOSE) console.log(JSON.stringify({ record, stderr: driven.stderr.slice(-2000) }, null, 1));
        else if (driven.stderr) console.log(`         driver stderr (last lines): ${driven.stderr.trim().split("\n").slice(-5).join(" | ")}`);
      }
    }
  }
  fs.rmSync(workDir, { recursive: true, force: true });
  console.log(`${chosen.length} scenarios x ${clients.length} clients: ${missed === 0 ? "every client passed every scenario" : `${missed} missed`}`);
  process.exit(missed === 0 ? 0 : 1);
}

main().catch((error) => {
  console.error(`conformance: ${error.message}`);
  process.exit(2);
});
