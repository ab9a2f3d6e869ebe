//! A STREAM-like probe of this machine's memory bandwidth, for reading the speak benchmark's
//! GB/s figures against (docs/performance.md §2): reads a buffer far larger than the L3
//! (`--mib`, default 2048) and one that fits it (64 MiB), summing 64-bit words, on the rayon
//! pool (`RAYON_NUM_THREADS`); best of `--rounds` (5). Read-only, as matrix-vector products are.
//!
//!     cargo run --release --example bandwidth [-- --mib 2048 --rounds 5]
use std::time::Instant;

use rayon::prelude::*;

fn read_gbs(buf: &[u64], rounds: usize) -> f64 {
    let mut best = f64::INFINITY;
    let mut sink = 0u64;
    for _ in 0..rounds {
        let t = Instant::now();
        sink = sink.wrapping_add(
            buf.par_chunks(1 << 16)
                .map(|c| {
                    // Four independent sums so the loop is bound by loads, not by additions.
                    let mut s = [0u64; 4];
                    for w in c.chunks_exact(4) {
                        for i in 0..4 {
                            s[i] = s[i].wrapping_add(w[i]);
                        }
                    }
                    s.iter().fold(0u64, |a, b| a.wrapping_add(*b))
                })
                .reduce(|| 0, u64::wrapping_add),
        );
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    (buf.len() * 8) as f64 / best / 1e9
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str, default: usize| -> usize {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map_or(default, |v| v.parse().expect("a number"))
    };
    let (mib, rounds) = (get("--mib", 2048), get("--rounds", 5));
    let threads = rayon::current_num_threads();
    let big: Vec<u64> = (0..mib << 17).map(|i| i as u64).collect();
    let dram = read_gbs(&big, rounds);
    drop(big);
    let small: Vec<u64> = (0..64usize << 17).map(|i| i as u64).collect();
    let l3 = read_gbs(&small, rounds * 4);
    println!("{threads} thread(s): read {dram:.1} GB/s from memory ({mib} MiB), {l3:.1} GB/s from a 64 MiB buffer (L3)");
}
