//! Every long call honours a cancel and `statement_timeout` within a second (docs/SECURITY.md,
//! "Time").
//!
//! PostgreSQL acts on a cancel only where the running code checks its interrupt flag; a loop in
//! Rust without that check keeps a backend busy — and deaf to cancel, timeout and terminate —
//! until it ends. Each test builds inputs at the caps of docs/API.md "Limits" that made one call
//! of the API run for minutes before (a quadratic loop without an interrupt check), runs the
//! call over and over in one statement of a session of its own, interrupts that statement from
//! outside once it has run for a while — `pg_cancel_backend` from a second session, then
//! `statement_timeout` — and measures how long the backend takes to end it with `57014`. The
//! bound is on interrupt latency, not on speed: a call may take as long as its input needs, but
//! it must stop within a second of being told to.

use postgres::Client;
use serde_json::{json, Map, Value};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use syncular_multisession::*;

/// The longest a backend may take to end a statement after the interrupt.
const BOUND: Duration = Duration::from_secs(1);
/// When the test stops waiting (the old code took minutes).
const GIVE_UP: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug)]
enum Stop {
    /// `pg_cancel_backend` from a second session.
    Cancel,
    /// `statement_timeout`.
    Timeout,
}

/// Runs `body` in a session of its own, interrupts it after it has run for `running`, asserts
/// that it ends with `57014` within [`BOUND`] of the interrupt, and returns that latency.
fn interrupt(db: &TestDb, body: &str, stop: Stop, running: Duration) -> Duration {
    let mut worker = db.connect();
    let pid = backend_pid(&mut worker);
    if let Stop::Timeout = stop {
        worker
            .batch_execute(&format!("SET statement_timeout = {}", running.as_millis()))
            .unwrap();
    }
    let (tx, rx) = mpsc::channel();
    let body = body.to_string();
    std::thread::spawn(move || {
        let started = Instant::now();
        let result = worker.batch_execute(&body);
        let _ = tx.send((started, Instant::now(), result.map_err(|e| sql_error(&e))));
    });
    let cancelled_at = match stop {
        Stop::Cancel => {
            std::thread::sleep(running);
            if let Ok((_, _, result)) = rx.try_recv() {
                panic!("the statement ended before the cancel: {result:?}");
            }
            let mut observer = db.connect();
            let at = Instant::now();
            let sent: bool = one(&mut observer, "SELECT pg_cancel_backend($1)", &[&pid]);
            assert!(sent, "no backend {pid} to cancel");
            Some(at)
        }
        Stop::Timeout => None,
    };
    let (started, ended, result) = rx.recv_timeout(GIVE_UP).unwrap_or_else(|_| {
        panic!("{stop:?}: the statement did not end within {GIVE_UP:?} of its start")
    });
    let err = match result {
        Ok(()) => panic!("{stop:?}: the statement ended without being interrupted"),
        Err(err) => err,
    };
    assert_eq!(err.state, "57014", "{stop:?}: {err:?}");
    let from = cancelled_at.unwrap_or(started + running);
    let latency = ended.saturating_duration_since(from);
    assert!(
        latency < BOUND,
        "{stop:?}: the backend took {latency:?} to honour the interrupt"
    );
    latency
}

/// Both interrupts of [`interrupt`], after the statement has run for `running`.
fn cancel_and_timeout(db: &TestDb, body: &str, running: Duration) {
    let call = body
        .split("syncular.")
        .nth(1)
        .and_then(|s| s.split('(').next());
    for stop in [Stop::Cancel, Stop::Timeout] {
        let latency = interrupt(db, body, stop, running);
        eprintln!(
            "{stop:?} of {}: 57014 after {latency:?}",
            call.unwrap_or(body)
        );
    }
}

/// Keeps a JSON input for the statements of a test: `(SELECT v FROM public.inputs WHERE k = …)`.
fn keep(c: &mut Client, key: &str, value: &Value) {
    c.batch_execute("CREATE TABLE IF NOT EXISTS public.inputs (k text PRIMARY KEY, v jsonb)")
        .unwrap();
    c.execute("INSERT INTO public.inputs VALUES ($1, $2)", &[&key, value])
        .unwrap();
}

/// `DO` block repeating `call` (a statement that may use `iteration`, 1, 2, …) until it is
/// interrupted.
fn repeated(call: &str) -> String {
    format!(
        "DO $$ DECLARE iteration bigint := 0;
         BEGIN LOOP iteration := iteration + 1; {call}; END LOOP; END $$"
    )
}

