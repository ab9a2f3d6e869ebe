//! Line charts as SVG, drawn by hand (no plotting dependency): `checkpoints/loss.svg` and the
//! charts of `checkpoints/report.html` (docs/training.md §9, §14.6). A chart has lines over a
//! shared x axis (optimizer steps); a sparse line (one point per evaluation) is dashed with its
//! points marked, and a shaded band can mark a range of good values.

/// One line: its name, colour, whether dashed (points marked), and its (x, y) points.
/// Non-finite values are left out.
pub struct Series {
    pub name: String,
    pub color: &'static str,
    pub dashed: bool,
    pub points: Vec<(f64, f64)>,
}

/// A chart.
pub struct Chart {
    pub title: String,
    pub x_label: &'static str,
    pub series: Vec<Series>,
    /// A y range shaded in the background (e.g. the speaking rates that raise no alarm).
    pub band: Option<(f64, f64)>,
    /// Whether the y axis starts at 0 when every value is positive.
    pub from_zero: bool,
    /// What to say when there is nothing to draw.
    pub empty: &'static str,
    /// A step marked by a vertical line with a label (the chosen checkpoint).
    pub marker: Option<(f64, String)>,
}

/// The colours lines take in turn.
pub const COLORS: [&str; 6] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
];

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 400.0;

/// The chart as one `<svg>` element (self-contained, 720 × 400).
pub fn svg(chart: &Chart) -> String {
    let (w, h) = (WIDTH, HEIGHT);
    // The legend sits right of the plot, where it covers no line.
    let (left, right, top, bottom) = (64.0, 150.0, 28.0, 44.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    s.push_str(&format!(
        "<text x=\"{left}\" y=\"18\" font-size=\"14\">{}</text>\n",
        escape(&chart.title)
    ));
    let finite: Vec<(f64, f64)> = chart
        .series
        .iter()
        .flat_map(|l| l.points.iter().copied())
        .filter(|(x, v)| x.is_finite() && v.is_finite())
        .collect();
    if finite.is_empty() {
        s.push_str(&format!(
            "<text x=\"50%\" y=\"50%\" text-anchor=\"middle\">{}</text>\n</svg>\n",
            escape(chart.empty)
        ));
        return s;
    }
    let min = |it: &mut dyn Iterator<Item = f64>| it.fold(f64::INFINITY, f64::min);
    let max = |it: &mut dyn Iterator<Item = f64>| it.fold(f64::NEG_INFINITY, f64::max);
    let marked = chart.marker.iter().map(|(x, _)| *x);
    let xs: Vec<f64> = finite.iter().map(|p| p.0).chain(marked).collect();
    let x0 = min(&mut xs.iter().copied());
    let x1 = max(&mut xs.iter().copied()).max(x0 + 1.0);
    let band = chart.band.into_iter().flat_map(|(a, b)| [a, b]);
    let ys: Vec<f64> = finite.iter().map(|p| p.1).chain(band).collect();
    let mut y0 = min(&mut ys.iter().copied());
    let mut y1 = max(&mut ys.iter().copied());
    if chart.from_zero {
        y0 = y0.min(0.0);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-9);
    if !chart.from_zero || y0 < 0.0 {
        y0 -= pad;
    }
    y1 += pad;
    let px = |x: f64| left + (x - x0) / (x1 - x0) * pw;
    let py = |y: f64| top + ph - (y - y0) / (y1 - y0) * ph;
    if let Some((a, b)) = chart.band {
        s.push_str(&format!(
            "<rect x=\"{left}\" y=\"{:.1}\" width=\"{pw}\" height=\"{:.1}\" fill=\"#e8f4e8\"/>\n",
            py(b),
            (py(a) - py(b)).max(0.0)
        ));
    }
    // Axes, ticks and grid.
    s.push_str(&format!(
        "<rect x=\"{left}\" y=\"{top}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#444\"/>\n"
    ));
    for i in 0..=5 {
        let yv = y0 + (y1 - y0) * i as f64 / 5.0;
        let y = py(yv);
        s.push_str(&format!(
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            left + pw,
            left - 6.0,
            y + 4.0,
            tick(yv)
        ));
    }
    // Ticks on whole steps: as many as there are steps between the ends, at most 5.
    let intervals = ((x1 - x0).round() as usize).clamp(1, 5);
    for i in 0..=intervals {
        let xv = x0 + (x1 - x0) * i as f64 / intervals as f64;
        s.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
            px(xv),
            top + ph + 16.0,
            xv.round()
        ));
    }
    s.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
        left + pw / 2.0,
        h - 8.0,
        chart.x_label
    ));
    if let Some((x, label)) = &chart.marker {
        let x = px(*x);
        s.push_str(&format!(
            "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{top}\" y2=\"{}\" stroke=\"#000\" \
             stroke-width=\"1\" stroke-dasharray=\"2 3\"/><text x=\"{:.1}\" y=\"{}\" \
             text-anchor=\"middle\" font-size=\"11\">{}</text>\n",
            top + ph,
            x,
            top - 3.0,
            escape(label)
        ));
    }
    for (k, line) in chart
        .series
        .iter()
        .filter(|l| !l.points.is_empty())
        .enumerate()
    {
        let pts: Vec<(f64, f64)> = line
            .points
            .iter()
            .filter(|(x, v)| x.is_finite() && v.is_finite())
            .map(|&(x, y)| (px(x), py(y)))
            .collect();
        let dash = if line.dashed {
            " stroke-dasharray=\"6 3\""
        } else {
            ""
        };
        let color = line.color;
        if pts.len() > 1 {
            let joined: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            s.push_str(&format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\"{dash} points=\"{}\"/>\n",
                joined.join(" ")
            ));
        }
        // A lone point, and every point of a dashed (sparse) line, is marked.
        if pts.len() == 1 || line.dashed {
            for (x, y) in &pts {
                s.push_str(&format!(
                    "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{color}\"/>\n"
                ));
            }
        }
        let lx = left + pw + 10.0;
        let ly = top + 8.0 + 16.0 * k as f64;
        s.push_str(&format!(
            "<line x1=\"{lx}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"2\"{dash}/>\
             <text x=\"{}\" y=\"{}\">{}</text>\n",
            lx + 20.0,
            lx + 26.0,
            ly + 4.0,
            escape(&line.name)
        ));
    }
    s.push_str("</svg>\n");
    s
}

