//! The schema the extension installs into, and the channel it notifies on (docs/SECURITY.md,
//! "Installing" and "Notifications"): attacks by a role that can create schemas in the database
//! (the walkthrough grants CREATE on the database to the migrator), by a role given CREATE on
//! schema `syncular` (a 0.24 host during a rolling upgrade), and by any role that can connect.
//! The prize is one of the attacker's functions or operators run with the installing
//! superuser's rights, or the partitions' commits read from a notification channel.

use postgres::fallible_iterator::FallibleIterator;
use postgres::Client;
use serde_json::{json, Value};
use std::time::Duration;
use syncular_multisession::*;

/// A database without the extension and without a schema `syncular` (the fixture's, both
/// dropped), as a database looks before `CREATE EXTENSION syncular`.
fn bare(test: &str) -> (TestDb, Client) {
    let db = TestDb::new(test);
    let mut c = db.connect();
    exec(
        &mut c,
        "DROP EXTENSION syncular CASCADE; DROP SCHEMA syncular CASCADE",
    );
    (db, c)
}

/// A role `<database>_<suffix>` (roles are cluster-wide; the database name is unique per test).
fn role(c: &mut Client, db: &TestDb, suffix: &str, login: bool) -> String {
    let name = format!("{}_{suffix}", db.name);
    let login = if login { "LOGIN" } else { "NOLOGIN" };
    exec(c, &format!("CREATE ROLE {name} {login}"));
    name
}

/// Schema `marker` (the superuser's) with a table every role may insert into: the attacker's
/// planted functions record there as whom they ran.
fn marker(c: &mut Client) {
    exec(
        c,
        "CREATE SCHEMA marker;
         CREATE TABLE marker.ran (who name, superuser boolean, what text);
         GRANT USAGE ON SCHEMA marker TO PUBLIC;
         GRANT INSERT ON marker.ran TO PUBLIC;",
    );
}

/// The body of a planted PL/pgSQL function: record who runs it, then return `result`.
fn record(what: &str, result: &str) -> String {
    format!(
        "BEGIN
           INSERT INTO marker.ran SELECT current_user, rolsuper, '{what}' FROM pg_catalog.pg_roles
            WHERE rolname = current_user;
           RETURN {result};
         END"
    )
}

/// Who ran a planted function, and what it was.
fn ran(c: &mut Client) -> Vec<String> {
    column(
        c,
        "SELECT who || ' (superuser: ' || superuser || '): ' || what FROM marker.ran ORDER BY 1",
        &[],
    )
}

fn installed(c: &mut Client) -> Option<String> {
    try_one(
        c,
        "SELECT extversion FROM pg_extension WHERE extname = 'syncular'",
        &[],
    )
    .ok()
}

