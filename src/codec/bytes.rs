//! The codec's primitives (docs/CODEC.md §Primitives): fixed-width little-endian, no varints.
//! Every failure carries upstream's message exactly.

use super::{CodecError, Result};

/// Largest integer a JavaScript number holds exactly: the `i64` contract is ±(2^53 − 1).
pub const MAX_SAFE: i64 = (1 << 53) - 1;

/// The UTF-8 encoding of U+FEFF, which upstream's `TextDecoder` removes from the start of every
/// decoded string (docs/CODEC.md §BOM).
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// A bounds-checked reader over one payload.
pub struct Reader<'a> {
    data: &'a [u8],
    position: usize,
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Reader<'a> {
        Reader { data, position: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.data.len() - self.position
    }

    /// The next `size` bytes, or `truncated input: needed <n> bytes, have <m>` (always the
    /// plural, as upstream writes it).
    pub fn take(&mut self, size: usize) -> Result<&'a [u8]> {
        let remaining = self.remaining();
        if remaining < size {
            return Err(CodecError(format!(
                "truncated input: needed {size} bytes, have {remaining}"
            )));
        }
        let start = self.position;
        self.position += size;
        Ok(&self.data[start..start + size])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// An `i64` within ±(2^53 − 1), else `i64 outside the safe-integer contract: <decimal>`.
    pub fn i64(&mut self) -> Result<i64> {
        let value = i64::from_le_bytes(self.array()?);
        if !(-MAX_SAFE..=MAX_SAFE).contains(&value) {
            return Err(CodecError(format!(
                "i64 outside the safe-integer contract: {value}"
            )));
        }
        Ok(value)
    }

    /// Any bit pattern (NaN payloads, ±Inf, −0, subnormals).
    pub fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_le_bytes(self.array()?))
    }

    /// `0x00` or `0x01`, else `invalid bool byte 0x<lowercase hex, no padding>`.
    pub fn bool(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            byte => Err(CodecError(format!("invalid bool byte 0x{byte:x}"))),
        }
    }

    /// `u32` length, then that many bytes.
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let length = self.u32()? as usize;
        self.take(length)
    }

    /// `u32` length, then strict UTF-8 (`invalid UTF-8 in string`), one leading U+FEFF removed.
    pub fn str(&mut self) -> Result<&'a str> {
        let raw = self.bytes()?;
        let text =
            std::str::from_utf8(raw).map_err(|_| CodecError::new("invalid UTF-8 in string"))?;
        Ok(strip_bom(text))
    }

    /// `trailing bytes after <what>` unless the payload is used up.
    pub fn expect_end(&self, what: &str) -> Result<()> {
        if self.remaining() != 0 {
            return Err(CodecError(format!("trailing bytes after {what}")));
        }
        Ok(())
    }
}

/// Removes one leading U+FEFF, as a WHATWG `TextDecoder` with `ignoreBOM: false` does.
pub fn strip_bom(text: &str) -> &str {
    if text.as_bytes().starts_with(BOM) {
        &text[BOM.len()..]
    } else {
        text
    }
}

/// An appending writer. Lengths above `u32` cannot be written (`u32 out of range: <n>`, as
/// upstream's writer refuses them); PostgreSQL values never get there.
pub struct Writer {
    pub out: Vec<u8>,
}

impl Writer {
    pub fn with_capacity(capacity: usize) -> Writer {
        Writer {
            out: Vec::with_capacity(capacity),
        }
    }

    /// [`Writer::with_capacity`] for a size that comes from the data (a stored row merged with a
    /// patch): the allocation may fail, and the call then ends in `53200` (`src/alloc.rs`).
    pub fn try_with_capacity(capacity: usize) -> Result<Writer> {
        Ok(Writer {
            out: crate::alloc::try_with_capacity(capacity)?,
        })
    }