/// A tick label with as many digits as its size needs.
fn tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else if v.abs() >= 0.001 {
        format!("{v:.3}")
    } else {
        format!("{v:.1e}")
    }
}

/// `text` safe inside XML and HTML text and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(series: Vec<Series>, band: Option<(f64, f64)>) -> Chart {
        Chart {
            title: "t <&>".into(),
            x_label: "step",
            series,
            band,
            from_zero: false,
            empty: "nothing yet",
            marker: Some((2.0, "chosen".into())),
        }
    }

    #[test]
    fn lines_points_band_and_escaping() {
        let line = |name: &str, dashed, points: Vec<(f64, f64)>| Series {
            name: name.into(),
            color: COLORS[0],
            dashed,
            points,
        };
        let s = svg(&chart(
            vec![
                line("a", false, vec![(1.0, 2.0), (2.0, f64::NAN), (3.0, 1.0)]),
                line("b\"", true, vec![(2.0, 1.5)]),
                line("empty", false, vec![]),
            ],
            Some((0.8, 1.25)),
        ));
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("t &lt;&amp;&gt;") && s.contains("b&quot;"));
        assert_eq!(
            s.matches("<polyline").count(),
            1,
            "the NaN point is left out"
        );
        assert_eq!(s.matches("<circle").count(), 1, "the lone dashed point");
        assert!(s.contains("fill=\"#e8f4e8\""), "the band");
        assert!(
            !s.contains(">empty<"),
            "no legend for a line without points"
        );
        assert!(s.contains(">chosen</text>") && s.contains("stroke-dasharray=\"2 3\""));
        let none = svg(&chart(vec![line("a", false, vec![(1.0, f64::NAN)])], None));
        assert!(none.contains("nothing yet") && !none.contains("<polyline"));
    }
}
