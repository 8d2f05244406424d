// The event-stream reader on hand-made bodies split at awkward places. No daemon needed.

import assert from "node:assert/strict";
import { test } from "node:test";

import { readEvents } from "../src/sse.js";

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
