//! Exact duplicate recordings: two sources whose decoded audio is identical, sample for sample
//! at the same rate, are one take (a copy, a re-export with other metadata, the same samples in
//! another container or bit depth). Training on both would weigh that take twice, so prep uses
//! the first (in path order) and names both in a warning.
//!
//! The decoded samples are compared, not the file bytes: a copy whose tags, header chunks or
//! container differ is the same recording, and the samples are decoded anyway, so hashing them
//! costs one pass. A lossy re-encode decodes to other samples and is not an exact duplicate.

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};

use super::records::SourceRecord;
use super::sources::{hex, SourceFile};

/// The digest of decoded audio: its sample rate and every sample's bits.
pub fn audio_digest(samples: &[f32], sample_rate: u32) -> String {
    let mut h = Sha256::new();
    h.update(sample_rate.to_le_bytes());
    h.update((samples.len() as u64).to_le_bytes());
    for s in samples {
        h.update(s.to_bits().to_le_bytes());
    }
    hex(&h.finalize()[..16])
}

/// Every source whose audio an earlier source (in `records`' order) already has, with that
/// earlier source.
pub fn find(records: &BTreeMap<SourceFile, SourceRecord>) -> BTreeMap<SourceFile, SourceFile> {
    let mut first: HashMap<&str, &SourceFile> = HashMap::new();
    let mut duplicates = BTreeMap::new();
    for (file, record) in records {
        if record.audio_sha256.is_empty() {
            continue;
        }
        match first.get(record.audio_sha256.as_str()) {
            Some(original) => {
                duplicates.insert(file.clone(), (*original).clone());
            }
            None => {
                first.insert(&record.audio_sha256, file);
            }
        }
    }
    duplicates
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_is_of_the_samples_and_their_rate() {
        let x = [0.0, 0.5, -0.25];
        assert_eq!(audio_digest(&x, 16_000), audio_digest(&x.clone(), 16_000));
        assert_ne!(audio_digest(&x, 16_000), audio_digest(&x, 24_000));
        assert_ne!(
            audio_digest(&x, 16_000),
            audio_digest(&[0.0, 0.5, -0.5], 16_000)
        );
        assert_ne!(audio_digest(&x, 16_000), audio_digest(&x[..2], 16_000));
    }
}
