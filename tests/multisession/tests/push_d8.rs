//! One result per push (D8 in docs/DESIGN.md §Invariants) under every way a host can finish a
//! push: the one-call push, stage/finish, and the classic calls (docs/API.md §8, `push_finish`).
//! For every idempotency key, in committed state: at most one stored result, at most one commit,
//! and an applied result names the commit that exists (a rejected one: no commit at all).
//!
//! Two kinds of test: races with a second session that stores a result without taking the
//! partition lock (`put_push_result` needs none), and a property test over generated
//! interleavings of stage, direct pushes, finish, results and rollbacks in real sessions.

use postgres::Client;
use serde_json::{json, Value};
use std::thread;
use syncular_multisession::native_push::*;
use syncular_multisession::rng::Rng;
use syncular_multisession::*;

fn stage_options(identity: &str) -> Value {
    json!({"cacheIdentity": identity, "onCommitHooks": "stage", "commitValidator": true})
}

fn rejection(identity: &str) -> Value {
    json!({"status": "rejected", "results": [{"opIndex": 0, "status": "error",
        "code": "app.denied", "message": "no", "retryable": false}],
        "recordedAtMs": NOW, "cacheIdentity": identity})
}

/// Every commit of `key` (client `c1` in `P`) and its stored result, raw.
fn commits_and_result(c: &mut Client, key: &str) -> (Vec<i64>, Option<Value>) {
    let seqs = column(
        c,
        "SELECT commit_seq FROM syncular.sync_commits
          WHERE partition = $1 AND client_id = 'c1' AND client_commit_id = $2 ORDER BY 1",
        &[&P, &key],
    );
    let result = c
        .query_opt(
            "SELECT result FROM syncular.sync_push_results
              WHERE partition = $1 AND client_id = 'c1' AND client_commit_id = $2",
            &[&P, &key],
        )
        .unwrap()
        .map(|r| r.get(0));
    (seqs, result)
}

/// How a session finishes the push of `k1` in the race below.
#[derive(Clone, Copy, Debug)]
enum Finisher {
    /// `push_begin`, stage, then `push_finish` races.
    Finish,
    /// `push_commit` (autocommit) races.
    Direct,
    /// `push_begin`, `append_commit`, then the applied `put_push_result` races.
    Classic,
}

/// `push_begin` of client `c1`'s key `ccid`: `None` when it begins the push, the stored result
/// when the key is a replay.
fn try_push_begin(c: &mut Client, ccid: &str) -> Result<Option<Value>, postgres::Error> {
    try_one(
        c,
        "SELECT syncular.push_begin($1, 'c1', $2, $3)",
        &[&P, &ccid, &V],
    )
}

/// What session B stores for `k1` in the race below.
#[derive(Clone, Copy, Debug)]
enum Stored {
    /// A rejection.
    Rejection,
    /// An applied result naming the `commit_seq` A is about to append (red team 32, F1: the
    /// next number is `max_commit_seq` + 1, which a host role can read), with a record of its own.
    ForgedApplied,
}

/// Session B stores a result for `k1` first, without the partition lock, and commits only once
/// session A's own result for `k1` waits for B's row. A has appended the commit of `k1` by then:
/// it must fail (the error undoes the append), not answer B's result as a replay with its commit
/// standing — whatever B's result says, even A's own `commit_seq`.
fn race(finisher: Finisher) {
    race_with(finisher, Stored::Rejection);
}

