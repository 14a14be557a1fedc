// A push notification worker on presenced's change feed: when a user goes
// OFFLINE, it sends a push notification (here, a line on stdout: "push:
// alice went OFFLINE at 2026-12-06T02:07:52.676Z (cursor 011a...)").
//
// It follows `Changes` (flips only) with the TypeScript client's
// ChangesConsumer and saves the cursor of each batch to a file once the
// batch's notifications are sent, so that a restart (a deploy, a crash,
// kill -9) resumes where it left off: each OFFLINE is pushed at least once.
// What a crash can repeat is the last batch, whose cursor was not saved yet:
// each notification carries its event's cursor, which a push service can
// take as an idempotency key to send it once.
//
// A `gap` (the server lost changes: it crashed before it synced them) and a
// cursor older than the feed retains (the worker was away too long) are
// logged as resync warnings: what went OFFLINE meanwhile cannot be known
// from the feed. A real worker would resync there (a Snapshot of the users
// it cares about); this one goes on from the oldest change retained.
//
// Settings (environment): PRESENCED_URL (http://127.0.0.1:50051),
// PRESENCED_TOKEN (a service token with the `feed` scope, when the server has
// credentials), CURSOR_FILE (push-worker.cursor), and FROM: where a first run
// starts, while the cursor file holds no cursor: `now` (the default: no
// notifications for what happened before the worker existed) or `oldest`.
import { ChangesConsumer, ChangesOutOfRangeError, cursorToHex, pb } from "@presenced/client";
import { FileCursorStore, nodeTransport } from "@presenced/client/node";

const PRESENCED_URL = process.env.PRESENCED_URL ?? "http://127.0.0.1:50051";
const CURSOR_FILE = process.env.CURSOR_FILE ?? "push-worker.cursor";
const FROM = process.env.FROM ?? "now";
if (FROM !== "now" && FROM !== "oldest") {
  console.error(`push-worker: FROM=${FROM}: give \`now\` or \`oldest\``);
  process.exit(2);
}

const feed = await ChangesConsumer.open(nodeTransport(PRESENCED_URL), new FileCursorStore(CURSOR_FILE), {
  from: FROM,
  kinds: [pb.ChangeKind.FLIP],
  bearerToken: process.env.PRESENCED_TOKEN,
});
const resumed = feed.committedCursor === undefined ? `from ${FROM}` : `after ${cursorToHex(feed.committedCursor)}`;
console.log(`push-worker: following ${PRESENCED_URL} ${resumed} (cursor file ${CURSOR_FILE})`);

// A deploy's SIGTERM: stop between batches; what was sent is saved.
process.once("SIGTERM", () => feed.close());

/** Sends one notification; the event's cursor identifies it to the push service. */
async function push(user, event) {
  const at = new Date(Number(event.atMs)).toISOString();
  console.log(`push: ${user.userId} went OFFLINE at ${at} (cursor ${cursorToHex(event.cursor)})`);
}

for (;;) {
  try {
    await feed.run(async (batch) => {
      for (const event of batch.events) {
        const change = event.event;
        if (change.case === "flip" && change.value.state === pb.State.OFFLINE) await push(change.value, event);
        if (change.case === "gap") {
          const lost = change.value.lost === 0n ? "an unknown number of" : String(change.value.lost);
          console.warn(
            `push-worker: resync: presenced lost ${lost} changes after ${cursorToHex(change.value.afterCursor)} ` +
              `(${change.value.reason}); users who went OFFLINE then were not notified`,
          );
        }
      }
    });
    break; // closed
  } catch (err) {
    if (!(err instanceof ChangesOutOfRangeError)) throw err;
    console.warn(`push-worker: resync: ${err.message}; going on from there`);
    await feed.resumeFrom(err.oldestCursor);
  }
}
