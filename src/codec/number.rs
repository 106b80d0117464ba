//! ECMAScript `Number::toString` and upstream's rendering of values to text (docs/CODEC.md
//! §Rendering): the text a primary key is compared with the row id by, and the text stored as a
//! scope value.

use super::{ColumnType, Value};

/// `String(n)` for a JavaScript number (ECMA-262 Number::toString, radix 10).
///
/// Rust's `{:e}` formatting yields the shortest digit string that round-trips, the same digits
/// ECMAScript's algorithm picks; only the layout around them differs, which is done here.
pub fn js_number_to_string(value: f64) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value == 0.0 {
        return "0".into(); // −0 too
    }
    if value.is_infinite() {
        return if value > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sign = if value < 0.0 { "-" } else { "" };
    let formatted = format!("{:e}", value.abs());
    let (mantissa, exponent) = formatted.split_once('e').unwrap_or((&formatted, "0"));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let exponent: i64 = exponent.parse().unwrap_or(0);
    let k = digits.len() as i64;
    // ECMA-262: the value is 0.d1d2…dk × 10^n.
    let n = exponent + 1;
    let body = if k <= n && n <= 21 {
        format!("{digits}{}", "0".repeat((n - k) as usize))
    } else if 0 < n && n <= 21 {
        let (int, frac) = digits.split_at(n as usize);
        format!("{int}.{frac}")
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat((-n) as usize))
    } else {
        let e = n - 1;
        let e_sign = if e < 0 { '-' } else { '+' };
        let (first, rest) = digits.split_at(1);
        if rest.is_empty() {
            format!("{first}e{e_sign}{}", e.abs())
        } else {
            format!("{first}.{rest}e{e_sign}{}", e.abs())
        }
    };
    format!("{sign}{body}")
}

/// upstream's `renderScopeValue`: `None` is *missing* (NULL, absent, bytes/crdt, and the empty
/// string); numbers as ECMAScript renders them; booleans as `true`/`false`.
pub fn render(ty: ColumnType, value: Option<&Value<'_>>) -> Option<String> {
    match value? {
        Value::Null | Value::Bytes(_) => None,
        Value::Text(t) if t.is_empty() => None,
        Value::Text(t) => Some(t.to_string()),
        // Safe integers render the same in Rust and JavaScript.
        Value::Int(i) => Some(i.to_string()),
        Value::Float(f) => Some(js_number_to_string(*f)),
        Value::Bool(b) => Some(b.to_string()),
    }
    .filter(|_| !ty.is_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    /// CD-07: the rendering table of docs/CODEC.md §Rendering.
    #[test]
    fn cd07_number_rendering() {
        for (value, text) in [
            (2.0, "2"),
            (0.1, "0.1"),
            (1e21, "1e+21"),
            (1e20, "100000000000000000000"),
            (123456789012345680000.0, "123456789012345680000"),
            (1e-7, "1e-7"),
            (1e-6, "0.000001"),
            (1.5e-7, "1.5e-7"),
            (-0.0, "0"),
            (0.0, "0"),
            (f64::NAN, "NaN"),
            (f64::INFINITY, "Infinity"),
            (f64::NEG_INFINITY, "-Infinity"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
            (-1.25, "-1.25"),
            (0.1 + 0.2, "0.30000000000000004"),
            (9007199254740991.0, "9007199254740991"),
            (1.2345e25, "1.2345e+25"),
            (100.0, "100"),
        ] {
            assert_eq!(js_number_to_string(value), text, "{value:e}");
        }
    }

    #[test]
    fn cd07_value_rendering() {
        let text = |s: &'static str| Value::Text(Cow::Borrowed(s));
        assert_eq!(
            render(ColumnType::String, Some(&text("p1"))),
            Some("p1".into())
        );
        assert_eq!(render(ColumnType::String, Some(&text(""))), None);
        assert_eq!(render(ColumnType::String, None), None);
        assert_eq!(render(ColumnType::String, Some(&Value::Null)), None);
        assert_eq!(
            render(ColumnType::Json, Some(&text("{}"))),
            Some("{}".into())
        );
        assert_eq!(
            render(ColumnType::Integer, Some(&Value::Int(-7))),
            Some("-7".into())
        );
        assert_eq!(
            render(ColumnType::Float, Some(&Value::Float(2.0))),
            Some("2".into())
        );
        assert_eq!(
            render(ColumnType::Float, Some(&Value::Float(-0.0))),
            Some("0".into())
        );
        assert_eq!(
            render(ColumnType::Boolean, Some(&Value::Bool(true))),
            Some("true".into())
        );
        assert_eq!(
            render(ColumnType::Boolean, Some(&Value::Bool(false))),
            Some("false".into())
        );
        let bytes = Value::Bytes(Cow::Borrowed(b"ab"));
        assert_eq!(render(ColumnType::Bytes, Some(&bytes)), None);
        assert_eq!(render(ColumnType::Crdt, Some(&bytes)), None);
    }
}
