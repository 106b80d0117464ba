//! Decoding and validation of the commit document of `append_commit` (core-api §2.2).
//!
//! Pure Rust, no database access, so it is unit- and property-tested on its own. The first
//! violation is reported, visiting keys in the order of the spec's tables (jsonb does not keep
//! the client's key order): `clientId`, `clientCommitId`, `actorId`, `createdAtMs`,
//! `writerVersion`, `changes`, then per change `table`, `rowId`, `op`, `rowVersion`, `scopes`,
//! `payload`.

use crate::args::{json_int, IntProblem};
use crate::error::{Error, Result};
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine;
use serde_json::{Map, Value};
use std::collections::BTreeSet;

/// RFC 4648 standard alphabet; padding optional on input, always written on output.
pub const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent)
        .with_decode_allow_trailing_bits(true),
);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Upsert = 1,
    Delete = 2,
}

#[derive(Debug, PartialEq)]
pub struct Change {
    pub table: String,
    pub row_id: String,
    pub op: Op,
    /// NULL for deletes, whatever the document said.
    pub row_version: Option<i64>,
    pub scopes: Map<String, Value>,
    /// NULL for deletes, whatever the document said.
    pub payload: Option<Vec<u8>>,
}

#[derive(Debug, PartialEq)]
pub struct Commit {
    pub client_id: String,
    pub client_commit_id: String,
    pub actor_id: String,
    pub created_at_ms: i64,
    pub writer_version: Option<i64>,
    pub changes: Vec<Change>,
}

impl Commit {
    /// Distinct `(table, var, value)` over every change's scopes, in byte order.
    pub fn scope_index(&self) -> BTreeSet<(&str, &str, &str)> {
        self.changes
            .iter()
            .flat_map(|c| {
                c.scopes.iter().map(move |(var, value)| {
                    (
                        c.table.as_str(),
                        var.as_str(),
                        value.as_str().expect("validated as string"),
                    )
                })
            })
            .collect()
    }

    /// Distinct `(table, rowId)` of the delete changes: each gets a tombstone.
    pub fn tombstones(&self) -> BTreeSet<(&str, &str)> {
        self.changes
            .iter()
            .filter(|c| c.op == Op::Delete)
            .map(|c| (c.table.as_str(), c.row_id.as_str()))
            .collect()
    }
}

fn fail<T>(path: &str, reason: &str) -> Result<T> {
    Err(Error::invalid_commit(path, reason))
}

fn string(obj: &Map<String, Value>, key: &str, path: &str, non_empty: bool) -> Result<String> {
    match obj.get(key) {
        None | Some(Value::Null) => fail(path, "missing"),
        Some(Value::String(s)) if non_empty && s.is_empty() => fail(path, "empty"),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => fail(path, "type"),
    }
}

/// An optional integer `>= min`; absent or null is `None`.
fn integer(obj: &Map<String, Value>, key: &str, path: &str, min: i64) -> Result<Option<i64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match json_int(v) {
            Ok(n) if n >= min => Ok(Some(n)),
            Ok(_) | Err(IntProblem::Range) => fail(path, "range"),
            Err(IntProblem::Type) => fail(path, "type"),
        },
    }
}

