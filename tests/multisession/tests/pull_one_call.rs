//! docs/SCENARIOS.md: the one-call pull (PULL1-01 … PULL1-06). `syncular.pull` must answer
//! exactly what the classic path of docs/HOST-WALKTHROUGH.md answers — the host below drives
//! that path call by call (serve_entry, get_client, a REPEATABLE READ snapshot with the gate,
//! partition_state, read_commit_window / scan_rows pages, put_client) with upstream's decisions
//! and delivery rule — row for row, outcome for outcome, and leave the same client record.

use postgres::Client;
use serde_json::{json, Value};
use syncular_multisession::*;

/// A small deterministic generator (no dependency): the cases are the same on every run.
struct Gen(u64);

impl Gen {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n.max(1)
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.next(items.len())]
    }
}

/// One delivered row, as both paths report it.
#[derive(Debug, PartialEq)]
struct PullRow {
    sub: i32,
    commit_seq: Option<i64>,
    idx: Option<i32>,
    row_id: String,
    op: Option<String>,
    row_version: Option<i64>,
    scopes: Value,
    payload: Option<Vec<u8>>,
    column_versions: Option<Vec<u8>>,
}

/// What a pull answered: per-subscription outcomes, rows, and the client record afterwards.
#[derive(Debug, PartialEq)]
struct Answer {
    client: String,
    outcomes: Vec<Value>,
    rows: Vec<PullRow>,
    record: Option<Value>,
}

const ACTOR: &str = "actor-1";
const EPOCH: &str = "epoch-1";

fn limit(req: &Value, key: &str, range: (i64, i64), default: i64) -> i64 {
    match req[key].as_i64().unwrap_or(0) {
        0 => default,
        n => n.clamp(range.0, range.1),
    }
}

/// Upstream's token reading, for the tokens this test writes (well-formed or plainly not).
fn token(sub: &Value) -> Option<(i64, Option<String>)> {
    let raw = sub["bootstrapState"].as_str()?;
    let t: Value = serde_json::from_str(raw).ok()?;
    if t["tables"][0].as_str()? != sub["table"].as_str()? || !t["tableIndex"].is_number() {
        return None;
    }
    let row_cursor = match &t["rowCursor"] {
        Value::Null if t.get("rowCursor").is_some() => None,
        Value::String(s) => Some(s.clone()),
        _ => return None,
    };
    Some((t["asOfCommitSeq"].as_i64()?, row_cursor))
}