fn race_with(finisher: Finisher, stored_by_b: Stored) {
    let (db, mut a) = fixture(&format!("d8_race_{finisher:?}_{stored_by_b:?}"));
    let op = up(&mut a, "tasks", "t1", None, task("t1", "p1"));
    let mut b = db.connect();
    let mut observer = db.connect();
    let pid = backend_pid(&mut a);
    if let Finisher::Finish | Finisher::Classic = finisher {
        exec(&mut a, "BEGIN");
        assert_eq!(try_push_begin(&mut a, "k1").unwrap(), None);
    }
    if let Finisher::Finish = finisher {
        exec(&mut a, "SAVEPOINT syncular_push_candidate");
        let staged = try_push(&mut a, "k1", std::slice::from_ref(&op), stage_options("a"));
        assert_eq!(staged.unwrap()["outcome"], "staged");
    }
    exec(&mut b, "BEGIN");
    let document = match stored_by_b {
        Stored::Rejection => rejection("b"),
        Stored::ForgedApplied => {
            let next = one::<i64>(&mut b, "SELECT syncular.max_commit_seq($1)", &[&P]) + 1;
            json!({"status": "applied", "commitSeq": next, "results": [{"opIndex": 0,
                "status": "conflict", "code": "sync.version_conflict", "message": "forged",
                "serverVersion": 7}], "recordedAtMs": NOW, "cacheIdentity": "b"})
        }
    };
    let stored: Value = one(
        &mut b,
        "SELECT syncular.put_push_result($1, 'c1', 'k1', $2)",
        &[&P, &document],
    );
    assert_eq!(stored["cacheIdentity"], "b");
    let contested = thread::spawn(move || {
        let outcome = match finisher {
            Finisher::Finish => {
                try_one::<Value>(&mut a, "SELECT syncular.push_finish($1, 'c1', 'k1')", &[&P])
            }
            Finisher::Direct => try_push(&mut a, "k1", &[op], json!({"cacheIdentity": "a"})),
            Finisher::Classic => {
                let d = doc("k1", json!([chg("tasks", "t1")]), Some(V));
                let seq: i64 = one(&mut a, "SELECT syncular.append_commit($1, $2)", &[&P, &d]);
                try_one::<Value>(
                    &mut a,
                    "SELECT syncular.put_push_result($1, 'c1', 'k1', $2)",
                    &[&P, &applied(seq, 1, "a")],
                )
            }
        };
        (outcome.map_err(|e| sql_error(&e)), a)
    });
    wait_until_blocked(&mut observer, pid);
    exec(&mut b, "COMMIT");
    let (outcome, mut a) = contested.join().unwrap();
    let err = outcome.expect_err("the result of another session won: A's append must not stand");
    assert_eq!(
        (err.state.as_str(), err.detail),
        (
            "SY000",
            Some(json!({"argument": "client_commit_id", "reason": "range"}))
        ),
        "{finisher:?}"
    );
    assert!(err.hint.is_some_and(|h| h.contains("stored")));
    let _ = a.batch_execute("ROLLBACK");
    let (seqs, result) = commits_and_result(&mut observer, "k1");
    assert_eq!(seqs, Vec::<i64>::new(), "{finisher:?}");
    assert_eq!(result.unwrap()["cacheIdentity"], "b");
}

#[test]
fn d8_a_result_stored_by_another_session_undoes_a_finish() {
    race(Finisher::Finish);
}

#[test]
fn d8_a_result_stored_by_another_session_undoes_a_direct_push() {
    race(Finisher::Direct);
}

#[test]
fn d8_a_result_stored_by_another_session_undoes_a_classic_push() {
    race(Finisher::Classic);
}

#[test]
fn d8_an_applied_result_forged_by_another_session_undoes_every_kind_of_push() {
    for finisher in [Finisher::Finish, Finisher::Direct, Finisher::Classic] {
        race_with(finisher, Stored::ForgedApplied);
    }
}

