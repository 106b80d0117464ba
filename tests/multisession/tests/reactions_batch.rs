//! docs/SCENARIOS.md: the batch acknowledgements and the claim order across states
//! (RXN-10 … RXN-14), and the reaction documents every reader returns (RXN-15).

use serde_json::{json, Value};
use std::sync::{Arc, Barrier};
use std::thread;
use syncular_multisession::*;

/// `n` reactions of partition `p` named `k0` … with `createdAtMs` NOW, NOW + 1, …
fn enqueue_n(c: &mut postgres::Client, p: &str, n: i64) {
    let list: Vec<Value> = (0..n)
        .map(|i| {
            let mut r = reaction(1, &format!("k{i}"));
            r["createdAtMs"] = json!(NOW + i);
            r
        })
        .collect();
    let _: i32 = one(
        c,
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&p, &Value::Array(list)],
    );
}

fn claim_in(
    c: &mut impl postgres::GenericClient,
    p: &str,
    owner: &str,
    at: i64,
    lim: i32,
) -> Vec<String> {
    let claimed: Value = c
        .query_one(
            "SELECT syncular.claim_reactions($1, $2, ARRAY['email.send'], $3, 100, $4)",
            &[&p, &owner, &at, &lim],
        )
        .unwrap()
        .get(0);
    keys_of(&claimed)
}

fn keys_of(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|r| r["idempotencyKey"].as_str().unwrap().to_string())
        .collect()
}

fn complete(
    c: &mut impl postgres::GenericClient,
    p: &str,
    keys: &[&str],
    owner: &str,
) -> Result<Vec<String>, postgres::Error> {
    c.query_one(
        "SELECT syncular.complete_reactions($1, $2, $3, $4)",
        &[&p, &keys, &owner, &(NOW + 10)],
    )
    .map(|row| row.get(0))
}

fn fail(
    c: &mut postgres::Client,
    p: &str,
    owner: &str,
    failures: Value,
) -> Result<Value, postgres::Error> {
    try_one(
        c,
        "SELECT syncular.fail_reactions($1, $2, $3)",
        &[&p, &owner, &failures],
    )
}

fn status(c: &mut postgres::Client, p: &str, key: &str) -> Value {
    let r: Value = one(c, "SELECT syncular.get_reaction($1, $2)", &[&p, &key]);
    r["status"].clone()
}

