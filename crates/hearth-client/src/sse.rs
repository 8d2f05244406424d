//! An incremental parser for `text/event-stream` (Server-Sent Events) as the WHATWG spec describes it:
//! lines end with LF, CRLF or CR; `field: value` lines build an event; a blank line dispatches it; lines
//! starting with `:` are comments (keep-alives). Chunks from the network may split lines, and even a CRLF pair,
//! anywhere; the parser keeps the partial line and never holds more than its limits.

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field; `message` when the server sent none.
    pub event: String,
    /// The `data:` lines, joined with `\n`.
    pub data: String,
    /// The `id:` field of this event, if any.
    pub id: Option<String>,
}

/// The stream broke a limit: a line or an event longer than the parser accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("event-stream line longer than {limit} bytes")]
    LineTooLong { limit: usize },
    #[error("event-stream event larger than {limit} bytes")]
    EventTooLarge { limit: usize },
}

/// Default longest line: a 256 KiB output chunk in base64 inside JSON is about 350 KiB.
pub const DEFAULT_MAX_LINE: usize = 1024 * 1024;
/// Default largest event (all its data lines together).
pub const DEFAULT_MAX_EVENT: usize = 4 * 1024 * 1024;

/// Incremental SSE parser. Feed it bytes with [`SseParser::push`]; it returns the events completed so far.
#[derive(Debug)]
pub struct SseParser {
    max_line: usize,
    max_event: usize,
    /// Bytes of the current, unfinished line.
    line: Vec<u8>,
    /// The previous chunk ended with CR: a LF at the start of the next one belongs to that line end.
    after_cr: bool,
    event: String,
    data: String,
    has_data: bool,
    id: Option<String>,
    /// Set once a limit was broken: the stream cannot be trusted to be in sync any more.
    failed: Option<SseError>,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_LINE, DEFAULT_MAX_EVENT)
    }
}

impl SseParser {
    pub fn new(max_line: usize, max_event: usize) -> Self {
        SseParser {
            max_line,
            max_event,
            line: Vec::new(),
            after_cr: false,
            event: String::new(),
            data: String::new(),
            has_data: false,
            id: None,
            failed: None,
        }
    }

    /// Consumes a chunk and returns the events it completed, in order. After an error every later call
    /// returns the same error.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<SseEvent>, SseError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let mut out = Vec::new();
        let mut rest = chunk;
        if self.after_cr && !rest.is_empty() {
            self.after_cr = false;
            if let Some(stripped) = rest.strip_prefix(b"\n") {
                rest = stripped;
            }
        }
        while let Some(pos) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.append_to_line(&rest[..pos])?;
            let line = std::mem::take(&mut self.line);
            self.process_line(&line, &mut out)?;
            if rest[pos] == b'\r' {
                match rest.get(pos + 1) {
                    Some(b'\n') => rest = &rest[pos + 2..],
                    Some(_) => rest = &rest[pos + 1..],
                    None => {
                        self.after_cr = true;
                        rest = &[];
                    }
                }
            } else {
                rest = &rest[pos + 1..];
            }
        }
        self.append_to_line(rest)?;
        Ok(out)
    }

    fn append_to_line(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        if self.line.len() + bytes.len() > self.max_line {
            return Err(self.fail(SseError::LineTooLong { limit: self.max_line }));
        }
        self.line.extend_from_slice(bytes);
        Ok(())
    }

    fn fail(&mut self, err: SseError) -> SseError {
        self.failed = Some(err.clone());
        self.line = Vec::new();
        self.data = String::new();
        err
    }

    fn process_line(&mut self, line: &[u8], out: &mut Vec<SseEvent>) -> Result<(), SseError> {
        if line.is_empty() {
            self.dispatch(out);
            return Ok(());
        }
        if line[0] == b':' {
            return Ok(());
        }
        // Invalid UTF-8 cannot be a valid event; decode lossily so that garbage becomes a decode error of the
        // event's JSON later rather than silently vanishing here.
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line.as_ref(), ""),
        };
        match field {
            "event" => self.event = value.to_owned(),
            "data" => {
                let extra = value.len() + usize::from(self.has_data);
                if self.data.len() + extra > self.max_event {
                    return Err(self.fail(SseError::EventTooLarge {
                        limit: self.max_event,
                    }));
                }
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            // An id containing NUL is ignored, as the spec says.
            "id" if !value.contains('\0') => self.id = Some(value.to_owned()),
            // `retry` and unknown fields do not matter to a client that never reconnects.
            _ => {}
        }
        Ok(())
    }

    fn dispatch(&mut self, out: &mut Vec<SseEvent>) {
        let event = std::mem::take(&mut self.event);
        let data = std::mem::take(&mut self.data);
        let has_data = std::mem::replace(&mut self.has_data, false);
        let id = self.id.take();
        // An event with no data lines is not dispatched (spec: "if the data buffer is empty, return").
        if !has_data {
            return;
        }
        out.push(SseEvent {
            event: if event.is_empty() {
                "message".to_owned()
            } else {
                event
            },
            data,
            id,
        });
    }
}