/// The attack of security issue 25: a role with CREATE on the database makes schema `syncular`
/// before the install; after it, renames that schema (it owns it), makes a new `syncular` with a
/// table `sync_commits` and a function `_fence_guard_busy()`, and creates a trigger on a table
/// of its own: the fence guard's event trigger called the function as the superuser.
#[test]
fn a_schema_squatted_before_install_is_refused_and_nothing_planted_ever_runs() {
    let (db, mut c) = bare("squat");
    let mallory = role(&mut c, &db, "mallory", false);
    exec(
        &mut c,
        &format!("GRANT CREATE ON DATABASE {} TO {mallory}", db.name),
    );
    marker(&mut c);
    exec(
        &mut c,
        &format!("SET ROLE {mallory}; CREATE SCHEMA syncular; RESET ROLE"),
    );
    let install = c.batch_execute("CREATE EXTENSION syncular");
    // The rest of the attack, whether or not the install went through.
    exec(
        &mut c,
        &format!(
            "SET ROLE {mallory};
             ALTER SCHEMA syncular RENAME TO syncular_old;
             CREATE SCHEMA syncular;
             CREATE TABLE syncular.sync_commits (x int);
             CREATE FUNCTION syncular._fence_guard_busy() RETURNS boolean LANGUAGE plpgsql
               AS $$ {} $$;
             CREATE TABLE syncular.mine (x int);
             CREATE FUNCTION syncular.mine_trigger() RETURNS trigger LANGUAGE plpgsql
               AS $$ BEGIN RETURN NEW; END $$;
             CREATE TRIGGER mine BEFORE INSERT ON syncular.mine
               FOR EACH ROW EXECUTE FUNCTION syncular.mine_trigger();
             DROP TRIGGER mine ON syncular.mine;
             RESET ROLE;",
            record("_fence_guard_busy", "true")
        ),
    );
    assert_eq!(
        ran(&mut c),
        Vec::<String>::new(),
        "a function of the squatter ran"
    );
    let refused = expect_error(
        install.map(|_| ()),
        "42P06",
        "syncular: the existing schema \"syncular\" is not one the extension can be installed into",
        Some(json!(format!(
            "It is owned by role {mallory}, which is not a superuser."
        ))),
    );
    assert!(
        refused.hint.as_deref().is_some_and(
            |h| h.contains("install the extension before granting CREATE on the database")
        ),
        "{refused:?}"
    );
    assert_eq!(installed(&mut c), None);
}

/// Only a schema no other role ever controlled is installed into: owned by a superuser, CREATE
/// held by no other role, and empty. The schema DROP EXTENSION leaves behind (USAGE granted to
/// the two roles) is one; so is the one a pg_dump restore creates first
/// (`coexistence.rs`, OPS-01).
#[test]
fn an_existing_schema_is_installed_into_only_if_no_other_role_could_control_it() {
    let (db, mut c) = bare("schemas");
    let mallory = role(&mut c, &db, "mallory", false);
    let refused = [
        (
            format!("CREATE SCHEMA syncular AUTHORIZATION {mallory}"),
            format!("It is owned by role {mallory}, which is not a superuser."),
        ),
        (
            format!("CREATE SCHEMA syncular; GRANT USAGE, CREATE ON SCHEMA syncular TO {mallory}"),
            format!("CREATE on it is granted to {mallory}."),
        ),
        (
            "CREATE SCHEMA syncular; GRANT ALL ON SCHEMA syncular TO PUBLIC".to_string(),
            "CREATE on it is granted to PUBLIC.".to_string(),
        ),
        (
            "CREATE SCHEMA syncular; CREATE TABLE syncular.leftover (x int)".to_string(),
            "It already holds 1 object(s), e.g. table leftover.".to_string(),
        ),
        (
            // A grant made and revoked again leaves no CREATE, but what was made meanwhile stays.
            format!(
                "CREATE SCHEMA syncular; GRANT USAGE, CREATE ON SCHEMA syncular TO {mallory};
                 SET ROLE {mallory};
                 CREATE FUNCTION syncular.helper() RETURNS int LANGUAGE sql AS 'SELECT 1';
                 RESET ROLE;
                 REVOKE CREATE ON SCHEMA syncular FROM {mallory}"
            ),
            "It already holds 1 object(s), e.g. function helper().".to_string(),
        ),
    ];
    for (setup, detail) in refused {
        exec(&mut c, &setup);
        expect_error(
            c.batch_execute("CREATE EXTENSION syncular"),
            "42P06",
            "syncular: the existing schema \"syncular\" is not one the extension can be installed into",
            Some(json!(detail)),
        );
        assert_eq!(installed(&mut c), None, "{setup}");
        exec(&mut c, "DROP SCHEMA syncular CASCADE");
    }
    // A superuser's empty schema with USAGE granted only: installed into.
    exec(
        &mut c,
        &format!("CREATE SCHEMA syncular; GRANT USAGE ON SCHEMA syncular TO {mallory}"),
    );
    exec(&mut c, "CREATE EXTENSION syncular");
    assert_eq!(append(&mut c, P, "tasks", "t1", Some(V)), 1);
    // DROP EXTENSION keeps the schema and its grants: installing again works.
    exec(&mut c, "DROP EXTENSION syncular; CREATE EXTENSION syncular");
    assert_eq!(append(&mut c, P, "tasks", "t1", Some(V)), 1);
}

