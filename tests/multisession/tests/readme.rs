//! The SQL session README.md opens with, so the first thing a reader pastes cannot rot: the
//! `sql` block after the marker below is run statement by statement, as psql sends it (each
//! statement on its own, autocommit unless the block says `BEGIN`), in a database without the
//! extension, and every `-- → ` line of the block must be what the statement before it returned:
//! one line per row, its columns joined by ` | `. The push and the pull must carry such lines, so
//! the session is checked to push a row and pull it back.

use postgres::{Client, SimpleQueryMessage};
use syncular_multisession::*;

/// The comment in README.md that the tested block follows.
const MARKER: &str = "<!-- tested: tests/multisession/tests/readme.rs";
/// A comment line holding the expected output of the statement that ended before it.
const OUTPUT: &str = "-- → ";

/// One statement of the session and the output lines the README shows for it.
#[derive(Debug)]
struct Statement {
    sql: String,
    expected: Vec<String>,
}

/// The first ```sql block after `MARKER` in README.md.
fn readme_session() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
    let readme = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let at = readme
        .find(MARKER)
        .unwrap_or_else(|| panic!("README.md lost the marker {MARKER:?}"));
    let rest = &readme[at..];
    let start = rest
        .find("```sql\n")
        .expect("a ```sql block after the marker")
        + "```sql\n".len();
    let end = rest[start..]
        .find("\n```")
        .expect("the sql block after the marker ends");
    rest[start..start + end].to_string()
}

/// Splits `sql` into statements at each `;` outside quotes and comments, as psql does, and
/// attaches every `-- → ` comment to the statement that ended before it. Dollar quoting is not
/// understood here: the session has none, and this keeps it that way.
fn statements(sql: &str) -> Vec<Statement> {
    assert!(
        !sql.contains('$'),
        "the README session uses `$` (dollar quoting or a parameter): split it by hand here first"
    );
    let mut out: Vec<Statement> = Vec::new();
    let mut current = String::new();
    let mut chars = sql.chars().peekable();
    let mut quote: Option<char> = None;
    while let Some(ch) = chars.next() {
        match quote {
            Some(q) => {
                current.push(ch);
                if ch == q {
                    quote = None; // a doubled quote reopens at once: same text either way
                }
            }
            None if ch == '\'' || ch == '"' => {
                quote = Some(ch);
                current.push(ch);
            }
            None if ch == '-' && chars.peek() == Some(&'-') => {
                let mut comment = String::from("-");
                while let Some(&next) = chars.peek() {
                    if next == '\n' {
                        break;
                    }
                    comment.push(next);
                    chars.next();
                }
                if let Some(expected) = comment.strip_prefix(OUTPUT) {
                    assert!(
                        current.trim().is_empty(),
                        "an output line inside a statement: {current}"
                    );
                    out.last_mut()
                        .expect("an output line before any statement")
                        .expected
                        .push(expected.trim_end().to_string());
                }
            }
            None if ch == ';' => {
                out.push(Statement {
                    sql: current.trim().to_string(),
                    expected: Vec::new(),
                });
                current.clear();
            }
            None => current.push(ch),
        }
    }
    assert!(quote.is_none(), "an unclosed quote in the README session");
    assert!(
        current.trim().is_empty(),
        "the README session ends without `;`: {current}"
    );
    out
}

/// The rows of one statement as psql prints them in a line each: text columns joined by ` | `
/// (NULL as the empty string, as psql shows it).
fn run(c: &mut Client, sql: &str) -> Vec<String> {
    let messages = c
        .simple_query(sql)
        .unwrap_or_else(|e| panic!("README session, statement\n{sql}\nfailed: {e:?}"));
    messages
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(
                (0..row.len())
                    .map(|i| row.get(i).unwrap_or(""))
                    .collect::<Vec<_>>()
                    .join(" | "),
            ),
            _ => None,
        })
        .collect()
}

#[test]
fn the_readme_session_pushes_a_row_and_pulls_it_back() {
    // A database as a reader's scratch database looks: no extension, no schema `syncular`.
    let db = TestDb::new("readme");
    let mut c = db.connect();
    exec(
        &mut c,
        "DROP EXTENSION syncular CASCADE; DROP SCHEMA syncular CASCADE",
    );
    let session = statements(&readme_session());
    for call in ["syncular.push_commit(", "syncular.pull("] {
        let shown = session
            .iter()
            .find(|s| s.sql.contains(call))
            .unwrap_or_else(|| panic!("the README session has no {call}…) statement"));
        assert!(
            !shown.expected.is_empty(),
            "the README session shows no output (`{OUTPUT}…`) for its {call}…) statement"
        );
    }
    for statement in &session {
        let rows = run(&mut c, &statement.sql);
        if !statement.expected.is_empty() {
            assert_eq!(
                rows, statement.expected,
                "README session, what\n{}\nreturned",
                statement.sql
            );
        }
    }
}

#[test]
fn the_splitter_keeps_quoted_semicolons_and_attaches_outputs() {
    let split = statements(
        "SELECT 'a;b', \"x;y\"; -- a remark\n-- → a;b | 1\nBEGIN;  -- → on the same line\nCOMMIT;\n",
    );
    let sql: Vec<&str> = split.iter().map(|s| s.sql.as_str()).collect();
    assert_eq!(sql, ["SELECT 'a;b', \"x;y\"", "BEGIN", "COMMIT"]);
    assert_eq!(split[0].expected, ["a;b | 1"]);
    assert_eq!(split[1].expected, ["on the same line"]);
    assert!(split[2].expected.is_empty());
}
