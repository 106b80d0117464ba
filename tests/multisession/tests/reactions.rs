//! docs/SCENARIOS.md: the reaction outbox (RXN-01 … RXN-09).

use serde_json::{json, Value};
use std::sync::{Arc, Barrier};
use std::thread;
use syncular_multisession::*;

fn enqueue(c: &mut postgres::Client, reactions: Value) -> Result<i32, postgres::Error> {
    try_one(
        c,
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&P, &reactions],
    )
}

fn claim_r(c: &mut postgres::Client, owner: &str, at: i64, duration: i64, lim: i32) -> Value {
    one(
        c,
        "SELECT syncular.claim_reactions($1, $2, ARRAY['email.send'], $3, $4, $5)",
        &[&P, &owner, &at, &duration, &lim],
    )
}

fn get(c: &mut postgres::Client, key: &str) -> Option<Value> {
    one(c, "SELECT syncular.get_reaction($1, $2)", &[&P, &key])
}

fn call_bool(
    c: &mut postgres::Client,
    sql: &str,
    params: &[&(dyn postgres::types::ToSql + Sync)],
) -> bool {
    one(c, sql, params)
}

fn empty_commit(c: &mut postgres::Client) -> i64 {
    one(
        c,
        "SELECT syncular.append_commit($1, $2)",
        &[&P, &doc(&fresh_id(), json!([]), Some(V))],
    )
}

#[test]
fn rxn_01_enqueue_commits_and_rolls_back_with_its_source() {
    let db = TestDb::new("rxn01");
    let mut c = db.connect();
    exec(&mut c, "BEGIN");
    let s = empty_commit(&mut c);
    enqueue(&mut c, json!([reaction(s, RKEY)])).unwrap();
    exec(&mut c, "COMMIT");
    let r = get(&mut c, RKEY).unwrap();
    assert_eq!(
        (
            r["status"].clone(),
            r["sourceCommitSeq"].clone(),
            r["attempts"].clone(),
            r["availableAtMs"].clone()
        ),
        (json!("pending"), json!(1), json!(0), json!(NOW))
    );
    for key in [
        "leaseOwner",
        "leaseExpiresAtMs",
        "completedAtMs",
        "lastFailure",
    ] {
        assert!(r.get(key).is_none(), "{key} must be absent");
    }
    let listed: Value = one(
        &mut c,
        "SELECT syncular.list_reactions($1, 10, ARRAY['pending'], ARRAY['email.send'])",
        &[&P],
    );
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let key2 = r#"["c1","commit-2","email"]"#;
    exec(&mut c, "BEGIN");
    let s2 = empty_commit(&mut c);
    enqueue(&mut c, json!([reaction(s2, key2)])).unwrap();
    exec(&mut c, "ROLLBACK");
    assert_eq!(get(&mut c, key2), None);
    assert_eq!(
        one::<i64>(&mut c, "SELECT syncular.max_commit_seq($1)", &[&P]),
        1
    );
}

#[test]
fn rxn_02_concurrent_claimers() {
    let db = TestDb::new("rxn02");
    let mut c = db.connect();
    enqueue(&mut c, json!([reaction(1, RKEY)])).unwrap();
    let barrier = Arc::new(Barrier::new(2));
    let claimers: Vec<_> = ["lease-1", "lease-2"]
        .into_iter()
        .map(|owner| {
            let mut s = db.connect();
            let barrier = barrier.clone();
            thread::spawn(move || {
                barrier.wait();
                claim_r(&mut s, owner, NOW, 100, 1)
            })
        })
        .collect();
    let results: Vec<Value> = claimers.into_iter().map(|t| t.join().unwrap()).collect();
    let won: Vec<&Value> = results
        .iter()
        .filter(|r| r.as_array().unwrap().len() == 1)
        .collect();
    assert_eq!(won.len(), 1, "{results:?}");
    assert!(results.iter().any(|r| r == &json!([])));
    assert_eq!(
        (won[0][0]["status"].clone(), won[0][0]["attempts"].clone()),
        (json!("leased"), json!(1))
    );
}

#[test]
fn rxn_03_expired_leases_are_reclaimed_and_a_stale_owner_cannot_acknowledge() {
    let db = TestDb::new("rxn03");
    let mut c = db.connect();
    enqueue(&mut c, json!([reaction(1, RKEY)])).unwrap();
    claim_r(&mut c, "lease-1", NOW, 100, 10);
    assert!(call_bool(
        &mut c,
        "SELECT syncular.extend_reaction_lease($1, $2, 'lease-1', $3)",
        &[&P, &RKEY, &(NOW + 200)]
    ));
    assert_eq!(claim_r(&mut c, "lease-2", NOW + 199, 100, 10), json!([]));
    let again = claim_r(&mut c, "lease-2", NOW + 200, 100, 10);
    assert_eq!(
        (again[0]["leaseOwner"].clone(), again[0]["attempts"].clone()),
        (json!("lease-2"), json!(2))
    );
    assert!(!call_bool(
        &mut c,
        "SELECT syncular.complete_reaction($1, $2, 'lease-1', $3)",
        &[&P, &RKEY, &(NOW + 201)]
    ));
    assert!(call_bool(
        &mut c,
        "SELECT syncular.complete_reaction($1, $2, 'lease-2', $3)",
        &[&P, &RKEY, &(NOW + 201)]
    ));
}

