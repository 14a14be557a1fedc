// Bundles the console's script into crates/presence-server/console/app.js,
// beside the page and the stylesheet it belongs to (index.html, console.css:
// sources, edited there); the server builds that directory into its binary.
// app.js is committed, so that building presenced needs neither node nor npm;
// `.ci/run` builds it again and fails if the committed file differs from what
// the source gives.
//
// The TypeScript client is bundled from its source (../clients/js/src, after
// `npm run client` has generated its protobuf code), with its own
// node_modules, so that the page carries one copy of each library.
import { mkdir } from "node:fs/promises";
import { fileURLToPath } from "node:url";
import path from "node:path";

import * as esbuild from "esbuild";

const here = path.dirname(fileURLToPath(import.meta.url));
const client = path.join(here, "..", "clients", "js");
const out = path.join(here, "..", "crates", "presence-server", "console");

await mkdir(out, { recursive: true });
await esbuild.build({
  entryPoints: [path.join(here, "src", "main.ts")],
  outfile: path.join(out, "app.js"),
  bundle: true,
  format: "esm",
  target: "es2022",
  minify: true,
  legalComments: "none",
  charset: "utf8",
  alias: { "@presenced/client": path.join(client, "src") },
  nodePaths: [path.join(client, "node_modules")],
  logLevel: "info",
});
