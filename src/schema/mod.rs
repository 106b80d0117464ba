//! Schema versions (docs/DESIGN.md §Schema barrier, docs/CODEC.md): [`barrier`] stores the
//! layouts of each schema version (`migrate_schema`) and holds writers of an older one;
//! [`push_schema`] stores the host's compiled schema per version and reads it back as codec
//! layouts; [`encode_row`] is the row codec's SQL face (`encode_row`, `decode_row`);
//! [`evolution`] is what may change between two versions and the re-encoding of stored rows
//! when a table's layout grew; [`marker`] reads the stored schema version for both sides, and asks whether every snapshot a
//! payload was read through sees it, from what [`executor_snapshots`] kept and what [`stamp`]
//! recorded in the marker of its writer.

pub mod barrier;
pub mod digest;
pub mod encode_row;
pub mod evolution;
pub mod executor_snapshots;
pub mod marker;
pub mod push_schema;
pub mod shards;
pub mod stamp;
