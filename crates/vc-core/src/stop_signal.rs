//! Ctrl-C / SIGTERM as a request to stop. The first signal only sets a flag, which the work
//! that installed the handlers polls: the training loop stops after the current optimizer step
//! and saves a checkpoint (docs/training.md §8.1), the rank launcher passes the request to its
//! ranks (docs/distributed.md §5). A second Ctrl-C exits at once (the last complete checkpoint
//! stays valid). It sits below both of its users, so that the launcher does not depend on the
//! trainer.

use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

/// Whether a stop was requested.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Installs the handlers (idempotent).
pub fn install() {
    #[cfg(unix)]
    unix::install();
}

/// Restores the default actions (after training: Ctrl-C during the export ends the process;
/// the export is written under a temporary name, so nothing half-written is left in place).
pub fn restore() {
    #[cfg(unix)]
    unix::restore();
}

#[cfg(unix)]
mod unix {
    use super::*;

    extern "C" fn on_signal(sig: libc::c_int) {
        if STOP.swap(true, Ordering::SeqCst) && sig == libc::SIGINT {
            // Second Ctrl-C: leave now (only async-signal-safe calls here).
            // SAFETY: `_exit` is async-signal-safe and takes no pointers.
            unsafe { libc::_exit(130) };
        }
    }

    pub fn install() {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only touches an atomic and calls `_exit`, both async-signal-safe.
        unsafe {
            libc::signal(libc::SIGINT, handler);
            libc::signal(libc::SIGTERM, handler);
        }
    }

    pub fn restore() {
        // SAFETY: resets the dispositions to the defaults.
        unsafe {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
        }
    }
}
