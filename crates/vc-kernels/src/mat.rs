//! Bounds-checked matrix views over slices.
//!
//! A view borrows the slice it reads or writes, so the borrow checker keeps it from outliving
//! its storage or aliasing a mutable view; the constructors check once that every element the
//! view can address lies inside the slice, so the GEMM wrapper ([`super::gemm`]) can hand the
//! pointers to the `gemm` crate without further checks.

/// A read-only `rows × cols` matrix: element `(i, j)` is `data[i·rs + j·cs]` (any strides,
/// including 0 and the transposed `rs = 1`).
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

/// Index one past the last element a `rows × cols` view with strides `rs`, `cs` addresses
/// (0 for an empty view); panics on overflow.
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        return 0;
    }
    (rows - 1)
        .checked_mul(rs)
        .and_then(|r| (cols - 1).checked_mul(cs).and_then(|c| r.checked_add(c)))
        .and_then(|last| last.checked_add(1))
        .expect("matrix view extent overflows usize")
}

/// The check of both views' dense constructors: `len` values are exactly `rows·cols`.
fn check_dense(len: usize, rows: usize, cols: usize) {
    assert_eq!(
        Some(len),
        rows.checked_mul(cols),
        "matrix view: {len} values for {rows}×{cols}"
    );
}

impl<'a> MatRef<'a> {
    /// `rows` contiguous rows of `cols` values: `data` must hold exactly `rows·cols` values.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        check_dense(data.len(), rows, cols);
        Self {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// A view with row stride `rs` and column stride `cs`; every addressed element must lie
    /// in `data` (checked).
    pub fn strided(data: &'a [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        let end = extent(rows, cols, rs, cs);
        assert!(
            end <= data.len(),
            "matrix view {rows}×{cols} (strides {rs}, {cs}) needs {end} values, slice has {}",
            data.len()
        );
        Self {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn row_stride(&self) -> usize {
        self.rs
    }

    pub fn col_stride(&self) -> usize {
        self.cs
    }

    /// Columns `a..b` (no copy).
    pub fn cols_range(self, a: usize, b: usize) -> Self {
        assert!(
            a <= b && b <= self.cols,
            "columns {a}..{b} of {}",
            self.cols
        );
        let at = if a < b && self.rows > 0 {
            a * self.cs
        } else {
            0
        };
        Self::strided(&self.data[at..], self.rows, b - a, self.rs, self.cs)
    }

    /// Rows `a..b` (no copy).
    pub fn rows_range(self, a: usize, b: usize) -> Self {
        self.t().cols_range(a, b).t()
    }

    /// Element `(i, j)`.
    pub fn get(&self, i: usize, j: usize) -> f32 {
        assert!(
            i < self.rows && j < self.cols,
            "({i}, {j}) outside the view"
        );
        self.data[i * self.rs + j * self.cs]
    }

    /// The backing slice, from the first element on (the view reads at most
    /// [`Self::rows`]`·rs` of it).
    pub(super) fn data(&self) -> &'a [f32] {
        self.data
    }
}

/// A mutable `rows × cols` matrix with contiguous rows: element `(i, j)` is `data[i·rs + j]`,
/// `rs ≥ cols` so rows never overlap.
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    rs: usize,
}

impl<'a> MatMut<'a> {
    /// `rows` contiguous rows of `cols` values: `data` must hold exactly `rows·cols` values.
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        check_dense(data.len(), rows, cols);
        Self {
            data,
            rows,
            cols,
            rs: cols,
        }
    }

    /// A view with row stride `rs ≥ cols` (checked, as is the extent).
    pub fn strided(data: &'a mut [f32], rows: usize, cols: usize, rs: usize) -> Self {
        assert!(
            rows <= 1 || cols <= rs,
            "mutable matrix view: rows of {cols} values overlap at stride {rs}"
        );
        let end = extent(rows, cols, rs, 1);
        assert!(
            end <= data.len(),
            "matrix view {rows}×{cols} (row stride {rs}) needs {end} values, slice has {}",
            data.len()
        );
        Self {
            data,
            rows,
            cols,
            rs,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn row_stride(&self) -> usize {
        self.rs
    }

    /// Row `i`.
    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        assert!(i < self.rows, "row {i} outside the view");
        &mut self.data[i * self.rs..i * self.rs + self.cols]
    }

    /// A shorter-lived view of the same elements.
    pub fn rb_mut(&mut self) -> MatMut<'_> {
        MatMut {
            data: self.data,
            rows: self.rows,
            cols: self.cols,
            rs: self.rs,
        }
    }

    /// The same elements, read-only.
    pub fn as_ref(&self) -> MatRef<'_> {
        MatRef::strided(self.data, self.rows, self.cols, self.rs, 1)
    }

    /// The backing slice and the row stride, for the GEMM wrapper.
    pub(super) fn data_mut(&mut self) -> &mut [f32] {
        self.data
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_address_the_right_elements() {
        let v: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let a = MatRef::new(&v, 3, 4);
        assert_eq!(a.get(2, 1), 9.0);
        let t = a.t();
        assert_eq!((t.rows(), t.cols()), (4, 3));
        assert_eq!(t.get(1, 2), 9.0);
        // Every second column of rows 0..2, starting at column 1.
        let s = MatRef::strided(&v[1..], 2, 2, 4, 2);
        assert_eq!([s.get(0, 0), s.get(0, 1), s.get(1, 1)], [1.0, 3.0, 7.0]);
        // Stride 0 repeats a row.
        let b = MatRef::strided(&v[..4], 5, 4, 0, 1);
        assert_eq!(b.get(4, 3), 3.0);
        let empty = MatRef::strided(&[], 0, 7, 100, 1);
        assert_eq!(empty.rows(), 0);

        let mut w = [0f32; 10];
        let mut m = MatMut::strided(&mut w[1..], 3, 2, 3);
        m.row_mut(2)[1] = 5.0;
        assert_eq!(m.as_ref().get(2, 1), 5.0);
        assert_eq!(w[8], 5.0);
    }

    #[test]
    #[should_panic(expected = "needs 12 values")]
    fn out_of_bounds_views_are_refused() {
        let v = vec![0f32; 11];
        MatRef::strided(&v, 3, 4, 4, 1);
    }

    #[test]
    #[should_panic(expected = "overlap")]
    fn overlapping_mutable_rows_are_refused() {
        let mut v = vec![0f32; 16];
        MatMut::strided(&mut v, 3, 4, 2);
    }

    #[test]
    #[should_panic(expected = "values for 2×3")]
    fn contiguous_views_need_the_exact_length() {
        let v = vec![0f32; 7];
        MatRef::new(&v, 2, 3);
    }
}
