//! The conflict rule of an update (steps U6/U7 of docs/DESIGN.md, "The one-call push, step by
//! step"; docs/CODEC.md §Column versions): a present column whose effective version moved past
//! `baseVersion` is a conflict, answered with the stored row and a bitmap of the columns that
//! moved. Conflicts are per column ([`versions::conflict`]): an edit of a column nobody else
//! changed applies even when the row moved on.

use super::outcome::Stop;
use crate::codec::versions::{self, Versions};
use crate::commit::BASE64;
use crate::error::Result;
use crate::tables::StoredRow;
use base64::Engine;
use serde_json::json;

/// What the update brings to the rule.
pub(super) struct Update<'u> {
    /// The operation's index in the commit.
    pub(super) op: usize,
    pub(super) base_version: Option<i64>,
    /// The payload's present columns.
    pub(super) present: &'u [usize],
    pub(super) is_crdt: &'u [bool],
    pub(super) primary_key: usize,
    pub(super) columns: usize,
}

/// `Ok(Some(stop))` when the update must not apply: its rejection or its conflict record.
pub(super) fn conflict(
    update: &Update<'_>,
    stored: &StoredRow,
    blob: Option<&Versions>,
) -> Result<Option<Stop>> {
    let server_version = stored.server_version.max(0) as u64;
    if let versions::Check::Conflict(marked) = versions::conflict(
        update.base_version,
        update.present,
        |i| update.is_crdt[i],
        update.primary_key,
        blob.map(Vec::as_slice),
        server_version,
    ) {
        let bitmap = versions::conflict_bitmap(update.columns, &marked);
        return Ok(Some(Stop::Rejected(json!({
            "opIndex": update.op, "status": "conflict", "code": "sync.version_conflict",
            "message": "present columns moved past baseVersion (§6.2)",
            "serverVersion": stored.server_version,
            "serverRow": crate::alloc::try_base64(&BASE64, &stored.payload)?,
            "conflictColumns": BASE64.encode(bitmap),
        }))));
    }
    Ok(None)
}
