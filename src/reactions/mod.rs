//! The reaction outbox (docs/DESIGN.md §Reactions, §sync_reactions): enqueued in the push
//! transaction with their source commit, claimed under a lease with `FOR UPDATE SKIP LOCKED`,
//! completed / extended / failed only while the caller still owns the lease. Nothing here takes
//! the partition lock.
//!
//! - [`enqueue`]: `enqueue_reactions` — validating the binary argument, writing the rows below
//!   SQL (or by one statement where the table needs one), naming a duplicate;
//! - [`lease`]: the worker's calls — `claim_reactions` and the acknowledgements under the lease
//!   (`complete_reaction(s)`, `extend_reaction_lease`, `fail_reaction(s)`) and `retry_reaction`;
//! - [`read`]: `get_reaction`, `list_reactions` and the retention call `prune_reactions`;
//! - [`document`]: the reaction document every reader returns, written in jsonb's binary layout.

mod document;
mod enqueue;
mod lease;
mod read;

/// A payload's compact size cap (docs/API.md §Reactions, `enqueue_reactions`).
const MAX_PAYLOAD_BYTES: usize = 65_536;
/// A failure's `details` compact size cap (docs/API.md §Reactions, `fail_reaction`).
const MAX_DETAILS_BYTES: usize = 8_192;
/// Nesting depth cap of payloads and failure details.
const MAX_DEPTH: usize = 16;
/// A reaction type's length cap.
const MAX_TYPE_BYTES: usize = 128;
