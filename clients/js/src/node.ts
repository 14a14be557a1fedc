/**
 * `@presenced/client/node`: the Node transport (gRPC over HTTP/2, both ways
 * streaming), which the {@link LeaseChannel} needs. Browsers use
 * `createGrpcWebTransport` of `@connectrpc/connect-web` with the viewer side instead.
 */
import type { Transport } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";

import { LeaseChannel, type LeaseChannelOptions } from "./leaseChannel.js";

/** A gRPC transport to `baseUrl` (for instance `http://127.0.0.1:50051`). */
export function nodeTransport(baseUrl: string): Transport {
  return createGrpcTransport({
    baseUrl,
    // A server that vanished without closing the connection is noticed within
    // seconds, and the streams on it reopened.
    pingIntervalMs: 10_000,
    pingTimeoutMs: 5_000,
  });
}

/** A {@link LeaseChannel} to `baseUrl` over {@link nodeTransport}. */
export function connectLeaseChannel(baseUrl: string, options: LeaseChannelOptions = {}): LeaseChannel {
  return new LeaseChannel(nodeTransport(baseUrl), options);
}