/// Session B's result for `k1`, still being inserted, is waited for by A's push (its result's
/// insert, below SQL as `ON CONFLICT DO NOTHING` does it: docs/DESIGN.md §Push path); B rolls
/// back, and A's push applies with its own result, once.
#[test]
fn d8_a_result_another_session_rolls_back_leaves_the_key_to_the_push() {
    let (db, mut a) = fixture("d8_rolled_back_result");
    let op = up(&mut a, "tasks", "t1", None, task("t1", "p1"));
    let mut b = db.connect();
    let mut observer = db.connect();
    let pid = backend_pid(&mut a);
    exec(&mut b, "BEGIN");
    one::<Value>(
        &mut b,
        "SELECT syncular.put_push_result($1, 'c1', 'k1', $2)",
        &[&P, &rejection("b")],
    );
    let contested = thread::spawn(move || {
        let outcome = try_push(&mut a, "k1", &[op], json!({"cacheIdentity": "a"}));
        (outcome.map_err(|e| sql_error(&e)), a)
    });
    wait_until_blocked(&mut observer, pid);
    exec(&mut b, "ROLLBACK");
    let (outcome, _a) = contested.join().unwrap();
    let answer = outcome.expect("B's result is gone: the push applies");
    assert_eq!(
        (&answer["outcome"], &answer["replayed"]),
        (&json!("applied"), &json!(false))
    );
    let (seqs, result) = commits_and_result(&mut observer, "k1");
    assert_eq!(seqs.len(), 1);
    let result = result.unwrap();
    assert_eq!(
        (&result["cacheIdentity"], &result["commitSeq"]),
        (&json!("a"), &json!(seqs[0]))
    );
}

/// An applied result whose `commitSeq` is written `2.0` names commit 2 (`put_push_result`
/// validates it so): stored in the transaction that appended commit 2, it is accepted, not
/// refused as another transaction's (red team 32, F2).
#[test]
fn d8_an_applied_result_naming_its_commit_as_a_whole_float_is_stored() {
    let (_db, mut a) = fixture("d8_float_seq");
    append(&mut a, P, "tasks", "t0", Some(V));
    exec(&mut a, "BEGIN");
    assert_eq!(try_push_begin(&mut a, "k1").unwrap(), None);
    let d = doc("k1", json!([chg("tasks", "t1")]), Some(V));
    let seq: i64 = one(&mut a, "SELECT syncular.append_commit($1, $2)", &[&P, &d]);
    assert_eq!(seq, 2);
    let stored: Value = one(
        &mut a,
        "SELECT syncular.put_push_result($1, 'c1', 'k1', $2)",
        &[
            &P,
            &json!({"status": "applied", "commitSeq": 2.0, "results": [],
                      "recordedAtMs": NOW, "cacheIdentity": "a"}),
        ],
    );
    assert_eq!(stored["cacheIdentity"], "a");
    exec(&mut a, "COMMIT");
    let (seqs, result) = commits_and_result(&mut a, "k1");
    assert_eq!(
        (seqs, result.unwrap()["cacheIdentity"].clone()),
        (vec![2], json!("a"))
    );
}

/// The finish re-reads the stored result of its key under the lock, as `push_commit` does
/// (steps C1/C4): one committed meanwhile by another session makes it refuse before it appends.
#[test]
fn d8_push_finish_rechecks_the_stored_result_of_its_key() {
    let (db, mut a) = fixture("d8_recheck");
    let op = up(&mut a, "tasks", "t1", None, task("t1", "p1"));
    let mut b = db.connect();
    let max: i64 = one(&mut a, "SELECT syncular.max_commit_seq($1)", &[&P]);
    exec(&mut a, "BEGIN");
    exec(&mut a, "SAVEPOINT syncular_push_candidate");
    let staged = try_push(&mut a, "k1", &[op], stage_options("a"));
    assert_eq!(staged.unwrap()["outcome"], "staged");
    let stored: Value = one(
        &mut b,
        "SELECT syncular.put_push_result($1, 'c1', 'k1', $2)",
        &[&P, &rejection("b")],
    );
    assert_eq!(stored["status"], "rejected");
    let err = expect_error(
        try_one::<Value>(&mut a, "SELECT syncular.push_finish($1, 'c1', 'k1')", &[&P]),
        "SY000",
        "sync.storage.invalid_argument",
        Some(json!({"argument": "client_commit_id", "reason": "range"})),
    );
    assert!(err.hint.is_some_and(|h| h.contains("stored")));
    // The refusal came before the append: no number was taken.
    exec(&mut a, "ROLLBACK TO SAVEPOINT syncular_push_candidate");
    let now: i64 = one(&mut a, "SELECT syncular.max_commit_seq($1)", &[&P]);
    assert_eq!(now, max);
    exec(&mut a, "COMMIT");
    let (seqs, result) = commits_and_result(&mut a, "k1");
    assert_eq!(seqs, Vec::<i64>::new());
    assert_eq!(result.unwrap()["cacheIdentity"], "b");
}

