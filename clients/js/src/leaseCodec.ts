/**
 * The wire form of the `Leases` stream, written by hand for its hot path.
 *
 * A gateway sends hundreds of thousands of renewals a second, each one item of
 * a `LeaseBatch`, and reads as many `LeaseResult`s back. Going through
 * protobuf-es's reflective `toBinary`/`fromBinary` for every one of them was
 * most of a gateway's CPU (with the garbage it makes), so renewals and their
 * results are encoded and decoded here directly: a batch is sized first and
 * written into one buffer that already holds its gRPC frame header, and a
 * renewal's result is read without building a reader. Every other item, and
 * every result that is not a plain renewal's, goes through protobuf-es as
 * before: they are rare, and it knows every field.
 *
 * The field numbers are those of `proto/presence/v1/presence.proto`; the
 * tests check this codec against protobuf-es in both directions.
 */
import { fromBinary, toBinary } from "@bufbuild/protobuf";

import {
  LeaseItemSchema,
  LeaseResultSchema,
  RenewResponseSchema,
  type LeaseItem,
  type LeaseResult,
  type RenewRequest,
} from "./gen/presence/v1/presence_pb.js";

/** Bytes before a gRPC message on the wire: a compression flag and a 4-byte big-endian length. */
export const FRAME_HEADER_BYTES = 5;

/** Length-delimited field `n`: its tag byte (every field here is below 16). */
const delimited = (field: number): number => (field << 3) | 2;
const varintTag = (field: number): number => field << 3;

// LeaseBatch
const BATCH_ID = varintTag(1);
const BATCH_ITEMS = delimited(2);
// LeaseItem.renew
const ITEM_RENEW = delimited(2);
// RenewRequest
const RENEW_USER_ID = delimited(1);
const RENEW_SESSION_ID = delimited(2);
const RENEW_GENERATION = varintTag(3);
const RENEW_TTL_MS = varintTag(4);
// LeaseResults
const RESULTS_BATCH_ID = varintTag(1);
const RESULTS_RESULT = delimited(2);
// LeaseResult
const RESULT_CODE = varintTag(1);
const RESULT_MESSAGE = delimited(2);
const RESULT_RENEW = delimited(4);
// RenewResponse
const RENEWED_EXPIRES_AT_MS = varintTag(1);
const RENEWED_THROTTLED = varintTag(2);

/**
 * `LeaseBatch { batch_id, items }` as one gRPC frame (header included), ready
 * to be written to the stream.
 */
export function encodeBatchFrame(batchId: number, items: readonly LeaseItem[]): Uint8Array {
  // First pass: every item's size, and what the second would otherwise work
  // out again: a renewal's own size and its generation as a number (bigint
  // arithmetic is slow), the bytes of any other item (from protobuf-es).
  const count = items.length;
  const sizes = new Array<number>(count);
  const renewSizes = new Array<number>(count);
  // Generations are uint64 bigints, and bigint arithmetic is slow: each is
  // split once into two 32-bit halves, which the varint is written from.
  const generationLows = new Array<number>(count);
  const generationHighs = new Array<number>(count);
  const encoded: (Uint8Array | undefined)[] = new Array(count);
  let body = batchId === 0 ? 0 : 1 + varintSize(batchId);
  for (let i = 0; i < count; i++) {
    const item = items[i]!;
    let size: number;
    // A renewal that reports attention (A1) is rare: protobuf-es writes it whole.
    if (item.op.case === "renew" && isPlainRenewal(item.op.value)) {
      const renew = item.op.value;
      scratch.setBigUint64(0, BigInt.asUintN(64, renew.generation), true);
      const low = scratch.getUint32(0, true);
      const high = scratch.getUint32(4, true);
      const inner = renewSize(renew, low, high);
      generationLows[i] = low;
      generationHighs[i] = high;
      renewSizes[i] = inner;
      size = 1 + varintSize(inner) + inner;
    } else {
      const bytes = toBinary(LeaseItemSchema, item);
      encoded[i] = bytes;
      size = bytes.length;
    }
    sizes[i] = size;
    body += 1 + varintSize(size) + size;
  }
  const frame = new Uint8Array(FRAME_HEADER_BYTES + body);
  writeFrameHeader(frame, body);
  let at = FRAME_HEADER_BYTES;
  if (batchId !== 0) {
    frame[at++] = BATCH_ID;
    at = writeVarint(frame, at, batchId);
  }
  for (let i = 0; i < count; i++) {
    frame[at++] = BATCH_ITEMS;
    at = writeVarint(frame, at, sizes[i]!);
    const bytes = encoded[i];
    if (bytes !== undefined) {
      frame.set(bytes, at);
      at += bytes.length;
    } else {
      const renew = (items[i]!.op as { value: RenewRequest }).value;
      at = writeRenewItem(frame, at, renew, renewSizes[i]!, generationLows[i]!, generationHighs[i]!);
    }
  }
  return frame;
}

