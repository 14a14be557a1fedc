/**
 * A {@link LeaseWire} that speaks gRPC over `node:http2` itself, with the
 * hand-written codec of `leaseCodec.ts`: the `Leases` stream of a Node
 * gateway, without protobuf-es's reflection or connect's async iterables on
 * the path of every renewal.
 *
 * It keeps one HTTP/2 connection and opens each `Leases` call on it, a new
 * connection when that one is gone. The connection is pinged while it is
 * open, so that a server that vanished without closing it (a dead host, a
 * partition) fails the stream within `pingIntervalMs + pingTimeoutMs` and the
 * channel reopens it, as with connect's Node transport.
 *
 * An `https://` base URL speaks TLS, with the CA, client certificate and
 * server name of `options.tls` (see {@link ClientTlsOptions}).
 */
import * as http2 from "node:http2";

import { Code, ConnectError } from "@connectrpc/connect";

import { FRAME_HEADER_BYTES, decodeResults, encodeBatchFrame } from "./leaseCodec.js";
import { codeOf } from "./call.js";
import type { LeaseSink, LeaseStream, LeaseWire } from "./leaseWire.js";
import { type ClientTlsOptions, secureSessionOptions } from "./tls.js";

/** How an {@link http2LeaseWire} watches its connection. */
export interface Http2LeaseWireOptions {
  /** Time between pings on the connection. Default 10 s. */
  pingIntervalMs?: number;
  /** A ping unanswered this long closes the connection, and fails its stream. Default 5 s. */
  pingTimeoutMs?: number;
  /** For an `https://` base URL: the server's CA, a client certificate, the server name. */
  tls?: ClientTlsOptions;
}

/** The largest `LeaseResults` accepted: far above what a batch of the largest size is answered with. */
const MAX_MESSAGE_BYTES = 64 << 20;

const USER_AGENT = "presenced-client-js/0.1.0";

/** A {@link LeaseWire} to the presenced at `baseUrl` (`http://host:port` or `https://...`). */
export function http2LeaseWire(baseUrl: string, options: Http2LeaseWireOptions = {}): LeaseWire {
  const url = new URL(baseUrl);
  if (url.protocol !== "http:" && url.protocol !== "https:") {
    throw new ConnectError(`base URL: ${baseUrl} is neither http: nor https:`, Code.InvalidArgument);
  }
  const path = `${url.pathname.replace(/\/+$/, "")}/presence.v1.Presence/Leases`;
  const pingIntervalMs = options.pingIntervalMs ?? 10_000;
  const pingTimeoutMs = options.pingTimeoutMs ?? 5_000;
  const secure = secureSessionOptions(url, options.tls);
  let connection: Connection | undefined;

  const connect = (): Connection => {
    if (connection !== undefined && connection.usable()) return connection;
    connection?.close();
    connection = new Connection(url.origin, secure, pingIntervalMs, pingTimeoutMs, () => (connection = undefined));
    return connection;
  };

  return {
    open(headers, sink) {
      return openStream(connect(), path, headers, sink);
    },
    close() {
      connection?.close();
      connection = undefined;
    },
  };
}

/** One HTTP/2 connection, pinged while it is open. */
class Connection {
  readonly session: http2.ClientHttp2Session;
  /**
   * The text of the server's GOAWAY, if it sent one with text: why it closed
   * the connection (a plaintext client on a TLS port is told so this way).
   */
  goawayText: string | undefined;
  private readonly pinger: ReturnType<typeof setInterval>;
  private gone = false;

  constructor(
    origin: string,
    secure: http2.SecureClientSessionOptions | undefined,
    pingIntervalMs: number,
    pingTimeoutMs: number,
    onGone: () => void,
  ) {
    // Windows big enough that results never wait for a window update on loopback.
    this.session = http2.connect(origin, { ...secure, settings: { initialWindowSize: 4 << 20 } });
    const drop = (): void => {
      if (this.gone) return;
      this.gone = true;
      clearInterval(this.pinger);
      onGone();
    };
    // A connection error reaches the streams on it; nothing else needs it.
    this.session.on("error", drop);
    this.session.on("goaway", (_code: number, _lastStreamId: number, debug?: Buffer) => {
      if (debug !== undefined && debug.length > 0) this.goawayText = debug.toString("utf8");
      drop();
    });
    this.session.on("close", drop);
    this.session.once("connect", () => this.session.setLocalWindowSize(16 << 20));
    this.pinger = setInterval(() => {
      if (this.session.destroyed) return;
      const timeout = setTimeout(() => this.session.destroy(new Error("presenced did not answer a ping")), pingTimeoutMs);
      try {
        this.session.ping(() => clearTimeout(timeout));
      } catch {
        clearTimeout(timeout);
      }
    }, pingIntervalMs);
    this.pinger.unref();
  }

  usable(): boolean {
    return !this.gone && !this.session.closed && !this.session.destroyed;
  }

  close(): void {
    this.gone = true;
    clearInterval(this.pinger);
    if (!this.session.destroyed) this.session.close();
  }
}