    pub fn raw(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    pub fn u32(&mut self, value: usize) -> Result<()> {
        let value =
            u32::try_from(value).map_err(|_| CodecError(format!("u32 out of range: {value}")))?;
        self.raw(&value.to_le_bytes());
        Ok(())
    }

    /// Refuses values outside ±(2^53 − 1) with upstream's message.
    pub fn i64(&mut self, value: i64) -> Result<()> {
        if !(-MAX_SAFE..=MAX_SAFE).contains(&value) {
            return Err(CodecError(format!(
                "i64 outside the safe-integer contract: {value}"
            )));
        }
        self.raw(&value.to_le_bytes());
        Ok(())
    }

    /// Writes the float; NaN is canonicalized to `0x7FF8000000000000` (docs/CODEC.md §NaN).
    pub fn f64(&mut self, value: f64) {
        let value = if value.is_nan() { f64::NAN } else { value };
        self.raw(&value.to_bits().to_le_bytes());
    }

    pub fn bool(&mut self, value: bool) {
        self.out.push(u8::from(value));
    }

    pub fn bytes(&mut self, value: &[u8]) -> Result<()> {
        self.u32(value.len())?;
        self.raw(value);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_messages_use_the_plural() {
        let mut r = Reader::new(&[]);
        assert_eq!(
            r.u8().unwrap_err().0,
            "truncated input: needed 1 bytes, have 0"
        );
        let mut r = Reader::new(&[1, 0]);
        assert_eq!(
            r.str().unwrap_err().0,
            "truncated input: needed 4 bytes, have 2"
        );
        let mut r = Reader::new(&[3, 0, 0, 0, b'a', b'b']);
        assert_eq!(
            r.str().unwrap_err().0,
            "truncated input: needed 3 bytes, have 2"
        );
    }

    #[test]
    fn bool_and_i64_messages() {
        assert_eq!(
            Reader::new(&[2]).bool().unwrap_err().0,
            "invalid bool byte 0x2"
        );
        assert_eq!(
            Reader::new(&[0xff]).bool().unwrap_err().0,
            "invalid bool byte 0xff"
        );
        let big = (MAX_SAFE + 1).to_le_bytes();
        assert_eq!(
            Reader::new(&big).i64().unwrap_err().0,
            "i64 outside the safe-integer contract: 9007199254740992"
        );
        let low = (-MAX_SAFE - 1).to_le_bytes();
        assert_eq!(
            Reader::new(&low).i64().unwrap_err().0,
            "i64 outside the safe-integer contract: -9007199254740992"
        );
        assert_eq!(Reader::new(&MAX_SAFE.to_le_bytes()).i64(), Ok(MAX_SAFE));
        assert_eq!(Reader::new(&(-MAX_SAFE).to_le_bytes()).i64(), Ok(-MAX_SAFE));
    }

    #[test]
    fn strict_utf8_and_one_bom() {
        let s = |b: &[u8]| {
            let mut v = (b.len() as u32).to_le_bytes().to_vec();
            v.extend_from_slice(b);
            Reader::new(&v).str().map(str::to_string)
        };
        assert_eq!(s(b"\xEF\xBB\xBFa").unwrap(), "a");
        assert_eq!(s(b"\xEF\xBB\xBF\xEF\xBB\xBFa").unwrap(), "\u{FEFF}a");
        assert_eq!(s(b"\xEF\xBF\xBE").unwrap(), "\u{FFFE}"); // noncharacter accepted
        for bad in [
            &b"\xC0\x80"[..],    // overlong NUL
            b"\xED\xA0\x80",     // surrogate U+D800
            b"\xF4\x90\x80\x80", // above U+10FFFF
            b"\xFF",
            b"\xE2\x82", // cut sequence
        ] {
            assert_eq!(s(bad).unwrap_err().0, "invalid UTF-8 in string");
        }
    }

    #[test]
    fn nan_is_canonical_and_negative_zero_keeps_its_sign() {
        let mut w = Writer::with_capacity(16);
        w.f64(f64::from_bits(0x7FF0_0000_0000_0001));
        w.f64(-0.0);
        assert_eq!(
            w.out,
            [0, 0, 0, 0, 0, 0, 0xF8, 0x7F, 0, 0, 0, 0, 0, 0, 0, 0x80]
        );
    }
}