/// RXN-10: two sessions claim and complete in open transactions: SKIP LOCKED hands each its own
/// rows without waiting, each batch completes exactly its own, a stale owner's batch changes
/// nothing, and the keys come back in the order given.
#[test]
fn rxn_10_batch_complete_under_concurrent_claimers() {
    let db = TestDb::new("rxn10");
    let mut c = db.connect();
    enqueue_n(&mut c, P, 10);
    let barrier = Arc::new(Barrier::new(2));
    let workers: Vec<_> = ["w1", "w2"]
        .into_iter()
        .map(|owner| {
            let mut s = db.connect();
            let barrier = barrier.clone();
            thread::spawn(move || {
                let mut tx = s.transaction().unwrap();
                let mine = claim_in(&mut tx, P, owner, NOW + 20, 5);
                // Both hold their claims (row locks) here: neither waits for the other.
                barrier.wait();
                let refs: Vec<&str> = mine.iter().map(String::as_str).collect();
                let done = complete(&mut tx, P, &refs, owner).unwrap();
                barrier.wait();
                tx.commit().unwrap();
                (mine, done)
            })
        })
        .collect();
    let results: Vec<(Vec<String>, Vec<String>)> =
        workers.into_iter().map(|t| t.join().unwrap()).collect();
    let mut all: Vec<String> = Vec::new();
    for (mine, done) in &results {
        assert_eq!(mine.len(), 5, "{results:?}");
        assert_eq!(mine, done);
        all.extend(mine.iter().cloned());
    }
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 10, "{results:?}");
    assert_eq!(
        count(&mut c, "syncular.sync_reactions WHERE status = 'completed'"),
        10
    );

    // A stale owner, a wrong owner, an absent key: only the owner's leased keys change, in the
    // order given (duplicates once).
    enqueue_n(&mut c, "part-2", 3);
    let mine = claim_in(&mut c, "part-2", "w1", NOW + 20, 3);
    assert_eq!(mine, ["k0", "k1", "k2"]);
    assert_eq!(
        complete(&mut c, "part-2", &["k2", "k0"], "w2").unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(
        complete(&mut c, "part-2", &["k2", "absent", "k0", "k2"], "w1").unwrap(),
        ["k2", "k0"]
    );
    assert_eq!(status(&mut c, "part-2", "k1"), json!("leased"));
    // Completed already: a second acknowledgement changes nothing.
    assert_eq!(
        complete(&mut c, "part-2", &["k0"], "w1").unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(
        complete(&mut c, "part-2", &[], "w1").unwrap(),
        Vec::<String>::new()
    );
}

/// RXN-11: the batch failure: retry at a time below the cap, dead-letter at the cap
/// (`attempts >= maxAttempts`) or without a retry time; the failure object kept as in the single
/// form; another owner's keys untouched.
#[test]
fn rxn_11_batch_fail_retries_and_dead_letters_at_the_cap() {
    let db = TestDb::new("rxn11");
    let mut c = db.connect();
    enqueue_n(&mut c, P, 3); // maxAttempts 3 each
    let failure =
        |at: i64| json!({"code":"email.unavailable","atMs":at,"details":{"n":1},"extra":true});
    let kept = |at: i64| json!({"code":"email.unavailable","atMs":at,"details":{"n":1}});
    // Attempts 1 and 2: retried.
    for attempt in 1..=2 {
        let at = NOW + attempt * 100;
        assert_eq!(claim_in(&mut c, P, "w", at, 10), ["k0", "k1", "k2"]);
        let out = fail(
            &mut c,
            P,
            "w",
            json!([{"idempotencyKey":"k0","failure":failure(at),"retryAtMs":at + 50},
                   {"idempotencyKey":"k1","failure":failure(at),"retryAtMs":at + 50},
                   {"idempotencyKey":"k2","failure":failure(at),"retryAtMs":at + 50}]),
        )
        .unwrap();
        assert_eq!(out, json!({"pending":["k0","k1","k2"],"deadLetter":[]}));
    }
    let r: Value = one(&mut c, "SELECT syncular.get_reaction($1, 'k0')", &[&P]);
    assert_eq!(
        (
            r["status"].clone(),
            r["attempts"].clone(),
            r["availableAtMs"].clone(),
            r["lastFailure"].clone()
        ),
        (
            json!("pending"),
            json!(2),
            json!(NOW + 250),
            kept(NOW + 200)
        )
    );
    // Attempt 3 (the cap): a retry time no longer retries; k2 by another owner is untouched.
    let at = NOW + 300;
    assert_eq!(claim_in(&mut c, P, "w", at, 2), ["k0", "k1"]);
    assert_eq!(claim_in(&mut c, P, "other", at, 1), ["k2"]);
    let out = fail(
        &mut c,
        P,
        "w",
        json!([{"idempotencyKey":"k1","failure":failure(at),"retryAtMs":at + 50},
               {"idempotencyKey":"k2","failure":failure(at),"retryAtMs":at + 50},
               {"idempotencyKey":"k0","failure":failure(at + 1)}]),
    )
    .unwrap();
    assert_eq!(out, json!({"pending":[],"deadLetter":["k1","k0"]}));
    for (key, available) in [("k0", NOW + 301), ("k1", NOW + 300)] {
        let r: Value = one(&mut c, "SELECT syncular.get_reaction($1, $2)", &[&P, &key]);
        assert_eq!(
            (
                r["status"].clone(),
                r["attempts"].clone(),
                r["availableAtMs"].clone()
            ),
            (json!("dead-letter"), json!(3), json!(available))
        );
        assert!(r.get("leaseOwner").is_none() && r.get("leaseExpiresAtMs").is_none());
    }
    assert_eq!(status(&mut c, P, "k2"), json!("leased"));
    // Below the cap, no retry time: dead-letter, as fail_reaction without retry_at_ms.
    let out = fail(
        &mut c,
        P,
        "other",
        json!([{"idempotencyKey":"k2","failure":failure(at),"retryAtMs":null}]),
    )
    .unwrap();
    assert_eq!(out, json!({"pending":[],"deadLetter":["k2"]}));
    assert_eq!(
        fail(&mut c, P, "w", json!([])).unwrap(),
        json!({"pending":[],"deadLetter":[]})
    );
}

/// RXN-12: a batch acts on its own partition only.
#[test]
fn rxn_12_batches_keep_partitions_apart() {
    let db = TestDb::new("rxn12");
    let mut c = db.connect();
    enqueue_n(&mut c, P, 2);
    enqueue_n(&mut c, "part-2", 2);
    assert_eq!(claim_in(&mut c, P, "w", NOW + 10, 10), ["k0", "k1"]);
    assert_eq!(claim_in(&mut c, "part-2", "w", NOW + 10, 10), ["k0", "k1"]);
    assert_eq!(complete(&mut c, P, &["k0"], "w").unwrap(), ["k0"]);
    let out = fail(
        &mut c,
        "part-2",
        "w",
        json!([{"idempotencyKey":"k1","failure":{"code":"x","atMs":NOW}}]),
    )
    .unwrap();
    assert_eq!(out, json!({"pending":[],"deadLetter":["k1"]}));
    assert_eq!(status(&mut c, P, "k0"), json!("completed"));
    assert_eq!(status(&mut c, "part-2", "k0"), json!("leased"));
    assert_eq!(status(&mut c, P, "k1"), json!("leased"));
    assert_eq!(status(&mut c, "part-2", "k1"), json!("dead-letter"));
}

/// RXN-13: bad input is refused with SY000 (`{argument, reason}`) before anything changes.
#[test]
fn rxn_13_batch_input_is_validated_whole() {
    let db = TestDb::new("rxn13");
    let mut c = db.connect();
    enqueue_n(&mut c, P, 2);
    claim_in(&mut c, P, "w", NOW + 10, 10);
    let good = json!({"idempotencyKey":"k0","failure":{"code":"x","atMs":NOW}});
    let cases = [
        (json!({"k0": 1}), "failures", "type"),
        (
            json!([good, {"idempotencyKey":"k1","failure":{"code":"","atMs":NOW}}]),
            "failures[1].failure.code",
            "empty",
        ),
        (
            json!([good, {"idempotencyKey":"k1"}]),
            "failures[1].failure",
            "missing",
        ),
        (
            json!([good, {"idempotencyKey":"k1","failure":{"code":"x","atMs":-1}}]),
            "failures[1].failure.atMs",
            "range",
        ),
        (
            json!([good, {"idempotencyKey":"k1","failure":{"code":"x","atMs":NOW},"retryAtMs":"soon"}]),
            "failures[1].retryAtMs",
            "type",
        ),
        (
            json!([good, {"idempotencyKey":"","failure":{"code":"x","atMs":NOW}}]),
            "failures[1].idempotencyKey",
            "empty",
        ),
        (json!([good, 7]), "failures[1]", "type"),
        (
            json!([good, good]),
            "failures[1].idempotencyKey",
            "duplicate",
        ),
        (
            json!([good, {"idempotencyKey":"k1","failure":{"code":"x","atMs":NOW,"details":{"d":"x".repeat(8_193)}}}]),
            "failures[1].failure.details",
            "too_large",
        ),
    ];
    for (failures, argument, reason) in cases {
        expect_error(
            fail(&mut c, P, "w", failures),
            "SY000",
            "sync.storage.invalid_argument",
            Some(json!({"argument":argument,"reason":reason})),
        );
    }
    for (keys, reason) in [
        (vec![Some("k0"), None], "missing"),
        (vec![Some("k0"), Some("")], "empty"),
    ] {
        expect_error(
            try_one::<Vec<String>>(
                &mut c,
                "SELECT syncular.complete_reactions($1, $2, 'w', $3)",
                &[&P, &keys, &NOW],
            ),
            "SY000",
            "sync.storage.invalid_argument",
            Some(json!({"argument":"idempotency_keys","reason":reason})),
        );
    }
    expect_error(
        try_one::<Vec<String>>(
            &mut c,
            "SELECT syncular.complete_reactions($1, $2, '', $3)",
            &[&P, &vec!["k0"], &NOW],
        ),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument":"lease_owner","reason":"empty"})),
    );
    assert_eq!(
        count(&mut c, "syncular.sync_reactions WHERE status = 'leased'"),
        2
    );
}

/// RXN-14: the claim order across states: a lapsed lease is due at its expiry, a pending row at
/// its available time, whichever is earlier first.
#[test]
fn rxn_14_claim_order_mixes_expired_leases_and_pending_rows() {
    let db = TestDb::new("rxn14");
    let mut c = db.connect();
    let mut x = reaction(1, "x");
    x["createdAtMs"] = json!(NOW - 1000);
    let mut y = reaction(1, "y");
    y["createdAtMs"] = json!(NOW - 995);
    let mut z = reaction(1, "z");
    z["createdAtMs"] = json!(NOW - 980);
    let _: i32 = one(
        &mut c,
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&P, &json!([x])],
    );
    // x leased at NOW − 1000 for 10 ms: due again at NOW − 990.
    assert_eq!(claim_in(&mut c, P, "w0", NOW - 1000, 1), ["x"]);
    exec(
        &mut c,
        "UPDATE syncular.sync_reactions SET lease_expires_at_ms = 1749999999010 WHERE idempotency_key = 'x'",
    );
    let _: i32 = one(
        &mut c,
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&P, &json!([y, z])],
    );
    // Due times: y NOW − 995, x NOW − 990, z NOW − 980.
    assert_eq!(claim_in(&mut c, P, "w1", NOW, 1), ["y"]);
    assert_eq!(claim_in(&mut c, P, "w1", NOW, 1), ["x"]);
    assert_eq!(claim_in(&mut c, P, "w1", NOW, 1), ["z"]);
    assert_eq!(claim_in(&mut c, P, "w1", NOW, 1), Vec::<String>::new());
}