/** A renewal with no field beyond those {@link writeRenewItem} writes. */
function isPlainRenewal(renew: RenewRequest): boolean {
  return renew.attention === undefined && renew.focusedRoomId === undefined;
}

/** The compression flag (0: none) and the big-endian length of a gRPC frame. */
function writeFrameHeader(frame: Uint8Array, length: number): void {
  frame[0] = 0;
  frame[1] = length >>> 24;
  frame[2] = (length >>> 16) & 0xff;
  frame[3] = (length >>> 8) & 0xff;
  frame[4] = length & 0xff;
}

/** A bigint's 64 bits, read back as two 32-bit halves. */
const scratch = new DataView(new ArrayBuffer(8));

/** The encoded size of `RenewRequest` alone, its generation split into 32-bit halves. */
function renewSize(renew: RenewRequest, low: number, high: number): number {
  let size = 0;
  if (renew.userId.length > 0) size += stringFieldSize(renew.userId);
  if (renew.sessionId.length > 0) size += stringFieldSize(renew.sessionId);
  if (low !== 0 || high !== 0) size += 1 + varint64Size(low, high);
  if (renew.ttlMs !== 0) size += 1 + varintSize(renew.ttlMs);
  return size;
}

/** `LeaseItem { renew }`, whose `RenewRequest` is `size` bytes. */
function writeRenewItem(buf: Uint8Array, at: number, renew: RenewRequest, size: number, low: number, high: number): number {
  buf[at++] = ITEM_RENEW;
  at = writeVarint(buf, at, size);
  if (renew.userId.length > 0) at = writeStringField(buf, at, RENEW_USER_ID, renew.userId);
  if (renew.sessionId.length > 0) at = writeStringField(buf, at, RENEW_SESSION_ID, renew.sessionId);
  if (low !== 0 || high !== 0) {
    buf[at++] = RENEW_GENERATION;
    at = writeVarint64(buf, at, low, high);
  }
  if (renew.ttlMs !== 0) {
    buf[at++] = RENEW_TTL_MS;
    at = writeVarint(buf, at, renew.ttlMs);
  }
  return at;
}

function stringFieldSize(value: string): number {
  const length = utf8Length(value);
  return 1 + varintSize(length) + length;
}

function writeStringField(buf: Uint8Array, at: number, tag: number, value: string): number {
  buf[at++] = tag;
  at = writeVarint(buf, at, utf8Length(value));
  return writeUtf8(buf, at, value);
}

/** UTF-8 bytes of `value`; a lone surrogate counts as U+FFFD, as `TextEncoder` writes it. */
export function utf8Length(value: string): number {
  let length = 0;
  for (let i = 0; i < value.length; i++) {
    const c = value.charCodeAt(i);
    if (c < 0x80) length += 1;
    else if (c < 0x800) length += 2;
    else if (c >= 0xd800 && c < 0xdc00 && i + 1 < value.length && isLowSurrogate(value.charCodeAt(i + 1))) {
      length += 4;
      i++;
    } else length += 3;
  }
  return length;
}

