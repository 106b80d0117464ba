//! The push path (docs/DESIGN.md §Push path), one file a step.
//!
//! The classic calls, in the order a host makes them: [`begin`] (`push_begin`: the partition
//! lock, the gate under the lock and the locked idempotency re-check), `append_commit`
//! (src/log.rs), then [`result`] (`put_push_result`, where the first writer of an idempotency
//! key wins; `get_push_result`).
//!
//! The one-call push (`push_commit`, docs/API.md), whose driver is [`one_call`]:
//! [`request`] reads the arguments, [`open`] makes the static refusals and opens the tables,
//! [`context`] runs the operations in an internal subtransaction ([`subtransaction`]), each
//! decided by [`rules`] — the version conflict in [`conflict`] — and ending, when it does not
//! apply, in an [`outcome`]; [`batch`] writes the rows of a triggerless table in one statement;
//! [`append`] appends the commit and stores its result; [`stage`] is `push_commit`'s staged
//! mode and `push_finish`.
//!
//! The push guard (src/push_guard.rs) sits below this folder: `append_commit` (src/log.rs)
//! consults it too, and the log is below the push path.

mod append;
mod batch;
mod begin;
mod conflict;
mod context;
mod one_call;
mod open;
mod outcome;
mod request;
pub mod result;
mod rules;
pub mod stage;
pub(crate) mod subtransaction;
