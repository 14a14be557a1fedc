/**
 * `@presenced/client/node`: what a Node gateway or backend needs. The
 * transport (gRPC over HTTP/2, both ways streaming) for unary calls,
 * watchers and the change feed's consumer, a {@link LeaseChannel} on the
 * `node:http2` lease wire, and a {@link FileCursorStore} for the consumer's cursor. Browsers use
 * `createGrpcWebTransport` of `@connectrpc/connect-web` with the viewer side instead.
 */
import type { Transport } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";

import { ClusterLeases } from "./cluster.js";
import { http2LeaseWire, type Http2LeaseWireOptions } from "./http2Wire.js";
import { LeaseChannel, type LeaseChannelOptions } from "./leaseChannel.js";
import { type ClientTlsOptions, secureSessionOptions } from "./tls.js";

export { FileCursorStore } from "./cursorFile.js";
export { http2LeaseWire, type Http2LeaseWireOptions } from "./http2Wire.js";
export { type ClientTlsOptions, type Pem } from "./tls.js";

/** How a {@link nodeTransport} connects. */
export interface NodeTransportOptions {
  /** For an `https://` base URL: the server's CA, a client certificate, the server name. */
  tls?: ClientTlsOptions;
}

/**
 * A gRPC transport to `baseUrl` (for instance `http://127.0.0.1:50051`, or
 * `https://presence.internal:50051` with `options.tls`).
 */
export function nodeTransport(baseUrl: string, options: NodeTransportOptions = {}): Transport {
  const secure = secureSessionOptions(new URL(baseUrl), options.tls);
  return createGrpcTransport({
    baseUrl,
    // A server that vanished without closing the connection is noticed within
    // seconds, and the streams on it reopened.
    pingIntervalMs: 10_000,
    pingTimeoutMs: 5_000,
    ...(secure === undefined ? {} : { nodeOptions: secure }),
  });
}

/**
 * A {@link LeaseChannel} to `baseUrl` on its own HTTP/2 connection, with the
 * hand-written `Leases` codec ({@link http2LeaseWire}): the fast one. An
 * `https://` URL speaks TLS with `options.tls`.
 */
export function connectLeaseChannel(
  baseUrl: string,
  options: LeaseChannelOptions & Http2LeaseWireOptions = {},
): LeaseChannel {
  return new LeaseChannel(http2LeaseWire(baseUrl, options), options);
}

/**
 * A {@link ClusterLeases} over the cluster of `slots` slots that the node at
 * `seed` belongs to, with a {@link connectLeaseChannel} of `options` to each
 * node as it is learned. The nodes are reached with the seed's scheme and
 * `options.tls` (one CA and client certificate for every node; a
 * `servername` there would be every node's name).
 */
export function connectClusterLeases(
  seed: string,
  slots: number,
  options: LeaseChannelOptions & Http2LeaseWireOptions = {},
): ClusterLeases {
  return new ClusterLeases(seed, slots, (url) => connectLeaseChannel(url, options));
}
