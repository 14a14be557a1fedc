//! Where answers go: stdout, whole lines, flushed at once so that a reader
//! of a live `watch` sees each change as it happens.

use std::io::{ErrorKind, Write};

use serde_json::Value;

use crate::exit::{Exit, Failure};

/// Whether the reader is still there: a closed pipe (`presenced watch u1 | head -1`)
/// ends the output quietly, as it does for other command-line tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reader {
    Listening,
    Gone,
}

/// Writes `text` (whole lines) to stdout and flushes it.
pub(crate) fn print(text: &str) -> Result<Reader, Failure> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(Reader::Listening),
        Err(err) if err.kind() == ErrorKind::BrokenPipe => Ok(Reader::Gone),
        Err(err) => Err(Failure::new(Exit::Failed, format!("cannot write to stdout: {err}"))),
    }
}

/// One JSON document (or stream object) on one line.
pub(crate) fn print_json(value: &Value) -> Result<Reader, Failure> {
    print(&format!("{value}\n"))
}

/// One JSON document, indented, for a reader (`export`).
pub(crate) fn print_pretty_json(value: &Value) -> Result<Reader, Failure> {
    let pretty = serde_json::to_string_pretty(value)
        .map_err(|err| Failure::new(Exit::Failed, format!("cannot write JSON: {err}")))?;
    print(&format!("{pretty}\n"))
}