/// The classic path, as docs/HOST-WALKTHROUGH.md sends it.
fn classic(
    c: &mut Client,
    p: &str,
    client_id: &str,
    actor: &str,
    req: &Value,
) -> Result<Answer, SqlError> {
    // The host's request validation (upstream's): a subscription of a table the server does not
    // have fails the whole request before anything is read. The registry answers as the
    // extension's readers of one table answer an unregistered one.
    for sub in req["subscriptions"].as_array().unwrap() {
        let table = sub["table"].as_str().unwrap();
        let known: bool = one(
            c,
            "SELECT EXISTS (SELECT 1 FROM syncular.sync_app_tables WHERE tbl = $1)",
            &[&table],
        );
        if !known {
            c.query_one("SELECT syncular.get_row_scopes($1, $2, 'x')", &[&p, &table])
                .map_err(|e| sql_error(&e))?;
            unreachable!("get_row_scopes read an unregistered table");
        }
    }
    c.query_one(
        "SELECT syncular.serve_entry($1, $2, $3, $4)",
        &[&p, &NOW, &EPOCH, &V],
    )
    .map_err(|e| sql_error(&e))?;
    let stored: Option<Value> = one(c, "SELECT syncular.get_client($1, $2)", &[&p, &client_id]);
    if stored
        .as_ref()
        .is_some_and(|r| r["actorId"] != json!(actor))
    {
        return Ok(Answer {
            client: "actor_mismatch".into(),
            outcomes: vec![],
            rows: vec![],
            record: stored,
        });
    }
    let limit_commits = limit(req, "limitCommits", (1, 1000), 1000);
    let snapshot_rows = limit(req, "limitSnapshotRows", (1, 50_000), 1000);
    let pages = limit(req, "maxSnapshotPages", (1, 50), 4);
    let mut tx = c
        .build_transaction()
        .isolation_level(postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .unwrap();
    // Per subscription its outcome and cursor, and every row delivered.
    type Read = (Vec<Value>, Vec<PullRow>, Vec<i64>);
    let read = |tx: &mut postgres::Transaction<'_>| -> Result<Read, SqlError> {
        tx.query_one("SELECT syncular.assert_serve_ready($1, $2)", &[&p, &V])
            .map_err(|e| sql_error(&e))?;
        let state: Value = tx
            .query_one("SELECT syncular.partition_state($1)", &[&p])
            .unwrap()
            .get(0);
        let (max, horizon) = (
            state["maxCommitSeq"].as_i64().unwrap(),
            state["horizonSeq"].as_i64().unwrap(),
        );
        let (mut outcomes, mut rows, mut cursors) = (vec![], vec![], vec![]);
        for (i, sub) in req["subscriptions"].as_array().unwrap().iter().enumerate() {
            let (id, table, cursor) = (
                &sub["id"],
                sub["table"].as_str().unwrap(),
                sub["cursor"].as_i64().unwrap(),
            );
            let tok = token(sub);
            let effective = &sub["effective"];
            // The host revokes effective scopes that admit no row: no variable, or a variable
            // without values (upstream's rule; docs/API.md `pull`).
            let admits_nothing = effective.as_object().is_some_and(|m| {
                m.is_empty() || m.values().any(|v| v.as_array().is_some_and(Vec::is_empty))
            });
            if effective.is_null() || admits_nothing {
                outcomes.push(json!({"id": id, "status": "revoked", "reasonCode": "sync.scope_revoked", "bootstrap": false, "nextCursor": cursor}));
                continue;
            }
            if tok.is_none() && cursor >= 0 && cursor < horizon {
                outcomes.push(json!({"id": id, "status": "reset", "reasonCode": "sync.cursor_expired", "bootstrap": false, "nextCursor": cursor}));
                continue;
            }
            if tok.is_none() && cursor >= 0 && cursor <= max {
                let window = tx
                    .query(
                        "SELECT commit_seq, idx, row_id, op, row_version, scopes, payload
                           FROM syncular.read_commit_window($1, $2, $3, $4, $5, $6)",
                        &[
                            &p,
                            &table,
                            effective,
                            &cursor,
                            &max,
                            &((limit_commits + 1) as i32),
                        ],
                    )
                    .map_err(|e| sql_error(&e))?;
                // Upstream's delivery rule over whole commits.
                let mut commits: Vec<Vec<&postgres::Row>> = vec![];
                for r in &window {
                    match commits.last_mut() {
                        Some(cm) if cm[0].get::<_, i64>(0) == r.get::<_, i64>(0) => cm.push(r),
                        _ => commits.push(vec![r]),
                    }
                }
                let (mut delivered, mut n, mut last) = (0i64, 0usize, cursor);
                for cm in &commits {
                    if delivered > 0 && delivered + cm.len() as i64 > limit_commits {
                        break;
                    }
                    for r in cm {
                        rows.push(PullRow {
                            sub: i as i32,
                            commit_seq: Some(r.get(0)),
                            idx: Some(r.get(1)),
                            row_id: r.get(2),
                            op: Some(r.get(3)),
                            row_version: r.get(4),
                            scopes: r.get(5),
                            payload: r.get(6),
                            column_versions: None,
                        });
                    }
                    delivered += cm.len() as i64;
                    n += 1;
                    last = cm[0].get(0);
                    if delivered >= limit_commits {
                        break;
                    }
                }
                let exhausted = window.len() as i64 <= limit_commits && n == commits.len();
                let next = if exhausted {
                    cursor.max(max)
                } else {
                    cursor.max(last)
                };
                outcomes.push(
                    json!({"id": id, "status": "active", "bootstrap": false, "nextCursor": next}),
                );
                cursors.push(next);
                continue;
            }
            let resume = tok.filter(|(as_of, _)| *as_of >= horizon);
            let as_of = resume.as_ref().map_or(max, |t| t.0);
            let mut row_cursor = resume.and_then(|t| t.1);
            let mut complete = false;
            for _ in 0..pages {
                let scanned = tx
                    .query(
                        "SELECT row_id, server_version, scopes, payload, column_versions
                           FROM syncular.scan_rows($1, $2, $3, $4, $5)",
                        &[
                            &p,
                            &table,
                            effective,
                            &row_cursor,
                            &((snapshot_rows + 1) as i32),
                        ],
                    )
                    .map_err(|e| sql_error(&e))?;
                let has_more = scanned.len() as i64 > snapshot_rows;
                for r in scanned.iter().take(snapshot_rows as usize) {
                    rows.push(PullRow {
                        sub: i as i32,
                        commit_seq: None,
                        idx: None,
                        row_id: r.get(0),
                        op: None,
                        row_version: Some(r.get(1)),
                        scopes: r.get(2),
                        payload: Some(r.get(3)),
                        column_versions: r.get(4),
                    });
                }
                if !has_more {
                    complete = true;
                    break;
                }
                row_cursor = Some(scanned[snapshot_rows as usize - 1].get(0));
            }
            let mut outcome =
                json!({"id": id, "status": "active", "bootstrap": true, "nextCursor": as_of});
            if !complete {
                outcome["bootstrapState"] =
                    json!(json!({"asOfCommitSeq": as_of, "tables": [table],
                    "tableIndex": 0, "rowCursor": row_cursor})
                    .to_string());
            }
            outcomes.push(outcome);
            cursors.push(as_of);
        }
        Ok((outcomes, rows, cursors))
    };
    let (outcomes, rows, cursors) = match read(&mut tx) {
        Ok(answer) => answer,
        Err(e) => {
            tx.rollback().unwrap();
            return Err(e);
        }
    };
    tx.commit().unwrap();
    let cursor = cursors
        .iter()
        .copied()
        .min()
        .or(stored.as_ref().and_then(|r| r["cursor"].as_i64()))
        .unwrap_or(-1);
    let subs: Vec<Value> = req["subscriptions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| json!({"id": s["id"], "table": s["table"], "scopes": s["scopes"]}))
        .collect();
    let record = json!({"clientId": client_id, "actorId": actor, "cursor": cursor,
                        "subscriptions": subs, "updatedAtMs": NOW, "wireVersion": 1});
    c.query_one("SELECT syncular.put_client($1, $2)", &[&p, &record])
        .unwrap();
    let record = one(c, "SELECT syncular.get_client($1, $2)", &[&p, &client_id]);
    Ok(Answer {
        client: "recorded".into(),
        outcomes,
        rows,
        record,
    })
}

/// The same request through `syncular.pull`.
fn one_call(
    c: &mut Client,
    p: &str,
    client_id: &str,
    actor: &str,
    req: &Value,
) -> Result<Answer, SqlError> {
    let result = c
        .query(
            "SELECT sub, commit_seq, idx, row_id, op, row_version, scopes, payload, column_versions, document
               FROM syncular.pull($1, $2, $3, $4, $5, $6, $7)",
            &[&p, &client_id, &actor, &NOW, &EPOCH, &V, req],
        )
        .map_err(|e| sql_error(&e))?;
    let document: Value = result[0].get(9);
    assert!(
        result[0].get::<_, Option<i32>>(0).is_none(),
        "the document comes first"
    );
    let rows = result[1..]
        .iter()
        .map(|r| PullRow {
            sub: r.get(0),
            commit_seq: r.get(1),
            idx: r.get(2),
            row_id: r.get(3),
            op: r.get(4),
            row_version: r.get(5),
            scopes: r.get(6),
            payload: r.get(7),
            column_versions: r.get(8),
        })
        .collect();
    let outcomes = document["subscriptions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            let mut o = o.clone();
            // Counts the classic host would compute itself.
            for key in ["commits", "changes", "rows"] {
                o.as_object_mut().unwrap().remove(key);
            }
            o
        })
        .collect();
    Ok(Answer {
        client: document["client"].as_str().unwrap().to_string(),
        outcomes,
        rows,
        record: one(c, "SELECT syncular.get_client($1, $2)", &[&p, &client_id]),
    })
}

