//! Time of one `q8` product `x (m, k) · wᵀ` for the code predictor's shapes at 1–8 activation
//! rows, in milliseconds per call: what batching rows costs in the kernel
//! (docs/performance.md §10.1). The products cycle through 24 matrices (about 80 MB for the
//! default shape), as a frame cycles through the code predictor's layers: the weights come from
//! the last-level cache or memory, never from a core's own cache.
//!
//!     cargo run --release --example q8_micro [N K] [CALLS]

use std::time::Instant;

use vc_kernels::q8::{Q8Matrix, Q8Rows};

fn main() {
    // As a frame runs its products: from a worker of the rayon pool.
    vc_kernels::pool::on_pool(run)
}

fn run() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("arguments are numbers"))
        .collect();
    let (n, k) = (
        args.first().copied().unwrap_or(3072),
        args.get(1).copied().unwrap_or(1024),
    );
    let calls = args.get(2).copied().unwrap_or(2000);
    // A fixed pseudo-random matrix: the timing does not depend on the values.
    let mut seed = 0x9e37_79b9_u32;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed as f32 / u32::MAX as f32 - 0.5
    };
    let mats: Vec<Q8Matrix> = (0..24)
        .map(|_| {
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            Q8Matrix::from_f32(&w, n, k).expect("matrix")
        })
        .collect();
    println!(
        "24 × ({n}, {k}) weights, {:.1} MB each, {calls} calls each",
        mats[0].bytes() as f64 / 1e6
    );
    for m in [1, 2, 4, 8] {
        let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
        let rows = Q8Rows::quantize(&x, m, k).expect("rows");
        let mut out = vec![0f32; m * n];
        for c in 0..calls / 10 {
            mats[c % mats.len()].matmul_t(&rows, &mut out);
        }
        let t = Instant::now();
        for c in 0..calls {
            mats[c % mats.len()].matmul_t(&rows, &mut out);
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / calls as f64;
        println!(
            "m = {m}: {ms:.4} ms per call, {:.3} ms per row",
            ms / m as f64
        );
    }
}
