//! The operator's views: `stats()` (one health view per partition) and the opt-in change
//! notification after each appended commit (docs/API.md, `stats`, "Change notifications").

use postgres::fallible_iterator::FallibleIterator;
use serde_json::{json, Value};
use std::time::Duration;
use syncular_multisession::*;

#[test]
fn stats_counts_log_clients_checkpoints_and_reactions_per_partition() {
    let db = TestDb::new("ops_stats");
    let mut c = db.connect();
    for row in ["t1", "t2", "t3"] {
        append(&mut c, P, "tasks", row, Some(V));
    }
    append(&mut c, "part-2", "tasks", "x", Some(V));
    for (client, cursor, at) in [("c1", 1, NOW), ("c2", 3, NOW), ("c3", 0, NOW - 10 * DAY)] {
        c.execute(
            "SELECT syncular.put_client($1, $2)",
            &[
                &P,
                &json!({"clientId": client, "actorId": "a", "cursor": cursor,
                        "subscriptions": [], "updatedAtMs": at}),
            ],
        )
        .unwrap();
    }
    declare(&mut c, P, "proj", 2, NOW);
    one::<i32>(
        &mut c,
        "SELECT syncular.enqueue_reactions($1, $2)",
        &[&P, &json!([reaction(1, "r1"), reaction(2, "r2")])],
    );
    let stats: Value = one(&mut c, "SELECT syncular.stats($1)", &[&(NOW - DAY)]);
    assert_eq!(
        stats,
        json!([
            {"partition": P, "maxCommitSeq": 3, "horizonSeq": 0, "commits": 3, "changes": 3,
             "clients": 3, "activeClients": 2, "maxActiveLag": 2, "pendingCheckpoints": 1,
             "reactions": {"pending": 2, "leased": 0, "completed": 0, "deadLetter": 0}},
            {"partition": "part-2", "maxCommitSeq": 1, "horizonSeq": 0, "commits": 1, "changes": 1,
             "clients": 0, "activeClients": 0, "maxActiveLag": 0, "pendingCheckpoints": 0,
             "reactions": {"pending": 0, "leased": 0, "completed": 0, "deadLetter": 0}}
        ])
    );
}

#[test]
fn appended_commits_are_notified_on_commit_when_enabled() {
    let db = TestDb::new("ops_notify");
    let mut listener = db.connect();
    // The install's own channel (security_install.rs: only syncular_host can learn it).
    let channel: String = one(&mut listener, "SELECT syncular.notify_channel()", &[]);
    exec(&mut listener, &format!("LISTEN \"{channel}\""));
    let mut c = db.connect();
    let received = |listener: &mut postgres::Client| -> Vec<Value> {
        let mut out = Vec::new();
        let mut notifications = listener.notifications();
        let mut it = notifications.timeout_iter(Duration::from_millis(300));
        while let Some(n) = it.next().unwrap() {
            assert_eq!(n.channel(), channel);
            out.push(serde_json::from_str(n.payload()).unwrap());
        }
        out
    };
    // Off by default.
    append(&mut c, P, "tasks", "t1", Some(V));
    assert_eq!(received(&mut listener), Vec::<Value>::new());
    // On: delivered when the appending transaction commits, never for a rolled-back one.
    exec(&mut c, "SET syncular.notify_commits = on");
    exec(&mut c, "BEGIN");
    try_append(&mut c, P, "tasks", "t2", Some(V)).unwrap();
    exec(&mut c, "ROLLBACK");
    append(&mut c, P, "tasks", "t3", Some(V));
    append(&mut c, "part-2", "tasks", "x", Some(V));
    assert_eq!(
        received(&mut listener),
        vec![
            json!({"partition": P, "commitSeq": 2}),
            json!({"partition": "part-2", "commitSeq": 1})
        ]
    );
}