/// Puts the client record back as it was (the classic path wrote it).
fn restore_client(c: &mut Client, p: &str, client_id: &str, before: &Option<Value>) {
    match before {
        Some(record) => {
            c.query_one("SELECT syncular.put_client($1, $2)", &[&p, record])
                .unwrap();
        }
        None => {
            c.execute(
                "DELETE FROM syncular.sync_clients WHERE partition = $1 AND client_id = $2",
                &[&p, &client_id],
            )
            .unwrap();
        }
    }
}

/// Runs `req` both ways on the same state and compares everything.
#[track_caller]
fn same_answer(
    c: &mut Client,
    p: &str,
    client_id: &str,
    actor: &str,
    req: &Value,
) -> Result<Answer, SqlError> {
    let before: Option<Value> = one(c, "SELECT syncular.get_client($1, $2)", &[&p, &client_id]);
    let expected = classic(c, p, client_id, actor, req);
    restore_client(c, p, client_id, &before);
    let got = one_call(c, p, client_id, actor, req);
    // A token is compared as JSON (the extension writes upstream's key order).
    let tokens_parsed = |answer: Result<Answer, SqlError>| {
        answer.map(|mut a| {
            for o in &mut a.outcomes {
                if let Some(Value::String(t)) = o.get("bootstrapState") {
                    o["bootstrapState"] = serde_json::from_str(t).unwrap();
                }
            }
            a
        })
    };
    let (expected, got) = (tokens_parsed(expected), tokens_parsed(got));
    match (&expected, &got) {
        (Ok(e), Ok(g)) => assert_eq!(g, e, "request {req}"),
        (Err(e), Err(g)) => assert_eq!(
            (&g.state, &g.detail),
            (&e.state, &e.detail),
            "request {req}"
        ),
        _ => panic!("request {req}: classic {expected:?}, one call {got:?}"),
    }
    got
}

const PROJECTS: [&str; 4] = ["p0", "p1", "p2", "p3"];