// ---- scope matching: the commit window and the pull --------------------------------------------

/// Scope variables of every change and filter: the cap, `k00` … `k63` (docs/API.md "Limits").
const VARS: usize = 64;
/// Changes of `tasks` in the log (5 commits of 2,000) and current rows of `tasks`.
const CHANGES: usize = 10_000;
/// Values listed per variable after the first. The old rule searched the lists linearly:
/// 63 × 10,000 comparisons per change, minutes for the window. More values would only lengthen
/// what no check can interrupt: the argument is parsed whole before the first loop of the call
/// (docs/SECURITY.md "Time").
const LISTED: usize = 10_000;

/// The effective filter at the caps: `k00` lists only `x` (candidate selection reads one index
/// range), every other variable lists 9,999 other values before `x`. Every change matches.
fn wide_filter() -> Value {
    let mut filter = Map::new();
    filter.insert("k00".into(), json!(["x"]));
    for k in 1..VARS {
        let mut values: Vec<Value> = (1..LISTED).map(|i| json!(format!("v{i:05}"))).collect();
        values.push(json!("x"));
        filter.insert(format!("k{k:02}"), Value::Array(values));
    }
    Value::Object(filter)
}

/// `{"k00": "x", …, "k63": "x"}`, as SQL.
const SCOPES_SQL: &str =
    "(SELECT jsonb_object_agg('k' || lpad(v::text, 2, '0'), 'x') FROM generate_series(0, 63) v)";

/// The log: 5 commits of 2,000 changes of `tasks`, each change scoped by all 64 variables.
fn wide_log(c: &mut Client) {
    c.batch_execute(&format!(
        "SELECT syncular.append_commit('{P}', jsonb_build_object(
           'clientId', 'c1', 'clientCommitId', 'wide-' || i, 'actorId', 'a1', 'createdAtMs', 1,
           'writerVersion', 1,
           'changes', (SELECT jsonb_agg(jsonb_build_object('table', 'tasks', 'rowId',
                                        'r' || i || '-' || j, 'op', 'upsert', 'rowVersion', 1,
                                        'scopes', {SCOPES_SQL}, 'payload', 'AQID'))
                         FROM generate_series(1, 2000) j)))
         FROM generate_series(1, 5) i"
    ))
    .unwrap();
    // Every change matches a small filter on the first and the last variable.
    let small = json!({"k00": ["x"], "k63": ["x"]});
    let n: i64 = one(
        c,
        "SELECT count(*) FROM syncular.read_commit_window($1, 'tasks', $2, 0, 100, 100000)",
        &[&P, &small],
    );
    assert_eq!(n, CHANGES as i64);
}

#[test]
fn the_commit_window_honours_cancel_and_timeout_at_the_caps() {
    let db = TestDb::new("interrupt_window");
    let mut c = db.connect();
    wide_log(&mut c);
    keep(&mut c, "filter", &wide_filter());
    let body = repeated(&format!(
        "PERFORM count(*) FROM syncular.read_commit_window('{P}', 'tasks',
           (SELECT v FROM public.inputs WHERE k = 'filter'), 0, 1000000, 100000)"
    ));
    cancel_and_timeout(&db, &body, Duration::from_millis(1500));
}

/// A pull request of one subscription with the wide filter: `cursor` 0 reads the window,
/// `cursor` -1 the bootstrap scan of the current rows.
fn pull_request(filter: &Value, cursor: i64) -> Value {
    json!({"subscriptions": [{"id": "s1", "table": "tasks", "scopes": {}, "effective": filter,
                              "cursor": cursor}],
           "limitCommits": 1000, "limitSnapshotRows": 50000, "maxSnapshotPages": 1})
}

fn pull_call(request: &str) -> String {
    repeated(&format!(
        "PERFORM count(*) FROM syncular.pull('{P}', 'c1', 'a1', 1, 'epoch-1', 1,
           (SELECT v FROM public.inputs WHERE k = '{request}'))"
    ))
}

