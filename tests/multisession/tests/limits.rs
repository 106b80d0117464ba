//! Argument caps under a memory limit (docs/SECURITY.md, docs/API.md "Limits").
//!
//! A failed allocation in Rust aborts the process, and an aborted backend makes the postmaster
//! restart every session with crash recovery. So no argument may make the extension allocate
//! without bound: every text, array and document is measured before it is copied or parsed.
//! This test calls every function of the API with each of its variable-size arguments
//! oversized, on a cluster whose processes run under an address-space limit
//! (`SYNCULAR_TEST_PG_LIMITED`, started by scripts/test.sh with `ulimit -v`), and shows that
//! each call ends in a clean error while a sentinel session and the postmaster live on.

use postgres::{Client, NoTls};
use serde_json::Value;
use syncular_multisession::{app_tables_sql, sql_error};

fn limited_cluster() -> String {
    std::env::var("SYNCULAR_TEST_PG_LIMITED").expect(
        "SYNCULAR_TEST_PG_LIMITED: connection parameters of the memory-limited cluster that \
         scripts/test.sh starts",
    )
}

fn connect(db: &str) -> Client {
    Client::connect(&format!("{} dbname={db}", limited_cluster()), NoTls)
        .unwrap_or_else(|e| panic!("cannot connect to the memory-limited cluster: {e}"))
}

/// A value of SQL type `typ` that every function accepts in that position.
fn small(typ: &str) -> &'static str {
    match typ {
        "text" => "'p'",
        "bigint" => "1",
        "integer" => "1",
        "boolean" => "false",
        "jsonb" => "'{}'::jsonb",
        "text[]" => "'{}'::text[]",
        "name" => "'x'::name",
        "regclass" => "'public.tasks'::regclass",
        "bytea" => "'\\x01'::bytea",
        "smallint[]" => "'{}'::smallint[]",
        "bigint[]" => "'{}'::bigint[]",
        "bytea[]" => "'{}'::bytea[]",
        other => panic!("no small value for {other}"),
    }
}

/// Oversized values of a variable-size SQL type: over the caps in every way a caller can be.
fn oversized(typ: &str) -> &'static [&'static str] {
    match typ {
        // 16 MB: far over the 4 KiB key cap.
        "text" => &["repeat('x', 16000000)"],
        // 2 million elements; one element of 16 MB.
        "text[]" => &[
            "array_fill('x'::text, ARRAY[2000000])",
            "ARRAY[repeat('x', 16000000)]",
        ],
        // 40 MB as stored; 1.5 million values in 12 MB.
        "jsonb" => &[
            "to_jsonb(repeat('x', 40000000))",
            "(SELECT jsonb_agg(0) FROM generate_series(1, 1500000))",
        ],
        // 40 MB: over the 32 MiB payload cap.
        "bytea" => &["convert_to(repeat('x', 40000000), 'UTF8')"],
        // push_commit's operation arrays: 2 million elements; 40 MB of payloads.
        "smallint[]" => &["array_fill(1::smallint, ARRAY[2000000])"],
        "bigint[]" => &["array_fill(1::bigint, ARRAY[2000000])"],
        "bytea[]" => &[
            "array_fill('\\x01'::bytea, ARRAY[2000000])",
            "ARRAY[convert_to(repeat('x', 40000000), 'UTF8')]",
        ],
        _ => &[],
    }
}

fn is_clean(state: &str) -> bool {
    // Our refusals, or PostgreSQL's own out-of-memory / program-limit errors.
    state.starts_with("SY") || state == "53200" || state == "54000"
}