function openStream(
  connection: Connection,
  path: string,
  headers: Record<string, string> | undefined,
  sink: LeaseSink,
): LeaseStream {
  let stream: http2.ClientHttp2Stream;
  try {
    stream = connection.session.request({
      ":method": "POST",
      ":path": path,
      "content-type": "application/grpc+proto",
      te: "trailers",
      "user-agent": USER_AGENT,
      ...headers,
    });
  } catch (err) {
    // A connection that closed under us: the stream fails as a broken one would, later.
    const error = new ConnectError(`the lease stream could not be opened: ${String(err)}`, Code.Unavailable);
    queueMicrotask(() => sink.ended(error));
    return { send() {}, abort() {} };
  }
  let over = false;
  let httpStatus: number | undefined;
  let grpcStatus: number | undefined;
  let grpcMessage = "";
  let failure: Error | undefined;
  let buffered: Uint8Array | undefined;

  const end = (error: ConnectError | undefined): void => {
    if (over) return;
    over = true;
    sink.ended(error);
  };
  const refuse = (error: ConnectError): void => {
    end(error);
    stream.close(http2.constants.NGHTTP2_CANCEL);
  };
  const status = (fields: http2.IncomingHttpHeaders): void => {
    const value = fields["grpc-status"];
    if (value === undefined) return;
    grpcStatus = Number(value);
    grpcMessage = percentDecoded(String(fields["grpc-message"] ?? ""));
  };

  stream.on("response", (fields) => {
    httpStatus = Number(fields[":status"]);
    status(fields); // a trailers-only answer (a refusal before any result)
  });
  stream.on("trailers", status);
  stream.on("error", (err) => (failure = err));
  stream.on("data", (chunk: Uint8Array) => {
    if (over) return;
    let data = buffered === undefined ? chunk : concat(buffered, chunk);
    while (data.length >= FRAME_HEADER_BYTES) {
      if ((data[0]! & 1) !== 0) {
        return refuse(new ConnectError("presenced sent a compressed message, which was not asked for", Code.Internal));
      }
      const length = ((data[1]! << 24) | (data[2]! << 16) | (data[3]! << 8) | data[4]!) >>> 0;
      if (length > MAX_MESSAGE_BYTES) {
        return refuse(new ConnectError(`presenced sent a message of ${length} bytes`, Code.ResourceExhausted));
      }
      if (data.length < FRAME_HEADER_BYTES + length) break;
      const message = data.subarray(FRAME_HEADER_BYTES, FRAME_HEADER_BYTES + length);
      data = data.subarray(FRAME_HEADER_BYTES + length);
      let answer;
      try {
        answer = decodeResults(message);
      } catch (err) {
        return refuse(new ConnectError(`presenced sent lease results that do not decode: ${String(err)}`, Code.Internal));
      }
      sink.results(answer.batchId, answer.results);
      if (over) return;
    }
    buffered = data.length > 0 ? data : undefined;
  });
  const settle = (): void => {
    if (grpcStatus === 0) return end(undefined);
    if (grpcStatus !== undefined) return end(new ConnectError(grpcMessage, codeOf(grpcStatus)));
    if (httpStatus !== undefined && httpStatus !== 200) {
      return end(new ConnectError(`presenced answered HTTP ${httpStatus}`, httpCode(httpStatus)));
    }
    const why = failure !== undefined ? `: ${failureText(failure, connection.goawayText)}` : "";
    end(new ConnectError(`the lease stream closed without a status${why}`, Code.Unavailable));
  };
  // The server's half ended (its status came): the call is over even when
  // no reset follows (presenced sends one; a proxy before it may not), and
  // waiting for "close" would leave the stream half open until the
  // response timeout.
  stream.on("end", () => {
    settle();
    if (!stream.closed && !stream.destroyed) stream.close(http2.constants.NGHTTP2_CANCEL);
  });
  stream.on("close", settle);

  return {
    send(batchId, items) {
      if (over || stream.closed || stream.destroyed) return;
      stream.write(encodeBatchFrame(batchId, items));
    },
    abort() {
      over = true;
      if (!stream.closed && !stream.destroyed) stream.close(http2.constants.NGHTTP2_CANCEL);
    },
  };
}

/**
 * What broke a stream, as its caller should read it. A connection that failed
 * (a TLS handshake that did not trust the server, or that the server refused)
 * cancels the streams waiting on it with its own error as the cause: that
 * cause is the reason. A connection the server closed with a GOAWAY that
 * says why (`this port speaks TLS`) fails its streams with a bare code
 * ("Session closed with error code 1"): the GOAWAY's text is the reason.
 */
function failureText(failure: Error, goawayText: string | undefined): string {
  const cause = (failure as Error & { cause?: unknown }).cause;
  const code = (failure as NodeJS.ErrnoException).code;
  if (code === "ERR_HTTP2_STREAM_CANCEL" && cause instanceof Error) return cause.message.trim();
  if (code === "ERR_HTTP2_SESSION_ERROR" && goawayText !== undefined) return `${failure.message}: ${goawayText}`;
  return failure.message.trim();
}

function concat(a: Uint8Array, b: Uint8Array): Uint8Array {
  const joined = new Uint8Array(a.length + b.length);
  joined.set(a, 0);
  joined.set(b, a.length);
  return joined;
}

/** `grpc-message` is percent-encoded (gRPC over HTTP/2); a malformed one is taken as it is. */
function percentDecoded(value: string): string {
  try {
    return decodeURIComponent(value);
  } catch {
    return value;
  }
}

/** What an HTTP status without a gRPC status means (the gRPC spec's table). */
function httpCode(status: number): Code {
  switch (status) {
    case 400:
      return Code.Internal;
    case 401:
      return Code.Unauthenticated;
    case 403:
      return Code.PermissionDenied;
    case 404:
      return Code.Unimplemented;
    case 429:
    case 502:
    case 503:
    case 504:
      return Code.Unavailable;
    default:
      return Code.Unknown;
  }
}
