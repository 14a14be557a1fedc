/**
 * TLS to an `https://` presenced from Node (contract T1, T2): what a gateway
 * or a Node viewer trusts and presents. Both Node wires take the same
 * {@link ClientTlsOptions}: the `node:http2` lease wire (`connectLeaseChannel`)
 * and connect's gRPC transport (`nodeTransport`); they go to `node:http2`'s
 * `connect` as they are. A page needs none of this: the browser does its TLS.
 */
import type { SecureClientSessionOptions } from "node:http2";

import { Code, ConnectError } from "@connectrpc/connect";

/** A PEM text, as a string or as the bytes of a file (`readFileSync(path)`). */
export type Pem = string | Buffer;

/**
 * TLS settings of a client of an `https://` presenced. Every field is
 * optional: without any, the server's certificate is checked against Node's
 * own roots (and `NODE_EXTRA_CA_CERTS`), for the host of the URL.
 */
export interface ClientTlsOptions {
  /**
   * The CA (or CAs) that issued the server's certificate (PEM): trusted
   * instead of Node's own roots, as `--ca` of the CLI.
   */
  ca?: Pem | Pem[];
  /**
   * A client certificate chain (PEM), for a server under mutual TLS
   * (`--tls-client-ca`); with `key`. A certificate whose identity the server
   * lists with `--tls-service-identity` makes the gateway a service caller
   * without a token.
   */
  cert?: Pem;
  /** The private key of `cert` (PEM). */
  key?: Pem;
  /**
   * The name the server's certificate must carry, and the TLS SNI, when it
   * is not the URL's host (dialling an IP address, or through a tunnel).
   */
  servername?: string;
}

/**
 * The options of `node:http2`'s `connect` for `url` with `tls`; none for an
 * `http://` URL without TLS settings. Refuses, with `INVALID_ARGUMENT`, TLS
 * settings for an `http://` URL (they would be ignored: the traffic would go
 * in the clear) and half a client certificate.
 */
export function secureSessionOptions(url: URL, tls: ClientTlsOptions | undefined): SecureClientSessionOptions | undefined {
  if (tls === undefined) return undefined;
  if (url.protocol !== "https:") {
    throw new ConnectError(`TLS settings need an https:// base URL, got ${url.origin}`, Code.InvalidArgument);
  }
  if ((tls.cert === undefined) !== (tls.key === undefined)) {
    throw new ConnectError("TLS settings: a client certificate needs both cert and key", Code.InvalidArgument);
  }
  const options: SecureClientSessionOptions = {};
  if (tls.ca !== undefined) options.ca = tls.ca;
  if (tls.cert !== undefined) options.cert = tls.cert;
  if (tls.key !== undefined) options.key = tls.key;
  if (tls.servername !== undefined) options.servername = tls.servername;
  return options;
}
