//! CPU benchmark of the Rust codec, the counterpart of `scripts/reference/bench_codec.py --bench`
//! (same inputs, same protocol, same JSON line). Run through `scripts/bench/codec.sh`.
//!
//! ```text
//! cargo run --release --example bench_codec -- --codec DIR --audio WAV [--seconds 60] [--stream [--push N] [--streams S]]
//! ```
//! Loads the codec in DIR (a `speech_tokenizer/` directory or a model directory; not timed),
//! reads WAV at 24 kHz, loops it to `--seconds`, warms up with an encode + decode of the first
//! 2 s, then times `encode` of the whole input and `decode` of its codes (chunked, 300 + 25
//! frames), and with `--stream` the same codes through `serve`'s streaming decoder one frame at a
//! time (`--push N`: N frames per push; `--streams S`: S streams of the same codes decoded
//! together, one push of each per step, as `serve` decodes its open streams; several times the
//! decode's time, so not by default), checking that every stream's samples equal the decode's
//! bit for bit. Prints `{"encode_seconds",
//! "decode_seconds", "audio_seconds", "frames"}` (and `"stream_decode_seconds"`) on stdout;
//! diagnostics go to stderr. `RAYON_NUM_THREADS` sets the threads (default: every core).
//!
//! `--parity REF` instead compares with official outputs written by `scripts/bench/codec.sh`:
//! `REF/codes.i64` (frames × 16, little-endian) of the first `REF/samples` samples of WAV and
//! `REF/wav.f32` (their decode). Prints `{"frames", "codes_differing", "wav_max_abs_diff"}`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use vc_model::codec::Codec;

/// User + system CPU time of this process (Linux; NaN elsewhere).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let tick = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    match (tick(11), tick(12)) {
        // utime and stime, in clock ticks (100 per second on Linux).
        (Some(u), Some(s)) => (u + s) / 100.0,
        _ => f64::NAN,
    }
}

