//! Decoding and validation of the commit document of `append_commit` (docs/API.md §Commit log).
//!
//! Reads the `jsonb` argument in its binary form ([`crate::jsonb`]): strings are borrowed from
//! the datum, a change's `scopes` object is passed on to SQL as the original bytes. No database
//! access. The first violation is reported, visiting keys in the order docs/API.md lists them:
//! `clientId`, `clientCommitId`, `actorId`, `createdAtMs`, `writerVersion`, `changes`, then per
//! change `table`, `rowId`, `op`, `rowVersion`, `scopes` (its variables in byte order),
//! `payload`. Keys the document format does not name are ignored.

use crate::args;
use crate::error::{Error, Result};
use crate::jsonb::{self, given, JsonbArg, Malformed, Node, RawJsonb};
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine;
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

pub struct Change<'a> {
    pub table: &'a str,
    pub row_id: &'a str,
    pub op: Op,
    /// NULL for deletes, whatever the document said.
    pub row_version: Option<i64>,
    /// `(variable, value)` pairs of `scopes`.
    pub scopes: Vec<(&'a str, &'a str)>,
    /// The `scopes` object as the client sent it, stored in `sync_changes.scopes`.
    pub scopes_jsonb: RawJsonb<'a>,
    /// NULL for deletes, whatever the document said.
    pub payload: Option<Vec<u8>>,
}

pub struct Commit<'a> {
    pub client_id: &'a str,
    pub client_commit_id: &'a str,
    pub actor_id: &'a str,
    pub created_at_ms: i64,
    pub writer_version: Option<i64>,
    pub changes: Vec<Change<'a>>,
}

impl<'a> Commit<'a> {
    /// Distinct `(table, var, value)` over every change's scopes, in byte order.
    pub fn scope_index(&self) -> BTreeSet<(&'a str, &'a str, &'a str)> {
        self.changes
            .iter()
            .flat_map(|c| {
                crate::interrupts::check();
                c.scopes
                    .iter()
                    .map(move |&(var, value)| (c.table, var, value))
            })
            .collect()
    }

    /// Distinct `(table, rowId)` of the delete changes: each gets a tombstone.
    pub fn tombstones(&self) -> BTreeSet<(&'a str, &'a str)> {
        self.changes
            .iter()
            .filter(|c| c.op == Op::Delete)
            .map(|c| (c.table, c.row_id))
            .collect()
    }
}

/// Where a violation is: built only when there is one.
#[derive(Clone, Copy)]
enum At<'k> {
    Top(&'k str),
    Change(usize, &'k str),
    Scope(usize, &'k str),
}

impl At<'_> {
    fn fail<T>(self, reason: &str) -> Result<T> {
        let path = match self {
            At::Top(key) => key.to_string(),
            At::Change(i, key) => format!("changes[{i}].{key}"),
            At::Scope(i, var) => format!("changes[{i}].scopes.{var}"),
        };
        Err(Error::invalid_commit(&path, reason))
    }
}

/// A datum PostgreSQL built never fails to read; if one did, the document is refused as a whole.
fn readable<T>(read: std::result::Result<T, Malformed>) -> Result<T> {
    read.map_err(|_| Error::invalid_commit("", "type"))
}

fn utf8<'a>(bytes: &'a [u8], at: At<'_>) -> Result<&'a str> {
    std::str::from_utf8(bytes).or_else(|_| at.fail("type"))
}

fn string<'a>(node: Option<Node<'a>>, at: At<'_>, non_empty: bool) -> Result<&'a str> {
    jsonb::string_field(node, non_empty).or_else(|reason| at.fail(reason))
}

/// An optional integer `>= min`; absent or null is `None`.
fn integer(node: Option<Node<'_>>, at: At<'_>, min: i64) -> Result<Option<i64>> {
    jsonb::integer_field(node, (min, crate::limits::MAX_SAFE)).or_else(|reason| at.fail(reason))
}

type Scopes<'a> = (Vec<(&'a str, &'a str)>, RawJsonb<'a>);

fn scopes<'a>(node: Option<Node<'a>>, i: usize) -> Result<Scopes<'a>> {
    let map = match given(node) {
        None => return At::Change(i, "scopes").fail("missing"),
        Some(Node::Object(map)) => map,
        Some(_) => return At::Change(i, "scopes").fail("type"),
    };
    let pairs = readable(map.pairs())?;
    let mut scopes = Vec::with_capacity(pairs.len());
    // jsonb keeps keys in (length, bytes) order; violations are reported in byte order.
    let mut first_bad: Option<&str> = None;
    for (var, value) in pairs {
        crate::interrupts::check();
        let var = utf8(var, At::Change(i, "scopes"))?;
        match value {
            Node::String(v) => scopes.push((var, utf8(v, At::Scope(i, var))?)),
            _ => first_bad = Some(first_bad.map_or(var, |b| b.min(var))),
        }
    }
    if let Some(var) = first_bad {
        return At::Scope(i, var).fail("type");
    }
    Ok((scopes, map.to_jsonb()))
}