fn change(value: &Value, at: &str) -> Result<Change> {
    let Value::Object(obj) = value else {
        return fail(at, "type");
    };
    let path = |key: &str| format!("{at}.{key}");
    let table = string(obj, "table", &path("table"), true)?;
    if table.starts_with("sync_") {
        return fail(&path("table"), "reserved");
    }
    let row_id = string(obj, "rowId", &path("rowId"), false)?;
    let op = match obj.get("op") {
        None | Some(Value::Null) => return fail(&path("op"), "missing"),
        Some(Value::String(s)) if s == "upsert" => Op::Upsert,
        Some(Value::String(s)) if s == "delete" => Op::Delete,
        Some(Value::String(_)) => return fail(&path("op"), "range"),
        Some(_) => return fail(&path("op"), "type"),
    };
    let row_version = integer(obj, "rowVersion", &path("rowVersion"), 1)?;
    let scopes = match obj.get("scopes") {
        None | Some(Value::Null) => return fail(&path("scopes"), "missing"),
        Some(Value::Object(map)) => {
            if let Some((var, _)) = map.iter().find(|(_, v)| !v.is_string()) {
                return fail(&format!("{at}.scopes.{var}"), "type");
            }
            map.clone()
        }
        Some(_) => return fail(&path("scopes"), "type"),
    };
    let payload = match obj.get("payload") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match BASE64.decode(s) {
            Ok(bytes) => Some(bytes),
            Err(_) => return fail(&path("payload"), "base64"),
        },
        Some(_) => return fail(&path("payload"), "type"),
    };
    let (row_version, payload) = match op {
        Op::Upsert => (row_version, payload),
        Op::Delete => (None, None),
    };
    Ok(Change {
        table,
        row_id,
        op,
        row_version,
        scopes,
        payload,
    })
}