// ---- the property test -------------------------------------------------------------------

/// Keys per case: enough for pushes of one key to meet those of another.
const KEYS: usize = 3;
const CASES: usize = 400;

#[derive(Clone, Copy, Debug)]
enum Action {
    /// `push_begin`, then `SAVEPOINT syncular_push_candidate` (the host protocol's opening).
    Begin(usize),
    /// `push_commit` with `onCommitHooks: "stage"` and a commit validator.
    Stage(usize),
    /// `push_commit` without hooks.
    Direct(usize),
    /// The classic accepted push: `push_begin`, `append_commit`, `put_push_result(applied)`.
    Classic(usize),
    Finish(usize),
    /// `put_push_result`, applied (`true`) or rejected.
    Result(usize, bool),
    RollbackToCandidate,
}

/// What the test knows of the transaction: the push `push_begin` began and the push staged
/// (their state follows savepoints as the extension's does, docs/API.md §8), and the same two
/// as they were when the candidate savepoint was set.
#[derive(Clone, Copy, Default, Debug)]
struct Model {
    begun: Option<usize>,
    staged: Option<usize>,
    candidate: Option<(Option<usize>, Option<usize>)>,
}

/// One transaction's actions. Keys are drawn at random, but most finishes and results name
/// the key the transaction last began or staged, so that pushes meet their own key often.
fn generate(rng: &mut Rng) -> Vec<Action> {
    let mut recent: Option<usize> = None;
    // `own`: the action opens a push of its own (push_begin, a stage), which later ones name.
    let mut k = |rng: &mut Rng, own: bool| match recent {
        Some(key) if rng.chance(75) => key,
        _ => {
            let key = rng.below(KEYS as u64) as usize;
            if own {
                recent = Some(key);
            }
            key
        }
    };
    let mut actions = Vec::new();
    if rng.chance(60) {
        actions.push(Action::Begin(k(rng, true)));
    }
    for _ in 0..1 + rng.below(6) {
        let action = match rng.below(100) {
            0..=29 => Action::Stage(k(rng, true)),
            30..=37 => Action::Direct(k(rng, false)),
            38..=45 => Action::Classic(k(rng, false)),
            46..=70 => Action::Finish(k(rng, false)),
            71..=84 => Action::Result(k(rng, false), rng.chance(40)),
            85..=92 => Action::RollbackToCandidate,
            _ => Action::Begin(k(rng, true)),
        };
        actions.push(action);
    }
    actions
}

/// The refusals an interleaving may meet: the guard's (docs/API.md §8) and a finish with
/// nothing staged. Anything else is a failure of the test.
fn expected_refusal(err: &SqlError) -> bool {
    let reason = |d: &Option<Value>| {
        d.as_ref()
            .map(|d| (d["argument"].clone(), d["reason"].clone()))
    };
    match err.state.as_str() {
        "SY004" => err.detail == Some(json!({"reason": "prior_writes"})),
        "SY000" => matches!(
            reason(&err.detail),
            Some((Value::String(a), Value::String(r)))
                if r == "range" && ["client_commit_id", "result.status", "result.commitSeq"].contains(&a.as_str())
        ),
        _ => false,
    }
}

struct Case<'a> {
    c: &'a mut Client,
    keys: Vec<String>,
    ops: Vec<Op>,
    model: Model,
    /// Refusals are caught by a savepoint around each call (a host that goes on after an
    /// error); otherwise the first one aborts the transaction.
    catching: bool,
    aborted: bool,
    /// Calls refused so far.
    refusals: usize,
}

