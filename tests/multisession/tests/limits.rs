//! Memory under a limit (docs/SECURITY.md rule 9, docs/DESIGN.md §Memory, docs/API.md "Limits").
//!
//! An aborted backend makes the postmaster restart every session with crash recovery, and a
//! failed allocation in Rust aborts unless it is made fallible. So out of memory must be an
//! ERROR (`53200`): no argument and no stored value may make the extension allocate without
//! bound, and what still runs out must end cleanly. The tests run on a cluster whose processes
//! live under an address-space limit (`SYNCULAR_TEST_PG_LIMITED`, started by scripts/test.sh
//! with `ulimit -v`): every function with each variable-size argument oversized, and with every
//! argument at its cap at once; the three aborts of issue 25 (a pull over one large commit for
//! many subscriptions, a huge stored column-versions blob, `push_commit` with both arrays at
//! their caps); stored data at its largest read back by every reader. Each call answers or ends
//! in a clean ERROR while a sentinel session and the postmaster live on.

use postgres::{Client, NoTls};
use serde_json::{json, Value};
use syncular_multisession::native_push;
use syncular_multisession::{app_tables_sql, sql_error, SqlError};

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
    let (l, mut c) = Limited::new("every_argument");
    register_tasks(&mut c);
    let functions = callable_functions(&mut c);
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
    l.assert_nobody_restarted(c);
}

/// Appends commit `ccid` of client `c1` in partition `p`: one upsert of `tasks` row `row_id`
/// (project `p1`) whose payload is `bytes` bytes, base64 in the document.
fn append_large_row(c: &mut Client, ccid: &str, row_id: &str, bytes: usize) {
    c.batch_execute(&format!(
        "SELECT syncular.append_commit('p', jsonb_build_object(
           'clientId', 'c1', 'clientCommitId', '{ccid}', 'actorId', 'a1', 'createdAtMs', 1,
           'changes', jsonb_build_array(jsonb_build_object(
             'table', 'tasks', 'rowId', '{row_id}', 'op', 'upsert', 'rowVersion', 1,
             'scopes', jsonb_build_object('project_id', 'p1'),
             'payload', translate(encode(convert_to(repeat('x', {bytes}), 'UTF8'), 'base64'),
                                  E'\\n', '')))))"
    ))
    .unwrap();
}

/// The app tables, with `tasks` registered.
fn register_tasks(c: &mut Client) {
    c.batch_execute(&app_tables_sql()).unwrap();
    c.batch_execute("SELECT syncular.register_table('tasks', 'public.tasks')")
        .unwrap();
}

/// Every SQL-callable function of the extension with its argument types (trigger functions
/// cannot be called): at least the 70 there are.
fn callable_functions(c: &mut Client) -> Vec<(String, Vec<String>)> {
    let functions: Vec<(String, Vec<String>)> = c
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
    functions
}

/// A database of its own on the memory-limited cluster, with a sentinel session and the
/// postmaster's start time: [`Limited::assert_nobody_restarted`] shows that no backend aborted
/// (an abort makes the postmaster end every session and restart). [`Limited::new`] also opens
/// the test's own session.
struct Limited {
    db: String,
    sentinel: Client,
    started: std::time::SystemTime,
}

impl Limited {
    fn new(test: &str) -> (Limited, Client) {
        let db = format!("limits_{test}_{}", std::process::id());
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
        let started = sentinel
            .query_one("SELECT pg_postmaster_start_time()", &[])
            .unwrap()
            .get(0);
        let c = connect(&db);
        let limited = Limited {
            db,
            sentinel,
            started,
        };
        (limited, c)
    }

    /// Ends the test's session `c`, then checks the sentinel and drops the database.
    #[track_caller]
    fn assert_nobody_restarted(mut self, c: Client) {
        drop(c);
        let now: std::time::SystemTime = self
            .sentinel
            .query_one("SELECT pg_postmaster_start_time()", &[])
            .expect("the sentinel session survived")
            .get(0);
        assert_eq!(self.started, now, "the postmaster restarted");
        drop(self.sentinel);
        connect("postgres")
            .batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.db))
            .unwrap();
    }
}