/// The stored JSON values of RXN-15: (stored, what a reader returns). Strings holding the text of
/// an object or array are unwrapped (a 0.24 host's driver bound JSON as text); other strings stay.
fn rxn15_json_values() -> Vec<(Value, Value)> {
    let nested = json!({"a": null, "b": [null, {"c": null}], "n": 9007199254740991_i64,
                        "f": 1.5, "s": "é😀\n\"q\""});
    vec![
        (nested.clone(), nested),
        (json!([]), json!([])),
        (json!([1, "x", null]), json!([1, "x", null])),
        (json!("{\"x\": 1}"), json!({"x": 1})),
        (json!(" [1,2]"), json!([1, 2])),
        (json!("{oops"), json!("{oops")),
        (json!("5"), json!("5")),
    ]
}

/// RXN-15: `get_reaction`, `list_reactions` and `claim_reactions` return, for every combination of
/// status, nullable lease/completion columns, payload and failure shape (written directly, as any
/// writer could), the document docs/API.md §Reactions defines: NULL columns are absent keys, nulls
/// inside the payload stay, string-wrapped values are unwrapped — built here independently.
#[test]
fn rxn_15_documents_of_every_row_shape() {
    let db = TestDb::new("rxn15");
    let mut c = db.connect();
    let payloads = rxn15_json_values();
    let mut failures: Vec<(Option<Value>, Option<Value>)> = vec![(None, None)];
    failures.push((
        Some(json!({"message": "m", "retryable": null})),
        Some(json!({"message": "m", "retryable": null})),
    ));
    failures.push((
        Some(json!("{\"message\":\"w\"}")),
        Some(json!({"message": "w"})),
    ));
    failures.push((Some(json!("nope")), Some(json!("nope"))));
    let mut expected: Vec<(String, i64, Value)> = Vec::new();
    let mut i = 0_i64;
    for status in ["pending", "leased", "completed", "dead-letter"] {
        for owner in [None, Some("w-old")] {
            for expires in [None, Some(NOW - 5)] {
                for completed in [None, Some(NOW - 7)] {
                    for (stored_failure, read_failure) in &failures {
                        let (stored, read) = &payloads[i as usize % payloads.len()];
                        let key = format!("k{i:04}");
                        let created = NOW - 1000 + (i * 7919) % 500;
                        c.execute(
                            "INSERT INTO syncular.sync_reactions (partition, idempotency_key,
                               type, version, payload, source_client_id, source_client_commit_id,
                               source_commit_seq, created_at_ms, available_at_ms, status,
                               attempts, max_attempts, lease_owner, lease_expires_at_ms,
                               completed_at_ms, last_failure)
                             VALUES ($1, $2, 'email.send', 2, $3, 'c1', 'commit-1', $4, $5, $5,
                                     $6, 1, 10, $7, $8, $9, $10)",
                            &[
                                &P,
                                &key,
                                stored,
                                &(i * 3),
                                &created,
                                &status,
                                &owner,
                                &expires,
                                &completed,
                                stored_failure,
                            ],
                        )
                        .unwrap();
                        let mut doc = json!({"idempotencyKey": key, "type": "email.send",
                            "version": 2, "payload": read, "sourceClientId": "c1",
                            "sourceClientCommitId": "commit-1", "sourceCommitSeq": i * 3,
                            "createdAtMs": created, "availableAtMs": created,
                            "status": status, "attempts": 1, "maxAttempts": 10});
                        if let Some(o) = owner {
                            doc["leaseOwner"] = json!(o);
                        }
                        if let Some(at) = expires {
                            doc["leaseExpiresAtMs"] = json!(at);
                        }
                        if let Some(at) = completed {
                            doc["completedAtMs"] = json!(at);
                        }
                        if let Some(f) = read_failure {
                            doc["lastFailure"] = f.clone();
                        }
                        expected.push((key, created, doc));
                        i += 1;
                    }
                }
            }
        }
    }
    for (key, _, doc) in &expected {
        let got: Value = one(&mut c, "SELECT syncular.get_reaction($1, $2)", &[&P, key]);
        assert_eq!(&got, doc, "get_reaction {key}");
    }
    let mut newest_first = expected.clone();
    newest_first.sort_by(|a, b| (b.1, &b.0).cmp(&(a.1, &a.0)));
    let docs = |list: &[(String, i64, Value)]| -> Value {
        Value::Array(list.iter().map(|(_, _, d)| d.clone()).collect())
    };
    let listed: Value = one(&mut c, "SELECT syncular.list_reactions($1, 1000)", &[&P]);
    assert_eq!(listed, docs(&newest_first));
    let none: Value = one(
        &mut c,
        "SELECT syncular.list_reactions($1, 10, ARRAY['no-such-status'])",
        &[&P],
    );
    assert_eq!(none, json!([]));
    // Claimable: pending rows (due at creation), and leased rows whose lease has run out.
    let now = NOW;
    let mut claimable: Vec<(String, i64, Value)> = expected
        .iter()
        .filter(|(_, _, d)| {
            d["status"] == "pending"
                || (d["status"] == "leased" && d.get("leaseExpiresAtMs").is_some())
        })
        .cloned()
        .collect();
    claimable.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
    for (_, _, d) in claimable.iter_mut() {
        let m = d.as_object_mut().unwrap();
        m.insert("status".into(), json!("leased"));
        m.insert("attempts".into(), json!(2));
        m.insert("leaseOwner".into(), json!("w-new"));
        m.insert("leaseExpiresAtMs".into(), json!(now + 100));
        m.remove("completedAtMs");
    }
    let claimed: Value = one(
        &mut c,
        "SELECT syncular.claim_reactions($1, 'w-new', ARRAY['email.send'], $2, 100, 1000)",
        &[&P, &now],
    );
    assert_eq!(claimed, docs(&claimable));
    // Enqueued payloads are stored as the jsonb they came in: numbers keep their digits.
    let _: i32 = one(
        &mut c,
        r#"SELECT syncular.enqueue_reactions('num', jsonb_build_array(
             jsonb_build_object('idempotencyKey', 'n', 'type', 'email.send', 'version', 1,
               'payload', '{"n": 1.10, "big": 12345678901234567890123, "e": 1e2}'::jsonb,
               'sourceClientId', 'c1', 'sourceClientCommitId', 'commit-1',
               'sourceCommitSeq', 1, 'createdAtMs', 1750000000000)))"#,
        &[],
    );
    let payload: String = one(
        &mut c,
        "SELECT (syncular.get_reaction('num', 'n') -> 'payload')::text",
        &[],
    );
    assert_eq!(
        payload,
        r#"{"e": 100, "n": 1.10, "big": 12345678901234567890123}"#
    );
}

