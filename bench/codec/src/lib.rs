//! The extension's codec modules, compiled on their own (see Cargo.toml).
#[path = "../../../src/codec/mod.rs"]
pub mod codec;
