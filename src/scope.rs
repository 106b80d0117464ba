//! The scope model (docs/DESIGN.md §Scopes): stored scopes `{var: "value"}`, effective scope
//! filters `{var: [values]}`, and the choice of the first variable that drives candidate
//! selection.

use crate::args;
use crate::error::{Code, Error, Result};
use crate::jsonb;
use crate::limits;
use serde_json::{Map, Value};

/// An effective scope filter, keys in UTF-16 code-unit order (upstream sorts JavaScript strings),
/// at most [`limits::SCOPE_VARIABLES`] of them; each key's values sorted by bytes and distinct,
/// so a stored value is looked up by binary search (docs/SECURITY.md, "Time").
pub struct Filter {
    pub keys: Vec<(String, Vec<String>)>,
}

/// Whether `value` is one of `values` (sorted by bytes, as [`filter_value`] leaves them).
fn listed(values: &[String], value: &[u8]) -> bool {
    values.binary_search_by(|x| x.as_bytes().cmp(value)).is_ok()
}

impl Filter {
    /// Whether no stored scopes can match: no variable at all, or a variable with no value.
    pub fn admits_nothing(&self) -> bool {
        self.keys.is_empty() || self.keys.iter().any(|(_, values)| values.is_empty())
    }

    /// The variable and values of candidate selection; `None` selects nothing (no key, or an
    /// empty value list for the first key).
    pub fn first(&self) -> Option<(&str, &[String])> {
        self.keys
            .first()
            .filter(|(_, values)| !values.is_empty())
            .map(|(k, v)| (k.as_str(), &v[..]))
    }
}

impl Filter {
    /// The matching rule (docs/DESIGN.md §Scopes) in Rust, for rows read from app tables: every
    /// key of the filter is present in `scopes` as a string that is one of the key's values.
    /// Its SQL twin is [`scope_matches!`]; a test holds the two together, and holds
    /// [`Filter::matches_binary`] (what the pull path runs, on rows it has not parsed) to both.
    #[cfg(any(test, feature = "pg_test"))]
    pub fn matches(&self, scopes: &Value) -> bool {
        self.keys.iter().all(|(var, values)| {
            scopes
                .get(var)
                .and_then(|v| v.as_str())
                .is_some_and(|v| listed(values, v.as_bytes()))
        })
    }

    /// [`Filter::matches`] on stored scopes in jsonb's binary form, read in place (no text, no
    /// parsing): the commit window checks every change this way. A string-wrapped or malformed
    /// document matches nothing, as in the SQL twin. jsonb keeps an object's keys sorted by
    /// length, then bytes, so each variable is found by binary search: one change costs its
    /// scopes once plus a logarithm per variable of the filter, never their product.
    pub fn matches_binary(&self, scopes: &jsonb::OwnedJsonb) -> bool {
        let Ok(Ok(jsonb::Node::Object(object))) = scopes.container().map(|c| c.root()) else {
            return self.keys.is_empty();
        };
        let Ok(pairs) = object.pairs() else {
            return false;
        };
        self.keys.iter().all(|(var, values)| {
            let var = var.as_bytes();
            pairs
                .binary_search_by(|(key, _)| (key.len(), *key).cmp(&(var.len(), var)))
                .is_ok_and(|i| matches!(pairs[i].1, jsonb::Node::String(s) if listed(values, s)))
        })
    }
}

/// Decodes `scope_filter`: NULL counts as `{}`; values must be arrays of strings.
pub fn filter(name: &str, value: Option<args::JsonArg>) -> Result<Filter> {
    filter_value(name, args::optional_json(name, value)?)
}

pub fn filter_value(name: &str, value: Option<Value>) -> Result<Filter> {
    let value = value.unwrap_or(Value::Object(Map::new()));
    let Value::Object(map) = &value else {
        return Err(Error::invalid_argument(name, "type"));
    };
    if map.len() > limits::SCOPE_VARIABLES {
        return Err(
            Error::invalid_argument(name, "too_large").with_hint(format!(
                "at most {} scope variables in one filter",
                limits::SCOPE_VARIABLES
            )),
        );
    }
    let mut keys = Vec::with_capacity(map.len());
    for (var, values) in map {
        let at = format!("{name}.{var}");
        let Value::Array(values) = values else {
            return Err(Error::invalid_argument(&at, "type"));
        };
        let mut values = values
            .iter()
            .map(|v| {
                crate::interrupts::check();
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| Error::invalid_argument(&at, "type"))
            })
            .collect::<Result<Vec<_>>>()?;
        // Sorted and distinct for the lookups of the matching rule; the window and the scan
        // read the first variable's values as a set, so their order changes nothing there.
        values.sort_unstable();
        values.dedup();
        keys.push((var.clone(), values));
    }
    keys.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
    Ok(Filter { keys })
}