/// Typed events decoded from an SSE answer ([`crate::CommandStream`], [`crate::TemplateBuildStream`],
/// [`crate::WatchStream`]): it ends after its terminal event or its first `Err`.
pub struct EventStream<T> {
    inner: futures::stream::BoxStream<'static, Result<T, crate::Error>>,
}

impl<T> EventStream<T> {
    pub(crate) fn new(inner: futures::stream::BoxStream<'static, Result<T, crate::Error>>) -> Self {
        EventStream { inner }
    }
}

impl<T> futures::Stream for EventStream<T> {
    type Item = Result<T, crate::Error>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use futures::StreamExt;
        self.inner.poll_next_unpin(cx)
    }
}

impl<T> std::fmt::Debug for EventStream<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EventStream<{}>", std::any::type_name::<T>())
    }
}

/// The body of an answer that must be an event stream; another content type is a decode error.
pub(crate) fn event_body(
    resp: reqwest::Response,
) -> Result<futures::stream::BoxStream<'static, Result<bytes::Bytes, reqwest::Error>>, crate::Error> {
    use futures::StreamExt;
    let content_type = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !content_type.starts_with("text/event-stream") {
        return Err(crate::Error::Decode(format!(
            "expected an event stream, got content type {content_type:?}"
        )));
    }
    Ok(resp.bytes_stream().boxed())
}

