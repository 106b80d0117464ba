//! Upgrades: an install created at the first released version (sql/released/) and updated with
//! ALTER EXTENSION … UPDATE keeps its data, continues its sequences, and ends with exactly the
//! catalog of a fresh install of the current version (a forgotten update script fails here).

use postgres::Client;
use serde_json::json;
use syncular_multisession::*;

const FIRST_RELEASE: &str = "0.1.0";

/// Everything the extension defines, as comparable text.
fn catalog(c: &mut Client) -> Vec<String> {
    let queries = [
        "SELECT 'function ' || p.proname || '(' || pg_get_function_arguments(p.oid) || ') ' || pg_get_function_result(p.oid)
                || ' secdef=' || p.prosecdef || ' vol=' || p.provolatile::text || ' strict=' || p.proisstrict
                || ' config=' || coalesce(array_to_string(p.proconfig, ';'), '') || ' acl=' || coalesce(p.proacl::text, '')
                || ' comment=' || coalesce(obj_description(p.oid, 'pg_proc'), '')
           FROM pg_proc p WHERE p.pronamespace = 'syncular'::regnamespace",
        "SELECT 'column ' || c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                || ' collation=' || coalesce(co.collname, '') || ' notnull=' || a.attnotnull
                || ' default=' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
           FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
           LEFT JOIN pg_collation co ON co.oid = a.attcollation
           LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
          WHERE c.relnamespace = 'syncular'::regnamespace AND c.relkind = 'r'",
        "SELECT 'index ' || pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
          WHERE c.relnamespace = 'syncular'::regnamespace",
        "SELECT 'constraint ' || conname || ' ' || pg_get_constraintdef(oid) FROM pg_constraint
          WHERE connamespace = 'syncular'::regnamespace",
        "SELECT 'reloptions ' || relname || ' ' || coalesce(array_to_string(reloptions, ','), '') FROM pg_class
          WHERE relnamespace = 'syncular'::regnamespace AND relkind = 'r'",
        "SELECT 'trigger ' || tgrelid::regclass || ' ' || tgname || ' ' || tgfoid::regprocedure || ' '
                || tgenabled::text || ' ' || tgtype FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
          WHERE c.relnamespace = 'syncular'::regnamespace AND NOT tgisinternal",
        "SELECT 'event trigger ' || evtname || ' ' || evtevent || ' ' || evtfoid::regprocedure || ' ' || evtenabled::text
                || ' ' || coalesce(array_to_string(evttags, ','), '') FROM pg_event_trigger",
        "SELECT 'config dump ' || c.relname FROM pg_extension e, unnest(e.extconfig) AS x(oid) JOIN pg_class c ON c.oid = x.oid
          WHERE e.extname = 'syncular'",
    ];
    let mut out: Vec<String> = queries
        .iter()
        .flat_map(|q| {
            c.query(*q, &[])
                .unwrap()
                .into_iter()
                .map(|r| r.get::<_, String>(0))
        })
        .collect();
    out.sort();
    out
}

