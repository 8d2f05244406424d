// Reading response bodies: the daemon's server-sent events (`event:` names the variant, `data:` is one JSON
// object), and whole bodies; both stop promptly when an AbortSignal fires.

/** One parsed event: its name and its data lines joined. */
export interface SseEvent {
  event: string;
  data: string;
}

/**
 * Yields the events of an SSE body as they arrive. Comments (keep-alives) and `id:`/`retry:` are skipped. When
 * `signal` aborts, the body is cancelled and the generator throws the signal's reason (this does not rely on
 * `fetch` erroring a body that is already being read, which it does not do reliably).
 */
export async function* readEvents(body: ReadableStream<Uint8Array>, signal?: AbortSignal): AsyncGenerator<SseEvent> {
  const decoder = new TextDecoder();
  const reader = body.getReader();
  const onAbort = () => void reader.cancel(signal?.reason).catch(() => undefined);
  signal?.addEventListener("abort", onAbort, { once: true });
  let buffer = "";
  let event = "";
  let data: string[] = [];
  try {
    for (;;) {
      signal?.throwIfAborted();
      const { done, value } = await reader.read();
      signal?.throwIfAborted();
      buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
      let nl: number;
      while ((nl = buffer.search(/\r\n|\r|\n/)) >= 0) {
        const line = buffer.slice(0, nl);
        buffer = buffer.slice(nl + (buffer.startsWith("\r\n", nl) ? 2 : 1));
        if (line === "") {
          if (data.length > 0) yield { event: event || "message", data: data.join("\n") };
          event = "";
          data = [];
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "event") event = val;
        else if (field === "data") data.push(val);
      }
      if (done) break;
    }
  } finally {
    signal?.removeEventListener("abort", onAbort);
    // Stops the download when the consumer leaves early (error, abort, or an exit event).
    await reader.cancel().catch(() => undefined);
  }
}

/** Reads a whole body, cancelling it and throwing the signal's reason when `signal` aborts. */
export async function readAll(body: ReadableStream<Uint8Array>, signal?: AbortSignal): Promise<Uint8Array> {
  const reader = body.getReader();
  const onAbort = () => void reader.cancel(signal?.reason).catch(() => undefined);
  signal?.addEventListener("abort", onAbort, { once: true });
  const chunks: Uint8Array[] = [];
  let size = 0;
  try {
    for (;;) {
      signal?.throwIfAborted();
      const { done, value } = await reader.read();
      signal?.throwIfAborted();
      if (done) break;
      chunks.push(value);
      size += value.length;
    }
  } finally {
    signal?.removeEventListener("abort", onAbort);
    await reader.cancel().catch(() => undefined);
  }
  const out = new Uint8Array(size);
  let at = 0;
  for (const c of chunks) {
    out.set(c, at);
    at += c.length;
  }
  return out;
}