fn enqueue_keys(c: &mut postgres::Client, p: &str, keys: &[&str]) -> Result<i32, postgres::Error> {
    let list: Vec<Value> = keys.iter().map(|k| reaction(1, k)).collect();
    try_one(
        c,
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&p, &Value::Array(list)],
    )
}

fn duplicate_of(result: Result<i32, postgres::Error>, key: &str) {
    expect_error(
        result,
        "SY050",
        "sync.storage.reaction_duplicate",
        Some(json!({ "idempotencyKey": key })),
    );
}

/// RXN-16: a duplicate names the first element (array order) whose key exists — also when keys
/// and partition hold the characters PostgreSQL's key description uses (`, ` and `)`), and when
/// one key's description contains another's — and writes nothing.
#[test]
fn rxn_16_duplicates_name_the_first_existing_key() {
    let db = TestDb::new("rxn16");
    let mut c = db.connect();
    let p = "part, 2)";
    assert_eq!(
        enqueue_keys(&mut c, p, &[RKEY, "k)", "e1", "e2"]).unwrap(),
        4
    );
    duplicate_of(enqueue_keys(&mut c, p, &["n1", "e2", "e1"]), "e2");
    duplicate_of(enqueue_keys(&mut c, p, &["n1", RKEY]), RKEY);
    // "k" is new and inserted first; "k)"'s description `=(part, 2), k))` contains "k"'s.
    duplicate_of(enqueue_keys(&mut c, p, &["k", "k)"]), "k)");
    duplicate_of(enqueue_keys(&mut c, P, &["n1", "n1"]), "n1");
    assert_eq!(
        count(
            &mut c,
            "syncular.sync_reactions WHERE idempotency_key IN ('n1', 'k')"
        ),
        0
    );
    assert_eq!(count(&mut c, "syncular.sync_reactions"), 4);
}