/// The outcome of a statement that may fail: `Ok` or the error, which must be a server error
/// (a lost session means the backend died) and clean ([`is_clean`]).
#[track_caller]
fn clean<T>(what: &str, outcome: Result<T, postgres::Error>) -> Result<T, SqlError> {
    match outcome {
        Ok(v) => Ok(v),
        Err(e) if e.as_db_error().is_none() => {
            panic!("{what}: the session was lost ({e}): the backend died")
        }
        Err(e) => {
            let severity = e.as_db_error().map(|d| d.severity().to_string());
            let err = sql_error(&e);
            assert!(is_clean(&err.state), "{what}: {err:?}");
            // An ERROR: FATAL would end the session (src/alloc.rs, the last resort).
            assert_eq!(severity.as_deref(), Some("ERROR"), "{what}: {err:?}");
            Err(err)
        }
    }
}

/// The first column of the one row of a simple-protocol query, parsed as JSON.
fn simple_value(messages: &[postgres::SimpleQueryMessage]) -> Value {
    messages
        .iter()
        .find_map(|m| match m {
            postgres::SimpleQueryMessage::Row(row) => {
                row.get(0).map(|t| serde_json::from_str(t).unwrap())
            }
            _ => None,
        })
        .expect("one row")
}

/// The output budget of one call (docs/API.md "Limits"): 64 MiB of row data.
const OUTPUT_BYTES: i64 = 64 << 20;

/// Issue 25: one `pull` with 1,000 subscriptions over one commit of 20 MiB collected every
/// subscription's copy of it before returning the first row (20 GB), and the backend aborted.
/// The output of a call is bounded in total: the subscriptions past the budget deliver nothing
/// and keep their cursor (the next pull continues), and the session lives on.
#[test]
fn a_pull_over_one_large_commit_for_many_subscriptions_stays_within_its_budget() {
    let (l, mut c) = Limited::new("pull_budget");
    register_tasks(&mut c);
    append_large_row(&mut c, "k1", "r1", 20_971_520);
    let subscriptions: Vec<Value> = (0..1000)
        .map(|i| {
            json!({"id": format!("s{i}"), "table": "tasks", "scopes": {"project_id": ["p1"]},
                   "effective": {"project_id": ["p1"]}, "cursor": 0})
        })
        .collect();
    let request = json!({ "subscriptions": subscriptions });
    let rows = clean(
        "pull",
        c.query(
            "SELECT sub, commit_seq, octet_length(payload)::bigint, document
               FROM syncular.pull('p', 'client-1', 'a1', 1, 'e1', 1, $1)",
            &[&request],
        ),
    )
    .expect("a pull over the budget answers what fits");
    let document: Value = rows[0].get(3);
    let delivered: Vec<i32> = rows[1..].iter().map(|r| r.get(0)).collect();
    let bytes: i64 = rows[1..].iter().map(|r| r.get::<_, i64>(2)).sum();
    assert!(
        !delivered.is_empty(),
        "the first subscription always gets its commit"
    );
    assert!(
        delivered.len() < 1000 && bytes <= OUTPUT_BYTES + (21 << 20),
        "{} changes, {bytes} bytes",
        delivered.len()
    );
    // The served subscriptions come first and moved on; the others delivered nothing and kept
    // their cursor, so the client record's cursor stays where the next pull resumes.
    let outcomes = document["subscriptions"].as_array().unwrap();
    assert_eq!(outcomes.len(), 1000);
    for (i, outcome) in outcomes.iter().enumerate() {
        let served = i < delivered.len();
        assert_eq!(delivered.get(i), served.then_some(&(i as i32)), "{i}");
        assert_eq!(outcome["status"], "active", "{outcome}");
        assert_eq!(outcome["changes"], json!(usize::from(served)), "{outcome}");
        assert_eq!(outcome["nextCursor"], json!(i64::from(served)), "{outcome}");
    }
    assert_eq!(document["cursor"], json!(0));
    // The next pull of the remaining subscriptions continues where the budget stopped.
    let rest = json!({"subscriptions": subscriptions[delivered.len()..]});
    let again = c
        .query(
            "SELECT sub FROM syncular.pull('p', 'client-1', 'a1', 1, 'e1', 1, $1) WHERE sub IS NOT NULL",
            &[&rest],
        )
        .unwrap();
    assert_eq!(again.len(), delivered.len().min(1000 - delivered.len()));
    l.assert_nobody_restarted(c);
}