const CHANGE_KEYS: [&str; 6] = ["table", "rowId", "op", "rowVersion", "scopes", "payload"];

fn change(value: Node<'_>, i: usize) -> Result<Change<'_>> {
    let Node::Object(obj) = value else {
        return At::Top(&format!("changes[{i}]")).fail("type");
    };
    let [table, row_id, op, row_version, scope_map, payload] = readable(obj.fields(CHANGE_KEYS))?;
    let table = string(table, At::Change(i, "table"), true)?;
    if table.starts_with("sync_") {
        return At::Change(i, "table").fail("reserved");
    }
    let row_id = string(row_id, At::Change(i, "rowId"), false)?;
    let op = match given(op) {
        None => return At::Change(i, "op").fail("missing"),
        Some(Node::String(b"upsert")) => Op::Upsert,
        Some(Node::String(b"delete")) => Op::Delete,
        Some(Node::String(_)) => return At::Change(i, "op").fail("range"),
        Some(_) => return At::Change(i, "op").fail("type"),
    };
    let row_version = integer(row_version, At::Change(i, "rowVersion"), 1)?;
    let (scopes, scopes_jsonb) = scopes(scope_map, i)?;
    let payload = match given(payload) {
        None => None,
        Some(Node::String(s)) => match BASE64.decode(s) {
            Ok(bytes) => Some(bytes),
            Err(_) => return At::Change(i, "payload").fail("base64"),
        },
        Some(_) => return At::Change(i, "payload").fail("type"),
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
        scopes_jsonb,
        payload,
    })
}

const COMMIT_KEYS: [&str; 6] = [
    "clientId",
    "clientCommitId",
    "actorId",
    "createdAtMs",
    "writerVersion",
    "changes",
];

