//! JSON validation with ECMAScript `JSON.parse`'s grammar, and the BlobRef shape check
//! (docs/CODEC.md §JSON, §BlobRef).
//!
//! Upstream validates json and blob_ref values with `JSON.parse`, which accepts lone surrogate
//! escapes (`"\ud800"`), numbers of any magnitude (`1e400`), duplicate keys and any nesting
//! depth. serde_json differs on two of these (lone surrogates, a depth limit of 128), so this is
//! a small validator of its own: iterative, with one byte of stack per open container, so no
//! input can overflow the thread's stack and memory stays below the input's size.

use super::{CodecError, Result};

/// Whether `text` is a JSON text `JSON.parse` accepts.
pub fn parses(text: &str) -> bool {
    let mut s = Scanner::new(text);
    s.value() && {
        s.ws();
        s.at_end()
    }
}

struct Scanner<'a> {
    text: &'a str,
    i: usize,
}

impl<'a> Scanner<'a> {
    fn new(text: &'a str) -> Scanner<'a> {
        Scanner { text, i: 0 }
    }

    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.i).copied()
    }

    fn at_end(&self) -> bool {
        self.i >= self.text.len()
    }

    fn eat(&mut self, byte: u8) -> bool {
        if self.peek() == Some(byte) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    /// JSON whitespace: space, tab, LF, CR (not every Unicode space, unlike JS source).
    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            crate::interrupts::check();
            self.i += 1;
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            crate::interrupts::check();
            self.i += 1;
        }
        self.i - start
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`; returns its text.
    fn number(&mut self) -> Option<&'a str> {
        let start = self.i;
        self.eat(b'-');
        match self.peek() {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return None,
        }
        if self.eat(b'.') && self.digits() == 0 {
            return None;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if !self.eat(b'+') {
                self.eat(b'-');
            }
            if self.digits() == 0 {
                return None;
            }
        }
        Some(&self.text[start..self.i])
    }

    fn literal(&mut self, word: &str) -> bool {
        if self.text.as_bytes()[self.i..].starts_with(word.as_bytes()) {
            self.i += word.len();
            true
        } else {
            false
        }
    }

    /// A string starting at `"`; with `out`, its value as UTF-16 code units (lone surrogates
    /// kept, as JavaScript strings keep them).
    fn string(&mut self, mut out: Option<&mut Vec<u16>>) -> bool {
        if !self.eat(b'"') {
            return false;
        }
        loop {
            crate::interrupts::check();
            let Some(byte) = self.peek() else {
                return false;
            };
            match byte {
                b'"' => {
                    self.i += 1;
                    return true;
                }
                b'\\' => {
                    self.i += 1;
                    let unit = match self.peek() {
                        Some(b'"') => u16::from(b'"'),
                        Some(b'\\') => u16::from(b'\\'),
                        Some(b'/') => u16::from(b'/'),
                        Some(b'b') => 0x08,
                        Some(b'f') => 0x0C,
                        Some(b'n') => 0x0A,
                        Some(b'r') => 0x0D,
                        Some(b't') => 0x09,
                        Some(b'u') => {
                            let hex = self.text.get(self.i + 1..self.i + 5);
                            match hex.and_then(|h| {
                                h.bytes()
                                    .all(|c| c.is_ascii_hexdigit())
                                    .then(|| u16::from_str_radix(h, 16).ok())
                                    .flatten()
                            }) {
                                Some(unit) => {
                                    self.i += 4;
                                    unit
                                }
                                None => return false,
                            }
                        }
                        _ => return false,
                    };
                    self.i += 1;
                    if let Some(out) = out.as_deref_mut() {
                        out.push(unit);
                    }
                }
                0x00..=0x1F => return false,
                _ => match out.as_deref_mut() {
                    // Multi-byte UTF-8 never contains `"`, `\` or a control byte, so without an
                    // output the bytes are skipped one by one.
                    None => self.i += 1,
                    Some(out) => {
                        let Some(c) = self.text[self.i..].chars().next() else {
                            return false;
                        };
                        let mut buffer = [0u16; 2];
                        out.extend_from_slice(c.encode_utf16(&mut buffer));
                        self.i += c.len_utf8();
                    }
                },
            }
        }
    }

    /// `ws "key" ws :`
    fn key(&mut self, out: Option<&mut Vec<u16>>) -> bool {
        self.ws();
        if !self.string(out) {
            return false;
        }
        self.ws();
        self.eat(b':')
    }

    /// One complete value (leading whitespace allowed), without recursion: `stack` holds one
    /// entry per open container (`true` = object).
    fn value(&mut self) -> bool {
        let mut stack = Stack::default();
        'value: loop {
            crate::interrupts::check();
            self.ws();
            match self.peek() {
                Some(b'{') => {
                    self.i += 1;
                    self.ws();
                    if !self.eat(b'}') {
                        stack.push(true);
                        if !self.key(None) {
                            return false;
                        }
                        continue 'value;
                    }
                }
                Some(b'[') => {
                    self.i += 1;
                    self.ws();
                    if !self.eat(b']') {
                        stack.push(false);
                        continue 'value;
                    }
                }
                Some(b'"') => {
                    if !self.string(None) {
                        return false;
                    }
                }
                Some(b'-' | b'0'..=b'9') => {
                    if self.number().is_none() {
                        return false;
                    }
                }
                Some(b't') if self.literal("true") => {}
                Some(b'f') if self.literal("false") => {}
                Some(b'n') if self.literal("null") => {}
                _ => return false,
            }
            // After a complete value: close containers or move to the next element.
            loop {
                crate::interrupts::check();
                self.ws();
                let Some(object) = stack.last() else {
                    return true;
                };
                match self.peek() {
                    Some(b',') => {
                        self.i += 1;
                        if object && !self.key(None) {
                            return false;
                        }
                        continue 'value;
                    }
                    Some(b'}') if object => {
                        self.i += 1;
                        stack.pop();
                    }
                    Some(b']') if !object => {
                        self.i += 1;
                        stack.pop();
                    }
                    _ => return false,
                }
            }
        }
    }
}

