//! Which 4-bit block format the `q4` precision uses (docs/performance.md §2.6): `q8` and the two
//! 4-bit candidates of `vc_kernels::q4` — symmetric (one f16 scale per 32 weights, 4.5 bits per
//! weight) and offset (scale and minimum, 5 bits) — side by side on
//!
//! - **error**: `‖y_q − y‖ / ‖y‖` of products `y = x · Wᵀ` against the f64 product of the f32
//!   operands, with 4 activation rows quantized as in generation, on synthetic matrices (Gaussian
//!   rows of varying scale, and the same with 1 weight in 200 an outlier 8× larger) and on every
//!   matrix of a model directory (default: the tiny test fixture), random activation rows;
//! - **speed**: one product at 1 and 4 activation rows on 24 matrices of the code predictor's
//!   `(3072, 1024)` shape in turn (as `examples/q8_micro`), on every path this CPU offers
//!   (`VOICECLONE_ISA` narrows them), milliseconds per call (the best of 3 rounds) and the
//!   weight bytes read per second.
//!
//!     cargo run --release --example q4_formats [MODEL_DIR]
use std::time::Instant;

use anyhow::Result;
use vc_core::hub::ModelSource;
use vc_kernels::isa::{Isa, IsaCap};
use vc_kernels::q4::{Q4Kind, Q4Matrix};
use vc_kernels::q8::{Q8Matrix, Q8Rows};
use vc_model::files::ModelFiles;
use vc_model::infer::RowTalker;
use vc_model::linear::WeightFormat;
use vc_model::weights::MappedWeights;

/// A format under comparison, quantized from f32.
enum Quantized {
    Q8(Q8Matrix),
    Q4(Q4Matrix),
}

const FORMATS: [&str; 3] = ["q8", "q4 symmetric", "q4 offset"];

impl Quantized {
    fn new(format: usize, w: &[f32], n: usize, k: usize) -> Self {
        match format {
            0 => Quantized::Q8(Q8Matrix::from_f32(w, n, k).expect("shape")),
            1 => Quantized::Q4(Q4Matrix::from_f32(w, n, k, Q4Kind::Symmetric).expect("shape")),
            _ => Quantized::Q4(Q4Matrix::from_f32(w, n, k, Q4Kind::Offset).expect("shape")),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Quantized::Q8(q) => q.bytes(),
            Quantized::Q4(q) => q.bytes(),
        }
    }

    fn matmul_t_with(&self, isa: Isa, x: &Q8Rows, out: &mut [f32]) {
        match self {
            Quantized::Q8(q) => q.matmul_t_with(isa, x, out),
            Quantized::Q4(q) => q.matmul_t_with(isa, x, out),
        }
    }
}

/// Deterministic uniform and normal values.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}

/// Processor seconds this process has used (user and system, from `/proc/self/stat`).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<f64> = rest
        .split(' ')
        .skip(11)
        .take(2)
        .map(|v| v.parse().expect("clock ticks"))
        .collect();
    // The kernel's clock ticks are 1/100 s on Linux (USER_HZ).
    (f[0] + f[1]) / 100.0
}

/// `‖y_q − y‖ / ‖y‖` of `x (m, k) · Wᵀ` in `format` against the f64 product.
fn product_error(format: usize, w: &[f32], n: usize, k: usize, x: &[f32], m: usize) -> f64 {
    let q = Quantized::new(format, w, n, k);
    let rows = Q8Rows::quantize(x, m, k).expect("shape");
    let mut got = vec![0f32; m * n];
    q.matmul_t_with(Isa::detected(), &rows, &mut got);
    let (mut num, mut den) = (0f64, 0f64);
    for i in 0..m {
        for r in 0..n {
            let y: f64 = (0..k)
                .map(|c| w[r * k + c] as f64 * x[i * k + c] as f64)
                .sum();
            num += (got[i * n + r] as f64 - y).powi(2);
            den += y * y;
        }
    }
    (num / den.max(1e-300)).sqrt()
}

fn main() -> Result<()> {
    if let Err(e) = IsaCap::from_env() {
        anyhow::bail!(e);
    }
    let dir = std::env::args().nth(1).unwrap_or_else(|| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-0b6").to_string()
    });
    // As a frame runs its products: from a worker of the rayon pool.
    vc_kernels::pool::on_pool(|| run(&dir))
}

