//! Size caps of the arguments and of a call's output (docs/API.md, "Limits"). They keep every
//! call's memory a small multiple of a bounded input: a larger argument is refused with reason
//! `too_large` before anything is copied or parsed, and a call collects at most
//! [`OUTPUT_BYTES`] of rows, so no argument and no stored data can make a call's memory grow
//! without bound (what runs out anyway ends in `53200`, docs/DESIGN.md §Memory).

/// Largest integer that round-trips through a JavaScript number.
pub const MAX_SAFE: i64 = (1 << 53) - 1;

/// Bytes of one text argument (a partition, table, id, key, name) or `text[]` element.
pub const KEY_BYTES: usize = 4096;
/// Elements of one `text[]` argument.
pub const ARRAY_ELEMENTS: usize = 100_000;
/// Bytes of one `jsonb` argument, as stored (binary).
pub const DOCUMENT_BYTES: usize = 32 << 20;
/// Values (objects, arrays, scalars, at every depth) in one `jsonb` argument.
pub const DOCUMENT_VALUES: usize = 1_000_000;
/// Rows one call returns at most (`lim`, `limit_changes`).
pub const RESULT_ROWS: i64 = 100_000;
/// Subscriptions in one `pull` request.
pub const PULL_SUBSCRIPTIONS: usize = 1_000;
/// Bytes of one `bytea` argument (a row payload), checked before it is read.
pub const PAYLOAD_BYTES: usize = 32 << 20;
/// Variables in one scope filter (`scope_filter`, a subscription's `effective`) and scope
/// patterns of one table in a push schema. Upstream's tables declare a handful; the cap keeps
/// every per-row match and authorization a small constant times the row.
pub const SCOPE_VARIABLES: usize = 64;
/// Columns of one table in a push schema: PostgreSQL's own limit for a table
/// (`MaxHeapAttributeNumber`), so every per-row walk over the columns is bounded.
pub const TABLE_COLUMNS: usize = 1600;

/// Bytes of rows one call collects before returning the first (`pull` over all its
/// subscriptions, `read_commit_window`, `scan_rows`): payloads, scopes, column versions and ids.
/// The first commit or row always goes; past this, `pull` stops and reports the rest as not yet
/// delivered, the two page readers refuse with `too_large` (src/pull/budget.rs, `Budget`).
pub const OUTPUT_BYTES: usize = 64 << 20;

/// The refusal of a call whose rows would exceed [`OUTPUT_BYTES`] and that cannot answer in
/// part (a shorter page would read as "exhausted", a claim would lose leases): its row limit
/// `argument` is too large for the data.
pub fn over_output(argument: &str) -> crate::error::Error {
    crate::error::Error::invalid_argument(argument, "too_large").with_hint(format!(
        "the rows would exceed {} MiB before {argument} is reached (docs/API.md, Limits): ask \
         for fewer",
        OUTPUT_BYTES >> 20
    ))
}
