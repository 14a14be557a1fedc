/**
 * The hand-written `Leases` codec against protobuf-es: the bytes of a batch
 * are exactly protobuf-es's, and results decode to exactly what protobuf-es
 * decodes, over every kind of item and result and random values.
 */
import assert from "node:assert/strict";
import { test } from "node:test";

import { create, fromBinary, toBinary, type MessageInitShape } from "@bufbuild/protobuf";

import { pb } from "../src/index.js";
import { MalformedResults, decodeResults, encodeBatchFrame, utf8Length } from "../src/leaseCodec.js";
import { TEST_TIMEOUT_MS } from "./helpers.js";

/** A small deterministic generator, so that a failure repeats. */
function random(seed: number): () => number {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 2 ** 32;
  };
}

/** Strings of the kinds gateways send: empty, ASCII, accented, CJK, emoji, and a lone surrogate. */
const STRINGS = ["", "alice", "user-123456789", "Zoë", "ユーザー", "😀 party", "a\ud800b", "\udc00", "x".repeat(200)];
const GENERATIONS = [0n, 1n, 127n, 128n, 2n ** 32n - 1n, 2n ** 32n, 2n ** 53n + 7n, 2n ** 64n - 1n];
const NUMBERS = [0, 1, 127, 128, 16_384, 45_000, 2 ** 31, 2 ** 32 - 1];

function pick<T>(next: () => number, values: readonly T[]): T {
  return values[Math.floor(next() * values.length)]!;
}

type ItemInit = MessageInitShape<typeof pb.LeaseItemSchema>;

/** Any uint64: the server's generations are stamps well above 2^32. */
function randomGeneration(next: () => number): bigint {
  const high = BigInt(Math.floor(next() * 2 ** 32)) >> BigInt(Math.floor(next() * 33));
  return (high << 32n) | BigInt(Math.floor(next() * 2 ** 32));
}

function randomItem(next: () => number): pb.LeaseItem {
  const generation = next() < 0.5 ? pick(next, GENERATIONS) : randomGeneration(next);
  const user = { userId: pick(next, STRINGS), sessionId: pick(next, STRINGS), generation };
  const kinds: ItemInit[] = [
    { op: { case: "renew", value: { ...user, ttlMs: pick(next, NUMBERS) } } },
    // A renewal that reports attention (A1): every field of it must reach the server.
    {
      op: {
        case: "renew",
        value: {
          ...user,
          ttlMs: pick(next, NUMBERS),
          attention: pick(next, [undefined, pb.Attention.ACTIVE, pb.Attention.BACKGROUND]),
          focusedRoomId: pick(next, [undefined, "", "doc-7"]),
        },
      },
    },
    {
      op: {
        case: "register",
        value: { userId: user.userId, sessionId: user.sessionId, gatewayId: pick(next, STRINGS), metadata: { device: pick(next, STRINGS) } },
      },
    },
    { op: { case: "unregister", value: { ...user, lingerMs: pick(next, NUMBERS) } } },
    { op: { case: "join", value: { ...user, roomId: pick(next, STRINGS) } } },
    { op: { case: "signal", value: { ...user, roomId: "r", kind: "typing", ttlMs: pick(next, NUMBERS) } } },
    {},
  ];
  return create(pb.LeaseItemSchema, pick(next, kinds));
}

test("a batch is written byte for byte as protobuf-es writes it, in one gRPC frame", { timeout: TEST_TIMEOUT_MS }, () => {
  const next = random(7);
  for (let round = 0; round < 5_000; round++) {
    const items = Array.from({ length: Math.floor(next() * 12) }, () => randomItem(next));
    const batchId = pick(next, [0, 1, 300, 2 ** 40 + 3]);
    const frame = encodeBatchFrame(batchId, items);
    const expected = toBinary(pb.LeaseBatchSchema, create(pb.LeaseBatchSchema, { batchId: BigInt(batchId), items }));
    assert.equal(frame[0], 0, "not compressed");
    assert.equal(new DataView(frame.buffer, frame.byteOffset).getUint32(1), expected.length, "the frame's length");
    assert.deepEqual(frame.subarray(5), expected, `round ${round}: ${JSON.stringify(items, (_, v) => (typeof v === "bigint" ? `${v}n` : v))}`);
  }
});

