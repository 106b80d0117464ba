//! The extension's codec modules, compiled on their own (see Cargo.toml).
#[path = "../../../src/codec/mod.rs"]
pub mod codec;

/// The codec's loops check for interrupts inside a backend (src/interrupts.rs); on its own there
/// is nothing to check.
mod interrupts {
    pub fn check() {}
}