fn main() -> Result<()> {
    let mut codec_dir = None;
    let mut audio = None;
    let mut seconds = 60.0f64;
    let mut parity = None;
    let mut stream_too = false;
    let mut push = 1usize;
    let mut streams = 1usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--codec" => codec_dir = Some(PathBuf::from(value()?)),
            "--audio" => audio = Some(PathBuf::from(value()?)),
            "--seconds" => seconds = value()?.parse().context("--seconds")?,
            "--parity" => parity = Some(PathBuf::from(value()?)),
            "--stream" => stream_too = true,
            "--push" => push = value()?.parse().context("--push")?,
            "--streams" => streams = value()?.parse().context("--streams")?,
            other => {
                bail!("unknown argument {other} (expected --codec DIR --audio WAV [--seconds S] [--stream [--push N] [--streams S]])")
            }
        }
    }
    let codec_dir = codec_dir.context("--codec DIR is required")?;
    if push == 0 || streams == 0 {
        bail!("--push and --streams need at least 1");
    }
    // The crate's memory-reuse policy, as the `voiceclone` binary applies it.
    vc_kernels::alloc::keep_freed_memory();
    let audio = audio.context("--audio WAV is required")?;

    let t = Instant::now();
    let codec = Codec::load_dir(&codec_dir)?;
    let load_s = t.elapsed().as_secs_f64();
    let sr = codec.sample_rate();
    let wav = vc_audio::load_mono(&audio, sr)?;
    if wav.is_empty() {
        bail!("{} has no samples", audio.display());
    }
    if let Some(dir) = parity {
        return check_parity(&codec, &wav, &dir);
    }
    let n = (seconds * sr as f64).round() as usize;
    let full: Vec<f32> = wav.iter().copied().cycle().take(n).collect();

    let warm = codec.encode(&full[..(2 * sr as usize).min(n)])?;
    codec.decode(&warm)?;

    let c0 = cpu_seconds();
    let t0 = Instant::now();
    let codes = codec.encode(&full)?;
    let t1 = Instant::now();
    let c1 = cpu_seconds();
    let out = codec.decode(&codes)?;
    let t2 = Instant::now();
    let c2 = cpu_seconds();
    // The streaming decoder of `serve`, one frame at a time as its decode workers push them
    // while generation keeps up with them (`--push N`: N at a time).
    let stream_dec = if stream_too {
        let t = Instant::now();
        use vc_model::codec::StreamDecoder;
        let mut decoders: Vec<StreamDecoder<'_>> = (0..streams)
            .map(|_| StreamDecoder::new(codec.decoder()))
            .collect();
        let mut streamed = vec![Vec::with_capacity(out.len()); streams];
        for group in codes.chunks(push) {
            let mut jobs: Vec<(&mut StreamDecoder<'_>, &[Vec<u32>])> =
                decoders.iter_mut().map(|d| (d, group)).collect();
            for (s, w) in streamed
                .iter_mut()
                .zip(StreamDecoder::push_many(&mut jobs)?)
            {
                s.extend(w);
            }
        }
        // The streaming decoder gives the offline samples bit for bit (docs/model.md §9.5).
        for s in &streamed {
            if s.len() != out.len() {
                bail!(
                    "the streaming decoder gave {} samples, the decoder {}",
                    s.len(),
                    out.len()
                );
            }
            let differing = s
                .iter()
                .zip(&out)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            if differing > 0 {
                bail!("{differing} streamed samples differ from the offline decode");
            }
        }
        Some(t.elapsed().as_secs_f64())
    } else {
        None
    };

    let frames = codes.len();
    if frames != n.div_ceil(codec.samples_per_frame()) || out.len() != frames * 1920 {
        bail!("unexpected output: {frames} frames, {} samples", out.len());
    }
    let enc = (t1 - t0).as_secs_f64();
    let dec = (t2 - t1).as_secs_f64();
    let audio_s = n as f64 / sr as f64;
    let rms = (out.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / out.len() as f64).sqrt();
    eprintln!(
        "threads={} load {load_s:.1} s; input={n} samples ({audio_s:.2} s) frames={frames} output={} samples \
         rms={rms:.3} finite={}; encode {:.2}x real time, decode {:.2}x real time{}; process CPU seconds encode {:.1}, \
         decode {:.1}",
        vc_kernels::conv::num_threads(),
        out.len(),
        out.iter().all(|v| v.is_finite()),
        audio_s / enc,
        audio_s / dec,
        stream_dec.map_or(String::new(), |t| format!(
            ", streamed decode ({streams} stream(s), {push} frame(s) per push) {:.2}x real time \
             per stream",
            audio_s / t
        )),
        c1 - c0,
        c2 - c1,
    );
    let mut report = serde_json::json!({
        "encode_seconds": (enc * 1000.0).round() / 1000.0,
        "decode_seconds": (dec * 1000.0).round() / 1000.0,
        "audio_seconds": (audio_s * 1000.0).round() / 1000.0,
        "frames": frames,
    });
    if let Some(t) = stream_dec {
        report["stream_decode_seconds"] = ((t * 1000.0).round() / 1000.0).into();
    }
    println!("{report}");
    Ok(())
}

/// Codes of the same samples must be identical; the decode of the official codes within the
/// tolerance of docs/model.md §14 (2e-3).
fn check_parity(codec: &Codec, wav: &[f32], dir: &std::path::Path) -> Result<()> {
    let read = |name: &str| {
        std::fs::read(dir.join(name)).with_context(|| format!("{}", dir.join(name).display()))
    };
    let samples: usize = String::from_utf8(read("samples")?)?.trim().parse()?;
    let q = codec.num_quantizers();
    let codes: Vec<Vec<u32>> = read("codes.i64")?
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")) as u32)
        .collect::<Vec<_>>()
        .chunks(q)
        .map(|r| r.to_vec())
        .collect();
    let want: Vec<f32> = read("wav.f32")?
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    let mine = codec.encode(&wav[..samples.min(wav.len())])?;
    if mine.len() != codes.len() {
        bail!("{} frames, official {}", mine.len(), codes.len());
    }
    let differing: usize = mine
        .iter()
        .zip(&codes)
        .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count())
        .sum();
    let out = codec.decode(&codes)?;
    if out.len() != want.len() {
        bail!("{} samples, official {}", out.len(), want.len());
    }
    let err = out
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!(
        "{}",
        serde_json::json!({"frames": codes.len(), "codes_differing": differing, "wav_max_abs_diff": err})
    );
    Ok(())
}