/// Issue 25: a stored `_sync_column_versions` of 150 MB was decoded at about 16 times its size
/// on every update of the row, and the backend aborted. Decoding is bounded by the table's
/// columns, so the update applies.
#[test]
fn a_huge_stored_column_versions_blob_is_read_in_bounded_memory() {
    use native_push::*;
    let (l, mut c) = Limited::new("column_versions");
    setup(&mut c);
    let insert = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    assert_eq!(push(&mut c, "k1", &[insert])["outcome"], "applied");
    // 150,000,000 bytes 0x02: 75 million pairs (column 2, version 2), all valid.
    c.batch_execute(
        "UPDATE public.np_tasks SET \"_sync_column_versions\" = convert_to(repeat(chr(2), 150000000), 'UTF8')
          WHERE \"_sync_row_id\" = 't1'",
    )
    .unwrap();
    let update = e2(&mut c);
    let outcome = clean("push_commit", try_push(&mut c, "k2", &[update], json!({})))
        .expect("the update is read and applied");
    assert_eq!(outcome["outcome"], "applied", "{outcome}");
    // Column 2 (title) at the new version 2, the others at 1: the blob is small again.
    let versions: Option<Vec<u8>> = c
        .query_one(
            "SELECT \"_sync_column_versions\" FROM public.np_tasks WHERE \"_sync_row_id\" = 't1'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(versions, Some(vec![2, 2]));
    l.assert_nobody_restarted(c);
}

/// Issue 25: `push_commit` with its two `text[]` arguments at their caps (100,000 elements of
/// 4 KiB each) copied them into Rust strings (800 MB on top of the arguments), and the backend
/// aborted under the limit. The arguments are borrowed: the call answers.
#[test]
fn push_commit_with_both_text_arrays_at_their_caps_answers() {
    let (l, mut c) = Limited::new("push_arrays");
    // The simple protocol, as psql sends it: a prepared statement would also keep the folded
    // arrays in its cached plan, and PostgreSQL would refuse that copy first.
    let outcome = clean(
        "push_commit",
        c.simple_query(
            "SELECT syncular.push_commit('p', 'c1', 'k', 'a1', 1, 1, '{}',
               array_fill(repeat('t', 4096), ARRAY[100000]),
               array_fill(repeat('r', 4096), ARRAY[100000]),
               array_fill(1::smallint, ARRAY[100000]), array_fill(NULL::bigint, ARRAY[100000]),
               array_fill('\\x00'::bytea, ARRAY[100000]))",
        ),
    )
    .map(|messages| simple_value(&messages))
    .expect("the arrays are read in place");
    // The tables of 4 KiB names are in no push schema: the static check answers.
    assert_eq!(
        (&outcome["outcome"], &outcome["reason"]),
        (&json!("fallback"), &json!("schema_not_registered")),
        "{outcome}"
    );
    l.assert_nobody_restarted(c);
}

/// Values at the caps of docs/API.md "Limits", computed once into a table (each call reads them
/// back, as large as an argument may be), one column per statement (a row of all of them
/// formed at once would not fit the limit).
const CAPS_SQL: &str = "
CREATE TABLE caps (text text, texts text[], doc jsonb, bytes bytea, byteas bytea[],
                   smallints smallint[], bigints bigint[]);
INSERT INTO caps (text) VALUES (repeat('x', 4096));
UPDATE caps SET texts = array_fill(repeat('x', 4096), ARRAY[100000]);
UPDATE caps SET doc = (SELECT jsonb_agg(repeat('x', 29)) FROM generate_series(1, 999000));
UPDATE caps SET bytes = convert_to(repeat('x', 33554432), 'UTF8');
UPDATE caps SET byteas = array_fill(convert_to(repeat('x', 335), 'UTF8'), ARRAY[100000]);
UPDATE caps SET smallints = array_fill(1::smallint, ARRAY[100000]),
                bigints = array_fill(1::bigint, ARRAY[100000]);";

/// A value of SQL type `typ` at its cap (a variable-size type), or a small one.
fn at_cap(typ: &str) -> &'static str {
    match typ {
        "text" => "(SELECT text FROM caps)",
        "text[]" => "(SELECT texts FROM caps)",
        "jsonb" => "(SELECT doc FROM caps)",
        "bytea" => "(SELECT bytes FROM caps)",
        "bytea[]" => "(SELECT byteas FROM caps)",
        "smallint[]" => "(SELECT smallints FROM caps)",
        "bigint[]" => "(SELECT bigints FROM caps)",
        // Row limits at theirs.
        "integer" => "100000",
        other => small(other),
    }
}