/// The open containers of [`Scanner::value`] (`true` = object): the first 64 levels in a
/// word, deeper ones in a vector, so ordinary documents validate without allocating.
#[derive(Default)]
struct Stack {
    bits: u64,
    depth: usize,
    deeper: Vec<bool>,
}

impl Stack {
    fn push(&mut self, object: bool) {
        if self.depth < 64 {
            self.bits = (self.bits & !(1 << self.depth)) | (u64::from(object) << self.depth);
        } else {
            self.deeper.push(object);
        }
        self.depth += 1;
    }

    fn last(&self) -> Option<bool> {
        match self.depth {
            0 => None,
            d if d <= 64 => Some((self.bits >> (d - 1)) & 1 == 1),
            _ => self.deeper.last().copied(),
        }
    }

    fn pop(&mut self) {
        if self.depth > 64 {
            self.deeper.pop();
        }
        self.depth = self.depth.saturating_sub(1);
    }
}

/// `JSON.stringify` of a JavaScript string given as UTF-16 code units (ES2019 well-formed
/// stringify: lone surrogates become `\udxxx`).
pub fn stringify_utf16(units: &[u16]) -> String {
    let mut out = String::with_capacity(units.len() + 2);
    out.push('"');
    for decoded in char::decode_utf16(units.iter().copied()) {
        crate::interrupts::check();
        match decoded {
            Ok('"') => out.push_str("\\\""),
            Ok('\\') => out.push_str("\\\\"),
            Ok('\u{08}') => out.push_str("\\b"),
            Ok('\u{0C}') => out.push_str("\\f"),
            Ok('\n') => out.push_str("\\n"),
            Ok('\r') => out.push_str("\\r"),
            Ok('\t') => out.push_str("\\t"),
            Ok(c) if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            Ok(c) => out.push(c),
            Err(lone) => out.push_str(&format!("\\u{:04x}", lone.unpaired_surrogate())),
        }
    }
    out.push('"');
    out
}

const CANONICAL_KEYS: [&str; 4] = ["blobId", "byteLength", "mediaType", "name"];

/// The top-level value of a canonical key, as far as the shape check needs it.
enum Member {
    Text(Vec<u16>),
    Number(f64),
    Other,
}

