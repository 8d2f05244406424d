import { CommandExitError, NotFoundError, Sandbox } from "@hearth/sdk";

const sbx = await Sandbox.create({ envs: { GREETING: "hi" } });
try {
  // A non-zero exit rejects with CommandExitError, which carries the result.
  try {
    await sbx.commands.run("echo $GREETING; ls /nowhere");
  } catch (err) {
    if (!(err instanceof CommandExitError)) throw err;
    console.log(`exit ${err.exitCode}, stdout ${JSON.stringify(err.stdout)}`);
  }

  // A background command answers at once with a handle.
  const job = await sbx.commands.run("read name; echo hello $name", { background: true });
  await job.sendStdin("world\n", { eof: true });
  const { stdout } = await job.wait();
  console.log(`pid ${job.pid} said: ${stdout.trim()}`);

  // Any call can be cancelled with an AbortSignal.
  const ac = new AbortController();
  setTimeout(() => ac.abort(), 1000);
  const slow = sbx.commands.run("sleep 60", { signal: ac.signal });
  await slow.catch((err: Error) => console.log(`cancelled: ${err.name}`));
} finally {
  await sbx.kill();
}

// Errors are typed: an unknown id is a NotFoundError.
await Sandbox.connect("sbx_missing").catch((err) => console.log(`missing: ${err instanceof NotFoundError}`));