/// A 0.1.0 install (whose script took any existing schema) in a schema another role owns, or
/// whose schema was renamed, is not updated: the update script checks first.
#[test]
fn an_update_refuses_an_install_whose_schema_another_role_owns_or_renamed() {
    let (db, mut c) = bare("upd_schema");
    let mallory = role(&mut c, &db, "mallory", false);
    exec(
        &mut c,
        &format!(
            "CREATE SCHEMA syncular AUTHORIZATION {mallory};
             CREATE EXTENSION syncular VERSION '0.1.0'"
        ),
    );
    expect_error(
        c.batch_execute("ALTER EXTENSION syncular UPDATE"),
        "42P15",
        "syncular: the extension's schema is not the superuser-owned schema \"syncular\"",
        Some(json!(format!(
            "The extension is in schema syncular, owned by role {mallory}."
        ))),
    );
    assert_eq!(installed(&mut c).as_deref(), Some("0.1.0"));

    exec(
        &mut c,
        "DROP SCHEMA syncular CASCADE;
         CREATE EXTENSION syncular VERSION '0.1.0';
         ALTER SCHEMA syncular RENAME TO elsewhere",
    );
    expect_error(
        c.batch_execute("ALTER EXTENSION syncular UPDATE"),
        "42P15",
        "syncular: the extension's schema is not the superuser-owned schema \"syncular\"",
        Some(json!(
            "The extension is in schema elsewhere, owned by role postgres."
        )),
    );
    assert_eq!(installed(&mut c).as_deref(), Some("0.1.0"));
    exec(
        &mut c,
        "ALTER SCHEMA elsewhere RENAME TO syncular; ALTER EXTENSION syncular UPDATE",
    );
    assert_ne!(installed(&mut c).as_deref(), Some("0.1.0"));
}