function writeUtf8(buf: Uint8Array, at: number, value: string): number {
  for (let i = 0; i < value.length; i++) {
    let c = value.charCodeAt(i);
    if (c < 0x80) {
      buf[at++] = c;
    } else if (c < 0x800) {
      buf[at++] = 0xc0 | (c >> 6);
      buf[at++] = 0x80 | (c & 0x3f);
    } else if (c >= 0xd800 && c < 0xdc00 && i + 1 < value.length && isLowSurrogate(value.charCodeAt(i + 1))) {
      c = 0x10000 + ((c - 0xd800) << 10) + (value.charCodeAt(++i) - 0xdc00);
      buf[at++] = 0xf0 | (c >> 18);
      buf[at++] = 0x80 | ((c >> 12) & 0x3f);
      buf[at++] = 0x80 | ((c >> 6) & 0x3f);
      buf[at++] = 0x80 | (c & 0x3f);
    } else {
      if (c >= 0xd800 && c < 0xe000) c = 0xfffd; // a lone surrogate
      buf[at++] = 0xe0 | (c >> 12);
      buf[at++] = 0x80 | ((c >> 6) & 0x3f);
      buf[at++] = 0x80 | (c & 0x3f);
    }
  }
  return at;
}

const isLowSurrogate = (c: number): boolean => c >= 0xdc00 && c < 0xe000;

/** The size of a varint of `value`, an integer in [0, 2^53). */
function varintSize(value: number): number {
  let size = 1;
  while (value >= 0x80) {
    value = Math.floor(value / 0x80);
    size++;
  }
  return size;
}

/** Writes `value`, an integer in [0, 2^53), as a varint. */
function writeVarint(buf: Uint8Array, at: number, value: number): number {
  while (value >= 0x80) {
    // `&` takes the low 32 bits, which hold the low 7 whatever the size.
    buf[at++] = (value & 0x7f) | 0x80;
    value = Math.floor(value / 0x80);
  }
  buf[at++] = value;
  return at;
}

/** The size of the varint of the uint64 `high` × 2^32 + `low`. */
function varint64Size(low: number, high: number): number {
  if (high === 0) return varintSize(low);
  const bits = 64 - Math.clz32(high);
  return Math.ceil(bits / 7);
}

/** Writes the uint64 `high` × 2^32 + `low` as a varint, 7 bits at a time from the low end. */
function writeVarint64(buf: Uint8Array, at: number, low: number, high: number): number {
  if (high === 0) return writeVarint(buf, at, low);
  // Four groups of 7 bits come from `low` alone, the fifth straddles the halves.
  for (let i = 0; i < 4; i++) {
    buf[at++] = (low & 0x7f) | 0x80;
    low >>>= 7;
  }
  const rest = (low | (high << 4)) & 0x7f; // low's last 4 bits, high's first 3
  high >>>= 3;
  if (high === 0) {
    buf[at++] = rest;
    return at;
  }
  buf[at++] = rest | 0x80;
  while (high >= 0x80) {
    buf[at++] = (high & 0x7f) | 0x80;
    high >>>= 7;
  }
  buf[at++] = high;
  return at;
}

/** A decoded `LeaseResults`. */
export interface DecodedResults {
  batchId: number;
  results: LeaseResult[];
}

/** Thrown for bytes that are not a `LeaseResults`. */
export class MalformedResults extends Error {}

const utf8 = new TextDecoder("utf-8", { fatal: true });

/** Decodes one `LeaseResults` message (the frame's payload, without its header). */
export function decodeResults(bytes: Uint8Array): DecodedResults {
  const reader = new Reader(bytes);
  let batchId = 0;
  const results: LeaseResult[] = [];
  while (reader.at < bytes.length) {
    const tag = reader.varint();
    if (tag === RESULTS_BATCH_ID) {
      batchId = reader.varint();
    } else if (tag === RESULTS_RESULT) {
      const length = reader.varint();
      const end = reader.take(length);
      results.push(decodeResult(bytes, end - length, end));
    } else {
      reader.skip(tag);
    }
  }
  return { batchId, results };
}

/**
 * One `LeaseResult`: read here when it is a renewal's (or carries no payload),
 * by protobuf-es otherwise.
 */