test("UTF-8 lengths are TextEncoder's, lone surrogates included", { timeout: TEST_TIMEOUT_MS }, () => {
  const encoder = new TextEncoder();
  for (const value of [...STRINGS, "\ud83d", "\ud83d\ude00\ud83d", "é".repeat(70)]) {
    assert.equal(utf8Length(value), encoder.encode(value).length, JSON.stringify(value));
  }
});

type ResultInit = MessageInitShape<typeof pb.LeaseResultSchema>;

function randomResult(next: () => number): ResultInit {
  const kinds: ResultInit[] = [
    { result: { case: "renew", value: { expiresAtMs: BigInt(Math.floor(next() * 2 ** 42)), throttled: next() < 0.5 } } },
    { result: { case: "renew", value: { expiresAtMs: pick(next, [0n, -1n, -(2n ** 63n), 2n ** 63n - 1n, 2n ** 49n, 2n ** 56n]) } } },
    { result: { case: "renew", value: {} } },
    { code: 5, message: "no lease for alice/s1" },
    { code: pick(next, [9, 8, 14, 3]), message: pick(next, STRINGS.filter((s) => !/[\ud800-\udfff]/.test(s))) },
    { result: { case: "register", value: { generation: pick(next, GENERATIONS), expiresAtMs: 17n } } },
    { result: { case: "unregister", value: {} } },
    { result: { case: "join", value: {} } },
    {},
  ];
  return pick(next, kinds);
}

test("results decode to exactly what protobuf-es decodes", { timeout: TEST_TIMEOUT_MS }, () => {
  const next = random(11);
  for (let round = 0; round < 2_000; round++) {
    const message = create(pb.LeaseResultsSchema, {
      batchId: BigInt(pick(next, [0, 1, 99, 2 ** 40])),
      results: Array.from({ length: Math.floor(next() * 10) }, () => randomResult(next)),
    });
    const bytes = toBinary(pb.LeaseResultsSchema, message);
    const decoded = decodeResults(bytes);
    const expected = fromBinary(pb.LeaseResultsSchema, bytes);
    assert.equal(decoded.batchId, Number(expected.batchId));
    assert.deepEqual(decoded.results, expected.results, `round ${round}`);
  }
});

test("a result with a field this codec does not know is read by protobuf-es, keeping it", { timeout: TEST_TIMEOUT_MS }, () => {
  const known = toBinary(pb.LeaseResultSchema, create(pb.LeaseResultSchema, { result: { case: "renew", value: { expiresAtMs: 9n } } }));
  // Field 15 (varint 1) inside the result, and field 3 (varint 2) inside its RenewResponse.
  const withUnknown = new Uint8Array([...known, 15 << 3, 1]);
  const renewWithUnknown = new Uint8Array([0x22, 4, 0x08, 9, 3 << 3, 2]);
  for (const result of [withUnknown, renewWithUnknown]) {
    const results = new Uint8Array([0x08, 5, 0x12, result.length, ...result]);
    const decoded = decodeResults(results);
    assert.equal(decoded.batchId, 5);
    assert.deepEqual(decoded.results, fromBinary(pb.LeaseResultsSchema, results).results);
  }
  // An unknown field of LeaseResults itself is skipped.
  assert.deepEqual(decodeResults(new Uint8Array([0x08, 2, 3 << 3, 0x80, 0x01, (4 << 3) | 2, 1, 0])), { batchId: 2, results: [] });
});

test("truncated or malformed results are refused, not misread", { timeout: TEST_TIMEOUT_MS }, () => {
  const bytes = toBinary(
    pb.LeaseResultsSchema,
    create(pb.LeaseResultsSchema, { batchId: 3n, results: [{ result: { case: "renew", value: { expiresAtMs: 1_700_000_000_000n } } }] }),
  );
  // Cut anywhere but after the batch id (bytes 0 and 1), a field is left unfinished.
  for (let cut = 1; cut < bytes.length; cut++) {
    if (cut === 2) continue;
    assert.throws(() => decodeResults(bytes.subarray(0, cut)), MalformedResults, `cut at ${cut}`);
  }
  assert.throws(() => decodeResults(new Uint8Array([0x0f])), MalformedResults, "wire type 7");
  assert.throws(() => decodeResults(new Uint8Array([0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01])), MalformedResults);
});
