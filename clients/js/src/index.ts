/**
 * `@presenced/client`: the TypeScript client of presenced.
 *
 * Gateway side (Node, a transport that streams both ways: see `@presenced/client/node`):
 * - {@link LeaseChannel}: one long-lived `Leases` stream shared by every
 *   session of a gateway; single calls are coalesced into batches (L8) and
 *   pipelined under bounded queues, and a broken stream is reopened with
 *   exponential backoff and jitter.
 * - {@link Session}: one socket's lease, renewed in the background (first beat
 *   jittered, then every heartbeat, sooner on `touch()` unless throttled),
 *   registered again when the server lost it (`NOT_FOUND`) with its rooms
 *   joined again, stopped when a newer connection owns it
 *   (`FAILED_PRECONDITION`), unregistered with linger on `close()`.
 *
 * Viewer side (Node and browsers: server streaming only, any connect `Transport`,
 * gRPC-Web in a page):
 * - {@link ViewerStore}: per user the newest presence seen; stale and duplicate
 *   events are dropped by version, a snapshot replaces everything.
 * - {@link Watcher}: a `Watch` that reconnects with backoff and jitter and
 *   resumes with the versions it holds.
 * - {@link RoomView}, {@link RoomWatcher}, {@link RoomCountWatcher}: the same for rooms.
 * - {@link RoomCountsView}, {@link RoomCountsWatcher}: the counts of up to
 *   10,000 rooms on one stream (R7), which changes its rooms in place.
 *
 * Backend side, the change feed (F1, F2; Node and browsers):
 * - {@link ChangesConsumer}: a resumable consumer of `Changes`. It starts after
 *   the cursor a {@link CursorStore} holds (`FileCursorStore` from
 *   `@presenced/client/node`, {@link MemoryCursorStore}, or the caller's own),
 *   hands out the events that arrived together as a {@link ChangeBatch}, and
 *   saves the batch's cursor once the caller commits it; a broken stream is
 *   reopened with backoff and jitter after it. At least once, identified by
 *   cursor; a cursor past retention is a {@link ChangesOutOfRangeError} with
 *   the oldest cursor.
 *
 * Answers from the server are connect's `ConnectError`s with the gRPC codes the
 * contract names; the wire types are the generated ones, re-exported as `pb`.
 */
export { Code, ConnectError, createClient } from "@connectrpc/connect";
export { Backoff, type BackoffOptions } from "./backoff.js";
export {
  type ChangeBatch,
  ChangesConsumer,
  type ChangesOptions,
  ChangesOutOfRangeError,
  type CursorStore,
  cursorFromHex,
  cursorToHex,
  MemoryCursorStore,
} from "./changes.js";
export { ClusterLeases, slotOf } from "./cluster.js";
export { type ClusterView, EtcdFollower, type SlotOwner } from "./etcd.js";
export {
  LeaseChannel,
  leaseResult,
  type LeaseChannelConfig,
  type LeaseChannelOptions,
  type LeaseChannelStats,
  type LeaseResultValue,
} from "./leaseChannel.js";
export { transportLeaseWire, type LeaseSink, type LeaseStream, type LeaseWire } from "./leaseWire.js";
export { Session, type SessionIdentity, type SessionLeases, type SessionOptions, type SessionState } from "./session.js";
export { ViewerStore, Watcher, type WatchOptions, type WatcherEvent } from "./viewer.js";
export { RoomCountWatcher, RoomView, RoomWatcher, type RoomWatchOptions, type RoomWatcherEvent } from "./room.js";
export {
  MAX_WATCHED_ROOMS,
  type RoomCountsChange,
  type RoomCountsEvent,
  RoomCountsView,
  RoomCountsWatcher,
  type RoomCountsWatchOptions,
} from "./roomCounts.js";
export * as pb from "./gen/presence/v1/presence_pb.js";
export { Presence } from "./gen/presence/v1/presence_pb.js";