impl Case<'_> {
    /// One call (or, for `Classic`, three) in the action savepoint when catching; `Ok(false)`:
    /// refused as expected.
    fn call(&mut self, body: impl FnOnce(&mut Client) -> Result<(), postgres::Error>) -> bool {
        if self.catching {
            exec(self.c, "SAVEPOINT act");
        }
        match body(self.c) {
            Ok(()) => {
                if self.catching {
                    exec(self.c, "RELEASE SAVEPOINT act");
                }
                true
            }
            Err(e) => {
                let err = sql_error(&e);
                assert!(expected_refusal(&err), "unexpected error {err:?}");
                self.refusals += 1;
                if self.catching {
                    exec(self.c, "ROLLBACK TO SAVEPOINT act");
                } else {
                    self.aborted = true;
                }
                false
            }
        }
    }

    fn run(&mut self, action: Action, rng: &mut Rng) {
        if self.aborted {
            return;
        }
        let key = |k: usize, keys: &[String]| keys[k].clone();
        match action {
            Action::Begin(k) => {
                let ccid = key(k, &self.keys);
                let mut begun = false;
                let ok = self.call(|c| {
                    let r = try_push_begin(c, &ccid)?;
                    begun = r.is_none();
                    Ok(())
                });
                if !ok {
                    return;
                }
                if begun {
                    self.model.begun = Some(k);
                }
                exec(self.c, "SAVEPOINT syncular_push_candidate");
                self.model.candidate = Some((self.model.begun, self.model.staged));
            }
            Action::Stage(k) | Action::Direct(k) => {
                let ccid = key(k, &self.keys);
                let op = self.ops[rng.below(self.ops.len() as u64) as usize].clone();
                let stage = matches!(action, Action::Stage(_));
                let options = if stage {
                    stage_options(&ccid)
                } else {
                    json!({"cacheIdentity": ccid})
                };
                let mut outcome = Value::Null;
                if self.call(|c| {
                    outcome = try_push(c, &ccid, &[op], options)?;
                    Ok(())
                }) && outcome["outcome"] == "staged"
                {
                    self.model.staged = Some(k);
                }
            }
            Action::Classic(k) => {
                let ccid = key(k, &self.keys);
                let mut begun = false;
                let ok = self.call(|c| {
                    let r = try_push_begin(c, &ccid)?;
                    if r.is_some() {
                        return Ok(()); // a replay: the host answers it
                    }
                    begun = true;
                    let d = doc(&ccid, json!([chg("tasks", "t1")]), Some(V));
                    let seq: i64 = try_one(c, "SELECT syncular.append_commit($1, $2)", &[&P, &d])?;
                    try_one::<Value>(
                        c,
                        "SELECT syncular.put_push_result($1, 'c1', $2, $3)",
                        &[&P, &ccid, &applied(seq, 1, &ccid)],
                    )?;
                    Ok(())
                });
                if ok && begun {
                    self.model.begun = Some(k);
                }
            }
            Action::Finish(k) => {
                let ccid = key(k, &self.keys);
                let mut outcome = Value::Null;
                if self.call(|c| {
                    outcome =
                        try_one(c, "SELECT syncular.push_finish($1, 'c1', $2)", &[&P, &ccid])?;
                    Ok(())
                }) {
                    assert_eq!(outcome["outcome"], "applied", "{outcome}");
                    self.model.staged = None;
                }
            }
            Action::Result(k, applied_wanted) => {
                let ccid = key(k, &self.keys);
                // An applied result with a commitSeq is checked only inside the push it
                // belongs to (docs/API.md §8: calls outside a push transaction are not
                // affected): elsewhere the test sends the rejection.
                let guarded = self.model.begun == Some(k) || self.model.staged == Some(k);
                let document = if applied_wanted && guarded {
                    let seq: Option<i64> = one(
                        self.c,
                        "SELECT max(commit_seq) FROM syncular.sync_commits
                          WHERE partition = $1 AND client_id = 'c1' AND client_commit_id = $2",
                        &[&P, &ccid],
                    );
                    let next: i64 = one(self.c, "SELECT syncular.max_commit_seq($1) + 1", &[&P]);
                    applied(seq.unwrap_or(next), 1, &ccid)
                } else {
                    rejection(&ccid)
                };
                self.call(|c| {
                    try_one::<Value>(
                        c,
                        "SELECT syncular.put_push_result($1, 'c1', $2, $3)",
                        &[&P, &ccid, &document],
                    )?;
                    Ok(())
                });
            }
            Action::RollbackToCandidate => {
                if let Some((begun, staged)) = self.model.candidate {
                    exec(self.c, "ROLLBACK TO SAVEPOINT syncular_push_candidate");
                    self.model.begun = begun;
                    self.model.staged = staged;
                }
            }
        }
    }
}