#[test]
fn the_pull_honours_cancel_and_timeout_at_the_caps() {
    let db = TestDb::new("interrupt_pull");
    let mut c = db.connect();
    wide_log(&mut c);
    // The current rows of the bootstrap: every row scoped by all 64 variables, indexed by the
    // first (as set_row_scopes would index it).
    c.batch_execute(&format!(
        "INSERT INTO public.tasks (\"_sync_partition\", \"_sync_row_id\", id, \"_sync_server_version\",
                                   \"_sync_scopes\", \"_sync_payload\")
         SELECT '{P}', 'r' || i, 'r' || i, 1, {SCOPES_SQL}, '\\x01' FROM generate_series(1, {CHANGES}) i;
         INSERT INTO syncular.sync_row_scopes (partition, tbl, var, value, row_id)
         SELECT '{P}', 'tasks', 'k00', 'x', 'r' || i FROM generate_series(1, {CHANGES}) i;"
    ))
    .unwrap();
    let small = json!({"k00": ["x"], "k63": ["x"]});
    let served = |c: &mut Client, request: &Value| -> i64 {
        one(
            c,
            "SELECT count(*) FROM syncular.pull($1, 'c1', 'a1', 1, 'epoch-1', 1, $2) WHERE sub = 0",
            &[&P, request],
        )
    };
    // The window delivers the first commit whole (2,000 changes); the bootstrap every row.
    assert_eq!(served(&mut c, &pull_request(&small, 0)), 2000);
    assert_eq!(served(&mut c, &pull_request(&small, -1)), CHANGES as i64);
    keep(&mut c, "window", &pull_request(&wide_filter(), 0));
    keep(&mut c, "bootstrap", &pull_request(&wide_filter(), -1));
    cancel_and_timeout(&db, &pull_call("window"), Duration::from_millis(1500));
    cancel_and_timeout(&db, &pull_call("bootstrap"), Duration::from_millis(1500));
}

// ---- the push on the widest push schema --------------------------------------------------------

/// Columns of the widest table a push schema may declare (docs/API.md "Limits").
const COLUMNS: usize = 1600;
/// Rows of the wide table, each updated by one operation of the push.
const ROWS: usize = 10_000;

/// Where `r00000` sits in `payload`, 1-based, past the `r` (for `overlay`).
fn digits_at(payload: &[u8]) -> i32 {
    let at = payload
        .windows(6)
        .position(|w| w == b"r00000")
        .expect("the row id in the payload");
    at as i32 + 2
}

#[test]
fn a_push_on_the_widest_schema_honours_cancel_and_timeout() {
    let db = TestDb::new("interrupt_push");
    let mut c = db.connect();
    // A table of meta columns only: its push schema does not materialize the app columns.
    c.batch_execute(&app_table_sql("public.wide", "")).unwrap();
    c.batch_execute("SELECT syncular.register_table('wide', 'public.wide')")
        .unwrap();
    let mut columns = vec![json!({"name": "c0000", "type": "string", "nullable": false})];
    columns.extend(
        (1..COLUMNS)
            .map(|i| json!({"name": format!("c{i:04}"), "type": "boolean", "nullable": true})),
    );
    let schema = json!({"wide": {"columns": columns, "primaryKey": "c0000", "materialize": false,
                                 "scopes": [{"variable": "c", "column": "c0000"}]}});
    let _: i32 = one(&mut c, "SELECT syncular.set_push_schema(1, $1)", &[&schema]);
    // Every column present, all but the key NULL: the smallest payload that makes each
    // operation an update of every column (the old code compared every column with every
    // present one per row: 2.56 million steps).
    let mut values = Map::new();
    values.insert("c0000".into(), json!("r00000"));
    for i in 1..COLUMNS {
        values.insert(format!("c{i:04}"), Value::Null);
    }
    let values = Value::Object(values);
    let full: Vec<u8> = one(
        &mut c,
        "SELECT syncular.encode_row('wide', $1, false)",
        &[&values],
    );
    let sparse: Vec<u8> = one(
        &mut c,
        "SELECT syncular.encode_row('wide', $1, true)",
        &[&values],
    );
    let (full_at, sparse_at) = (digits_at(&full), digits_at(&sparse));
    let id = "'r' || lpad(i::text, 5, '0')";
    let with_id = |at: i32| {
        format!(
            "overlay($1::bytea placing convert_to(lpad(i::text, 5, '0'), 'UTF8') from {at} for 5)"
        )
    };
    c.execute(
        &format!(
            "INSERT INTO public.wide (\"_sync_partition\", \"_sync_row_id\", \"_sync_server_version\",
                                      \"_sync_scopes\", \"_sync_payload\")
             SELECT '{P}', {id}, 1, jsonb_build_object('c', {id}), {}
               FROM generate_series(0, {}) i",
            with_id(full_at),
            ROWS - 1
        ),
        &[&full],
    )
    .unwrap();
    c.batch_execute(
        "CREATE TABLE public.ops (n int, tables text[], ids text[], kinds int2[], bvs int8[],
                                  payloads bytea[])",
    )
    .unwrap();
    // Operations 1: every row; 2: the first two (the sanity check below).
    for (n, count) in [(1, ROWS), (2, 2)] {
        c.execute(
            &format!(
                "INSERT INTO public.ops
                 SELECT {n}, array_agg('wide'::text), array_agg({id} ORDER BY i), array_agg(1::int2),
                        array_agg(NULL::int8), array_agg({} ORDER BY i)
                   FROM generate_series(0, {}) i",
                with_id(sparse_at),
                count - 1
            ),
            &[&sparse],
        )
        .unwrap();
    }
    let push = |ops: i32, key: &str| {
        format!(
            "SELECT syncular.push_commit('{P}', 'c1', {key}, 'a1', 1, 1, '{{\"c\":[\"*\"]}}'::jsonb, o.tables,
                                         o.ids, o.kinds, o.bvs, o.payloads)
               FROM public.ops o WHERE o.n = {ops}"
        )
    };
    // The operations apply (no fallback, no rejection): each iteration below does the work.
    let outcome: Value = one(&mut c, &push(2, "'check'"), &[]);
    assert_eq!(outcome["outcome"], json!("applied"), "{outcome}");
    let body = repeated(&format!("PERFORM ({})", push(1, "'wide-' || iteration")));
    cancel_and_timeout(&db, &body, Duration::from_millis(1500));
}