/// Issue 25, "the argument-cap test also calls every function with every argument at its cap
/// at once": each call answers or fails with a clean ERROR, and nobody restarts.
#[test]
fn every_function_with_every_argument_at_its_cap_at_once_ends_cleanly() {
    let (l, mut c) = Limited::new("at_caps");
    register_tasks(&mut c);
    c.batch_execute(CAPS_SQL).unwrap();
    let document_bytes: i64 = c
        .query_one("SELECT octet_length(doc::text)::bigint FROM caps", &[])
        .unwrap()
        .get(0);
    assert!(document_bytes > 32_000_000, "{document_bytes}");
    let functions = callable_functions(&mut c);
    for (function, types) in &functions {
        let args: Vec<&str> = types.iter().map(|t| at_cap(t)).collect();
        let sql = format!("SELECT syncular.{function}({})", args.join(", "));
        c.batch_execute("BEGIN").unwrap();
        let _ = clean(&sql, c.batch_execute(&sql));
        c.batch_execute("ROLLBACK")
            .unwrap_or_else(|e| panic!("{sql}: the session ended ({e})"));
    }
    l.assert_nobody_restarted(c);
}

/// The little-endian `u32` of a codec length prefix, as SQL hex.
fn le32(n: usize) -> String {
    format!("{:08x}", (n as u32).swap_bytes())
}

