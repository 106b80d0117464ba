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

/// Any JSON value (nested up to six levels, strings without U+0000, which jsonb refuses): the
/// generator of the in-backend property tests.
pub fn any_json() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
    use proptest::prelude::*;
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[^\u{0}]{0,12}".prop_map(Value::from),
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

/// Runs `test` on `cases` values of `strategy` (no persisted failures: a failure prints its
/// minimal case and panics, which fails the `#[pg_test]`).
pub fn run_cases<S: proptest::strategy::Strategy>(
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), proptest::test_runner::TestCaseError>,
) {
    let config = proptest::test_runner::Config {
        cases,
        failure_persistence: None,
        ..proptest::test_runner::Config::default()
    };
    proptest::test_runner::TestRunner::new(config)
        .run(&strategy, test)
        .unwrap_or_else(|e| panic!("{e}"));
}

/// Takes `ACCESS EXCLUSIVE` locks on `tables` (a `LOCK TABLE` list of the extension's tables)
/// before a test changes their definition. The in-backend tests run side by side on one
/// database, and a test that wrote a table and then asked for a stronger lock on it waited for
/// another test waiting for it (a deadlock: `pull::record`'s tests, session 31). So the tests
/// that change a definition take turns — one transaction-level advisory lock, tried again after
/// a pause while another test holds it — and each then takes its table locks all at once or
/// none (`NOWAIT` in a subtransaction, again after a pause), holding nothing else while it waits:
/// the tests that only read and write never wait for the advisory lock, and no two of these
/// tests hold their strong locks at once, so none of them is part of a cycle.
pub fn lock_for_ddl(tables: &str) {
    let turn = eventually(|| {
        Spi::get_one::<bool>("SELECT pg_try_advisory_xact_lock(7141592653)")
            .expect("advisory lock")
            .unwrap_or(false)
    });
    assert!(
        turn,
        "another test changed the extension's tables for 5 minutes"
    );
    let sql = format!("LOCK TABLE {tables} IN ACCESS EXCLUSIVE MODE NOWAIT");
    let locked = eventually(|| {
        let locked =
            crate::push::subtransaction::in_subtransaction(|| Spi::run(&sql), |r| r.is_ok());
        matches!(locked, Ok(Ok(())))
    });
    assert!(
        locked,
        "{tables} stayed locked by other tests for 5 minutes"
    );
}

/// Whether `attempt` succeeds within 5 minutes, tried again 10 ms after each failure: long
/// enough for every other test changing a definition to end first, in a debug build on a loaded
/// machine.
fn eventually(mut attempt: impl FnMut() -> bool) -> bool {
    (0..30_000).any(|_| {
        let done = attempt();
        if !done {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        done
    })
}