#[test]
fn rxn_04_retry_dead_letter_operator_retry() {
    let db = TestDb::new("rxn04");
    let mut c = db.connect();
    enqueue(&mut c, json!([reaction(1, RKEY)])).unwrap();
    claim_r(&mut c, "lease-1", NOW, 100, 10);
    let failure = json!({"code":"email.unavailable","atMs":NOW + 1});
    assert!(call_bool(
        &mut c,
        "SELECT syncular.fail_reaction($1, $2, 'lease-1', $3, $4)",
        &[&P, &RKEY, &failure, &(NOW + 50)]
    ));
    let r = get(&mut c, RKEY).unwrap();
    assert_eq!(
        (
            r["status"].clone(),
            r["availableAtMs"].clone(),
            r["lastFailure"].clone(),
            r["attempts"].clone()
        ),
        (json!("pending"), json!(NOW + 50), failure, json!(1))
    );
    assert_eq!(claim_r(&mut c, "lease-2", NOW + 49, 100, 10), json!([]));
    assert_eq!(
        claim_r(&mut c, "lease-2", NOW + 50, 100, 10)[0]["attempts"],
        json!(2)
    );
    let dead = json!({"code":"email.invalid_recipient","atMs":NOW + 60,"details":{"reason":"invalid_address"},"extra":1});
    assert!(call_bool(
        &mut c,
        "SELECT syncular.fail_reaction($1, $2, 'lease-2', $3)",
        &[&P, &RKEY, &dead]
    ));
    let r = get(&mut c, RKEY).unwrap();
    assert_eq!(
        (
            r["status"].clone(),
            r["availableAtMs"].clone(),
            r["attempts"].clone()
        ),
        (json!("dead-letter"), json!(NOW + 60), json!(2))
    );
    assert_eq!(
        r["lastFailure"],
        json!({"code":"email.invalid_recipient","atMs":NOW + 60,"details":{"reason":"invalid_address"}})
    );
    assert!(call_bool(
        &mut c,
        "SELECT syncular.retry_reaction($1, $2, $3)",
        &[&P, &RKEY, &(NOW + 70)]
    ));
    let r = get(&mut c, RKEY).unwrap();
    assert_eq!(
        (
            r["status"].clone(),
            r["attempts"].clone(),
            r["availableAtMs"].clone()
        ),
        (json!("pending"), json!(0), json!(NOW + 70))
    );
    assert!(r.get("lastFailure").is_none() && r.get("leaseOwner").is_none());
    assert!(!call_bool(
        &mut c,
        "SELECT syncular.retry_reaction($1, $2, $3)",
        &[&P, &RKEY, &(NOW + 71)]
    ));
}