/// A log of `commits` random commits in `p` (tables tasks and docs, scopes project_id and
/// sometimes org_id, upserts and deletes) and the current rows of both tables.
fn generate(c: &mut Client, g: &mut Gen, p: &str, commits: usize) {
    for n in 0..commits {
        let changes: Vec<Value> = (0..1 + g.next(4))
            .map(|k| {
                let table = *g.pick(&["tasks", "tasks", "docs"]);
                let mut scopes = json!({"project_id": g.pick(&PROJECTS)});
                if g.next(3) == 0 {
                    scopes["org_id"] = json!(g.pick(&["o1", "o2"]));
                }
                if g.next(5) == 0 {
                    json!({"table": table, "rowId": format!("r{n}-{k}"), "op": "delete", "scopes": scopes})
                } else {
                    json!({"table": table, "rowId": format!("r{n}-{k}"), "op": "upsert",
                           "rowVersion": 1 + g.next(9), "scopes": scopes, "payload": "AQID"})
                }
            })
            .collect();
        let d = json!({"clientId": "w", "clientCommitId": format!("{p}-{n}"), "actorId": "a",
                       "createdAtMs": NOW + n as i64, "changes": changes});
        let _: i64 = one(c, "SELECT syncular.append_commit($1, $2)", &[&p, &d]);
    }
    for n in 0..30 {
        let table = *g.pick(&["tasks", "docs"]);
        let mut scopes = json!({"project_id": g.pick(&PROJECTS)});
        if g.next(2) == 0 {
            scopes["org_id"] = json!(g.pick(&["o1", "o2"]));
        }
        put_row(
            c,
            p,
            table,
            &format!("row-{n:02}"),
            &scopes,
            1 + g.next(5) as i64,
            &[n as u8],
        );
    }
}

fn random_filter(g: &mut Gen) -> Value {
    let values =
        |g: &mut Gen| -> Vec<&str> { (0..g.next(3) + 1).map(|_| *g.pick(&PROJECTS)).collect() };
    match g.next(6) {
        0 => Value::Null,
        1 => json!({"project_id": values(g), "org_id": [g.pick(&["o1", "o2"])]}),
        2 => json!({"project_id": []}),
        3 => json!({}),
        _ => json!({"project_id": values(g)}),
    }
}

fn random_request(g: &mut Gen, max: i64, horizon: i64) -> Value {
    let subs: Vec<Value> = (0..1 + g.next(3))
        .map(|i| {
            // Now and then a table nobody registered: the whole request fails.
            let table = if g.next(16) == 0 {
                "nope"
            } else {
                *g.pick(&["tasks", "docs"])
            };
            let effective = random_filter(g);
            let cursor = *g.pick(&[
                -1,
                0,
                (horizon - 1).max(0),
                horizon,
                (horizon + max) / 2,
                max - 1,
                max,
                max + 3,
            ]);
            let mut sub = json!({"id": format!("s{i}"), "table": table,
                                 "scopes": {"project_id": PROJECTS}, "cursor": cursor});
            if !effective.is_null() {
                sub["effective"] = effective;
            }
            match g.next(8) {
                0 => {
                    let as_of = *g.pick(&[horizon - 1, horizon, max]);
                    let row_cursor = g
                        .pick(&[Value::Null, json!("row-07"), json!("row-20")])
                        .clone();
                    sub["bootstrapState"] =
                        json!(json!({"asOfCommitSeq": as_of, "tables": [table],
                                                         "tableIndex": 0, "rowCursor": row_cursor})
                        .to_string());
                }
                1 => sub["bootstrapState"] = json!("not a token"),
                2 => {
                    sub["bootstrapState"] = json!(json!({"asOfCommitSeq": max, "tables": ["other"],
                                                         "tableIndex": 0, "rowCursor": null})
                    .to_string())
                }
                _ => {}
            }
            sub
        })
        .collect();
    json!({"subscriptions": subs, "limitCommits": g.next(7), "limitSnapshotRows": g.next(6),
           "maxSnapshotPages": g.next(4)})
}

/// PULL1-01: 400 generated requests over two partitions, with and without pruned history.
#[test]
fn pull1_01_one_call_equals_the_classic_path() {
    let db = TestDb::new("pull1_01");
    let mut c = db.connect();
    let mut g = Gen(0x5EED_0001);
    generate(&mut c, &mut g, "part-a", 60);
    generate(&mut c, &mut g, "part-b", 25);
    one::<Value>(
        &mut c,
        "SELECT syncular.serve_entry('part-b', $1, $2, $3)",
        &[&NOW, &EPOCH, &V],
    );
    one::<Value>(
        &mut c,
        "SELECT syncular.prune_commits_through('part-b', $1, 9)",
        &[&EPOCH],
    );
    let (mut errors, mut bootstraps, mut resets, mut changes) = (0, 0, 0, 0);
    for n in 0..400 {
        let p = if n % 3 == 0 { "part-b" } else { "part-a" };
        let (max, horizon) = if p == "part-a" { (60, 0) } else { (25, 9) };
        let req = random_request(&mut g, max, horizon);
        let client_id = format!("client-{}", g.next(4));
        let actor = if g.next(15) == 0 { "actor-2" } else { ACTOR };
        match same_answer(&mut c, p, &client_id, actor, &req) {
            Err(_) => errors += 1,
            Ok(a) => {
                for o in &a.outcomes {
                    bootstraps += (o["bootstrap"] == json!(true)) as usize;
                    resets += (o["status"] == json!("reset")) as usize;
                }
                changes += a.rows.iter().filter(|r| r.commit_seq.is_some()).count();
            }
        }
    }
    // The generated cases reach every branch.
    assert!(errors > 0 && errors < 100, "{errors} errors");
    assert!(
        bootstraps > 50 && resets > 10 && changes > 500,
        "{bootstraps} {resets} {changes}"
    );
}

