//! The interrupt check of every loop over input or stored data (docs/SECURITY.md, "Time"):
//! PostgreSQL honours a cancel, `statement_timeout` or a terminate only where the running code
//! looks at its interrupt flag (`CHECK_FOR_INTERRUPTS()`). The executor does so between rows;
//! a loop in Rust does so only through [`check`], which raises the pending `57014` (or ends the
//! backend) as an ERROR that unwinds through the Rust frames like any other.

/// `CHECK_FOR_INTERRUPTS()`: one read of a flag unless an interrupt is pending, so it is cheap
/// enough for every iteration.
#[inline(always)]
pub fn check() {
    // The unit tests (`#[test]`, not `#[pg_test]`) run the pure code (the codec, filters, the
    // push schema's validation) outside a backend, where the flag and `ProcessInterrupts` do
    // not exist; the extension itself is never built with `cfg(test)`.
    #[cfg(not(test))]
    pgrx::check_for_interrupts!();
}
