//! The protobuf wire format by hand, for the three messages of TensorBoard's event files
//! (`Event`, `Summary`, `Summary.Value` with its `Audio`; docs/training.md §9.1): a builder
//! that writes fields in the order given, and a reader of one message's fields. A protobuf
//! library would bring a code generator or a schema compiler for a few dozen lines.

use anyhow::{bail, Result};

/// The wire types used here (protobuf's encoding guide numbers them so).
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

/// One message, its fields encoded in the order they are added. Every field given is written,
/// even a zero: `simple_value` and `audio` sit in a `oneof`, where a value left out would leave
/// the `Value` empty.
#[derive(Debug, Default, Clone)]
pub struct Message(Vec<u8>);

impl Message {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn double(mut self, field: u32, v: f64) -> Self {
        self.key(field, FIXED64);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn float(mut self, field: u32, v: f32) -> Self {
        self.key(field, FIXED32);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// An `int64` field (a negative value as its ten-byte two's complement, as protobuf does).
    pub fn int64(mut self, field: u32, v: i64) -> Self {
        self.key(field, VARINT);
        put_varint(&mut self.0, v as u64);
        self
    }

    /// A `bytes`, `string` or embedded-message field.
    pub fn bytes(mut self, field: u32, v: &[u8]) -> Self {
        self.key(field, LEN);
        put_varint(&mut self.0, v.len() as u64);
        self.0.extend_from_slice(v);
        self
    }

    pub fn string(self, field: u32, v: &str) -> Self {
        self.bytes(field, v.as_bytes())
    }

    pub fn message(self, field: u32, m: &Message) -> Self {
        self.bytes(field, &m.0)
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }

    fn key(&mut self, field: u32, wire: u8) {
        put_varint(&mut self.0, (u64::from(field) << 3) | u64::from(wire));
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A field's payload as the wire carries it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Wire<'a> {
    Varint(u64),
    Fixed64(u64),
    Len(&'a [u8]),
    Fixed32(u32),
}

/// The fields of one encoded message, `(number, payload)` in the order they were written; an
/// error where the bytes are not a message.
pub fn fields(mut buf: &[u8]) -> Result<Vec<(u32, Wire<'_>)>> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let key = take_varint(&mut buf)?;
        let field = u32::try_from(key >> 3).map_err(|_| anyhow::anyhow!("field number {key}"))?;
        let wire = match (key & 7) as u8 {
            VARINT => Wire::Varint(take_varint(&mut buf)?),
            FIXED64 => Wire::Fixed64(u64::from_le_bytes(take(&mut buf, 8)?.try_into()?)),
            LEN => {
                let n = usize::try_from(take_varint(&mut buf)?)?;
                Wire::Len(take(&mut buf, n)?)
            }
            FIXED32 => Wire::Fixed32(u32::from_le_bytes(take(&mut buf, 4)?.try_into()?)),
            other => bail!("unsupported wire type {other} (field {field})"),
        };
        out.push((field, wire));
    }
    Ok(out)
}

fn take<'a>(buf: &mut &'a [u8], n: usize) -> Result<&'a [u8]> {
    if buf.len() < n {
        bail!("a field runs past the end of its message");
    }
    let (head, rest) = buf.split_at(n);
    *buf = rest;
    Ok(head)
}

fn take_varint(buf: &mut &[u8]) -> Result<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let [b, rest @ ..] = *buf else {
            bail!("a varint runs past the end of its message");
        };
        *buf = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    bail!("a varint longer than ten bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_match_the_encoding_guide() {
        // The protobuf encoding guide's examples: 1 → 01, 150 → 96 01; a negative int64 takes
        // ten bytes.
        let m = Message::new().int64(1, 1).int64(2, 150).into_bytes();
        assert_eq!(m, [0x08, 0x01, 0x10, 0x96, 0x01]);
        let neg = Message::new().int64(1, -1).into_bytes();
        assert_eq!(neg.len(), 1 + 10);
        assert_eq!(fields(&neg).unwrap(), [(1, Wire::Varint(u64::MAX))]);
    }

    #[test]
    fn every_field_reads_back() {
        let inner = Message::new().string(1, "train/loss").float(2, 0.0);
        let m = Message::new()
            .double(1, 1.5e9)
            .int64(2, 300)
            .message(5, &inner)
            .bytes(4, &[0xff; 200])
            .into_bytes();
        let f = fields(&m).unwrap();
        assert_eq!(f[0], (1, Wire::Fixed64(1.5e9f64.to_bits())));
        assert_eq!(f[1], (2, Wire::Varint(300)));
        let Wire::Len(body) = f[2].1 else {
            panic!("{f:?}")
        };
        assert_eq!(
            fields(body).unwrap(),
            [
                (1, Wire::Len(b"train/loss")),
                (2, Wire::Fixed32(0f32.to_bits()))
            ]
        );
        assert_eq!(f[3], (4, Wire::Len(&[0xff; 200])));
        // Cut anywhere inside, the message is refused, not misread.
        for cut in 1..m.len() {
            let prefix = &m[..cut];
            if let Ok(f) = fields(prefix) {
                // Only a cut between two fields reads.
                assert!(f.len() < 4, "cut {cut}");
            }
        }
    }
}