fn pull_doc(c: &mut Client, p: &str, req: &Value) -> Result<Value, SqlError> {
    c.query_one(
        "SELECT document FROM syncular.pull($1, 'client-1', $2, $3, $4, $5, $6) LIMIT 1",
        &[&p, &ACTOR, &NOW, &EPOCH, &V, req],
    )
    .map(|r| r.get(0))
    .map_err(|e| sql_error(&e))
}

fn sub(cursor: i64) -> Value {
    json!({"id": "s1", "table": "tasks", "scopes": {"project_id": ["p1"]},
           "effective": {"project_id": ["p1"]}, "cursor": cursor})
}

/// PULL1-02: bootstrap, resume, reset and the horizon, step by step.
#[test]
fn pull1_02_bootstrap_resume_reset_and_horizon() {
    let db = TestDb::new("pull1_02");
    let mut c = db.connect();
    for n in 0..5 {
        put_row(&mut c, P, "tasks", &format!("t{n}"), &p1(), 1, b"x");
        append(&mut c, P, "tasks", &format!("t{n}"), None);
    }
    // A fresh client bootstraps in pages of 2 rows, 2 pages per pull: 4 rows and a token.
    let limits =
        |s: Value| json!({"subscriptions": [s], "limitSnapshotRows": 2, "maxSnapshotPages": 2});
    let d = pull_doc(&mut c, P, &limits(sub(-1))).unwrap();
    let s = &d["subscriptions"][0];
    assert_eq!(
        (
            s["bootstrap"].clone(),
            s["nextCursor"].clone(),
            s["rows"].clone()
        ),
        (json!(true), json!(5), json!(4))
    );
    let state = s["bootstrapState"].as_str().unwrap().to_string();
    // Upstream's JSON.stringify order, byte for byte.
    assert_eq!(
        state,
        r#"{"asOfCommitSeq":5,"tables":["tasks"],"tableIndex":0,"rowCursor":"t3"}"#
    );
    assert_eq!(
        serde_json::from_str::<Value>(&state).unwrap(),
        json!({"asOfCommitSeq": 5, "tables": ["tasks"], "tableIndex": 0, "rowCursor": "t3"})
    );
    assert_eq!(d["cursor"], json!(5));
    // The resume delivers the last row and completes, pinned at the token.
    append(&mut c, P, "tasks", "t9", None);
    let mut resume = sub(5);
    resume["bootstrapState"] = json!(state);
    let d = pull_doc(&mut c, P, &limits(resume.clone())).unwrap();
    assert_eq!(
        d["subscriptions"][0],
        json!({"id": "s1", "status": "active", "bootstrap": true, "nextCursor": 5, "rows": 1})
    );
    // Incremental from the pin: the commit appended meanwhile.
    let d = pull_doc(&mut c, P, &limits(sub(5))).unwrap();
    assert_eq!(d["subscriptions"][0]["commits"], json!(1));
    assert_eq!(d["subscriptions"][0]["nextCursor"], json!(6));
    // Prune through 3: a cursor behind the horizon is reset, one at it is incremental, a token
    // pinned behind it restarts the bootstrap at maxCommitSeq.
    one::<Value>(
        &mut c,
        "SELECT syncular.prune_commits_through($1, $2, 3)",
        &[&P, &EPOCH],
    );
    let d = pull_doc(&mut c, P, &limits(sub(2))).unwrap();
    assert_eq!(d["subscriptions"][0]["status"], json!("reset"));
    assert_eq!(
        d["subscriptions"][0]["reasonCode"],
        json!("sync.cursor_expired")
    );
    assert_eq!(d["cursor"], json!(6), "a reset leaves the stored cursor");
    let d = pull_doc(&mut c, P, &limits(sub(3))).unwrap();
    assert_eq!(d["subscriptions"][0]["status"], json!("active"));
    assert_eq!(d["subscriptions"][0]["nextCursor"], json!(6));
    resume["bootstrapState"] = json!(
        json!({"asOfCommitSeq": 2, "tables": ["tasks"], "tableIndex": 0, "rowCursor": "t1"})
            .to_string()
    );
    let d = pull_doc(&mut c, P, &limits(resume)).unwrap();
    assert_eq!(d["subscriptions"][0]["nextCursor"], json!(6));
    assert_eq!(
        d["subscriptions"][0]["rows"],
        json!(4),
        "restarted from the first row"
    );
    // Idle: cursor at the head, nothing read, cursor kept.
    let d = pull_doc(&mut c, P, &limits(sub(6))).unwrap();
    assert_eq!(
        d["subscriptions"][0],
        json!({"id": "s1", "status": "active", "bootstrap": false, "nextCursor": 6, "commits": 0, "changes": 0})
    );
    assert_eq!(
        (d["maxCommitSeq"].clone(), d["horizonSeq"].clone()),
        (json!(6), json!(3))
    );
}

