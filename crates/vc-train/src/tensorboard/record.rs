//! TFRecord framing, the container of TensorBoard's event files (docs/training.md §9.1): each
//! record is its length (u64, little-endian), the masked CRC32C of those 8 bytes, the data and
//! the masked CRC32C of the data. CRC32C (Castagnoli) is our own table-driven loop: a crate
//! for 20 lines is not worth a dependency.

/// The reflected Castagnoli polynomial.
const POLY: u32 = 0x82f6_3b78;

const TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
};

pub fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |c, &b| {
        TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
}

/// TFRecord's masked CRC: rotated and offset, so that a CRC stored inside CRC'd data does not
/// cancel out.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// `data` framed as one record.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// The records of a file's bytes, up to the first one that is cut short or fails its
/// checksum (the tail of a killed run), and whether every byte was read.
pub fn records(mut bytes: &[u8]) -> (Vec<&[u8]>, bool) {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let Some(data) = next_record(&mut bytes) else {
            return (out, false);
        };
        out.push(data);
    }
    (out, true)
}

fn next_record<'a>(bytes: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len_bytes = bytes.get(..8)?;
    let crc = u32::from_le_bytes(bytes.get(8..12)?.try_into().ok()?);
    if crc != masked_crc32c(len_bytes) {
        return None;
    }
    let len = usize::try_from(u64::from_le_bytes(len_bytes.try_into().ok()?)).ok()?;
    let end = 12usize.checked_add(len)?;
    let data = bytes.get(12..end)?;
    let crc = u32::from_le_bytes(bytes.get(end..end.checked_add(4)?)?.try_into().ok()?);
    if crc != masked_crc32c(data) {
        return None;
    }
    *bytes = &bytes[end + 4..];
    Some(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_of_the_check_string() {
        // The check value of CRC-32C (RFC 3720, iSCSI): "123456789" → 0xE3069283.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        // RFC 3720 B.4: 32 bytes of zeros → 0x8A9136AA.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
    }

    #[test]
    fn framed_records_read_back_and_a_damaged_tail_stops_the_reading() {
        let payloads: Vec<Vec<u8>> = vec![b"brain.Event:2".to_vec(), vec![], vec![7u8; 1000]];
        let file: Vec<u8> = payloads.iter().flat_map(|p| frame(p)).collect();
        assert_eq!(
            file.len(),
            payloads.iter().map(|p| p.len() + 16).sum::<usize>()
        );
        let (read, whole) = records(&file);
        assert!(whole);
        assert_eq!(read, payloads.iter().map(|p| &p[..]).collect::<Vec<_>>());
        // Cut inside the last record: the first two are read, the tail is not.
        let (read, whole) = records(&file[..file.len() - 3]);
        assert!(!whole);
        assert_eq!(read.len(), 2);
        // A flipped byte in the last record's data fails its checksum.
        let mut damaged = file.clone();
        let at = damaged.len() - 10;
        damaged[at] ^= 1;
        assert_eq!(records(&damaged), (read.clone(), false));
        // A damaged length is caught by its own checksum before it is trusted.
        let mut damaged = file.clone();
        damaged[29 + 3] ^= 0x40;
        assert_eq!(records(&damaged).0.len(), 1);
    }
}