#[test]
fn rxn_05_06_stale_batch_member_and_crash_before_ack() {
    let db = TestDb::new("rxn05");
    let mut c = db.connect();
    let mut r1 = reaction(1, "task-1");
    let mut r2 = reaction(1, "task-2");
    r1["createdAtMs"] = json!(NOW);
    r2["createdAtMs"] = json!(NOW);
    enqueue(&mut c, json!([r1, r2])).unwrap();
    assert_eq!(
        claim_r(&mut c, "w1", NOW, 100, 10)
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert!(call_bool(
        &mut c,
        "SELECT syncular.extend_reaction_lease($1, 'task-1', 'w1', $2)",
        &[&P, &(NOW + 300)]
    ));
    let second = claim_r(&mut c, "w2", NOW + 100, 100, 10);
    assert_eq!(second.as_array().unwrap().len(), 1);
    assert_eq!(
        (
            second[0]["idempotencyKey"].clone(),
            second[0]["attempts"].clone()
        ),
        (json!("task-2"), json!(2))
    );
    assert!(call_bool(
        &mut c,
        "SELECT syncular.complete_reaction($1, 'task-2', 'w2', $2)",
        &[&P, &(NOW + 101)]
    ));
    assert!(!call_bool(
        &mut c,
        "SELECT syncular.extend_reaction_lease($1, 'task-2', 'w1', $2)",
        &[&P, &(NOW + 400)]
    ));
    assert!(!call_bool(
        &mut c,
        "SELECT syncular.complete_reaction($1, 'task-2', 'w1', $2)",
        &[&P, &(NOW + 102)]
    ));
    assert!(call_bool(
        &mut c,
        "SELECT syncular.complete_reaction($1, 'task-1', 'w1', $2)",
        &[&P, &(NOW + 102)]
    ));
}

#[test]
fn rxn_07_retention_cutoffs() {
    let db = TestDb::new("rxn07");
    let mut c = db.connect();
    enqueue(&mut c, json!([reaction(1, "done"), reaction(1, "dead")])).unwrap();
    claim_r(&mut c, "w", NOW, 100, 10);
    assert!(call_bool(
        &mut c,
        "SELECT syncular.complete_reaction($1, 'done', 'w', $2)",
        &[&P, &NOW]
    ));
    assert!(call_bool(
        &mut c,
        "SELECT syncular.fail_reaction($1, 'dead', 'w', $2)",
        &[&P, &json!({"code":"x","atMs":NOW})]
    ));
    let prune = |c: &mut postgres::Client, now: i64| -> Value {
        one(
            c,
            "SELECT syncular.prune_reactions($1, $2, $3, 1000)",
            &[&P, &(now - 30 * DAY), &(now - 90 * DAY)],
        )
    };
    assert_eq!(
        prune(&mut c, NOW + 31 * DAY),
        json!({"completed":1,"deadLetter":0})
    );
    assert_eq!(
        prune(&mut c, NOW + 91 * DAY),
        json!({"completed":0,"deadLetter":1})
    );
    assert_eq!(
        one::<Value>(
            &mut c,
            "SELECT syncular.prune_reactions($1, 0, 0, 0)",
            &[&P]
        ),
        json!({"completed":0,"deadLetter":0})
    );
}

#[test]
fn rxn_08_claim_filters_and_ordering() {
    let db = TestDb::new("rxn08");
    let mut c = db.connect();
    let mut list = Vec::new();
    for (key, created) in [("b", NOW), ("a", NOW), ("c", NOW - 5)] {
        let mut r = reaction(1, key);
        r["createdAtMs"] = json!(created);
        list.push(r);
    }
    enqueue(&mut c, Value::Array(list)).unwrap();
    assert_eq!(
        one::<Value>(
            &mut c,
            "SELECT syncular.claim_reactions($1, 'w', ARRAY[]::text[], $2, 100, 10)",
            &[&P, &NOW]
        ),
        json!([])
    );
    assert_eq!(claim_r(&mut c, "w", NOW, 100, 0), json!([]));
    assert_eq!(
        one::<Value>(
            &mut c,
            "SELECT syncular.claim_reactions($1, 'w', ARRAY['other'], $2, 100, 10)",
            &[&P, &NOW]
        ),
        json!([])
    );
    assert_eq!(
        count(&mut c, "syncular.sync_reactions WHERE status = 'pending'"),
        3
    );
    let listed: Value = one(&mut c, "SELECT syncular.list_reactions($1, 10)", &[&P]);
    let keys: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["idempotencyKey"].as_str().unwrap())
        .collect();
    assert_eq!(keys, vec!["b", "a", "c"]);
    let claimed = claim_r(&mut c, "w", NOW, 100, 10);
    let keys: Vec<&str> = claimed
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["idempotencyKey"].as_str().unwrap())
        .collect();
    assert_eq!(keys, vec!["c", "a", "b"]);
}

fn nested(depth: usize) -> Value {
    (0..depth).fold(json!(1), |inner, _| json!([inner]))
}

#[test]
fn rxn_09_enqueue_validation() {
    let db = TestDb::new("rxn09");
    let mut c = db.connect();
    enqueue(&mut c, json!([reaction(1, "existing")])).unwrap();
    let with = |key: &str, value: Value| {
        let mut r = reaction(1, "fresh");
        r[key] = value;
        r
    };
    let cases = [
        (with("type", json!("9bad")), "reactions[0].type", "shape"),
        (with("version", json!(0)), "reactions[0].version", "range"),
        (
            with("maxAttempts", json!(101)),
            "reactions[0].maxAttempts",
            "range",
        ),
        (
            with("payload", json!({"blob": "x".repeat(65_537)})),
            "reactions[0].payload",
            "too_large",
        ),
        (
            with("payload", nested(17)),
            "reactions[0].payload",
            "too_deep",
        ),
        (
            with("payload", json!("scalar")),
            "reactions[0].payload",
            "type",
        ),
    ];
    for (r, argument, reason) in cases {
        expect_error(
            enqueue(&mut c, json!([r])),
            "SY000",
            "sync.storage.invalid_argument",
            Some(json!({"argument":argument,"reason":reason})),
        );
    }
    expect_error(
        enqueue(
            &mut c,
            json!([reaction(1, "new-1"), reaction(1, "existing")]),
        ),
        "SY050",
        "sync.storage.reaction_duplicate",
        Some(json!({"idempotencyKey":"existing"})),
    );
    expect_error(
        enqueue(&mut c, json!([reaction(1, "twice"), reaction(1, "twice")])),
        "SY050",
        "sync.storage.reaction_duplicate",
        Some(json!({"idempotencyKey":"twice"})),
    );
    assert_eq!(count(&mut c, "syncular.sync_reactions"), 1);
    assert_eq!(
        enqueue(&mut c, json!([with("payload", nested(16))])).unwrap(),
        1
    );
}
