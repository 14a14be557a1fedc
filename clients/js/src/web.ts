/**
 * `@presenced/client/web`: the browser's transport (gRPC-Web, server streaming
 * only), which the viewer side needs, and the connect names a page uses with
 * it, from the same copy of connect as the rest of the client (so that
 * `instanceof ConnectError` and `Code` agree in a bundle).
 */
import type { Transport } from "@connectrpc/connect";
import { createGrpcWebTransport } from "@connectrpc/connect-web";

export { Code, ConnectError, createClient } from "@connectrpc/connect";

/** A gRPC-Web transport to `baseUrl` (a page served by presenced passes `location.origin`). */
export function webTransport(baseUrl: string): Transport {
  return createGrpcWebTransport({ baseUrl, useBinaryFormat: true });
}
