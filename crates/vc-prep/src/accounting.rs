//! Where every second of a recording went, so that prep's summary adds up to the audio it was
//! given: each stretch is counted once, under the first of an ordered list of labelled layers
//! that covers it (kept utterances, then each reason to drop, then what Whisper heard but was
//! trimmed, then what was transcribed without a word heard), and under a last label when none
//! does (silence that was never transcribed).

/// Seconds of `0..total` under each label of `layers`, in their order, then `rest` for what
/// no layer covers; a stretch under several layers counts for the first of them. Spans are
/// `(start, end)` in seconds, clamped to `0..total`, and may overlap. Labels with no seconds
/// are left out; the seconds add up to `total`.
pub fn account<L: AsRef<str>>(
    total: f64,
    layers: &[(L, Vec<(f64, f64)>)],
    rest: &str,
) -> Vec<(String, f64)> {
    // (time, layer, +1 at a span's start / -1 at its end)
    let mut events: Vec<(f64, usize, i32)> = Vec::new();
    for (k, (_, spans)) in layers.iter().enumerate() {
        for &(a, b) in spans {
            let (a, b) = (a.clamp(0.0, total), b.clamp(0.0, total));
            if b > a {
                events.push((a, k, 1));
                events.push((b, k, -1));
            }
        }
    }
    events.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut seconds = vec![0.0; layers.len() + 1];
    let mut open = vec![0i32; layers.len()];
    let mut at = 0.0;
    for (t, k, step) in events {
        let owner = open.iter().position(|&n| n > 0).unwrap_or(layers.len());
        seconds[owner] += t - at;
        at = t;
        open[k] += step;
    }
    seconds[layers.len()] += total - at;
    layers
        .iter()
        .map(|(label, _)| label.as_ref())
        .chain([rest])
        .zip(seconds)
        .filter(|(_, s)| *s > 0.0)
        .map(|(label, s)| (label.to_string(), s))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stretch_counts_once_for_its_first_layer_and_the_parts_add_up() {
        let parts = account(
            10.0,
            &[
                ("kept", vec![(1.0, 3.0), (6.0, 7.0)]),
                ("dropped", vec![(2.0, 4.0), (-1.0, 0.5)]),
                ("heard", vec![(0.0, 8.0)]),
            ],
            "silence",
        );
        assert_eq!(
            parts,
            [
                ("kept".to_string(), 3.0),
                ("dropped".to_string(), 1.5),
                ("heard".to_string(), 3.5),
                ("silence".to_string(), 2.0),
            ]
        );
        // Nothing at all: all of it is the rest; a layer without seconds is left out.
        assert_eq!(
            account(4.0, &[("kept", vec![])], "silence"),
            [("silence".to_string(), 4.0)]
        );
    }
}