/// Validates the whole document; the first violation becomes `sync.storage.invalid_commit`.
pub fn decode(doc: Node<'_>) -> Result<Commit<'_>> {
    let Node::Object(obj) = doc else {
        return At::Top("").fail("type");
    };
    let [client_id, client_commit_id, actor_id, created_at_ms, writer_version, changes] =
        readable(obj.fields(COMMIT_KEYS))?;
    let client_id = string(client_id, At::Top("clientId"), true)?;
    let client_commit_id = string(client_commit_id, At::Top("clientCommitId"), true)?;
    let actor_id = string(actor_id, At::Top("actorId"), true)?;
    let Some(created_at_ms) = integer(created_at_ms, At::Top("createdAtMs"), 0)? else {
        return At::Top("createdAtMs").fail("missing");
    };
    let writer_version = integer(writer_version, At::Top("writerVersion"), 0)?;
    let changes = match given(changes) {
        None => Vec::new(),
        Some(Node::Array(items)) => items
            .children()
            .enumerate()
            .map(|(i, item)| {
                crate::interrupts::check();
                change(readable(item)?, i)
            })
            .collect::<Result<_>>()?,
        Some(_) => return At::Top("changes").fail("type"),
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

/// Decoding runs on real `jsonb` values, so these are in-backend tests (`cargo pgrx test`).
/// Reads the commit document of `append_commit` in its binary form and validates all of it.
/// A document bound as a jsonb *string* holding JSON text is read as that text (drivers that
/// bind text as jsonb), like every other JSON argument ([`args::unwrap_json_text`]).
pub fn with_commit<R>(
    document: Option<JsonbArg>,
    body: impl FnOnce(&Commit<'_>) -> Result<R>,
) -> Result<R> {
    args::with_jsonb("commit", document, |root| body(&decode(root)?))
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    use crate::error::Code;
    use crate::jsonb::JsonbArg;
    use pgrx::prelude::*;
    use serde_json::{json, Value};

    /// Decodes `doc` after a round trip through `jsonb_in`, as the argument arrives.
    fn decoded<R>(doc: &Value, check: impl FnOnce(Result<Commit<'_>>) -> R) -> R {
        let arg = JsonbArg::parse(&doc.to_string()).expect("valid jsonb");
        let root = arg.container().and_then(|c| c.root()).expect("readable");
        check(decode(root))
    }

    fn doc(changes: Value) -> Value {
        json!({"clientId":"c1","clientCommitId":"k","actorId":"a1","createdAtMs":1,
               "writerVersion":1,"changes":changes})
    }

    fn refusal(result: Result<Commit<'_>>) -> std::result::Result<Value, String> {
        match result {
            Err(Error::Sync {
                code: Code::InvalidCommit,
                detail: Some(d),
                ..
            }) => Ok(d),
            Err(other) => Err(format!("expected invalid_commit, got {other:?}")),
            Ok(_) => Err("expected invalid_commit, got a commit".into()),
        }
    }

    fn rejects(doc: &Value) -> Value {
        decoded(doc, refusal).unwrap_or_else(|e| panic!("{e}"))
    }

    #[pg_test]
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
        assert_eq!(
            rejects(&doc(json!([5]))),
            json!({"path":"changes[0]","reason":"type"})
        );
        assert_eq!(rejects(&json!(5)), json!({"path":"","reason":"type"}));
    }

    /// jsonb orders keys by length first; violations are still reported in byte order.
    #[pg_test]
    fn scope_violations_are_reported_in_byte_order() {
        let d = doc(json!([{"table":"t","rowId":"r","op":"upsert",
                            "scopes":{"zz":"ok","b":1,"aaa":2,"c":"ok"}}]));
        assert_eq!(
            rejects(&d),
            json!({"path":"changes[0].scopes.aaa","reason":"type"})
        );
    }

    #[pg_test]
    fn deletes_drop_version_and_payload_and_index_is_distinct() {
        decoded(
            &doc(json!([
                {"table":"tasks","rowId":"t1","op":"upsert","rowVersion":1,"scopes":{"project_id":"p1"},"payload":"AQID"},
                {"table":"tasks","rowId":"t3","op":"delete","rowVersion":4,"scopes":{"project_id":"p2"},"payload":"AQ"},
                {"table":"tasks","rowId":"t3","op":"delete","scopes":{"project_id":"p2"}},
                {"table":"docs","rowId":"d1","op":"upsert","scopes":{"org_id":"o1","project_id":"p1"}}
            ])),
            |commit| {
                let commit = commit.expect("valid");
                assert_eq!(commit.changes[0].payload.as_deref(), Some(&[1u8, 2, 3][..]));
                assert_eq!(commit.changes[0].row_version, Some(1));
                assert_eq!(commit.changes[1].row_version, None);
                assert_eq!(commit.changes[1].payload, None);
                assert_eq!(
                    commit.scope_index().into_iter().collect::<Vec<_>>(),
                    vec![
                        ("docs", "org_id", "o1"),
                        ("docs", "project_id", "p1"),
                        ("tasks", "project_id", "p1"),
                        ("tasks", "project_id", "p2"),
                    ]
                );
                assert_eq!(
                    commit.tombstones().into_iter().collect::<Vec<_>>(),
                    vec![("tasks", "t3")]
                );
            },
        );
    }

    #[pg_test]
    fn unpadded_base64_is_accepted() {
        decoded(
            &doc(json!([{"table":"t","rowId":"","op":"upsert","scopes":{},"payload":"AQI"}])),
            |commit| {
                let commit = commit.expect("valid");
                assert_eq!(commit.changes[0].payload.as_deref(), Some(&[1u8, 2][..]));
            },
        );
    }

    /// Every field of a change read back exactly, including non-ASCII text, many changes (past
    /// jsonb's 32-entry offset stride) and the scopes object passed on byte for byte.
    #[pg_test]
    fn fields_read_back_exactly() {
        let changes: Vec<Value> = (0..70)
            .map(|i| json!({"table":format!("täble{}", i % 3),"rowId":format!("row-{i}-ü"),
                            "op":if i % 5 == 0 {"delete"} else {"upsert"},
                            "rowVersion":i + 1,"scopes":{"project_id":format!("p{i}"),"org":"o"},
                            "payload":BASE64.encode(vec![i as u8; i]),"ignored":{"x":[1,2,{"y":null}]}}))
            .collect();
        let mut d = doc(Value::Array(changes.clone()));
        d["createdAtMs"] = json!(1_750_000_000_000i64);
        d["writerVersion"] = json!(7.0);
        decoded(&d, |commit| {
            let commit = commit.expect("valid");
            assert_eq!(
                (commit.client_id, commit.client_commit_id, commit.actor_id),
                ("c1", "k", "a1")
            );
            assert_eq!(commit.created_at_ms, 1_750_000_000_000);
            assert_eq!(commit.writer_version, Some(7));
            assert_eq!(commit.changes.len(), 70);
            for (i, (c, want)) in commit.changes.iter().zip(&changes).enumerate() {
                assert_eq!(c.table, want["table"].as_str().unwrap());
                assert_eq!(c.row_id, want["rowId"].as_str().unwrap());
                let delete = i % 5 == 0;
                assert_eq!(c.op, if delete { Op::Delete } else { Op::Upsert });
                assert_eq!(c.row_version, (!delete).then_some(i as i64 + 1));
                assert_eq!(c.payload, (!delete).then(|| vec![i as u8; i]));
                let mut scopes = c.scopes.clone();
                scopes.sort_unstable();
                assert_eq!(
                    scopes,
                    vec![
                        ("org", "o"),
                        ("project_id", want["scopes"]["project_id"].as_str().unwrap())
                    ]
                );
                let datum = c.scopes_jsonb.into_datum().expect("datum");
                let back = unsafe { pgrx::JsonB::from_datum(datum, false) }.expect("jsonb");
                assert_eq!(back.0, want["scopes"]);
            }
        });
    }

    /// Integer fields: the numeric reader agrees with PostgreSQL's own arithmetic on what is
    /// integral and what fits in ±(2^53 − 1).
    #[pg_test]
    fn integers_follow_numeric_semantics() {
        let cases = [
            "0",
            "-0",
            "1",
            "-1",
            "9999",
            "10000",
            "123456789",
            "9007199254740991",
            "9007199254740992",
            "-9007199254740991",
            "-9007199254740992",
            "1e15",
            "1e16",
            "1e300",
            "2.0",
            "2.50",
            "0.0001",
            "1e-300",
            "100000000.000",
            "-7.000000001",
            "99999999999999999999999999",
            "12345678901234.0",
            "0.5e1",
            "1.5e1",
        ];
        for text in cases {
            let d: Value = serde_json::from_str(&format!(
                r#"{{"clientId":"c","clientCommitId":"k","actorId":"a","createdAtMs":1,"writerVersion":{text}}}"#
            ))
            .unwrap_or_else(|_| panic!("{text}"));
            let expected = Spi::get_one::<String>(&format!(
                "SELECT CASE WHEN n <> trunc(n) THEN 'type'
                             WHEN abs(n) > 9007199254740991 THEN 'range'
                             WHEN n < 0 THEN 'range' ELSE n::bigint::text END
                 FROM (SELECT '{text}'::numeric AS n) x"
            ))
            .expect("query")
            .expect("value");
            // Round-trip the number through jsonb text so serde's own float reading plays no part.
            let arg =
                JsonbArg::parse(&d.to_string().replace(&d["writerVersion"].to_string(), text))
                    .expect("jsonb");
            let root = arg.container().and_then(|c| c.root()).expect("readable");
            let got = match decode(root) {
                Ok(c) => c.writer_version.expect("present").to_string(),
                Err(e) => refusal(Err(e)).expect("invalid_commit")["reason"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            };
            assert_eq!(got, expected, "writerVersion {text}");
        }
    }

    /// Hostile documents: any JSON value, and near-valid documents with one field replaced by
    /// an arbitrary value. Decoding never panics; it returns a commit or `invalid_commit` with a
    /// `path` and a `reason` from the fixed set.
    use crate::testing::{any_json, run_cases};
    use proptest::prelude::*;

    const REASONS: &[&str] = &["missing", "type", "range", "empty", "reserved", "base64"];

    fn check(doc: &Value) -> std::result::Result<(), TestCaseError> {
        decoded(doc, |result| {
            match result {
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
                    ..
                }) => {
                    prop_assert!(d["path"].is_string());
                    prop_assert!(REASONS.contains(&d["reason"].as_str().unwrap_or("")), "{d}");
                }
                Err(other) => prop_assert!(false, "unexpected {other:?}"),
            }
            Ok(())
        })
    }

    #[pg_test]
    fn any_value_is_decoded_or_refused() {
        run_cases(2000, any_json(), |doc| check(&doc));
    }

    #[pg_test]
    fn one_corrupted_field_is_refused_precisely() {
        let strategy = (
            prop::sample::select(COMMIT_KEYS.to_vec()),
            prop::sample::select(CHANGE_KEYS.to_vec()),
            any_json(),
            any::<bool>(),
        );
        run_cases(2000, strategy, |(key, change_key, value, in_change)| {
            let mut d = doc(
                json!([{"table":"tasks","rowId":"t1","op":"upsert","rowVersion":1,
                                    "scopes":{"project_id":"p1"},"payload":"AQID"}]),
            );
            if in_change {
                d["changes"][0][change_key] = value;
            } else {
                d[key] = value;
            }
            check(&d)
        });
    }
}