/// A canonical array index (`"0"`, `"17"`, up to 2^32 − 2): JavaScript lists such keys first.
fn array_index(key: &[u16]) -> Option<u64> {
    let digits = key
        .iter()
        .all(|&u| (u16::from(b'0')..=u16::from(b'9')).contains(&u));
    if !digits || key.is_empty() || key.len() > 10 || (key.len() > 1 && key[0] == u16::from(b'0')) {
        return None;
    }
    let value = key
        .iter()
        .fold(0u64, |acc, &u| acc * 10 + u64::from(u - u16::from(b'0')));
    (value <= 4_294_967_294).then_some(value)
}

fn utf16(text: &str) -> Vec<u16> {
    text.encode_utf16().collect()
}

fn blob_error(message: &str) -> CodecError {
    CodecError(format!("{message} (§5.9.1)"))
}

/// upstream's `parseBlobRef` checks, in its order, with JavaScript object semantics: duplicate
/// keys keep the last value at the first position; `Object.keys` lists array-index keys first.
pub fn check_blob_ref(raw: &str) -> Result<()> {
    blob_ref_id(raw).map(drop)
}

/// [`check_blob_ref`], returning the checked `blobId` (the push's blob references, step U11 of
/// docs/CODEC.md's push rules).
pub fn blob_ref_id(raw: &str) -> Result<String> {
    let not_json = || blob_error("blob_ref value does not parse as a JSON document");
    if !parses(raw) {
        return Err(not_json());
    }
    let mut s = Scanner::new(raw);
    s.ws();
    if !s.eat(b'{') {
        return Err(blob_error("blob_ref value must be a JSON object"));
    }
    // Per canonical key: position of its first occurrence and its last value.
    let mut canonical: [Option<(usize, Member)>; 4] = [None, None, None, None];
    let mut first_unknown: Option<Vec<u16>> = None;
    let mut smallest_index: Option<(u64, Vec<u16>)> = None;
    let names: Vec<Vec<u16>> = CANONICAL_KEYS.iter().map(|k| utf16(k)).collect();
    s.ws();
    let mut position = 0;
    if !s.eat(b'}') {
        loop {
            crate::interrupts::check();
            let mut key = Vec::new();
            if !s.key(Some(&mut key)) {
                return Err(not_json());
            }
            s.ws();
            match names.iter().position(|n| *n == key) {
                Some(k) => {
                    let member = match s.peek() {
                        Some(b'"') => {
                            let mut text = Vec::new();
                            if !s.string(Some(&mut text)) {
                                return Err(not_json());
                            }
                            Member::Text(text)
                        }
                        Some(b'-' | b'0'..=b'9') => match s.number() {
                            // The grammar checked above is a subset of Rust's float syntax;
                            // out-of-range magnitudes become ±inf, as in JavaScript.
                            Some(text) => Member::Number(text.parse().unwrap_or(f64::NAN)),
                            None => return Err(not_json()),
                        },
                        _ => {
                            if !s.value() {
                                return Err(not_json());
                            }
                            Member::Other
                        }
                    };
                    let first = canonical[k].as_ref().map_or(position, |(p, _)| *p);
                    canonical[k] = Some((first, member));
                }
                None => {
                    if !s.value() {
                        return Err(not_json());
                    }
                    match array_index(&key) {
                        Some(index) => {
                            if smallest_index.as_ref().is_none_or(|(i, _)| index < *i) {
                                smallest_index = Some((index, key));
                            }
                        }
                        None => {
                            if first_unknown.is_none() {
                                first_unknown = Some(key);
                            }
                        }
                    }
                }
            }
            position += 1;
            s.ws();
            if s.eat(b',') {
                continue;
            }
            if s.eat(b'}') {
                break;
            }
            return Err(not_json());
        }
    }
    if let Some(key) = smallest_index.map(|(_, k)| k).or(first_unknown) {
        return Err(CodecError(format!(
            "blob_ref has unknown key {} (§5.9.1)",
            stringify_utf16(&key)
        )));
    }
    let [blob_id, byte_length, media_type, name] = &canonical;
    let is_blob_id = |units: &[u16]| {
        let prefix = utf16("sha256:");
        units.len() == prefix.len() + 64
            && units.starts_with(&prefix)
            && units[prefix.len()..]
                .iter()
                .all(|&u| matches!(u, 0x30..=0x39 | 0x61..=0x66))
    };
    if !matches!(blob_id, Some((_, Member::Text(t))) if is_blob_id(t)) {
        return Err(blob_error("blob_ref.blobId must be \"sha256:<64 hex>\""));
    }
    let safe = |f: f64| f.is_finite() && f.trunc() == f && f.abs() <= 9_007_199_254_740_991.0;
    if !matches!(byte_length, Some((_, Member::Number(f))) if safe(*f) && *f >= 0.0) {
        return Err(blob_error(
            "blob_ref.byteLength must be a non-negative safe integer",
        ));
    }
    if matches!(media_type, Some((_, member)) if !matches!(member, Member::Text(_))) {
        return Err(blob_error(
            "blob_ref.mediaType must be a string when present",
        ));
    }
    if matches!(name, Some((_, member)) if !matches!(member, Member::Text(_))) {
        return Err(blob_error("blob_ref.name must be a string when present"));
    }
    let firsts: Vec<usize> = canonical.iter().flatten().map(|(p, _)| *p).collect();
    if firsts.windows(2).any(|w| w[0] > w[1]) {
        return Err(blob_error("blob_ref keys are not in canonical order"));
    }
    match blob_id {
        // Checked above: `sha256:` and 64 lowercase hex digits, so ASCII.
        Some((_, Member::Text(units))) => Ok(String::from_utf16_lossy(units)),
        _ => Err(blob_error("blob_ref.blobId must be \"sha256:<64 hex>\"")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CD-04: what `JSON.parse` accepts and rejects.
    #[test]
    fn cd04_json_parse_grammar() {
        for ok in [
            r#"{}"#,
            r#"[]"#,
            r#" {"a": [1, 2.5, -0, 1e400, 1E-2, true, false, null]} "#,
            r#""\ud800""#,
            r#""\udc00\ud800x""#,
            r#"1e400"#,
            r#"{"a":1,"a":2}"#,
            "\t\r\n0\n",
            r#""\u2028 é 😀 \/""#,
            "\"\u{7f}\"",
        ] {
            assert!(parses(ok), "{ok}");
        }
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert!(parses(&deep));
        let deep_objects = r#"{"a":"#.repeat(100_000) + "1" + &"}".repeat(100_000);
        assert!(parses(&deep_objects));
        for bad in [
            "",
            " ",
            "[1,]",
            r#"{"a":1,}"#,
            "NaN",
            "Infinity",
            "'a'",
            "{'a':1}",
            "\"a\u{1}\"",
            "\"a\nb\"",
            "01",
            "1.",
            ".5",
            "+1",
            "1e",
            "-",
            r#""\x""#,
            r#""\u12""#,
            r#""\u12G4""#,
            "[1] [2]",
            "tru",
            "nul",
            "{\"a\"}",
            "{1:2}",
            "[",
            "]",
            "\u{FEFF}{}",
            "\u{A0}1",
        ] {
            assert!(!parses(bad), "{bad:?}");
        }
        let unclosed = "[".repeat(100_000);
        assert!(!parses(&unclosed));
    }

    fn blob(raw: &str) -> std::result::Result<(), String> {
        check_blob_ref(raw).map_err(|e| e.0)
    }

    const ID: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    /// CD-05: each BlobRef failure, in upstream's order, with JavaScript object semantics.
    #[test]
    fn cd05_blob_ref_shape() {
        assert_eq!(
            blob(&format!(r#"{{"blobId":"{ID}","byteLength":3}}"#)),
            Ok(())
        );
        assert_eq!(
            blob(&format!(
                r#" {{ "blobId" : "{ID}", "byteLength": 1.0, "mediaType": "text/plain", "name": "a.txt" }} "#
            )),
            Ok(())
        );
        for ok_length in ["-0", "1e3", "0", "9007199254740991"] {
            assert_eq!(
                blob(&format!(r#"{{"blobId":"{ID}","byteLength":{ok_length}}}"#)),
                Ok(()),
                "{ok_length}"
            );
        }
        let not_json = "blob_ref value does not parse as a JSON document (§5.9.1)";
        let not_object = "blob_ref value must be a JSON object (§5.9.1)";
        let bad_id = "blob_ref.blobId must be \"sha256:<64 hex>\" (§5.9.1)";
        let bad_length = "blob_ref.byteLength must be a non-negative safe integer (§5.9.1)";
        let order = "blob_ref keys are not in canonical order (§5.9.1)";
        assert_eq!(blob("{"), Err(not_json.into()));
        assert_eq!(blob(""), Err(not_json.into()));
        for not in ["[]", "null", "1", "\"x\""] {
            assert_eq!(blob(not), Err(not_object.into()));
        }
        assert_eq!(blob("{}"), Err(bad_id.into()));
        assert_eq!(
            blob(r#"{"z":1,"1":2,"blobId":3}"#),
            Err("blob_ref has unknown key \"1\" (§5.9.1)".into())
        );
        assert_eq!(
            blob(r#"{"z":1,"10":2,"2":3}"#),
            Err("blob_ref has unknown key \"2\" (§5.9.1)".into())
        );
        assert_eq!(
            blob(r#"{"blobId":1,"z\n\"":1,"y":2}"#),
            Err("blob_ref has unknown key \"z\\n\\\"\" (§5.9.1)".into())
        );
        assert_eq!(
            blob(r#"{"\ud800":1}"#),
            Err("blob_ref has unknown key \"\\ud800\" (§5.9.1)".into())
        );
        // "01" and 2^32 - 1 are not array indices: insertion order.
        assert_eq!(
            blob(r#"{"x":1,"01":2,"4294967295":3}"#),
            Err("blob_ref has unknown key \"x\" (§5.9.1)".into())
        );
        assert_eq!(
            blob(r#"{"x":1,"4294967294":2}"#),
            Err("blob_ref has unknown key \"4294967294\" (§5.9.1)".into())
        );
        assert_eq!(blob(r#"{"blobId":"sha256:AB"}"#), Err(bad_id.into()));
        let upper = ID.to_uppercase().replace("SHA256", "sha256");
        assert_eq!(
            blob(&format!(r#"{{"blobId":"{upper}","byteLength":1}}"#)),
            Err(bad_id.into())
        );
        // An escaped key is the same key.
        assert_eq!(
            blob(&format!(r#"{{"blob\u0049d":"{ID}","byteLength":1}}"#)),
            Ok(())
        );
        for bad in ["-1", "1.5", "9007199254740992", "\"1\"", "null", "1e400"] {
            assert_eq!(
                blob(&format!(r#"{{"blobId":"{ID}","byteLength":{bad}}}"#)),
                Err(bad_length.into()),
                "{bad}"
            );
        }
        assert_eq!(
            blob(&format!(r#"{{"blobId":"{ID}"}}"#)),
            Err(bad_length.into())
        );
        assert_eq!(
            blob(&format!(
                r#"{{"blobId":"{ID}","byteLength":1,"mediaType":null}}"#
            )),
            Err("blob_ref.mediaType must be a string when present (§5.9.1)".into())
        );
        assert_eq!(
            blob(&format!(
                r#"{{"blobId":"{ID}","byteLength":1,"name":{{}}}}"#
            )),
            Err("blob_ref.name must be a string when present (§5.9.1)".into())
        );
        assert_eq!(
            blob(&format!(r#"{{"byteLength":1,"blobId":"{ID}"}}"#)),
            Err(order.into())
        );
        assert_eq!(
            blob(&format!(r#"{{"blobId":"{ID}","name":"n","byteLength":1}}"#)),
            Err(order.into())
        );
        // Duplicates: the last value counts, at the first position.
        assert_eq!(
            blob(&format!(r#"{{"blobId":1,"byteLength":1,"blobId":"{ID}"}}"#)),
            Ok(())
        );
        assert_eq!(
            blob(&format!(r#"{{"blobId":"{ID}","byteLength":1,"blobId":2}}"#)),
            Err(bad_id.into())
        );
        assert_eq!(
            blob(&format!(
                r#"{{"byteLength":1,"blobId":"{ID}","byteLength":2}}"#
            )),
            Err(order.into())
        );
    }

    #[test]
    fn stringify_escapes_like_javascript() {
        let units: Vec<u16> = "a\"\\\u{1}\u{1f}\u{7f}\u{2028}😀".encode_utf16().collect();
        assert_eq!(
            stringify_utf16(&units),
            "\"a\\\"\\\\\\u0001\\u001f\u{7f}\u{2028}😀\""
        );
    }
}