/// A role given CREATE on schema `syncular` (what a 0.24 host's startup DDL needs) plants
/// operators that are a better match than pg_catalog's for what the update script compares
/// (`oid` against `regclass`), and overloads of the fence guard's functions with a defaulted
/// argument. None of them ever runs as the superuser: not in `ALTER EXTENSION … UPDATE`, not in
/// the event triggers that fire for every CREATE/DROP TRIGGER of the database.
#[test]
fn objects_planted_in_the_schema_by_a_role_with_create_never_run_as_the_owner() {
    let (db, mut c) = bare("planted");
    let mallory = role(&mut c, &db, "mallory", false);
    marker(&mut c);
    exec(
        &mut c,
        &format!(
            "CREATE EXTENSION syncular VERSION '0.1.0';
             GRANT USAGE, CREATE ON SCHEMA syncular TO {mallory};
             SET ROLE {mallory};
             CREATE FUNCTION syncular.planted_eq(oid, regclass) RETURNS boolean LANGUAGE plpgsql
               AS $$ {eq} $$;
             CREATE FUNCTION syncular.planted_ne(oid, regclass) RETURNS boolean LANGUAGE plpgsql
               AS $$ {ne} $$;
             CREATE OPERATOR syncular.= (LEFTARG = oid, RIGHTARG = regclass, FUNCTION = syncular.planted_eq);
             CREATE OPERATOR syncular.<> (LEFTARG = oid, RIGHTARG = regclass, FUNCTION = syncular.planted_ne);
             CREATE FUNCTION syncular.planted_name_eq(name, text) RETURNS boolean LANGUAGE plpgsql
               AS $$ {name_eq} $$;
             CREATE OPERATOR syncular.= (LEFTARG = name, RIGHTARG = text, FUNCTION = syncular.planted_name_eq);
             CREATE FUNCTION syncular._fence_guard_busy(planted integer DEFAULT 0) RETURNS boolean
               LANGUAGE plpgsql AS $$ {busy} $$;
             CREATE FUNCTION syncular._native_fence_triggers(planted integer DEFAULT 0) RETURNS bigint
               LANGUAGE plpgsql AS $$ {count} $$;
             RESET ROLE;",
            eq = record("=(oid, regclass)", "$1 = $2::oid"),
            ne = record("<>(oid, regclass)", "$1 <> $2::oid"),
            name_eq = record("=(name, text)", "$1::text = $2"),
            busy = record("_fence_guard_busy(integer)", "true"),
            count = record("_native_fence_triggers(integer)", "1"),
        ),
    );
    exec(&mut c, "ALTER EXTENSION syncular UPDATE");
    assert_eq!(
        ran(&mut c),
        Vec::<String>::new(),
        "planted code ran in the update"
    );
    assert_ne!(installed(&mut c).as_deref(), Some("0.1.0"));

    // Triggers on any other table: the event triggers return before resolving a name.
    exec(
        &mut c,
        &format!(
            "SET ROLE {mallory};
             CREATE TABLE syncular.mine (x int);
             CREATE FUNCTION syncular.mine_trigger() RETURNS trigger LANGUAGE plpgsql
               AS $$ BEGIN RETURN NEW; END $$;
             CREATE TRIGGER mine BEFORE INSERT ON syncular.mine
               FOR EACH ROW EXECUTE FUNCTION syncular.mine_trigger();
             DROP TRIGGER mine ON syncular.mine;
             RESET ROLE;
             CREATE TRIGGER tasks_noop BEFORE INSERT ON public.tasks
               FOR EACH ROW EXECUTE FUNCTION syncular.mine_trigger();
             DROP TRIGGER tasks_noop ON public.tasks;"
        ),
    );
    assert_eq!(
        ran(&mut c),
        Vec::<String>::new(),
        "planted code ran in an event trigger"
    );

    // DDL on sync_commits itself (the owner's, or a 0.24 host's startup DDL) resolves the guard's
    // functions: the planted overloads make the call ambiguous, so the statement is refused —
    // the fence stays, and nothing planted runs (docs/SECURITY.md: never grant CREATE on the
    // schema to a role you would not trust with the extension owner's rights).
    let ddl = c.batch_execute("DROP TRIGGER sync_commits_writer_fence ON syncular.sync_commits");
    expect_error(
        ddl,
        "42725",
        "function syncular._fence_guard_busy() is not unique",
        None,
    );
    assert_eq!(ran(&mut c), Vec::<String>::new());
    let native: i64 = one(
        &mut c,
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'syncular.sync_commits'::regclass
            AND tgfoid = 'syncular.writer_fence_trigger()'::regprocedure",
        &[],
    );
    assert_eq!(native, 1);
}

/// `CREATE INDEX IF NOT EXISTS` of the update skips a name another relation holds: a role with
/// CREATE on the schema that takes the name of the claim index first must not leave the
/// updated install without it.
#[test]
fn a_name_taken_before_the_update_is_not_mistaken_for_its_index() {
    let (db, mut c) = bare("idx_squat");
    let mallory = role(&mut c, &db, "mallory", false);
    exec(
        &mut c,
        &format!(
            "CREATE EXTENSION syncular VERSION '0.1.0';
             GRANT USAGE, CREATE ON SCHEMA syncular TO {mallory};
             SET ROLE {mallory};
             CREATE TABLE syncular.sync_reactions_claim (x int);
             RESET ROLE;"
        ),
    );
    let err = expect_error(
        c.batch_execute("ALTER EXTENSION syncular UPDATE"),
        "P0001",
        "syncular: a pre-built reaction index differs from the one this update builds",
        None,
    );
    assert!(err.hint.is_some());
    assert_eq!(installed(&mut c).as_deref(), Some("0.1.0"));
}