/// Turns an SSE response body into a stream of typed items: `decode` maps each SSE event to an item (or `None`
/// to skip it), `is_terminal` says which item ends the stream, and a body that ends before a terminal item
/// yields `Err(Decode(ended_early))`. A transport or framing error is yielded once and ends the stream.
pub(crate) fn typed_events<T: Send + 'static>(
    body: futures::stream::BoxStream<'static, Result<bytes::Bytes, reqwest::Error>>,
    url: reqwest::Url,
    decode: fn(SseEvent) -> Option<Result<T, crate::Error>>,
    is_terminal: fn(&T) -> bool,
    ended_early: &'static str,
) -> impl futures::Stream<Item = Result<T, crate::Error>> + Send + 'static {
    use futures::StreamExt;
    struct St<T> {
        body: futures::stream::BoxStream<'static, Result<bytes::Bytes, reqwest::Error>>,
        parser: SseParser,
        queue: std::collections::VecDeque<Result<T, crate::Error>>,
        finished: bool,
        url: reqwest::Url,
        is_terminal: fn(&T) -> bool,
    }
    impl<T> St<T> {
        fn push(&mut self, item: Result<T, crate::Error>) {
            if self.finished {
                return;
            }
            self.finished = item.as_ref().map_or(true, self.is_terminal);
            self.queue.push_back(item);
        }
    }
    let state = St {
        body,
        parser: SseParser::default(),
        queue: std::collections::VecDeque::new(),
        finished: false,
        url,
        is_terminal,
    };
    futures::stream::unfold(state, move |mut st| async move {
        loop {
            if let Some(item) = st.queue.pop_front() {
                return Some((item, st));
            }
            if st.finished {
                return None;
            }
            match st.body.next().await {
                Some(Ok(chunk)) => match st.parser.push(&chunk) {
                    Ok(events) => {
                        for ev in events {
                            if let Some(item) = decode(ev) {
                                st.push(item);
                            }
                        }
                    }
                    Err(e) => st.push(Err(crate::Error::Decode(e.to_string()))),
                },
                Some(Err(e)) => {
                    let err = crate::Error::transport(&st.url, e);
                    st.push(Err(err));
                }
                None => st.push(Err(crate::Error::Decode(ended_early.into()))),
            }
        }
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ev(event: &str, data: &str) -> SseEvent {
        SseEvent {
            event: event.to_owned(),
            data: data.to_owned(),
            id: None,
        }
    }

    /// Feeds `input` split at every possible pair of positions and checks the events are always the same.
    fn parse_all_splits(input: &[u8]) -> Vec<SseEvent> {
        let mut whole = SseParser::default();
        let expected = whole.push(input).expect("whole input parses");
        for i in 0..=input.len() {
            for j in i..=input.len() {
                let mut p = SseParser::default();
                let mut got = p.push(&input[..i]).expect("part 1");
                got.extend(p.push(&input[i..j]).expect("part 2"));
                got.extend(p.push(&input[j..]).expect("part 3"));
                assert_eq!(got, expected, "split at {i},{j}");
            }
        }
        expected
    }

    #[test]
    fn events_survive_any_chunk_split() {
        let input = b"event: start\ndata: {\"type\":\"start\",\"pid\":7}\n\n\
                      event: stdout\r\ndata: {\"a\":1}\r\n\r\n\
                      event: exit\rdata: x\r\r";
        let got = parse_all_splits(input);
        assert_eq!(
            got,
            vec![
                ev("start", "{\"type\":\"start\",\"pid\":7}"),
                ev("stdout", "{\"a\":1}"),
                ev("exit", "x"),
            ]
        );
    }

    #[test]
    fn multi_line_data_is_joined_with_newlines() {
        let got = parse_all_splits(b"data: one\ndata:two\ndata:  three\ndata\n\n");
        assert_eq!(got, vec![ev("message", "one\ntwo\n three\n")]);
    }

    #[test]
    fn comments_ids_and_unknown_fields() {
        let got = parse_all_splits(b": keep-alive\n\nid: 5\nretry: 10\nfoo: bar\nevent: e\ndata: d\n\n");
        assert_eq!(
            got,
            vec![SseEvent {
                event: "e".into(),
                data: "d".into(),
                id: Some("5".into()),
            }]
        );
    }

    #[test]
    fn events_without_data_are_not_dispatched_and_unterminated_events_wait() {
        let mut p = SseParser::default();
        assert_eq!(p.push(b"event: lonely\n\n").unwrap(), vec![]);
        assert_eq!(p.push(b"data: half").unwrap(), vec![]);
        assert_eq!(p.push(b"\n").unwrap(), vec![]);
        assert_eq!(p.push(b"\n").unwrap(), vec![ev("message", "half")]);
    }

    #[test]
    fn garbage_does_not_panic() {
        let mut p = SseParser::default();
        let out = p.push(b"\xff\xfe\x00\ndata: \xc3\x28\n\n:\n\r\r\n\n\n").unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].data, "\u{fffd}(");
        // Binary noise of every byte value.
        let noise: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
        let mut p = SseParser::default();
        p.push(&noise).unwrap();
    }

    #[test]
    fn long_lines_are_refused_even_when_they_arrive_in_pieces() {
        let mut p = SseParser::new(16, 1024);
        assert!(p.push(b"data: 0123456").is_ok());
        assert_eq!(p.push(b"789abcdef"), Err(SseError::LineTooLong { limit: 16 }));
        // The parser stays failed.
        assert!(p.push(b"\n\n").is_err());
    }

    #[test]
    fn large_events_are_refused() {
        let mut p = SseParser::new(64, 10);
        assert!(p.push(b"data: 012345\n").is_ok());
        assert_eq!(
            p.push(b"data: 6789\n"),
            Err(SseError::EventTooLarge { limit: 10 })
        );
    }
}
