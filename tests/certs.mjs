// Certificates made on the spot for the JavaScript test suites (clients/js,
// examples/node-gateway, tests/browser), with the `openssl` CLI (OpenSSL 3:
// Debian's `openssl`, which .ci/install-openssl installs): a CA and the
// certificates it issues, written as PEM files into a directory of the test's
// own. The same shape as the Rust tests' `presence_tls::testing::Pki`.
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { isIP } from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";

const OPENSSL = process.env.OPENSSL ?? "openssl";

/** Runs `openssl ARGS...`; a failure carries what openssl said. */
function openssl(args) {
  try {
    execFileSync(OPENSSL, args, { stdio: ["ignore", "pipe", "pipe"] });
  } catch (err) {
    if (err.code === "ENOENT") {
      throw new Error(`${OPENSSL} is not installed: run \`bash .ci/install-openssl\` (Debian's openssl), or set OPENSSL`);
    }
    throw new Error(`openssl ${args.join(" ")} failed: ${err.stderr?.toString().trim() || err.message}`);
  }
}

/** A subject alternative name: a URI (`spiffe://...`), an IP address, or else a DNS name. */
function san(name) {
  if (name.includes("://")) return `URI:${name}`;
  if (isIP(name) !== 0) return `IP:${name}`;
  return `DNS:${name}`;
}

/**
 * An openssl configuration of its own (not the system's, whose defaults would
 * make every certificate `req -x509` signs a CA): the subject, and the one
 * extension section `-extensions ext` applies.
 */
function config(file, commonName, extensions) {
  const lines = ["[req]", "distinguished_name = dn", "prompt = no", "[dn]", `CN = ${commonName}`, "[ext]", ...extensions];
  writeFileSync(file, lines.join("\n") + "\n");
}

/** A new P-256 key at `key`, and a certificate for it at `cert`: self-signed, or signed by `issuer`. */
function certify({ cert, key, conf, days, issuer }) {
  const signer = issuer === undefined ? [] : ["-CA", issuer.cert, "-CAkey", issuer.key];
  openssl([
    "req", "-x509", "-config", conf, "-extensions", "ext", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
    "-noenc", "-keyout", key, "-out", cert, "-days", String(days), "-sha256", ...signer,
  ]);
}

/** A certificate authority whose files live in `dir`. */
export class Pki {
  /**
   * A new CA named `name`, its certificate at `dir/NAME-ca.pem` (and its key
   * beside it). `dir` defaults to a fresh directory under the system's temp.
   */
  constructor(name, dir = mkdtempSync(path.join(tmpdir(), `presenced-pki-${name}-`))) {
    this.name = name;
    this.dir = dir;
    this.caPath = path.join(dir, `${name}-ca.pem`);
    this.caKeyPath = path.join(dir, `${name}-ca-key.pem`);
    const conf = path.join(dir, `${name}-ca.cnf`);
    config(conf, `${name} test CA`, [
      "basicConstraints = critical, CA:TRUE",
      "keyUsage = critical, keyCertSign, cRLSign, digitalSignature",
      "subjectKeyIdentifier = hash",
    ]);
    certify({ cert: this.caPath, key: this.caKeyPath, conf, days: 3650 });
    /** The CA's certificate, PEM text: what a client trusts. */
    this.ca = readFileSync(this.caPath, "utf8");
  }

  /**
   * A certificate for `names` (DNS names, IP addresses, or URIs such as
   * `spiffe://...`), its first name also the subject's common name, usable by
   * servers and clients (extendedKeyUsage serverAuth, clientAuth); written to
   * `dir/STEM.pem` and `dir/STEM-key.pem`. Returns the paths and the PEM texts.
   */
  issue(stem, names) {
    const cert = path.join(this.dir, `${stem}.pem`);
    const key = path.join(this.dir, `${stem}-key.pem`);
    const conf = path.join(this.dir, `${stem}.cnf`);
    config(conf, names[0] ?? stem, [
      "basicConstraints = critical, CA:FALSE",
      "keyUsage = critical, digitalSignature",
      "extendedKeyUsage = serverAuth, clientAuth",
      ...(names.length > 0 ? [`subjectAltName = ${names.map(san).join(", ")}`] : []),
      "subjectKeyIdentifier = hash",
      "authorityKeyIdentifier = keyid",
    ]);
    certify({ cert, key, conf, days: 365, issuer: { cert: this.caPath, key: this.caKeyPath } });
    return { cert, key, certPem: readFileSync(cert, "utf8"), keyPem: readFileSync(key, "utf8") };
  }
}

/** The flags that make `presenced serve` serve TLS with `issued`'s certificate. */
export function tlsFlags(issued) {
  return ["--tls-cert", issued.cert, "--tls-key", issued.key];
}
