// The fault-injecting front: an HTTP/2 listener that passes every gRPC call
// on to a real presenced, except where the scenario's `server` faults say
// otherwise, and records what the client sent. Lease items are decoded (to
// answer one, or to note it); Watch and Changes openings are decoded (to
// inject into them, end or refuse them); everything else is passed through
// byte for byte.
import http2 from "node:http2";

import { create, fromBinary, fromJson, toBinary } from "../../js/node_modules/@bufbuild/protobuf/dist/esm/index.js";
import {
  ChangesOutOfRangeSchema,
  ChangesRequestSchema,
  LeaseBatchSchema,
  LeaseResultSchema,
  LeaseResultsSchema,
  NotOwnerSchema,
  WatchEventSchema,
  WatchRequestSchema,
} from "../../js/dist/src/gen/presence/v1/presence_pb.js";
import { CODES, Deframer, connect, frame, statusDetails } from "./grpc.mjs";

const SERVICE = "/presence.v1.Presence/";

/** The slot of `id` among `slots`: FNV-1a-32 of its UTF-8 bytes, as presenced computes it. */
export function slotOf(id, slots) {
  let hash = 0x811c9dc5;
  for (const byte of Buffer.from(id, "utf8")) hash = Math.imul(hash ^ byte, 0x01000193);
  return (hash >>> 0) % slots;
}

/** What one lease item is: its kind and whose. */
function describe(item) {
  const { case: kind, value } = item.op;
  return { kind, user_id: value?.userId ?? "", session_id: value?.sessionId ?? "", generation: Number(value?.generation ?? 0n) };
}

/** Response headers to pass on: HTTP/2's own and the connection's are not the front's to copy. */
function passable(headers) {
  const kept = {};
  for (const [name, value] of Object.entries(headers)) {
    if (name === ":status" || !name.startsWith(":")) kept[name] = value;
  }
  return kept;
}

export class Front {
  /**
   * `upstream` is presenced's host:port; `faults` the scenario's `server`
   * list; `record` where what was seen goes ({items, streams}).
   */
  constructor({ upstream, faults, slots, record }) {
    this.upstream = upstream;
    this.faults = faults.map((fault) => ({ ...fault, seen: 0, since: undefined }));
    this.slots = slots;
    this.record = record;
    this.counts = new Map();
    this.streamCount = 0;
    this.servers = [];
    this.sessions = [];
    this.t0 = Date.now();
  }

  /** Listens on a free loopback port as `name` ("main" faults, "second" only passes on); resolves its host:port. */
  async listen(name) {
    const server = http2.createServer();
    server.on("stream", (stream, headers) => this.#serve(name, stream, headers));
    server.on("sessionError", () => {});
    await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
    this.servers.push(server);
    return `127.0.0.1:${server.address().port}`;
  }

  close() {
    for (const server of this.servers) server.close();
    for (const session of this.sessions) session.destroy();
    this.servers = [];
  }

  now() {
    return Date.now() - this.t0;
  }

  #upstreamSession() {
    const session = connect(this.upstream);
    this.sessions.push(session);
    return session;
  }

