//! How a tensor is split across ranks (docs/distributed.md §2): along dimension 0 into equal
//! shards of `ceil(rows / world)` rows, rank r owning rows `[r·s, min((r+1)·s, rows))` — the
//! last ranks may own fewer rows or none. Collectives exchange padded shards (every rank sends
//! `s` rows), since NCCL needs equal chunk sizes; padding rows are zero and never stored.

use std::ops::Range;

/// The split of one tensor of `rows` rows (dimension 0) over `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowSplit {
    pub rows: usize,
    pub world: usize,
}

impl RowSplit {
    pub fn new(rows: usize, world: usize) -> Self {
        assert!(world > 0, "a split needs at least one rank");
        Self { rows, world }
    }

    /// Rows per padded shard.
    pub fn shard_rows(&self) -> usize {
        self.rows.div_ceil(self.world)
    }

    /// The rows rank `r` owns (possibly empty).
    pub fn owned(&self, r: usize) -> Range<usize> {
        let s = self.shard_rows();
        let start = (r * s).min(self.rows);
        start..((r + 1) * s).min(self.rows)
    }

    /// The rank owning row `row`.
    pub fn owner(&self, row: usize) -> usize {
        row / self.shard_rows().max(1)
    }
}

/// The intersection of two row ranges (empty when they do not overlap).
pub fn overlap(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    let start = a.start.max(b.start);
    start..a.end.min(b.end).max(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_row_exactly_once() {
        for rows in [0usize, 1, 2, 7, 8, 9, 128, 151_936] {
            for world in 1..=9 {
                let split = RowSplit::new(rows, world);
                let mut next = 0;
                for r in 0..world {
                    let own = split.owned(r);
                    assert_eq!(own.start, next, "rows {rows} world {world} rank {r}");
                    assert!(own.len() <= split.shard_rows());
                    for row in own.clone() {
                        assert_eq!(split.owner(row), r);
                    }
                    next = own.end;
                }
                assert_eq!(next, rows);
            }
        }
        assert_eq!(RowSplit::new(7, 3).owned(2), 6..7);
        assert_eq!(RowSplit::new(2, 4).owned(3), 2..2);
        assert_eq!(overlap(&(0..5), &(3..9)), 3..5);
        assert!(overlap(&(0..3), &(5..9)).is_empty());
    }
}