/// Notifications as `received` them within 300 ms: (channel, payload).
fn received(listener: &mut Client) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut notifications = listener.notifications();
    let mut it = notifications.timeout_iter(Duration::from_millis(300));
    while let Some(n) = it.next().unwrap() {
        out.push((
            n.channel().to_string(),
            serde_json::from_str(n.payload()).unwrap_or(Value::Null),
        ));
    }
    out
}

/// PostgreSQL has no privilege on LISTEN or NOTIFY: the channel is a random name per install,
/// which only the extension owner and `syncular_host` can read. A role without the grant cannot
/// learn it (from the function, the table, a catalog, another session's query), hears nothing
/// on the old fixed channel, and cannot reach a host's listener by sending on it.
#[test]
fn notifications_go_to_a_channel_only_syncular_host_can_name() {
    let db = TestDb::new("notify_secret");
    let mut c = db.connect();
    let server = role(&mut c, &db, "server", true);
    let outsider = role(&mut c, &db, "outsider", true);
    exec(&mut c, &format!("GRANT syncular_host TO {server}"));
    let channel: String = one(
        &mut c,
        "SELECT channel FROM syncular.sync_notify_channel",
        &[],
    );
    let secret = channel.strip_prefix("syncular_commits_").unwrap_or("");
    assert!(
        secret.len() == 32 && secret.chars().all(|ch| ch.is_ascii_hexdigit()),
        "{channel}"
    );
    // Every install makes its own (a database cloned from a template keeps the template's, as
    // the fixtures are: harmless, docs/SECURITY.md, "Notifications").
    let (other, mut o) = bare("notify_secret_other");
    exec(&mut o, "CREATE EXTENSION syncular");
    let other_channel: String = one(&mut o, "SELECT syncular.notify_channel()", &[]);
    assert_ne!(other_channel, channel);
    drop(other);

    let mut host = db.connect_as(&server);
    assert_eq!(
        one::<String>(&mut host, "SELECT syncular.notify_channel()", &[]),
        channel
    );
    exec(&mut host, &format!("LISTEN \"{channel}\""));

    // Refused (42501) at the schema already (no USAGE), and again with USAGE.
    let mut out = db.connect_as(&outsider);
    for usage in [false, true] {
        if usage {
            exec(
                &mut c,
                &format!("GRANT USAGE ON SCHEMA syncular TO {outsider}"),
            );
        }
        for sql in [
            "SELECT syncular.notify_channel()",
            "SELECT channel FROM syncular.sync_notify_channel",
        ] {
            let err = sql_error(&try_one::<String>(&mut out, sql, &[]).unwrap_err());
            assert_eq!(err.state, "42501", "{sql}: {err:?}");
        }
    }
    // Not in a function body, a comment, a column default or a setting anyone may read, nor in
    // the listening session's query text.
    let visible: i64 = one(
        &mut out,
        "SELECT (SELECT count(*) FROM pg_proc WHERE strpos(prosrc, $1) > 0)
              + (SELECT count(*) FROM pg_description WHERE strpos(description, $1) > 0)
              + (SELECT count(*) FROM pg_attrdef WHERE strpos(pg_get_expr(adbin, adrelid), $1) > 0)
              + (SELECT count(*) FROM pg_settings WHERE strpos(coalesce(setting, ''), $1) > 0)
              + (SELECT count(*) FROM pg_stat_activity WHERE strpos(coalesce(query, ''), $1) > 0)",
        &[&secret],
    );
    assert_eq!(visible, 0);
    exec(&mut out, "LISTEN syncular_commits");

    exec(&mut c, "SET syncular.notify_commits = on");
    let seq = append(&mut c, P, "tasks", "t1", Some(V));
    assert_eq!(
        received(&mut host),
        vec![(channel.clone(), json!({"partition": P, "commitSeq": seq}))]
    );
    assert_eq!(received(&mut out), vec![]);

    // A notification forged on the old fixed channel never reaches the host.
    exec(
        &mut out,
        "NOTIFY syncular_commits, '{\"partition\": \"part-1\", \"commitSeq\": 999}'",
    );
    assert_eq!(received(&mut host), vec![]);
}