/// Issue 25, "reads stored data at its largest": what the API stores at its caps (commits of a
/// full document, a push result and a client record at the document cap, reactions at their
/// payload cap) and app rows as large as their host made them, read back by every reader. Each
/// reader answers within its budget, or refuses cleanly; nobody restarts.
#[test]
fn stored_data_at_its_largest_is_read_back_cleanly() {
    use native_push::*;
    let (l, mut c) = Limited::new("stored");
    setup(&mut c);
    // Four commits, each a document at the 32 MiB cap (a 24 MB payload in base64).
    for k in 1..=4 {
        append_large_row(&mut c, &format!("big-{k}"), &format!("r{k}"), 24_000_000);
    }
    // A push result and a client record at the document cap.
    c.batch_execute(
        "SELECT syncular.put_push_result('p', 'c1', 'k-big', jsonb_build_object(
           'status', 'applied', 'commitSeq', 1,
           'results', (SELECT jsonb_agg(jsonb_build_object('opIndex', i, 'status', 'applied'))
                         FROM generate_series(0, 189999) AS i)))",
    )
    .unwrap();
    c.batch_execute(
        "SELECT syncular.put_client('p', jsonb_build_object(
           'clientId', 'big', 'actorId', 'a1', 'cursor', 0, 'updatedAtMs', 1,
           'subscriptions', (SELECT jsonb_agg(jsonb_build_object(
               'id', repeat('s', 280) || i, 'table', 'tasks',
               'scopes', jsonb_build_object('project_id', jsonb_build_array('p1'))))
             FROM generate_series(1, 90000) AS i)))",
    )
    .unwrap();
    // 1,500 reactions with a payload at its 64 KiB cap: 96 MB of documents for one list.
    for batch in 0..15 {
        c.batch_execute(&format!(
            "SELECT syncular.enqueue_reactions('p', (SELECT jsonb_agg(jsonb_build_object(
               'idempotencyKey', 'r' || i, 'type', 't', 'version', 1,
               'payload', jsonb_build_object('pad', repeat('z', 65000)),
               'sourceClientId', 'c1', 'sourceClientCommitId', 'k', 'sourceCommitSeq', 1,
               'createdAtMs', 1, 'availableAtMs', 1))
             FROM generate_series({from}, {to}) AS i))",
            from = batch * 100,
            to = batch * 100 + 99
        ))
        .unwrap();
    }
    // An app row its host wrote at 100 MB of payload (a valid row: a title of 100 MB) and
    // 100 MB of column versions.
    let insert = up(&mut c, "tasks", "t1", None, task("t1", "p1"));
    assert_eq!(push(&mut c, "k1", &[insert])["outcome"], "applied");
    let title = 100_000_000;
    c.batch_execute(&format!(
        "UPDATE public.np_tasks
            SET \"_sync_payload\" = '\\x30{id}7431{id}7031'::bytea || '\\x{len}'::bytea
                                    || convert_to(repeat('y', {title}), 'UTF8') || '\\x00'::bytea,
                \"_sync_column_versions\" = convert_to(repeat(chr(2), 100000000), 'UTF8')
          WHERE \"_sync_row_id\" = 't1'",
        id = le32(2),
        len = le32(title),
    ))
    .unwrap();

    let filter = r#"'{"project_id":["p1"]}'"#;
    let readers = [
        // The log: four commits of 24 MB are past the 64 MiB budget of one call.
        format!("SELECT count(*) FROM syncular.read_commit_window('p', 'tasks', {filter}, 0, 100, 100000)"),
        format!("SELECT count(*) FROM syncular.read_commit_window('p', 'tasks', {filter}, 0, 100, 1)"),
        format!(
            "SELECT count(*) FROM syncular.pull('p', 'cl', 'a1', 1, 'e1', 1, jsonb_build_object(
               'subscriptions', jsonb_build_array(jsonb_build_object('id', 's', 'table', 'tasks',
                 'scopes', {filter}::jsonb, 'effective', {filter}::jsonb, 'cursor', 0))))"
        ),
        "SELECT count(*) FROM syncular.list_commit_metadata('p', 0, 100000, NULL)".into(),
        // The push result and the client record.
        "SELECT length(syncular.get_push_result('p', 'c1', 'k-big')::text)".into(),
        "SELECT length(syncular.get_client('p', 'big')::text)".into(),
        "SELECT length(syncular.list_clients('p')::text)".into(),
        "SELECT length(syncular.list_client_cursors('p')::text)".into(),
        // The reactions: a list and a claim past the budget are refused, a small one answers.
        "SELECT length(syncular.list_reactions('p', 100000)::text)".into(),
        "SELECT length(syncular.list_reactions('p', 10)::text)".into(),
        "SELECT length(syncular.claim_reactions('p', 'w', ARRAY['t'], 2, 1000, 100000)::text)".into(),
        // The app row, by every reader of app rows.
        format!("SELECT count(*) FROM syncular.scan_rows('p', 'tasks', {filter}, NULL, 100)"),
        format!(
            "SELECT count(*) FROM syncular.pull('p', 'cl2', 'a1', 1, 'e1', 1, jsonb_build_object(
               'subscriptions', jsonb_build_array(jsonb_build_object('id', 's', 'table', 'tasks',
                 'scopes', {filter}::jsonb, 'effective', {filter}::jsonb, 'cursor', -1))))"
        ),
        "SELECT syncular.get_row_scopes('p', 'tasks', 't1')::text".into(),
    ];
    let mut answered = Vec::new();
    for sql in &readers {
        c.batch_execute("BEGIN").unwrap();
        let outcome = clean(sql, c.batch_execute(sql));
        answered.push(outcome.map_err(|e| (e.state, e.detail)));
        c.batch_execute("ROLLBACK")
            .unwrap_or_else(|e| panic!("{sql}: the session ended ({e})"));
    }
    // The update of the large row reads it, merges the new title and applies.
    let update = e2(&mut c);
    let outcome = clean("push_commit", try_push(&mut c, "k2", &[update], json!({})))
        .expect("the large stored row is read and updated");
    assert_eq!(outcome["outcome"], "applied", "{outcome}");
    // Stored scopes beyond what a jsonb argument may be are measured, not parsed: the push
    // refuses the row as damaged data (XX000), cleanly.
    let insert = up(&mut c, "tasks", "t2", None, task("t2", "p1"));
    assert_eq!(push(&mut c, "k3", &[insert])["outcome"], "applied");
    c.batch_execute(
        "UPDATE public.np_tasks
            SET \"_sync_scopes\" = jsonb_build_object('project_id', 'p1', 'pad', repeat('q', 34000000))
          WHERE \"_sync_row_id\" = 't2'",
    )
    .unwrap();
    let update = up(
        &mut c,
        "tasks",
        "t2",
        None,
        json!({"id": "t2", "title": "v2"}),
    );
    let refused = try_push(&mut c, "k4", &[update], json!({}))
        .expect_err("scopes over the document caps are refused");
    assert_eq!(
        refused.as_db_error().map(|e| e.severity()),
        Some("ERROR"),
        "{refused}"
    );
    let refused = sql_error(&refused);
    assert_eq!(refused.state, "XX000", "{refused:?}");
    let too_large = |argument: &str| {
        Err((
            "SY000".to_string(),
            Some(json!({"argument": argument, "reason": "too_large"})),
        ))
    };
    // Only the two page readers and the reaction lists past the budget refuse; every other
    // reader answers, the pull with what fits.
    for (i, (sql, outcome)) in readers.iter().zip(&answered).enumerate() {
        let expected = match i {
            0 => too_large("limit_changes"),
            8 | 10 => too_large("lim"),
            _ => Ok(()),
        };
        assert_eq!(outcome, &expected, "{sql}");
    }
    l.assert_nobody_restarted(c);
}
