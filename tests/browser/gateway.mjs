// A gateway process for the browser tests: registers the sessions given in
// GATEWAY_SESSIONS ([{userId, sessionId}]) through the TypeScript client's
// LeaseChannel, prints "registered", and renews them until it is killed. An
// https:// PRESENCED_URL is trusted with the CA in the file PRESENCED_CA.
import { readFileSync } from "node:fs";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const client = path.join(here, "..", "..", "clients", "js", "dist", "src");
const { Session } = await import(pathToFileURL(path.join(client, "index.js")).href);
const { connectLeaseChannel } = await import(pathToFileURL(path.join(client, "node.js")).href);

const ca = process.env.PRESENCED_CA;
const channel = connectLeaseChannel(process.env.PRESENCED_URL, ca ? { tls: { ca: readFileSync(ca) } } : {});
const options = { ttlMs: Number(process.env.GATEWAY_TTL_MS), heartbeatMs: Number(process.env.GATEWAY_HEARTBEAT_MS) };
const sessions = JSON.parse(process.env.GATEWAY_SESSIONS);
await Promise.all(
  sessions.map(({ userId, sessionId }) => Session.register(channel, { userId, sessionId, gatewayId: "browser-test" }, options)),
);
console.log("registered");
process.on("SIGTERM", () => process.exit(0));