  /** The `nth` match of a fault whose `on` is `on`, counting every event of that kind seen by the main listener. */
  #faultFor(listener, on, userId) {
    if (listener !== "main") return undefined;
    this.counts.set(on, (this.counts.get(on) ?? 0) + 1);
    const nth = this.counts.get(on);
    for (const fault of this.faults) {
      if (fault.on !== on) continue;
      if (fault.user_id !== undefined && fault.user_id !== userId) continue;
      // A fault lasting `for_ms` answers every matching event from its first match until then.
      if (fault.since !== undefined && fault.for_ms !== undefined && this.now() < fault.since + fault.for_ms) return fault;
      if (fault.since === undefined && nth === (fault.nth ?? 1)) {
        fault.since = this.now();
        return fault;
      }
    }
    return undefined;
  }

  #serve(listener, stream, headers) {
    const path = headers[":path"] ?? "";
    const number = ++this.streamCount;
    const opened = { t: this.now(), listener, path, stream: number, authorization: headers.authorization ?? "" };
    this.record.streams.push(opened);
    stream.on("error", () => {});
    const up = this.#upstreamSession().request({ ...headers, ":authority": this.upstream, ":scheme": "http" });
    up.on("error", () => {});
    const ended = { down: false };
    const endDown = (trailers) => {
      if (ended.down || stream.destroyed || stream.closed) return;
      ended.down = true;
      if (!stream.headersSent) {
        stream.respond({ ":status": 200, "content-type": "application/grpc", ...trailers }, { endStream: true });
      } else {
        stream.trailers = trailers;
        stream.end();
      }
    };
    const respondOnce = (responseHeaders) => {
      if (stream.headersSent || stream.destroyed) return;
      if (responseHeaders["grpc-status"] !== undefined) {
        ended.down = true;
        stream.respond(passable(responseHeaders), { endStream: true });
      } else {
        stream.respond(passable(responseHeaders), { waitForTrailers: true });
        stream.on("wantTrailers", () => stream.sendTrailers(stream.trailers ?? { "grpc-status": "0" }));
      }
    };
    up.on("response", respondOnce);
    up.on("trailers", (trailers) => endDown(passable(trailers)));
    up.on("end", () => endDown(stream.trailers ?? { "grpc-status": "0" }));
    up.on("close", () => endDown({ "grpc-status": String(CODES.UNAVAILABLE), "grpc-message": "presenced closed the call" }));
    stream.on("close", () => {
      if (!up.closed) up.close(http2.constants.NGHTTP2_CANCEL);
    });

    if (path === `${SERVICE}Leases`) this.#leases(listener, stream, up, number, endDown);
    else if (path === `${SERVICE}Watch`) this.#watch(listener, stream, up, opened, endDown);
    else if (path === `${SERVICE}Changes`) this.#changes(listener, stream, up, opened, endDown);
    else {
      stream.pipe(up);
      up.on("data", (chunk) => stream.write(chunk));
    }
  }

  #leases(listener, stream, up, number, endDown) {
    // Batches waiting for presenced's results: the items the front answered itself, by index.
    const answered = new Map();
    const fromClient = new Deframer();
    let broken = false;
    stream.on("data", (chunk) => {
      if (broken) return;
      for (const bytes of fromClient.push(chunk)) {
        const batch = fromBinaryBatch(bytes);
        const breakFault = this.#faultFor(listener, "batch");
        if (breakFault?.break) {
          // Not passed on, not answered: the stream is reset as a dropped
          // connection's would be ("reset"), or ended with UNAVAILABLE and
          // no reset, as a proxy may end it ("status").
          broken = true;
          for (const item of batch.items) this.record.items.push({ ...describe(item), t: this.now(), listener, stream: number, answer: "BROKEN" });
          up.close(http2.constants.NGHTTP2_CANCEL);
          if (breakFault.break === "reset") stream.close(http2.constants.NGHTTP2_INTERNAL_ERROR);
          else endDown({ "grpc-status": String(CODES.UNAVAILABLE), "grpc-message": "conformance front: the stream broke" });
          return;
        }
        const own = new Map();
        const passed = [];
        batch.items.forEach((item, index) => {
          const seen = describe(item);
          const fault = this.#faultFor(listener, seen.kind, seen.user_id);
          const entry = { ...seen, t: this.now(), listener, stream: number, answer: "PASSED" };
          this.record.items.push(entry);
          if (fault?.answer === undefined) {
            passed.push(item);
            return;
          }
          entry.answer = fault.answer;
          own.set(index, this.#answer(fault, seen));
        });
        if (passed.length === batch.items.length) {
          up.write(frame(LeaseBatchSchema, batch));
        } else if (passed.length > 0) {
          answered.set(batch.batchId, { own, total: batch.items.length });
          up.write(frame(LeaseBatchSchema, create(LeaseBatchSchema, { batchId: batch.batchId, items: passed })));
        } else {
          const results = [...own.keys()].sort((a, b) => a - b).map((index) => own.get(index));
          stream.write(frame(LeaseResultsSchema, create(LeaseResultsSchema, { batchId: batch.batchId, results })));
        }
      }
    });
    stream.on("end", () => up.end());
    const fromServer = new Deframer();
    up.on("data", (chunk) => {
      if (broken) return;
      for (const bytes of fromServer.push(chunk)) {
        const results = fromBinaryResults(bytes);
        const spliced = answered.get(results.batchId);
        if (spliced === undefined) {
          stream.write(frame(LeaseResultsSchema, results));
          continue;
        }
        answered.delete(results.batchId);
        const theirs = [...results.results];
        const all = [];
        for (let index = 0; index < spliced.total; index++) all.push(spliced.own.get(index) ?? theirs.shift());
        stream.write(frame(LeaseResultsSchema, create(LeaseResultsSchema, { batchId: results.batchId, results: all })));
      }
    });
  }

  /** The front's own result for an item a fault answers. */
  #answer(fault, seen) {
    const code = fault.answer === "NOT_OWNER" ? CODES.UNAVAILABLE : CODES[fault.answer];
    if (code === undefined) throw new Error(`a fault's answer is not a status code: ${fault.answer}`);
    const result = create(LeaseResultSchema, { code, message: `conformance front: ${fault.answer}` });
    if (fault.answer === "NOT_OWNER") {
      const owner = fault.not_owner?.owner ?? "";
      result.notOwner = create(NotOwnerSchema, {
        slot: slotOf(seen.user_id, this.slots),
        epoch: owner === "" ? 0n : 100n,
        ownerId: owner === "" ? "" : "second",
        ownerAddr: owner === "" ? "" : this.secondAddress,
      });
      result.message = owner === "" ? "conformance front: the slot is moving" : "conformance front: not the owner";
    }
    return result;
  }

  #watch(listener, stream, up, opened, endDown) {
    const fromClient = new Deframer();
    stream.on("data", (chunk) => {
      for (const bytes of fromClient.push(chunk)) {
        const request = fromBinaryWatch(bytes);
        opened.user_ids = request.userIds;
        opened.known_versions = Object.fromEntries(Object.entries(request.knownVersions).map(([user, version]) => [user, Number(version)]));
      }
      up.write(chunk);
    });
    stream.on("end", () => up.end());
    const fault = this.#faultFor(listener, "watch");
    let first = true;
    up.on("data", (chunk) => {
      stream.write(chunk);
      if (!first || fault === undefined) return;
      first = false;
      // After the first message (the opening snapshot): what the fault injects, then its ending.
      setTimeout(() => {
        for (const event of fault.inject ?? []) stream.write(frame(WatchEventSchema, fromJson(WatchEventSchema, event)));
        if (fault.end !== undefined) {
          up.close(http2.constants.NGHTTP2_CANCEL);
          endDown({ "grpc-status": String(CODES[fault.end]), "grpc-message": `conformance front: ${fault.end}` });
        }
      }, fault.after_ms ?? 0);
    });
  }

  #changes(listener, stream, up, opened, endDown) {
    const fault = this.#faultFor(listener, "changes");
    const fromClient = new Deframer();
    stream.on("data", (chunk) => {
      for (const bytes of fromClient.push(chunk)) {
        const request = fromBinaryChanges(bytes);
        opened.cursor_hex = Buffer.from(request.cursor).toString("hex");
      }
      if (fault?.refuse === undefined) up.write(chunk);
    });
    stream.on("end", () => up.end());
    if (fault?.refuse === "OUT_OF_RANGE") {
      up.close(http2.constants.NGHTTP2_CANCEL);
      const oldest = Buffer.from(fault.oldest_cursor_hex, "hex");
      const detail = toBinary(ChangesOutOfRangeSchema, create(ChangesOutOfRangeSchema, { oldestCursor: oldest }));
      const message = "conformance front: the cursor is older than the feed keeps";
      endDown({
        "grpc-status": String(CODES.OUT_OF_RANGE),
        "grpc-message": encodeURIComponent(message),
        "grpc-status-details-bin": statusDetails(CODES.OUT_OF_RANGE, message, [["presence.v1.ChangesOutOfRange", detail]]),
      });
    } else {
      up.on("data", (chunk) => stream.write(chunk));
    }
  }
}

// The decoders, named so that a decoding failure says which message it was.
const fromBinaryBatch = (bytes) => fromBinary(LeaseBatchSchema, bytes);
const fromBinaryResults = (bytes) => fromBinary(LeaseResultsSchema, bytes);
const fromBinaryWatch = (bytes) => fromBinary(WatchRequestSchema, bytes);
const fromBinaryChanges = (bytes) => fromBinary(ChangesRequestSchema, bytes);
