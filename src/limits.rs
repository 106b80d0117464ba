//! Size caps of the arguments (docs/API.md, "Limits"). They keep every call's memory a small
//! multiple of a bounded input: a larger argument is refused with reason `too_large` before
//! anything is copied or parsed, so no argument can exhaust a backend's memory (an allocation
//! failure in Rust aborts the whole server, docs/SECURITY.md).

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
