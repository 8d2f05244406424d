// The event-stream reader on hand-made bodies split at awkward places. No daemon needed.

import assert from "node:assert/strict";
import { test } from "node:test";

import { readAll, readEvents } from "../src/sse.js";

function body(parts: string[]): ReadableStream<Uint8Array> {
  const enc = new TextEncoder();
  return new ReadableStream({
    start(c) {
      for (const p of parts) c.enqueue(enc.encode(p));
      c.close();
    },
  });
}

async function collect(parts: string[]) {
  const out = [];
  for await (const ev of readEvents(body(parts))) out.push(ev);
  return out;
}

test("events split across chunks, keep-alive comments, CRLF and multi-line data", async () => {
  const events = await collect([
    ": keep-alive\n\nevent: st",
    'art\ndata: {"type":"start","pid":7}\n',
    '\nevent: stdout\r\ndata: {"a":\r\ndata: 1}\r\n\r\n',
    "event: exit\ndata: {}\n\n",
  ]);
  assert.deepEqual(events, [
    { event: "start", data: '{"type":"start","pid":7}' },
    { event: "stdout", data: '{"a":\n1}' },
    { event: "exit", data: "{}" },
  ]);
});

test("a multi-byte character split between chunks survives; a final event without blank line is dropped", async () => {
  const bytes = new TextEncoder().encode("data: café\n\ndata: cut");
  const split = bytes.indexOf(0xc3) + 1;
  const stream = new ReadableStream<Uint8Array>({
    start(c) {
      c.enqueue(bytes.slice(0, split));
      c.enqueue(bytes.slice(split));
      c.close();
    },
  });
  const out = [];
  for await (const ev of readEvents(stream)) out.push(ev);
  assert.deepEqual(out, [{ event: "message", data: "café" }]);
});

/** A body that sends one event and then nothing, forever (like a command that went quiet). */
function quietBody(): { stream: ReadableStream<Uint8Array>; cancelled: Promise<unknown> } {
  let onCancel: (reason: unknown) => void = () => undefined;
  const cancelled = new Promise((r) => (onCancel = r));
  const stream = new ReadableStream<Uint8Array>({
    start(c) {
      c.enqueue(new TextEncoder().encode("event: start\ndata: {}\n\n"));
    },
    cancel(reason) {
      onCancel(reason);
    },
  });
  return { stream, cancelled };
}

test("an abort stops a reader waiting on a quiet body, cancels the body and throws the reason", async () => {
  const { stream, cancelled } = quietBody();
  const ac = new AbortController();
  const seen: string[] = [];
  const start = Date.now();
  setTimeout(() => ac.abort(), 200);
  await assert.rejects(
    (async () => {
      for await (const ev of readEvents(stream, ac.signal)) seen.push(ev.event);
    })(),
    { name: "AbortError" },
  );
  assert.deepEqual(seen, ["start"]);
  assert.ok(Date.now() - start < 2000);
  assert.equal((await cancelled as Error).name, "AbortError");

  const quiet = quietBody();
  const ac2 = new AbortController();
  // (Not AbortSignal.timeout: its timer does not keep the event loop alive, and nothing else here does.)
  setTimeout(() => ac2.abort(new DOMException("too slow", "TimeoutError")), 200);
  await assert.rejects(readAll(quiet.stream, ac2.signal), { name: "TimeoutError" });
  await quiet.cancelled;
});

test("readAll joins the chunks of a body", async () => {
  const bytes = await readAll(body(["ab", "", "cd", "é"]));
  assert.equal(new TextDecoder().decode(bytes), "abcdé");
});
