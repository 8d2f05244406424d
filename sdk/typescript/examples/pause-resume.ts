import { Sandbox } from "@hearth/sdk";

// When its timeout passes, this sandbox is paused instead of destroyed.
const sbx = await Sandbox.create({ timeoutMs: 60_000, lifecycle: { onTimeout: "pause" } });
try {
  await sbx.commands.run("echo 'work in progress' > /root/notes.txt");
  const counter = await sbx.commands.run("i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done", {
    background: true,
  });

  // Pause to zero: memory goes to disk, the VM process ends.
  console.log(`state: ${(await sbx.pause()).state}`);

  // Later, possibly from another process: connect resumes it where it was.
  const same = await Sandbox.connect(sbx.id);
  console.log(`state: ${(await same.getInfo()).state}`);
  console.log(`notes: ${(await same.files.read("/root/notes.txt")).trim()}`);
  const running = (await same.commands.list()).some((p) => p.pid === counter.pid && p.exitCode === undefined);
  console.log(`counter still running: ${running}`);
  console.log(`paused for more than 0 s: ${(await same.getUsage()).pausedSeconds > 0}`);
} finally {
  await sbx.kill();
}