// ---- other loops over capped input -------------------------------------------------------------

/// The gate compares every pending checkpoint with the declarations: 60,000 of each (the old
/// code searched the declarations once per checkpoint: 1.8·10⁹ comparisons). Through
/// `serve_gate_refusal`, which returns nothing when all are declared: `assert_serve_ready`
/// returns the pending list, whose conversion to `jsonb` no check can interrupt.
#[test]
fn the_gate_honours_cancel_and_timeout_with_many_declarations() {
    let db = TestDb::new("interrupt_gate");
    let mut c = db.connect();
    let n = 60_000;
    c.batch_execute(&format!(
        "INSERT INTO syncular.sync_backfill_checkpoints
           (partition, name, schema_version, state, watermark, owner_epoch, observed_rows, updated_at_ms)
         SELECT '{P}', 'n' || lpad(i::text, 6, '0'), 1, 'declared', 0, 0, 0, 1
           FROM generate_series(1, {n}) i"
    ))
    .unwrap();
    // Declared in the reverse of the gate's order, every pending checkpoint among them.
    let declared: Vec<Value> = (1..=n)
        .rev()
        .map(|i| json!({"partition": P, "name": format!("n{i:06}")}))
        .collect();
    let refusal = |c: &mut Client, declared: &Value| -> Option<Value> {
        one(
            c,
            "SELECT syncular.serve_gate_refusal($1, 1, $2)",
            &[&P, declared],
        )
    };
    let undeclared = refusal(&mut c, &json!([])).expect("a refusal");
    assert_eq!(undeclared["kind"], json!("checkpoint"));
    keep(&mut c, "declared", &Value::Array(declared));
    let body = repeated(&format!(
        "PERFORM syncular.serve_gate_refusal('{P}', 1,
           (SELECT v FROM public.inputs WHERE k = 'declared'))"
    ));
    cancel_and_timeout(&db, &body, Duration::from_millis(1500));
    // What each iteration did: every pending checkpoint found among the declarations.
    let all: Value = one(
        &mut c,
        "SELECT v FROM public.inputs WHERE k = 'declared'",
        &[],
    );
    assert_eq!(refusal(&mut c, &all), None);
}

// ---- the caps that bound the time of a call ----------------------------------------------------