fn run(dir: &str) -> Result<()> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    println!("relative error of products (4 activation rows):");
    println!(
        "| weights | {} |",
        FORMATS.map(|f| format!("`{f}`")).join(" | ")
    );
    println!("|---|---|---|---|");
    let (n, k, m) = (256, 1024, 4);
    let x: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
    let gaussian: Vec<f32> = (0..n)
        .flat_map(|_| {
            // Rows of different scales, as layers' rows are.
            let s = (0.02 * (4.0 * rng.uniform()).exp()) as f32;
            (0..k).map(|_| rng.normal() * s).collect::<Vec<_>>()
        })
        .collect();
    let outliers: Vec<f32> = gaussian
        .iter()
        .map(|v| if rng.uniform() < 0.005 { v * 8.0 } else { *v })
        .collect();
    let mut quant_rates = Vec::new();
    for f in 0..FORMATS.len() {
        // Processor time, not wall time: the figure then holds on a busy machine.
        let (t, mut times) = (cpu_seconds(), 0);
        while cpu_seconds() - t < 1.0 {
            std::hint::black_box(Quantized::new(f, &gaussian, n, k));
            times += 1;
        }
        quant_rates.push(times as f64 * (n * k) as f64 / (cpu_seconds() - t) / 1e6);
    }
    for (what, w) in [
        ("Gaussian rows (256 × 1024)", &gaussian),
        ("the same, 0.5 % outliers × 8", &outliers),
    ] {
        let errs: Vec<String> = (0..FORMATS.len())
            .map(|f| format!("{:.4}", product_error(f, w, n, k, &x, m)))
            .collect();
        println!("| {what} | {} |", errs.join(" | "));
    }
    println!(
        "| quantizing, M weights per second of one core | {} |",
        quant_rates
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    let files = ModelFiles::resolve(&ModelSource::Local(dir.into()))?;
    let mapped = MappedWeights::open(&files.checkpoint.shards)?;
    let model = RowTalker::load(&mapped, &files.config, WeightFormat::F32)?;
    let mut sums = [0f64; 3];
    let mut count = 0;
    for (name, wl) in model.matrices() {
        let (n, k) = wl.dims();
        let w = mapped.f32(&name, &[n, k])?;
        let x: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
        for (f, s) in sums.iter_mut().enumerate() {
            *s += product_error(f, &w, n, k, &x, m);
        }
        count += 1;
    }
    println!(
        "| {dir}: mean over its {count} matrices | {} |",
        sums.map(|s| format!("{:.4}", s / count as f64)).join(" | ")
    );

    let (n, k) = (3072, 1024);
    let w: Vec<f32> = (0..n * k).map(|_| rng.normal() * 0.02).collect();
    println!(
        "\nspeed: 24 × ({n}, {k}) in turn, {} threads; ms per call (best of 3) and weight GB/s",
        rayon::current_num_threads()
    );
    println!(
        "| path | rows | {} |",
        FORMATS.map(|f| format!("`{f}`")).join(" | ")
    );
    println!("|---|---|---|---|---|");
    let sets: Vec<Vec<Quantized>> = (0..FORMATS.len())
        .map(|f| {
            (0..24)
                .map(|i| {
                    // Different matrices (a shifted copy), so none stays in a core's cache.
                    let mut v = w.clone();
                    v.rotate_left(i * 4099);
                    Quantized::new(f, &v, n, k)
                })
                .collect()
        })
        .collect();
    let mut paths = Isa::testable();
    // Sets that take the same integer path (AVX-512 without VNNI takes AVX2's) are measured once.
    let mut seen = Vec::new();
    paths.retain(|isa| {
        let new = !seen.contains(&isa.q4_path());
        seen.push(isa.q4_path());
        new
    });
    for isa in paths {
        for m in [1, 4] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
            let rows = Q8Rows::quantize(&x, m, k).expect("shape");
            let mut out = vec![0f32; m * n];
            let mut cells = Vec::new();
            for set in &sets {
                let mut best = f64::MAX;
                for _ in 0..3 {
                    let (mut calls, t) = (0usize, Instant::now());
                    while t.elapsed().as_secs_f64() < 0.25 {
                        set[calls % set.len()].matmul_t_with(isa, &rows, &mut out);
                        calls += 1;
                    }
                    best = best.min(t.elapsed().as_secs_f64() * 1e3 / calls as f64);
                }
                let gbs = set[0].bytes() as f64 / (best * 1e-3) / 1e9;
                cells.push(format!("{best:.4} ms, {gbs:.1} GB/s"));
            }
            println!("| {} | {m} | {} |", isa.q4_path(), cells.join(" | "));
        }
    }
    Ok(())
}
