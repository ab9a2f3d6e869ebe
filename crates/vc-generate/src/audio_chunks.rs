//! How many generated frames a streamed response decodes at once (docs/serving.md §4.1).
//!
//! A push of one frame through the stream decoder reads the early layers' weights for one
//! row each, so it costs two to three times the offline decoder's share of that frame on a CPU
//! (docs/performance.md §10.6); a push of 32 frames costs about the offline share. A stream
//! therefore sends its first frame alone, for the time to first audio, and then lets each
//! chunk grow to a quarter of the frames already sent, up to a cap: the audio already out
//! covers the wait for the next chunk while the stream runs faster than real time, and the
//! decoding it saves is what lets it. The samples are the same whatever the chunks are
//! (docs/serving.md §4); only when they leave changes.

/// The chunking of one streamed response (all its text chunks together: the client's buffer
/// does not restart between them).
#[derive(Debug, Clone)]
pub struct AudioChunks {
    sent: usize,
    most: usize,
}

/// Frames already sent per frame of the next chunk.
const GROWTH: usize = 4;

impl AudioChunks {
    /// Chunks of at most `most` frames (`speak.stream_chunk_frames`; 1: every frame as soon as
    /// it exists).
    pub fn new(most: usize) -> Self {
        AudioChunks {
            sent: 0,
            most: most.max(1),
        }
    }

    /// Frames the next chunk waits for (fewer only when the text chunk ends first).
    pub fn next_len(&self) -> usize {
        (self.sent / GROWTH).clamp(1, self.most)
    }

    /// Whether `waiting` generated frames make the next chunk.
    pub fn ready(&self, waiting: usize) -> bool {
        waiting >= self.next_len()
    }

    /// Records a chunk of `frames` frames as sent.
    pub fn sent(&mut self, frames: usize) {
        self.sent += frames;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunk lengths of a stream that decodes whenever a chunk is ready, for `frames`
    /// frames in all.
    fn lengths(most: usize, frames: usize) -> Vec<usize> {
        let mut c = AudioChunks::new(most);
        let (mut waiting, mut out) = (0, Vec::new());
        for f in 1..=frames {
            waiting += 1;
            if c.ready(waiting) || f == frames {
                out.push(waiting);
                c.sent(waiting);
                waiting = 0;
            }
        }
        out
    }

    #[test]
    fn the_first_frame_goes_alone_then_chunks_grow_to_the_cap() {
        let l = lengths(16, 200);
        assert_eq!(l.iter().sum::<usize>(), 200);
        assert_eq!(&l[..8], &[1; 8]);
        // Each chunk is at most a quarter of what was sent before it (at least one frame).
        let mut sent = 0;
        for &n in &l[..l.len() - 1] {
            assert!(n == 1 || n <= sent / 4, "{n} frames after {sent}: {l:?}");
            assert!(n <= 16);
            sent += n;
        }
        assert_eq!(l[l.len() - 2], 16, "the cap is reached: {l:?}");
        assert!(l.len() < 40, "{} chunks for 200 frames", l.len());
    }

    #[test]
    fn a_cap_of_one_sends_every_frame_alone() {
        assert_eq!(lengths(1, 30), vec![1; 30]);
    }
}
