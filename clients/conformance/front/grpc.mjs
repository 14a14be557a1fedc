// gRPC's framing over node:http2, as much of it as the front needs: messages
// out of a byte stream, a message into a frame, a unary call, and a status
// with its details (google.rpc.Status, encoded by hand: it is three fields).
import http2 from "node:http2";

import { fromBinary, toBinary } from "../../js/node_modules/@bufbuild/protobuf/dist/esm/index.js";
import { BinaryWriter } from "../../js/node_modules/@bufbuild/protobuf/dist/esm/wire/index.js";

/** The canonical codes by name, and names by code. */
export const CODES = {
  OK: 0, CANCELLED: 1, UNKNOWN: 2, INVALID_ARGUMENT: 3, DEADLINE_EXCEEDED: 4, NOT_FOUND: 5,
  ALREADY_EXISTS: 6, PERMISSION_DENIED: 7, RESOURCE_EXHAUSTED: 8, FAILED_PRECONDITION: 9, ABORTED: 10,
  OUT_OF_RANGE: 11, UNIMPLEMENTED: 12, INTERNAL: 13, UNAVAILABLE: 14, DATA_LOSS: 15, UNAUTHENTICATED: 16,
};
export const CODE_NAMES = Object.fromEntries(Object.entries(CODES).map(([name, code]) => [code, name]));

/** Splits a byte stream into gRPC messages: push chunks, get whole messages' bytes. */
export class Deframer {
  #pending = Buffer.alloc(0);

  push(chunk) {
    this.#pending = Buffer.concat([this.#pending, chunk]);
    const messages = [];
    while (this.#pending.length >= 5) {
      const length = this.#pending.readUInt32BE(1);
      if (this.#pending.length < 5 + length) break;
      if (this.#pending[0] !== 0) throw new Error("a compressed gRPC message: the front speaks identity only");
      messages.push(this.#pending.subarray(5, 5 + length));
      this.#pending = this.#pending.subarray(5 + length);
    }
    return messages;
  }
}

/** One message of `schema` as a gRPC frame. */
export function frame(schema, message) {
  const bytes = toBinary(schema, message);
  const header = Buffer.alloc(5);
  header.writeUInt32BE(bytes.length, 1);
  return Buffer.concat([header, Buffer.from(bytes)]);
}

/** The `grpc-status-details-bin` value of a status carrying `details` ([typeName, bytes] pairs). */
export function statusDetails(code, message, details) {
  const writer = new BinaryWriter();
  writer.uint32(8).int32(code);
  writer.uint32(18).string(message);
  for (const [typeName, bytes] of details) {
    writer.uint32(26).fork();
    writer.uint32(10).string(`type.googleapis.com/${typeName}`);
    writer.uint32(18).bytes(bytes);
    writer.join();
  }
  return Buffer.from(writer.finish()).toString("base64");
}

/** A unary call on an HTTP/2 session: resolves with the answer, rejects with `{code, message}`. */
export function unary(session, path, requestSchema, request, responseSchema, metadata = {}) {
  return new Promise((resolve, reject) => {
    const call = session.request({
      ":method": "POST",
      ":path": path,
      "content-type": "application/grpc",
      te: "trailers",
      ...metadata,
    });
    const deframer = new Deframer();
    const messages = [];
    let status;
    const take = (headers) => {
      if (headers["grpc-status"] !== undefined) status = { code: Number(headers["grpc-status"]), message: decodeURIComponent(headers["grpc-message"] ?? "") };
    };
    call.on("response", take);
    call.on("trailers", take);
    call.on("data", (chunk) => messages.push(...deframer.push(chunk)));
    call.on("error", (error) => reject({ code: CODES.UNAVAILABLE, message: String(error) }));
    call.on("close", () => {
      if (status === undefined) reject({ code: CODES.UNAVAILABLE, message: "the call ended without a status" });
      else if (status.code !== 0) reject(status);
      else resolve(fromBinary(responseSchema, messages[0] ?? new Uint8Array()));
    });
    call.end(frame(requestSchema, request));
  });
}

/** An HTTP/2 session to a plaintext gRPC server at `address` (host:port). */
export function connect(address) {
  const session = http2.connect(`http://${address}`);
  session.on("error", () => {});
  return session;
}