/// More than 64 variables in a scope filter, more than 1,600 columns or 64 scopes in a table of
/// a push schema: `too_large` on the argument (docs/API.md "Limits"); at the caps, accepted.
#[test]
fn the_caps_that_bound_a_call_are_refused_as_too_large() {
    let db = TestDb::new("interrupt_caps");
    let mut c = db.connect();
    let vars = |n: usize| -> Value {
        Value::Object((0..n).map(|i| (format!("v{i:02}"), json!(["x"]))).collect())
    };
    let too_large = |argument: &str| Some(json!({"argument": argument, "reason": "too_large"}));
    for (sql, argument) in [
        (
            "SELECT count(*) FROM syncular.read_commit_window($1, 'tasks', $2, 0, 10, 10)",
            "scope_filter",
        ),
        (
            "SELECT count(*) FROM syncular.scan_rows($1, 'tasks', $2, NULL, 10)",
            "scope_filter",
        ),
        (
            "SELECT syncular.latest_scoped_change_seq($1, 'tasks', $2)",
            "scope_filter",
        ),
    ] {
        let _: i64 = one(&mut c, sql, &[&P, &vars(64)]);
        let refused = try_one::<i64>(&mut c, sql, &[&P, &vars(65)]);
        expect_error(
            refused,
            "SY000",
            "sync.storage.invalid_argument",
            too_large(argument),
        );
    }
    let pull = "SELECT count(*) FROM syncular.pull($1, 'c1', 'a1', 1, 'epoch-1', 1, $2)";
    let _: i64 = one(&mut c, pull, &[&P, &pull_request(&vars(64), 0)]);
    let refused = try_one::<i64>(&mut c, pull, &[&P, &pull_request(&vars(65), 0)]);
    expect_error(
        refused,
        "SY000",
        "sync.storage.invalid_argument",
        too_large("request.subscriptions[0].effective"),
    );
    let table = |columns: usize, scopes: usize| {
        let columns: Vec<Value> = (0..columns)
            .map(|i| json!({"name": format!("c{i:04}"), "type": "string", "nullable": false}))
            .collect();
        let scopes: Vec<Value> = (0..scopes)
            .map(|i| json!({"variable": format!("v{i:02}"), "column": "c0000"}))
            .collect();
        json!({"t": {"columns": columns, "primaryKey": "c0000", "scopes": scopes}})
    };
    let set = "SELECT syncular.set_push_schema(1, $1)";
    let _: i32 = one(&mut c, set, &[&table(COLUMNS, VARS)]);
    for (schema, argument) in [
        (table(COLUMNS + 1, 1), "tables.t.columns"),
        (table(1, VARS + 1), "tables.t.scopes"),
    ] {
        let refused = try_one::<i32>(&mut c, set, &[&schema]);
        expect_error(
            refused,
            "SY000",
            "sync.storage.invalid_argument",
            too_large(argument),
        );
    }
}

/// A cancel or `statement_timeout` that arrives while a `jsonb` argument is read — its size
/// check walks every entry and looks at the interrupt flag — ends the call with `57014` as
/// PostgreSQL raises it, and never with pgrx's Rust backtrace in its DETAIL (the test clusters
/// run with RUST_BACKTRACE set, scripts/cluster.sh). The argument used to be checked while pgrx
/// unboxed it, before the function body that raises errors again as themselves (red team 34,
/// F2): now it is only detoasted there, and checked and parsed in the body. The timeouts sweep
/// the argument's reading, so some of them fall inside the walk.
#[test]
fn a_cancel_while_a_json_argument_is_read_has_no_backtrace() {
    let db = TestDb::new("int_argwalk");
    let mut c = db.connect();
    exec(
        &mut c,
        "CREATE TABLE public.big AS
           SELECT jsonb_object_agg('k' || i, jsonb_build_array('v' || i)) AS j
             FROM generate_series(1, 400000) i",
    );
    let calls = [
        "SELECT syncular.encode_row('tasks', (SELECT j FROM public.big))",
        "SELECT syncular.set_row_scopes('p', 'tasks', 'x', (SELECT j FROM public.big))",
        "SELECT * FROM syncular.pull('p', 'd', 'a', 0, 'e', 1, (SELECT j FROM public.big))",
    ];
    // A setting runs under the timeout set before it: on a loaded machine even a SET can take
    // longer than 2 ms and be cancelled, so it is repeated until it took.
    let set = |c: &mut Client, sql: &str| {
        while let Err(e) = c.batch_execute(sql) {
            let code = e.as_db_error().map(|d| d.code().code().to_string());
            assert_eq!(code.as_deref(), Some("57014"), "{sql}: {e}");
        }
    };
    let mut cancelled = 0;
    for call in calls {
        for ms in (2..=60).step_by(2) {
            set(&mut c, &format!("SET statement_timeout = {ms}"));
            let Err(e) = c.batch_execute(call) else {
                continue;
            };
            let Some(db_error) = e.as_db_error() else {
                panic!("{call}: {e}");
            };
            if db_error.code().code() == "57014" {
                cancelled += 1;
                let detail = db_error.detail().unwrap_or_default();
                assert!(
                    !detail.contains("pgrx") && !detail.contains("syncular::"),
                    "{call} at {ms} ms: a backtrace in the DETAIL: {detail}"
                );
            }
        }
        set(&mut c, "RESET statement_timeout");
    }
    assert!(cancelled > 10, "only {cancelled} calls were interrupted");
}
