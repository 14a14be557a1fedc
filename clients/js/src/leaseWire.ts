/**
 * What a {@link LeaseChannel} sends its batches over: one `Leases` stream at a
 * time, opened by a {@link LeaseWire}.
 *
 * Two wires exist. {@link http2LeaseWire} (`@presenced/client/node`, what
 * `connectLeaseChannel` uses) speaks gRPC over `node:http2` itself with the
 * hand-written codec of `leaseCodec.ts`: it is the fast one, for gateways.
 * {@link transportLeaseWire} goes through any connect `Transport` that can
 * stream both ways, with protobuf-es's own encoding: a `LeaseChannel` built on
 * a transport uses it.
 *
 * [LeaseChannel]: ./leaseChannel.ts
 */
import { ConnectError, createClient } from "@connectrpc/connect";
import type { Transport } from "@connectrpc/connect";

import {
  LeaseBatchSchema,
  Presence,
  type LeaseBatch,
  type LeaseItem,
  type LeaseResult,
} from "./gen/presence/v1/presence_pb.js";

/** Opens `Leases` streams. */
export interface LeaseWire {
  /**
   * Starts a `Leases` call carrying `headers`; batches can be sent on it at
   * once. What comes back goes to `sink`, until `sink.ended` is called once.
   */
  open(headers: Record<string, string> | undefined, sink: LeaseSink): LeaseStream;
  /** Lets go of what the wire holds (its connection); called when the channel closes. */
  close?(): void;
}

/** One open `Leases` call. */
export interface LeaseStream {
  /** Sends `LeaseBatch { batch_id, items }`. */
  send(batchId: number, items: LeaseItem[]): void;
  /** Cancels the call; the sink hears nothing more. */
  abort(): void;
}

/** Where a {@link LeaseStream}'s answers go. */
export interface LeaseSink {
  /** One `LeaseResults`. */
  results(batchId: number, results: LeaseResult[]): void;
  /**
   * The call is over: `undefined` when the server ended it with OK, otherwise
   * the status it ended with, or `UNAVAILABLE` when the stream broke.
   */
  ended(error: ConnectError | undefined): void;
}

/** A {@link LeaseWire} over a connect `Transport` (protobuf-es encodes and decodes). */
export function transportLeaseWire(transport: Transport): LeaseWire {
  const client = createClient(Presence, transport);
  return {
    open(headers, sink) {
      const requests = new RequestStream();
      const abort = new AbortController();
      let over = false;
      const end = (error: ConnectError | undefined): void => {
        if (over) return;
        over = true;
        sink.ended(error);
      };
      const results = client.leases(requests, { signal: abort.signal, ...(headers ? { headers } : {}) });
      void (async (): Promise<void> => {
        try {
          for await (const answer of results) {
            if (over) return;
            sink.results(Number(answer.batchId), answer.results);
          }
          end(undefined);
        } catch (err) {
          end(ConnectError.from(err));
        }
      })();
      return {
        send(batchId, items) {
          const message: LeaseBatch = { $typeName: LeaseBatchSchema.typeName, batchId: BigInt(batchId), items };
          requests.push(message);
        },
        abort() {
          over = true;
          requests.end();
          abort.abort();
        },
      };
    },
  };
}

/**
 * The request side of a `Leases` call through a transport: an async iterable
 * the transport reads and the wire writes. It holds at most the channel's
 * batches in flight, since every batch in it is in flight.
 */
class RequestStream implements AsyncIterable<LeaseBatch> {
  private readonly buffered: LeaseBatch[] = [];
  private reader: ((next: IteratorResult<LeaseBatch>) => void) | undefined;
  private ended = false;

  push(batch: LeaseBatch): void {
    const reader = this.reader;
    if (reader !== undefined) {
      this.reader = undefined;
      reader({ value: batch, done: false });
    } else {
      this.buffered.push(batch);
    }
  }

  end(): void {
    this.ended = true;
    const reader = this.reader;
    if (reader !== undefined) {
      this.reader = undefined;
      reader({ value: undefined, done: true });
    }
  }

  [Symbol.asyncIterator](): AsyncIterator<LeaseBatch> {
    return {
      next: (): Promise<IteratorResult<LeaseBatch>> => {
        const batch = this.buffered.shift();
        if (batch !== undefined) return Promise.resolve({ value: batch, done: false });
        if (this.ended) return Promise.resolve({ value: undefined, done: true });
        return new Promise((resolve) => (this.reader = resolve));
      },
      return: (): Promise<IteratorResult<LeaseBatch>> => {
        this.end();
        return Promise.resolve({ value: undefined, done: true });
      },
      // The transport calls it when the call fails: the stream is over either way.
      throw: (): Promise<IteratorResult<LeaseBatch>> => {
        this.end();
        return Promise.resolve({ value: undefined, done: true });
      },
    };
  }
}