/// PULL1-03: the gate refuses as serve_entry does, and the touch is rolled back with it.
#[test]
fn pull1_03_gate_refusal_rolls_everything_back() {
    let db = TestDb::new("pull1_03");
    let mut c = db.connect();
    declare(&mut c, "other", "titles", V, NOW);
    let req = json!({"subscriptions": [sub(0)]});
    let classic = expect_error(
        try_one::<Value>(
            &mut c,
            "SELECT syncular.serve_entry('fresh', $1, $2, $3)",
            &[&NOW, &EPOCH, &V],
        ),
        "SY002",
        "sync.schema_not_ready",
        None,
    );
    let err = pull_doc(&mut c, "fresh", &req).unwrap_err();
    assert_eq!((err.state, err.detail), (classic.state, classic.detail));
    assert_eq!(count(&mut c, "syncular.sync_partition_registry"), 0);
    assert_eq!(count(&mut c, "syncular.sync_clients"), 0);
    // Declared, it serves; the token is the one serve_entry returns.
    let declared = json!([{"partition": "other", "name": "titles"}]);
    let entry: Value = one(
        &mut c,
        "SELECT syncular.serve_entry('fresh', $1, $2, $3, $4)",
        &[&NOW, &EPOCH, &V, &declared],
    );
    let d: Value = one(
        &mut c,
        "SELECT document FROM syncular.pull('fresh', 'client-1', $1, $2, $3, $4, $5, $6) LIMIT 1",
        &[&ACTOR, &NOW, &EPOCH, &V, &req, &declared],
    );
    assert_eq!(d["gate"], entry["gate"]);
    assert_eq!(d["registry"], entry["registry"]);
}

/// PULL1-04: a client id bound to another actor: the touch happens (as serve_entry's would),
/// nothing else is read or written.
#[test]
fn pull1_04_a_client_of_another_actor_is_refused() {
    let db = TestDb::new("pull1_04");
    let mut c = db.connect();
    append(&mut c, P, "tasks", "t1", None);
    pull_doc(&mut c, P, &json!({"subscriptions": [sub(0)]})).unwrap();
    let before: Value = one(&mut c, "SELECT syncular.get_client($1, 'client-1')", &[&P]);
    let d: Value = one(
        &mut c,
        "SELECT document FROM syncular.pull($1, 'client-1', 'intruder', $2, $3, $4, $5) LIMIT 1",
        &[
            &P,
            &(NOW + 5),
            &EPOCH,
            &V,
            &json!({"subscriptions": [sub(0)]}),
        ],
    );
    assert_eq!(
        (
            d["client"].clone(),
            d["subscriptions"].clone(),
            d["cursor"].clone()
        ),
        (json!("actor_mismatch"), json!([]), Value::Null)
    );
    assert_eq!(d["registry"]["lastAuthenticatedAtMs"], json!(NOW + 5));
    let after: Value = one(&mut c, "SELECT syncular.get_client($1, 'client-1')", &[&P]);
    assert_eq!(after, before);
}

