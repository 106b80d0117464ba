//! Helpers shared by the in-backend tests (`#[pg_test]`) of several modules.

use pgrx::prelude::*;

/// The one `bigint` a query returns.
pub fn bigint(sql: &str) -> i64 {
    Spi::get_one::<i64>(sql).expect("query").expect("a value")
}

/// A one-change commit document of writer version 2, as an SQL literal.
pub const COMMIT: &str = r#"'{"clientId":"c1","clientCommitId":"k","actorId":"a1","createdAtMs":1,
    "writerVersion":2,"changes":[{"table":"tasks","rowId":"t1","op":"upsert",
    "scopes":{"project_id":"p1"},"payload":"AQID"}]}'"#;
