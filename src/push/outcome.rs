//! How an operation ends a one-call push before the append (docs/DESIGN.md §Push path):
//! a rejection record in upstream's words, a fallback to host code, or a staged push.

use crate::error::{Error, Result};
use serde_json::{json, Value};

/// Why the native call stops before the append.
pub(super) enum Stop {
    /// A terminating record (an error or a conflict) at its operation.
    Rejected(Value),
    /// Host code would run here (docs/DESIGN.md §Push path, fallback).
    Fallback(Value),
    /// Every operation applied and a commit validator or planner is next: the candidate rows
    /// stay for the host's hooks and `push_finish` (src/push/stage.rs).
    Staged,
}

pub(super) fn fallback_doc(reason: &str, at: Option<(usize, &str)>) -> Value {
    let mut doc = json!({"outcome": "fallback", "reason": reason});
    if let Some((op, table)) = at {
        doc["opIndex"] = json!(op);
        doc["table"] = json!(table);
    }
    doc
}

pub(super) fn fallback(reason: &str, at: Option<(usize, &str)>) -> Stop {
    Stop::Fallback(fallback_doc(reason, at))
}

/// An error record of the default path: upstream's code and message, never retryable.
pub(super) fn error_record(op: usize, code: &str, message: impl Into<String>) -> Value {
    json!({"opIndex": op, "status": "error", "code": code, "message": message.into(),
           "retryable": false})
}

pub(super) fn rejected(op: usize, code: &str, message: impl Into<String>) -> Result<Option<Stop>> {
    Ok(Some(Stop::Rejected(error_record(op, code, message))))
}

pub(super) const INVALID_REQUEST: &str = "sync.invalid_request";
pub(super) const FORBIDDEN: &str = "sync.forbidden";
pub(super) const ROW_MISSING: &str = "sync.row_missing";

/// `JSON.stringify` of a string (serde_json escapes exactly as ECMAScript for valid Unicode).
pub(super) fn quoted(text: &str) -> String {
    Value::from(text).to_string()
}

/// A stored row or payload that cannot be read is a request error, never a rejection.
pub(super) fn corrupt(table: &str, row_id: &str, what: &str, message: &str) -> Error {
    Error::Internal(format!(
        "syncular: stored row {table}/{row_id} has a corrupt {what}: {message}"
    ))
}