/// PULL1-05: hostile and malformed requests are refused with the argument they name.
#[test]
fn pull1_05_hostile_requests() {
    let db = TestDb::new("pull1_05");
    let mut c = db.connect();
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!([]), "request", "type"),
        (json!({}), "request.subscriptions", "missing"),
        (
            json!({"subscriptions": {}}),
            "request.subscriptions",
            "type",
        ),
        (
            json!({"subscriptions": [1]}),
            "request.subscriptions[0]",
            "type",
        ),
        (
            json!({"subscriptions": [{"id": "s", "table": "tasks", "cursor": 0}]}),
            "request.subscriptions[0].scopes",
            "missing",
        ),
        (
            json!({"subscriptions": [{"id": "s", "table": "tasks", "scopes": {"a": "x"}, "cursor": 0}]}),
            "request.subscriptions[0].scopes",
            "type",
        ),
        (
            json!({"subscriptions": [{"id": "", "table": "tasks", "scopes": {}, "cursor": 0}]}),
            "request.subscriptions[0].id",
            "empty",
        ),
        (
            json!({"subscriptions": [{"id": "s", "table": "tasks", "scopes": {}}]}),
            "request.subscriptions[0].cursor",
            "missing",
        ),
        (
            json!({"subscriptions": [{"id": "s", "table": "tasks", "scopes": {}, "cursor": 1.5}]}),
            "request.subscriptions[0].cursor",
            "type",
        ),
        (
            json!({"subscriptions": [{"id": "s", "table": "tasks", "scopes": {}, "cursor": 9007199254740992i64}]}),
            "request.subscriptions[0].cursor",
            "range",
        ),
        (
            json!({"subscriptions": [{"id": "s", "table": "tasks", "scopes": {}, "cursor": 0, "effective": {"a": [1]}}]}),
            "request.subscriptions[0].effective.a",
            "type",
        ),
        (
            json!({"subscriptions": [{"id": "s", "table": "tasks", "scopes": {}, "cursor": 0, "bootstrapState": {}}]}),
            "request.subscriptions[0].bootstrapState",
            "type",
        ),
        (
            json!({"subscriptions": [{"id": "x".repeat(5000), "table": "tasks", "scopes": {}, "cursor": 0}]}),
            "request.subscriptions[0].id",
            "too_large",
        ),
        (
            json!({"subscriptions": [], "limitCommits": "5"}),
            "request.limitCommits",
            "type",
        ),
        (
            json!({"subscriptions": [], "wireVersion": 0}),
            "request.wireVersion",
            "range",
        ),
        (
            json!({"subscriptions": vec![sub(0); 1001]}),
            "request.subscriptions",
            "too_large",
        ),
    ];
    for (req, argument, reason) in cases {
        let err = pull_doc(&mut c, P, &req).unwrap_err();
        assert_eq!(
            (err.state.as_str(), err.detail),
            (
                "SY000",
                Some(json!({"argument": argument, "reason": reason}))
            ),
            "{req}"
        );
    }
    // Reserved and unregistered tables fail the whole request, incremental or bootstrap, even
    // beside a good subscription (issue 27, item 4: never "active, nothing changed").
    for (cursor, table) in [
        (0, "sync_commits"),
        (0, "nope"),
        (-1, "nope"),
        (-1, "sync_commits"),
    ] {
        let mut s = sub(cursor);
        s["id"] = json!("s2");
        s["table"] = json!(table);
        let req = json!({"subscriptions": [sub(0), s]});
        let err = pull_doc(&mut c, P, &req).unwrap_err();
        assert_eq!(
            (err.state.as_str(), err.detail),
            ("SY041", Some(json!({"table": table}))),
            "{req}"
        );
    }
    // Effective scopes that admit no row revoke the subscription, bootstrap or incremental:
    // nothing read, the cursor echoed.
    for (cursor, effective) in [
        (-1, json!({})),
        (0, json!({})),
        (0, json!({"project_id": []})),
    ] {
        let mut s = sub(cursor);
        s["effective"] = effective;
        let d = pull_doc(&mut c, P, &json!({"subscriptions": [s]})).unwrap();
        assert_eq!(
            d["subscriptions"][0],
            json!({"id": s["id"], "status": "revoked", "reasonCode": "sync.scope_revoked",
                   "bootstrap": false, "nextCursor": cursor}),
            "{d}"
        );
        exec(&mut c, "DELETE FROM syncular.sync_clients");
    }
    // Limits beyond upstream's are clamped, not refused; nothing was written by the refusals.
    let d = pull_doc(&mut c, P, &json!({"subscriptions": [sub(0)], "limitCommits": -5, "limitSnapshotRows": 10_000_000, "maxSnapshotPages": 999})).unwrap();
    assert_eq!(d["subscriptions"][0]["status"], json!("active"));
    assert_eq!(count(&mut c, "syncular.sync_clients"), 1);
}

/// PULL1-06: a host role without SELECT on an app table cannot bootstrap from it through the
/// one call (docs/SECURITY.md, rule 3); with it, it can.
#[test]
fn pull1_06_bootstrap_reads_need_select() {
    let db = TestDb::new("pull1_06");
    let mut c = db.connect();
    put_row(&mut c, P, "tasks", "t1", &p1(), 1, b"x");
    exec(
        &mut c,
        "DO $$ BEGIN
           IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pull1_host') THEN
             CREATE ROLE pull1_host NOLOGIN;
           END IF;
         END $$;
         GRANT syncular_host TO pull1_host;
         REVOKE ALL ON public.tasks FROM pull1_host;
         SET ROLE pull1_host;",
    );
    let err = pull_doc(&mut c, P, &json!({"subscriptions": [sub(-1)]})).unwrap_err();
    assert_eq!(
        err.detail,
        Some(json!({"argument": "tbl", "reason": "privilege"}))
    );
    // Incremental pulls read only the log: no app-table privilege needed.
    pull_doc(&mut c, P, &json!({"subscriptions": [sub(0)]})).unwrap();
    exec(
        &mut c,
        "RESET ROLE; GRANT SELECT ON public.tasks TO pull1_host; SET ROLE pull1_host;",
    );
    let d = pull_doc(&mut c, P, &json!({"subscriptions": [sub(-1)]})).unwrap();
    assert_eq!(d["subscriptions"][0]["rows"], json!(1));
    exec(&mut c, "RESET ROLE");
}

