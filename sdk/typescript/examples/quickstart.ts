import { Sandbox } from "@hearth/sdk";

// HEARTH_URL and HEARTH_API_KEY say where the daemon is and how to authenticate.
const sbx = await Sandbox.create("minimal", { timeoutMs: 120_000, metadata: { example: "quickstart" } });
try {
  const { stdout } = await sbx.commands.run("uname -s");
  console.log(`kernel: ${stdout.trim()}`);

  // Output can be streamed as it is produced.
  await sbx.commands.run("for i in 1 2 3; do echo tick $i; sleep 0.2; done", {
    onStdout: (chunk) => process.stdout.write(chunk),
  });

  await sbx.files.write("/root/data/hello.txt", "hello from the host\n");
  const text = await sbx.files.read("/root/data/hello.txt");
  const names = (await sbx.files.list("/root/data")).map((e) => e.name);
  console.log(`read back: ${text.trim()}; directory holds ${names.join(", ")}`);
} finally {
  await sbx.kill();
}