/// Validates the whole document; the first violation becomes `sync.storage.invalid_commit`.
pub fn decode(doc: &Value) -> Result<Commit> {
    let Value::Object(obj) = doc else {
        return fail("", "type");
    };
    let client_id = string(obj, "clientId", "clientId", true)?;
    let client_commit_id = string(obj, "clientCommitId", "clientCommitId", true)?;
    let actor_id = string(obj, "actorId", "actorId", true)?;
    let Some(created_at_ms) = integer(obj, "createdAtMs", "createdAtMs", 0)? else {
        return fail("createdAtMs", "missing");
    };
    let writer_version = integer(obj, "writerVersion", "writerVersion", 0)?;
    let changes = match obj.get("changes") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| change(item, &format!("changes[{i}]")))
            .collect::<Result<_>>()?,
        Some(_) => return fail("changes", "type"),
    };
    Ok(Commit {
        client_id,
        client_commit_id,
        actor_id,
        created_at_ms,
        writer_version,
        changes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;
    use serde_json::json;

    fn doc(changes: Value) -> Value {
        json!({"clientId":"c1","clientCommitId":"k","actorId":"a1","createdAtMs":1,
               "writerVersion":1,"changes":changes})
    }

    fn rejects(doc: &Value) -> Value {
        match decode(doc) {
            Err(Error::Sync {
                code: Code::InvalidCommit,
                detail: Some(d),
            }) => d,
            other => panic!("expected invalid_commit, got {other:?}"),
        }
    }

    #[test]
    fn scenario_log_06_cases() {
        let chg = json!({"table":"tasks","rowId":"t1","op":"upsert","rowVersion":1,
                         "scopes":{"project_id":"p1"},"payload":"AQID"});
        let with = |key: &str, v: Value| {
            let mut c = chg.clone();
            c[key] = v;
            doc(json!([c]))
        };
        let mut no_client = doc(json!([]));
        no_client.as_object_mut().unwrap().remove("clientId");
        assert_eq!(
            rejects(&no_client),
            json!({"path":"clientId","reason":"missing"})
        );
        let mut d = doc(json!([]));
        d["createdAtMs"] = json!("x");
        assert_eq!(rejects(&d), json!({"path":"createdAtMs","reason":"type"}));
        d["createdAtMs"] = json!(1.5);
        assert_eq!(rejects(&d), json!({"path":"createdAtMs","reason":"type"}));
        assert_eq!(
            rejects(&with("op", json!("merge"))),
            json!({"path":"changes[0].op","reason":"range"})
        );
        assert_eq!(
            rejects(&with("table", json!(""))),
            json!({"path":"changes[0].table","reason":"empty"})
        );
        assert_eq!(
            rejects(&with("table", json!("sync_commits"))),
            json!({"path":"changes[0].table","reason":"reserved"})
        );
        assert_eq!(
            rejects(&with("scopes", json!({"project_id":5}))),
            json!({"path":"changes[0].scopes.project_id","reason":"type"})
        );
        assert_eq!(
            rejects(&with("payload", json!("%%%"))),
            json!({"path":"changes[0].payload","reason":"base64"})
        );
        assert_eq!(
            rejects(&doc(json!({}))),
            json!({"path":"changes","reason":"type"})
        );
        assert_eq!(rejects(&json!(5)), json!({"path":"","reason":"type"}));
    }

    #[test]
    fn deletes_drop_version_and_payload_and_index_is_distinct() {
        let commit = decode(&doc(json!([
            {"table":"tasks","rowId":"t1","op":"upsert","rowVersion":1,"scopes":{"project_id":"p1"},"payload":"AQID"},
            {"table":"tasks","rowId":"t3","op":"delete","rowVersion":4,"scopes":{"project_id":"p2"},"payload":"AQ"},
            {"table":"tasks","rowId":"t3","op":"delete","scopes":{"project_id":"p2"}},
            {"table":"docs","rowId":"d1","op":"upsert","scopes":{"org_id":"o1","project_id":"p1"}}
        ])))
        .unwrap();
        assert_eq!(commit.changes[0].payload.as_deref(), Some(&[1u8, 2, 3][..]));
        assert_eq!(commit.changes[1].row_version, None);
        assert_eq!(commit.changes[1].payload, None);
        assert_eq!(commit.scope_index().len(), 4);
        assert_eq!(
            commit.tombstones().into_iter().collect::<Vec<_>>(),
            vec![("tasks", "t3")]
        );
    }

    #[test]
    fn unpadded_base64_is_accepted() {
        let commit = decode(&doc(json!([
            {"table":"t","rowId":"","op":"upsert","scopes":{},"payload":"AQI"}
        ])))
        .unwrap();
        assert_eq!(commit.changes[0].payload.as_deref(), Some(&[1u8, 2][..]));
    }

    /// Hostile documents: any JSON value, and near-valid documents with one field replaced by
    /// an arbitrary value. Decoding never panics; it returns a commit or `invalid_commit` with a
    /// `path` and a `reason` from the fixed set.
    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn any_json() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                any::<f64>()
                    .prop_filter("finite", |f| f.is_finite())
                    .prop_map(Value::from),
                ".{0,12}".prop_map(Value::from),
                "[A-Za-z0-9+/=%]{0,16}".prop_map(Value::from),
            ];
            leaf.prop_recursive(6, 64, 8, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                    prop::collection::btree_map("[a-zA-Z]{1,12}", inner, 0..6)
                        .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        const REASONS: &[&str] = &["missing", "type", "range", "empty", "reserved", "base64"];

        fn check(doc: &Value) -> std::result::Result<(), TestCaseError> {
            match decode(doc) {
                Ok(commit) => {
                    prop_assert!(!commit.client_id.is_empty());
                    for c in &commit.changes {
                        prop_assert!(!c.table.is_empty() && !c.table.starts_with("sync_"));
                        if c.op == Op::Delete {
                            prop_assert!(c.payload.is_none() && c.row_version.is_none());
                        }
                    }
                }
                Err(Error::Sync {
                    code: Code::InvalidCommit,
                    detail: Some(d),
                }) => {
                    prop_assert!(d["path"].is_string());
                    prop_assert!(REASONS.contains(&d["reason"].as_str().unwrap_or("")), "{d}");
                }
                Err(other) => prop_assert!(false, "unexpected {other:?}"),
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

            #[test]
            fn any_value_is_decoded_or_refused(doc in any_json()) {
                check(&doc)?;
            }

            #[test]
            fn one_corrupted_field_is_refused_precisely(
                key in prop::sample::select(vec!["clientId", "clientCommitId", "actorId", "createdAtMs",
                                                 "writerVersion", "changes"]),
                change_key in prop::sample::select(vec!["table", "rowId", "op", "rowVersion", "scopes", "payload"]),
                value in any_json(),
                in_change in any::<bool>(),
            ) {
                let mut d = doc(json!([{"table":"tasks","rowId":"t1","op":"upsert","rowVersion":1,
                                        "scopes":{"project_id":"p1"},"payload":"AQID"}]));
                if in_change { d["changes"][0][change_key] = value; } else { d[key] = value; }
                check(&d)?;
            }
        }
    }
}