/// Decodes stored scopes `{var: "value"}` (set_row_scopes, the row-meta trigger).
pub fn stored(name: &str, value: Value) -> Result<Map<String, Value>> {
    let Value::Object(map) = args::unwrap_json_text(value) else {
        return Err(Error::invalid_argument(name, "type"));
    };
    if let Some((var, _)) = map.iter().find(|(_, v)| !v.is_string()) {
        return Err(Error::invalid_argument(&format!("{name}.{var}"), "type"));
    }
    Ok(map)
}

/// A table-name argument that addresses the sync log: non-empty, and not a reserved `sync_`
/// name (those are `unknown_table`, docs/API.md §Conventions).
pub fn log_table(name: &str, value: Option<&str>) -> Result<String> {
    let table = args::text(name, value)?;
    if table.starts_with("sync_") {
        return Err(Error::new(
            Code::UnknownTable,
            serde_json::json!({ "table": table }),
        ));
    }
    Ok(table)
}

/// SQL predicate (a string literal, for `concat!`): the stored scopes `$scopes` match the filter
/// `$filter`, i.e. every key of the filter is present in the scopes as a string that is one of
/// the key's values (docs/DESIGN.md §Scopes). Extra stored variables are ignored.
#[macro_export]
macro_rules! scope_matches {
    ($scopes:literal, $filter:literal) => {
        concat!(
            "NOT EXISTS (SELECT 1 FROM pg_catalog.jsonb_each(",
            $filter,
            ") AS f(k, vals)",
            " WHERE NOT coalesce(pg_catalog.jsonb_typeof(",
            $scopes,
            " -> f.k) = 'string'",
            " AND f.vals ? (",
            $scopes,
            " ->> f.k), false))"
        )
    };
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use super::*;
    use pgrx::prelude::*;
    use serde_json::json;

    #[test]
    fn keys_sort_by_utf16_code_units() {
        // U+FF21 (one UTF-16 unit 0xFF21) sorts after U+1F600 (surrogates 0xD83D…) in UTF-16,
        // before it in UTF-8 byte order.
        let f = filter_value(
            "f",
            Some(json!({"\u{FF21}": ["a"], "\u{1F600}": ["b"], "a": []})),
        )
        .unwrap();
        let keys: Vec<&str> = f.keys.iter().map(|k| k.0.as_str()).collect();
        assert_eq!(keys, vec!["a", "\u{1F600}", "\u{FF21}"]);
        assert!(f.first().is_none(), "first key has no values");
    }

    #[test]
    fn filter_values_must_be_string_arrays() {
        assert!(filter_value("f", Some(json!({"a": "x"}))).is_err());
        assert!(filter_value("f", Some(json!({"a": [1]}))).is_err());
        assert!(filter_value("f", None).unwrap().first().is_none());
    }

    fn refusal(result: Result<Filter>) -> Value {
        match result {
            Err(Error::Sync {
                detail: Some(detail),
                ..
            }) => detail,
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("accepted"),
        }
    }

    /// At most 64 variables (docs/API.md "Limits"); each variable's values sorted and distinct
    /// for the lookups of the matching rule, whatever order the filter lists them in.
    #[test]
    fn filters_are_capped_and_their_values_sorted() {
        let vars =
            |n: usize| Value::Object((0..n).map(|i| (format!("v{i}"), json!(["x"]))).collect());
        assert_eq!(filter_value("f", Some(vars(64))).unwrap().keys.len(), 64);
        assert_eq!(
            refusal(filter_value("f", Some(vars(65)))),
            json!({"argument": "f", "reason": "too_large"})
        );
        let f = filter_value("f", Some(json!({"a": ["b", "é", "a", "b", "c", ""]}))).unwrap();
        assert_eq!(f.keys[0].1, vec!["", "a", "b", "c", "é"]);
        for (value, listed) in [
            ("", true),
            ("a", true),
            ("c", true),
            ("é", true),
            ("d", false),
        ] {
            assert_eq!(f.matches(&json!({"a": value})), listed, "{value}");
        }
    }

    /// Stored scopes of 100 variables of every length (past jsonb's 32-entry offset stride, keys
    /// ordered by length first): the binary lookup finds each variable where the SQL twin does.
    #[pg_test]
    fn binary_lookup_agrees_on_wide_scopes() {
        let sql = concat!("SELECT ", scope_matches!("$1", "$2"));
        let names: Vec<String> = (0..100)
            .map(|i| format!("{}{i}", "k".repeat(1 + i % 7)))
            .collect();
        let scopes = Value::Object(
            names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.clone(), json!(if i % 9 == 0 { "y" } else { "x" })))
                .collect(),
        );
        let binary = Spi::get_one_with_args::<crate::jsonb::OwnedJsonb>(
            "SELECT $1",
            &[pgrx::JsonB(scopes.clone()).into()],
        )
        .expect("query")
        .expect("scopes");
        let check = |filter: Value, expected: bool| {
            let parsed = filter_value("f", Some(filter.clone())).expect("a filter");
            let in_sql = Spi::get_one_with_args::<bool>(
                sql,
                &[
                    pgrx::JsonB(scopes.clone()).into(),
                    pgrx::JsonB(filter.clone()).into(),
                ],
            )
            .expect("query")
            .expect("a boolean");
            assert_eq!(in_sql, expected, "{filter}");
            assert_eq!(parsed.matches(&scopes), expected, "{filter}");
            assert_eq!(parsed.matches_binary(&binary), expected, "{filter}");
        };
        for (i, name) in names.iter().enumerate() {
            check(json!({ name: ["w", "x"] }), i % 9 != 0);
            check(json!({ name: ["y"] }), i % 9 == 0);
        }
        let all = |values: Value| {
            Value::Object(
                names[..64]
                    .iter()
                    .map(|n| (n.clone(), values.clone()))
                    .collect(),
            )
        };
        check(all(json!(["x", "y"])), true);
        check(all(json!(["x"])), false);
        check(json!({"k0": ["y"], "absent": ["x"]}), false);
    }

    /// The Rust rule and its SQL twin agree on generated filters and scopes (values that
    /// match, miss, are absent, are not strings; empty filters and empty value lists).
    #[pg_test]
    fn rust_and_sql_matching_agree() {
        let sql = concat!("SELECT ", scope_matches!("$1", "$2"));
        let vars = ["a", "b", "c"];
        let values = ["x", "y", "", "\u{e9}"];
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = |n: usize| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as usize % n
        };
        let mut matched = 0;
        for _ in 0..2_000 {
            let mut scopes = serde_json::Map::new();
            for var in vars {
                match next(5) {
                    0 => {}
                    1 => {
                        scopes.insert(var.into(), json!(1));
                    }
                    2 => {
                        scopes.insert(var.into(), Value::Null);
                    }
                    _ => {
                        scopes.insert(var.into(), json!(values[next(values.len())]));
                    }
                }
            }
            let mut filter = serde_json::Map::new();
            for var in vars {
                if next(2) == 0 {
                    let list: Vec<&str> =
                        (0..next(3)).map(|_| values[next(values.len())]).collect();
                    filter.insert(var.into(), json!(list));
                }
            }
            let scopes = Value::Object(scopes);
            let filter = Value::Object(filter);
            let parsed = filter_value("f", Some(filter.clone())).expect("a filter");
            let in_sql = Spi::get_one_with_args::<bool>(
                sql,
                &[
                    pgrx::JsonB(scopes.clone()).into(),
                    pgrx::JsonB(filter.clone()).into(),
                ],
            )
            .expect("query")
            .expect("a boolean");
            let in_rust = parsed.matches(&scopes);
            assert_eq!(in_rust, in_sql, "scopes {scopes} filter {filter}");
            // The binary reading the commit window uses agrees too.
            let binary = Spi::get_one_with_args::<crate::jsonb::OwnedJsonb>(
                "SELECT $1",
                &[pgrx::JsonB(scopes.clone()).into()],
            )
            .expect("query")
            .expect("scopes");
            assert_eq!(
                parsed.matches_binary(&binary),
                in_rust,
                "scopes {scopes} filter {filter}"
            );
            matched += in_rust as usize;
        }
        assert!(
            matched > 100 && matched < 1_900,
            "{matched} of 2,000 matched"
        );
    }
}