/// D8 for every key of the case, in committed state.
#[track_caller]
fn assert_d8(c: &mut Client, keys: &[String], history: &str) {
    for key in keys {
        let (seqs, result) = commits_and_result(c, key);
        match result {
            None => assert!(
                seqs.is_empty(),
                "{key}: commits {seqs:?} without a result\n{history}"
            ),
            Some(r) if r["status"] == "applied" => assert_eq!(
                seqs,
                vec![r["commitSeq"].as_i64().unwrap()],
                "{key}: applied result {r} against commits {seqs:?}\n{history}"
            ),
            Some(r) => assert!(
                seqs.is_empty(),
                "{key}: rejected result {r} against commits {seqs:?}\n{history}"
            ),
        }
    }
}

/// Generated transactions of stage, direct and classic pushes, finishes, results (applied and
/// rejected), rollbacks to the candidate savepoint, ROLLBACK and COMMIT over a few keys; D8 is
/// checked after every transaction.
#[test]
fn d8_holds_over_generated_interleavings() {
    let (_db, mut c) = fixture("d8_property");
    let ops: Vec<Op> = ["t1", "t2", "t3"]
        .iter()
        .map(|id| up(&mut c, "tasks", id, None, task(id, "p1")))
        .collect();
    let mut rng = Rng(0x5EED_D8D8_0025_0005);
    let mut refusals = 0;
    let mut finished = 0;
    let mut refused_commits = 0;
    for case in 0..CASES {
        let keys: Vec<String> = (0..KEYS).map(|k| format!("case{case}-k{k}")).collect();
        let mut history = String::new();
        for _ in 0..1 + rng.below(3) {
            let actions = generate(&mut rng);
            let catching = rng.chance(50);
            let commit = rng.chance(70);
            history.push_str(&format!(
                "BEGIN (catching {catching}) {actions:?} {}\n",
                if commit { "COMMIT" } else { "ROLLBACK" }
            ));
            exec(&mut c, "BEGIN");
            let mut tx = Case {
                c: &mut c,
                keys: keys.clone(),
                ops: ops.clone(),
                model: Model::default(),
                catching,
                aborted: false,
                refusals: 0,
            };
            for action in actions {
                let before = tx.model.staged;
                tx.run(action, &mut rng);
                if matches!(action, Action::Finish(_))
                    && before.is_some()
                    && tx.model.staged.is_none()
                {
                    finished += 1;
                }
            }
            refusals += tx.refusals;
            let stands = tx.model.staged.is_some() && !tx.aborted;
            if commit && stands {
                // A staged push neither finished nor rolled back: the commit is refused and
                // the transaction rolled back (docs/API.md push_finish).
                let err = c.batch_execute("COMMIT").expect_err(&history);
                assert_eq!(
                    sql_error(&err).detail,
                    Some(json!({"reason": "staged_push"})),
                    "{history}"
                );
                refused_commits += 1;
            } else {
                exec(&mut c, if commit { "COMMIT" } else { "ROLLBACK" });
            }
            assert_d8(&mut c, &keys, &history);
        }
    }
    eprintln!(
        "d8: {CASES} cases: {finished} finishes, {refusals} refusals, {refused_commits} commits of a staged push refused"
    );
    // The interleavings reached both ends: finishes that went through and refusals.
    assert!(
        finished > 50 && refusals > 100 && refused_commits > 10,
        "{finished} finishes, {refusals} refusals, {refused_commits} refused commits"
    );
}