function decodeResult(bytes: Uint8Array, start: number, end: number): LeaseResult {
  const reader = new Reader(bytes, start, end);
  let code = 0;
  let message = "";
  let renewed: { expiresAtMs: bigint; throttled: boolean } | undefined;
  while (reader.at < end) {
    const tag = reader.varint();
    if (tag === RESULT_CODE) {
      code = reader.varint();
    } else if (tag === RESULT_MESSAGE) {
      const length = reader.varint();
      const stop = reader.take(length);
      message = utf8.decode(bytes.subarray(stop - length, stop));
    } else if (tag === RESULT_RENEW) {
      const length = reader.varint();
      const stop = reader.take(length);
      renewed = decodeRenewed(bytes, stop - length, stop);
      if (renewed === undefined) return fromBinary(LeaseResultSchema, bytes.subarray(start, end));
    } else {
      return fromBinary(LeaseResultSchema, bytes.subarray(start, end));
    }
  }
  const result: LeaseResult = {
    $typeName: LeaseResultSchema.typeName,
    code,
    message,
    result:
      renewed === undefined
        ? { case: undefined }
        : { case: "renew", value: { $typeName: RenewResponseSchema.typeName, ...renewed } },
  };
  return result;
}

/** A `RenewResponse` of the two fields it has today; undefined for anything else (protobuf-es reads it). */
function decodeRenewed(bytes: Uint8Array, start: number, end: number): { expiresAtMs: bigint; throttled: boolean } | undefined {
  const reader = new Reader(bytes, start, end);
  let expiresAtMs = 0n;
  let throttled = false;
  while (reader.at < end) {
    const tag = reader.varint();
    if (tag === RENEWED_EXPIRES_AT_MS) expiresAtMs = reader.int64();
    else if (tag === RENEWED_THROTTLED) throttled = reader.varint() !== 0;
    else return undefined;
  }
  return { expiresAtMs, throttled };
}

/** Reads varints and lengths out of `bytes[at, end)`, refusing to run past `end`. */
class Reader {
  at: number;
  constructor(
    private readonly bytes: Uint8Array,
    start = 0,
    private readonly end = bytes.length,
  ) {
    this.at = start;
  }

  /** A varint below 2^53 (every tag, length, code and id here). */
  varint(): number {
    let value = 0;
    let scale = 1;
    for (let i = 0; i < 8; i++) {
      const byte = this.byte();
      value += (byte & 0x7f) * scale;
      if (byte < 0x80) return value;
      scale *= 0x80;
    }
    throw new MalformedResults("a varint longer than this codec reads");
  }

  /** An int64 varint (up to 10 bytes; negative values take all ten). */
  int64(): bigint {
    const start = this.at;
    let value = 0;
    let scale = 1;
    for (let i = 0; i < 7; i++) {
      const byte = this.byte();
      value += (byte & 0x7f) * scale;
      if (byte < 0x80) return BigInt(value);
      scale *= 0x80;
    }
    // Past 49 bits: exactly, as a bigint.
    this.at = start;
    let big = 0n;
    for (let shift = 0n; shift < 70n; shift += 7n) {
      const byte = this.byte();
      big |= BigInt(byte & 0x7f) << shift;
      if (byte < 0x80) return BigInt.asIntN(64, big);
    }
    throw new MalformedResults("a varint of more than 10 bytes");
  }

  /** Moves past `length` bytes; where they end. */
  take(length: number): number {
    const stop = this.at + length;
    if (stop > this.end) throw new MalformedResults("a field runs past the end of its message");
    this.at = stop;
    return stop;
  }

  /** Moves past the value of a field with `tag` that this codec does not read. */
  skip(tag: number): void {
    switch (tag & 7) {
      case 0:
        while (this.byte() >= 0x80);
        return;
      case 1:
        this.take(8);
        return;
      case 2:
        this.take(this.varint());
        return;
      case 5:
        this.take(4);
        return;
      default:
        throw new MalformedResults(`a field of wire type ${tag & 7}`);
    }
  }

  private byte(): number {
    if (this.at >= this.end) throw new MalformedResults("a message ends inside a field");
    return this.bytes[this.at++]!;
  }
}
