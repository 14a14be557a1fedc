// The types of certs.mjs, for the TypeScript tests of clients/js.

/** A certificate and key written to files, and their PEM texts. */
export interface Issued {
  cert: string;
  key: string;
  certPem: string;
  keyPem: string;
}

/** A certificate authority whose files live in `dir`. */
export class Pki {
  constructor(name: string, dir?: string);
  readonly name: string;
  readonly dir: string;
  readonly caPath: string;
  readonly caKeyPath: string;
  /** The CA's certificate, PEM text. */
  readonly ca: string;
  issue(stem: string, names: string[]): Issued;
}

export function tlsFlags(issued: Issued): string[];