/// RXN-16 [MS]: an uncommitted insert of a key by another transaction is waited for: its commit
/// makes the waiting call a duplicate of that key with nothing inserted; its rollback lets the
/// waiting call insert everything.
#[test]
fn rxn_16_an_uncommitted_key_is_waited_for() {
    let db = TestDb::new("rxn16ms");
    for commit in [true, false] {
        let mut s1 = db.connect();
        let mut tx = s1.transaction().unwrap();
        let held = if commit { "held-c" } else { "held-r" };
        let fresh = if commit { "fresh-c" } else { "fresh-r" };
        let _: i32 = tx
            .query_one(
                "SELECT syncular.enqueue_reactions($1, $2)",
                &[&P, &json!([reaction(1, held)])],
            )
            .unwrap()
            .get(0);
        let mut s2 = db.connect();
        let pid = backend_pid(&mut s2);
        let waiter = thread::spawn(move || enqueue_keys(&mut s2, P, &[fresh, held]));
        let mut observer = db.connect();
        wait_until_blocked(&mut observer, pid);
        if commit {
            tx.commit().unwrap();
            duplicate_of(waiter.join().unwrap(), held);
        } else {
            tx.rollback().unwrap();
            assert_eq!(waiter.join().unwrap().unwrap(), 2);
        }
    }
    let mut c = db.connect();
    let keys = column::<String>(
        &mut c,
        "SELECT idempotency_key FROM syncular.sync_reactions ORDER BY 1",
        &[],
    );
    assert_eq!(keys, ["fresh-r", "held-c", "held-r"]);
}
