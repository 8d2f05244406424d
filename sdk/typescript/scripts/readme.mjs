// Rebuilds README.md from README.template.md, replacing each `{{examples/NAME.ts}}` line with that file in a
// ```ts block. test/readme.test.ts checks the README includes every example verbatim and runs them.
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const template = readFileSync(join(root, "README.template.md"), "utf8");
const out = template.replace(/^\{\{(examples\/[\w.-]+\.ts)\}\}$/gm, (_, file) => {
  return "```ts\n" + readFileSync(join(root, file), "utf8") + "```";
});
writeFileSync(join(root, "README.md"), out);
console.log("wrote README.md");