#[test]
fn an_install_updated_from_the_first_release_keeps_data_and_equals_a_fresh_one() {
    let updated = TestDb::new("upgraded");
    let mut c = updated.connect();
    exec(&mut c, "DROP EXTENSION syncular CASCADE");
    exec(
        &mut c,
        &format!("CREATE EXTENSION syncular VERSION '{FIRST_RELEASE}'"),
    );
    // Data written by the old version.
    migrate(&mut c, 1, &l1(), &json!([]));
    // A 0.1.0 registration, as the 0.1.0 library wrote it (by name; the new library, loaded
    // before the update, needs the columns the update adds).
    exec(
        &mut c,
        "INSERT INTO syncular.sync_app_tables VALUES ('tasks', 'public', 'tasks', false, 1)",
    );
    push_upserts(&mut c, P, "c1", "k1", &[("tasks", "t1", p1())], &json!([]));
    push_upserts(&mut c, P, "c1", "k2", &[("tasks", "t2", p1())], &json!([]));
    declare(&mut c, P, "proj", 2, NOW);
    one::<i32>(
        &mut c,
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&P, &json!([reaction(2, RKEY)])],
    );
    let before: i64 = one(&mut c, "SELECT (SELECT count(*) FROM syncular.sync_commits) + (SELECT count(*) FROM syncular.sync_changes)
                                 + (SELECT count(*) FROM syncular.sync_push_results) + (SELECT count(*) FROM syncular.sync_reactions)", &[]);
    exec(&mut c, "ALTER EXTENSION syncular UPDATE");
    let (installed, default): (String, String) = {
        let r = c.query_one("SELECT extversion, (SELECT default_version FROM pg_available_extensions WHERE name = 'syncular')
                               FROM pg_extension WHERE extname = 'syncular'", &[]).unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(installed, default);
    assert_ne!(installed, FIRST_RELEASE);
    let after: i64 = one(&mut c, "SELECT (SELECT count(*) FROM syncular.sync_commits) + (SELECT count(*) FROM syncular.sync_changes)
                                + (SELECT count(*) FROM syncular.sync_push_results) + (SELECT count(*) FROM syncular.sync_reactions)", &[]);
    assert_eq!(after, before);
    // The update stamped the marker it rewrote with itself (docs/SECURITY.md rule 19, red team
    // 24): its record describes its row version.
    let stamped: bool = one(
        &mut c,
        "SELECT written_by IS NOT NULL AND written_in % 4294967296 = xmin::text::bigint
           FROM syncular.sync_schema_meta",
        &[],
    );
    assert!(stamped, "the marker was stamped by the update");
    assert_eq!(append(&mut c, P, "tasks", "t3", Some(2)), 3);
    // The update gave the 0.1.0 registration its relation's OID and its owner as registrant.
    let registration: (bool, String) = {
        let r = c
            .query_one(
                "SELECT relation = 'public.tasks'::regclass, registered_by::text
                   FROM syncular.sync_app_tables WHERE tbl = 'tasks'",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(registration, (true, "postgres".to_string()));
    one::<Option<serde_json::Value>>(
        &mut c,
        "SELECT syncular.get_row_scopes($1, 'tasks', 't1')",
        &[&P],
    );
    expect_error(
        raw_commit(&mut c, P, 4, Some(1)),
        "SY001",
        "sync.storage.writer_fence_rejected",
        None,
    );
    assert_eq!(
        one::<serde_json::Value>(
            &mut c,
            "SELECT syncular.get_push_result($1, 'c1', 'k1')",
            &[&P]
        )["commitSeq"],
        json!(1)
    );

    let fresh = TestDb::new("fresh");
    let mut f = fresh.connect();
    exec(
        &mut f,
        "DROP EXTENSION syncular CASCADE; CREATE EXTENSION syncular",
    );
    let (a, b) = (catalog(&mut c), catalog(&mut f));
    assert!(
        b.len() > 150,
        "the comparison covers the whole extension ({} items)",
        b.len()
    );
    let only_updated: Vec<&String> = a.iter().filter(|x| !b.contains(x)).collect();
    let only_fresh: Vec<&String> = b.iter().filter(|x| !a.contains(x)).collect();
    assert!(
        only_updated.is_empty() && only_fresh.is_empty(),
        "catalogs differ:\nupdated only: {only_updated:#?}\nfresh only: {only_fresh:#?}"
    );
}

/// The reaction indexes of 0.2.0 built beforehand with CREATE INDEX CONCURRENTLY (docs/API.md
/// §11, upgrading) are kept by the update, which then equals a fresh install; a pre-built index
/// that differs from the update's is refused and the update rolls back.
#[test]
fn reaction_indexes_built_concurrently_before_the_update_are_kept() {
    let claim = "CREATE INDEX CONCURRENTLY sync_reactions_claim ON syncular.sync_reactions
                   (partition, (CASE WHEN status = 'leased' THEN lease_expires_at_ms ELSE available_at_ms END),
                    created_at_ms, idempotency_key)
                   WHERE status IN ('pending', 'leased')";
    let updated = TestDb::new("upgraded_prebuilt");
    let mut c = updated.connect();
    exec(&mut c, "DROP EXTENSION syncular CASCADE");
    exec(
        &mut c,
        &format!("CREATE EXTENSION syncular VERSION '{FIRST_RELEASE}'"),
    );
    one::<i32>(
        &mut c,
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&P, &json!([reaction(1, RKEY)])],
    );
    // A wrong pre-built index: refused, nothing updated.
    exec(
        &mut c,
        "CREATE INDEX CONCURRENTLY sync_reactions_claim ON syncular.sync_reactions (partition)",
    );
    let refused = c
        .batch_execute("ALTER EXTENSION syncular UPDATE")
        .unwrap_err();
    assert!(
        sql_error(&refused)
            .message
            .contains("pre-built reaction index"),
        "{refused:?}"
    );
    exec(&mut c, "DROP INDEX syncular.sync_reactions_claim");
    exec(&mut c, claim);
    // One statement per call: CONCURRENTLY runs outside a transaction block.
    exec(
        &mut c,
        "DROP INDEX CONCURRENTLY syncular.sync_reactions_completed",
    );
    exec(
        &mut c,
        "CREATE INDEX CONCURRENTLY sync_reactions_completed ON syncular.sync_reactions
           (partition, completed_at_ms, idempotency_key) WHERE status = 'completed'",
    );
    let oid = |c: &mut Client| -> u32 {
        one(
            c,
            "SELECT 'syncular.sync_reactions_claim'::regclass::oid",
            &[],
        )
    };
    let before = oid(&mut c);
    exec(&mut c, "ALTER EXTENSION syncular UPDATE");
    assert_eq!(oid(&mut c), before, "the pre-built index was kept");
    let fresh = TestDb::new("fresh_prebuilt");
    let mut f = fresh.connect();
    exec(
        &mut f,
        "DROP EXTENSION syncular CASCADE; CREATE EXTENSION syncular",
    );
    let (a, b) = (catalog(&mut c), catalog(&mut f));
    let differ: Vec<&String> = a
        .iter()
        .filter(|x| !b.contains(x))
        .chain(b.iter().filter(|x| !a.contains(x)))
        .collect();
    assert!(differ.is_empty(), "catalogs differ: {differ:#?}");
    let claimed: serde_json::Value = one(
        &mut c,
        "SELECT syncular.claim_reactions($1, 'w', ARRAY['email.send'], $2, 100, 10)",
        &[&P, &NOW],
    );
    assert_eq!(claimed.as_array().unwrap().len(), 1);
}