#[test]
fn every_argument_is_capped_and_no_call_can_abort_a_backend() {
    let db = format!("limits_{}", std::process::id());
    let mut admin = connect("postgres");
    for statement in [
        format!("DROP DATABASE IF EXISTS {db}"),
        format!("CREATE DATABASE {db}"),
    ] {
        admin.batch_execute(&statement).unwrap();
    }
    let mut sentinel = connect(&db);
    sentinel
        .batch_execute("CREATE EXTENSION IF NOT EXISTS syncular")
        .unwrap();
    sentinel.batch_execute(&app_tables_sql()).unwrap();
    sentinel
        .batch_execute("SELECT syncular.register_table('tasks', 'public.tasks')")
        .unwrap();
    let started: std::time::SystemTime = sentinel
        .query_one("SELECT pg_postmaster_start_time()", &[])
        .unwrap()
        .get(0);

    // Every SQL-callable function with its argument types (trigger functions cannot be called).
    let functions: Vec<(String, Vec<String>)> = sentinel
        .query(
            "SELECT p.proname::text,
                    coalesce(array(SELECT format_type(t, NULL) FROM unnest(p.proargtypes) AS t), '{}')
               FROM pg_proc p
              WHERE p.pronamespace = 'syncular'::regnamespace
                AND p.prorettype NOT IN ('trigger'::regtype, 'event_trigger'::regtype)
              ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(functions.len() >= 70, "{} functions", functions.len());

    let mut c = connect(&db);
    let mut calls = 0;
    let mut too_large = 0;
    for (function, types) in &functions {
        for (position, typ) in types.iter().enumerate() {
            for value in oversized(typ) {
                let args: Vec<&str> = types
                    .iter()
                    .enumerate()
                    .map(|(i, t)| if i == position { value } else { small(t) })
                    .collect();
                let sql = format!("SELECT syncular.{function}({})", args.join(", "));
                c.batch_execute("BEGIN").unwrap();
                let outcome = c.batch_execute(&sql);
                calls += 1;
                let err = match outcome {
                    Ok(()) => panic!("{sql}: an oversized argument was accepted"),
                    Err(e) if e.as_db_error().is_none() => {
                        panic!("{sql}: the session was lost ({e}): the backend died")
                    }
                    Err(e) => sql_error(&e),
                };
                assert!(is_clean(&err.state), "{sql}: {err:?}");
                if err.detail.as_ref().and_then(|d| d.get("reason"))
                    == Some(&Value::from("too_large"))
                {
                    too_large += 1;
                }
                c.batch_execute("ROLLBACK").unwrap();
            }
        }
    }
    // The refusal is the cap itself, not a later error, wherever the oversized argument is the
    // first one a function reads.
    assert!(
        too_large * 10 >= calls * 9,
        "{too_large} of {calls} calls refused with too_large"
    );

    // Values far beyond the caps, each large enough that copying it into Rust memory would
    // exceed the limit: the arrays and the document are refused before they are copied.
    for sql in [
        "SELECT syncular.tombstone_seqs('p', 'tasks', array_fill('x'::text, ARRAY[40000000]))",
        "SELECT syncular.set_blob_refs('p', 'tasks', 'r', array_fill('b'::text, ARRAY[40000000]))",
        "SELECT syncular.get_push_result('p', repeat('x', 300000000), 'k')",
        "SELECT syncular.append_commit('p', to_jsonb(repeat('x', 200000000)))",
    ] {
        c.batch_execute("BEGIN").unwrap();
        let err = match c.batch_execute(sql) {
            Ok(()) => panic!("{sql}: accepted"),
            Err(e) if e.as_db_error().is_none() => panic!("{sql}: the backend died ({e})"),
            Err(e) => sql_error(&e),
        };
        assert!(is_clean(&err.state), "{sql}: {err:?}");
        c.batch_execute("ROLLBACK").unwrap();
    }

    // Nobody was restarted: the sentinel session is alive, the postmaster is the same.
    let now: std::time::SystemTime = sentinel
        .query_one("SELECT pg_postmaster_start_time()", &[])
        .expect("the sentinel session survived")
        .get(0);
    assert_eq!(started, now, "the postmaster restarted");
    drop(c);
    drop(sentinel);
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .unwrap();
}
