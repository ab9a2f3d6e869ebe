//! Progress bars and user-facing warnings that do not garble each other.
//!
//! Bars draw on stderr only when it is a terminal; warnings always reach stderr, printed above
//! the bar, and are kept so that commands can summarise them.

use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

pub struct Progress {
    bar: ProgressBar,
    warnings: Mutex<Vec<String>>,
}

impl Progress {
    /// A bar counting `len` items of `unit`, e.g. `Progress::new(12, "files", "prep")`.
    pub fn new(len: u64, unit: &str, label: &str) -> Self {
        let bar = ProgressBar::new(len);
        let template = format!(
            "{label} [{{bar:32.cyan/blue}}] {{pos}}/{{len}} {unit} · {{msg}} · {{elapsed_precise}} (ETA {{eta}})"
        );
        if let Ok(style) = ProgressStyle::with_template(&template) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.enable_steady_tick(Duration::from_millis(250));
        Progress {
            bar,
            warnings: Mutex::new(Vec::new()),
        }
    }

    /// A bar that never draws (the ranks of a distributed run other than rank 0).
    pub fn hidden(len: u64) -> Self {
        Progress {
            bar: {
                let b = ProgressBar::hidden();
                b.set_length(len);
                b
            },
            warnings: Mutex::new(Vec::new()),
        }
    }

    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    pub fn set_message(&self, msg: String) {
        self.bar.set_message(msg);
    }

    /// Prints `warning: {msg}` to stderr above the bar and remembers it.
    pub fn warn(&self, msg: String) {
        self.bar.suspend(|| eprintln!("warning: {msg}"));
        if let Ok(mut w) = self.warnings.lock() {
            w.push(msg);
        }
    }

    /// Prints `msg` to stderr above the bar.
    pub fn println(&self, msg: impl AsRef<str>) {
        self.bar.suspend(|| eprintln!("{}", msg.as_ref()));
    }

    /// Jumps to `pos` (e.g. when resuming) without counting the jump in the rate and ETA.
    pub fn set_position(&self, pos: u64) {
        self.bar.set_position(pos);
        self.bar.reset_eta();
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }

    pub fn warnings(&self) -> Vec<String> {
        self.warnings.lock().map(|w| w.clone()).unwrap_or_default()
    }
}