/// The one-call push notifies too: its append runs with the extension owner's rights, which
/// read the channel, while the pushing role (a plain `syncular_host` member) cannot.
#[test]
fn a_push_commit_by_a_host_role_notifies_on_the_channel() {
    use syncular_multisession::native_push::{fixture, push, task, up};
    let (db, mut c) = fixture("notify_push");
    let server = role(&mut c, &db, "server", true);
    exec(
        &mut c,
        &format!(
            "GRANT syncular_host TO {server};
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {server};"
        ),
    );
    let mut listener = db.connect();
    let channel: String = one(&mut listener, "SELECT syncular.notify_channel()", &[]);
    exec(&mut listener, &format!("LISTEN \"{channel}\""));
    let mut host = db.connect_as(&server);
    let denied = sql_error(
        &try_one::<String>(
            &mut host,
            "SELECT channel FROM syncular.sync_notify_channel",
            &[],
        )
        .unwrap_err(),
    );
    assert_eq!(denied.state, "42501");
    exec(&mut host, "SET syncular.notify_commits = on");
    let op = up(&mut host, "tasks", "t1", None, task("t1", "p1"));
    let outcome = push(&mut host, "k1", &[op]);
    assert_eq!(outcome["outcome"], "applied", "{outcome}");
    assert_eq!(
        received(&mut listener),
        vec![(
            channel,
            json!({"partition": P, "commitSeq": outcome["commitSeq"]})
        )]
    );
}

/// Red team 40, F2: in a `SQL_ASCII` database (any bytes in text) a Latin-1 scope value was read
/// as `caf\u{FFFD}`, matching another tenant's allowed value. The extension is installed only
/// in UTF8 databases: `CREATE EXTENSION` refuses another encoding, and so does the update of an
/// install made at 0.1.0 (which had no such check), each with `0A000`, leaving nothing behind.
#[test]
fn the_extension_installs_and_updates_only_in_a_utf8_database() {
    let name = format!("sqlascii_{}", std::process::id());
    let mut admin = connect_to("postgres");
    exec(&mut admin, &format!("DROP DATABASE IF EXISTS {name}"));
    exec(
        &mut admin,
        &format!(
            "CREATE DATABASE {name} TEMPLATE template0 ENCODING 'SQL_ASCII' \
             LC_COLLATE 'C' LC_CTYPE 'C'"
        ),
    );
    let mut c = connect_to(&name);
    let refused = c
        .batch_execute("CREATE EXTENSION syncular")
        .map_err(|e| sql_error(&e))
        .unwrap_err();
    assert_eq!(refused.state, "0A000", "{refused:?}");
    assert!(
        refused.message.contains("SQL_ASCII, not UTF8"),
        "{refused:?}"
    );
    let installed: i64 = one(
        &mut c,
        "SELECT count(*) FROM pg_extension WHERE extname = 'syncular'",
        &[],
    );
    assert_eq!(installed, 0);
    exec(&mut c, "CREATE EXTENSION syncular VERSION '0.1.0'");
    let refused = c
        .batch_execute("ALTER EXTENSION syncular UPDATE")
        .map_err(|e| sql_error(&e))
        .unwrap_err();
    assert_eq!(refused.state, "0A000", "{refused:?}");
    let version: String = one(
        &mut c,
        "SELECT extversion FROM pg_extension WHERE extname = 'syncular'",
        &[],
    );
    assert_eq!(version, "0.1.0", "the update changed nothing");
    drop(c);
    exec(&mut admin, &format!("DROP DATABASE {name} WITH (FORCE)"));
}