/// The document of a pull by `client_id` of actor-1 at `now`, one subscription at `cursor`.
fn pull_at(c: &mut Client, client_id: &str, now: i64, cursor: i64) -> Value {
    one(
        c,
        "SELECT document FROM syncular.pull($1, $2, $3, $4, $5, $6, $7) LIMIT 1",
        &[
            &P,
            &client_id,
            &ACTOR,
            &now,
            &EPOCH,
            &V,
            &json!({"subscriptions": [sub(cursor)]}),
        ],
    )
}

/// PULL1-07: the pull's writes below SQL wait and go round as `ON CONFLICT DO UPDATE` does. A
/// second session's pull of a client whose record another open transaction writes — an update of
/// a stored record, and a record inserted for the first time (a speculative insert) — waits for
/// that transaction; after its commit the waiting pull updates the committed row (one record,
/// the later cursor and time), after its rollback it inserts its own. The registry entry is
/// touched by both, the later time kept.
#[test]
fn pull1_07_concurrent_pulls_of_one_client_wait_and_write_once() {
    let db = TestDb::new("pull1_07");
    let mut c = db.connect();
    append(&mut c, P, "tasks", "t1", None);
    // A stored record first (client-1); client-2 has none.
    pull_at(&mut c, "client-1", NOW, 0);
    for (client_id, end) in [
        ("client-1", "COMMIT"),
        ("client-2", "COMMIT"),
        ("client-3", "ROLLBACK"),
    ] {
        let mut s1 = db.connect();
        exec(&mut s1, "BEGIN");
        let first = pull_at(&mut s1, client_id, NOW + 10, 0);
        assert_eq!(first["client"], json!("recorded"), "{client_id}");
        let mut s2 = db.connect();
        let pid = backend_pid(&mut s2);
        let id = client_id.to_string();
        let waiter = std::thread::spawn(move || pull_at(&mut s2, &id, NOW + 20, 0));
        wait_until_blocked(&mut c, pid);
        exec(&mut s1, end);
        let second = waiter.join().unwrap();
        assert_eq!(second["client"], json!("recorded"), "{client_id}");
        assert_eq!(
            second["registry"]["lastAuthenticatedAtMs"],
            json!(NOW + 20),
            "{client_id}"
        );
        let records = count(
            &mut c,
            &format!(
                "syncular.sync_clients WHERE partition = '{P}' AND client_id = '{client_id}' \
                 AND updated_at_ms = {} AND actor_id = '{ACTOR}'",
                NOW + 20
            ),
        );
        assert_eq!(records, 1, "{client_id} after {end}");
    }
    let registry: i64 = one(
        &mut c,
        "SELECT last_authenticated_at_ms FROM syncular.sync_partition_registry WHERE partition = $1",
        &[&P],
    );
    assert_eq!(registry, NOW + 20);
}

/// PULL1-08: a pull waiting for the lock on a client record that its holder then updates and
/// commits goes round and updates the committed version (the row version it waited for is
/// answered "updated", as the executor's `ON CONFLICT DO UPDATE` goes round): one record, the
/// waiting pull's.
#[test]
fn pull1_08_a_record_updated_while_a_pull_waits_is_written_once() {
    let db = TestDb::new("pull1_08");
    let mut c = db.connect();
    append(&mut c, P, "tasks", "t1", None);
    pull_doc(&mut c, P, &json!({"subscriptions": [sub(0)]})).unwrap();
    let mut holder = db.connect();
    exec(&mut holder, "BEGIN");
    exec(
        &mut holder,
        &format!(
            "SELECT 1 FROM syncular.sync_clients WHERE partition = '{P}' \
             AND client_id = 'client-1' FOR UPDATE"
        ),
    );
    let mut waiter = db.connect();
    let pid = backend_pid(&mut waiter);
    let pulled = std::thread::spawn(move || pull_at(&mut waiter, "client-1", NOW + 20, 0));
    wait_until_blocked(&mut c, pid);
    exec(
        &mut holder,
        &format!(
            "UPDATE syncular.sync_clients SET cursor = 99, updated_at_ms = {} \
             WHERE partition = '{P}' AND client_id = 'client-1'",
            NOW + 10
        ),
    );
    exec(&mut holder, "COMMIT");
    let d = pulled.join().unwrap();
    assert_eq!(d["client"], json!("recorded"));
    let rows: Vec<(i64, i64)> = c
        .query(
            "SELECT cursor, updated_at_ms FROM syncular.sync_clients
              WHERE partition = $1 AND client_id = 'client-1'",
            &[&P],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows, vec![(d["cursor"].as_i64().unwrap(), NOW + 20)]);
}
