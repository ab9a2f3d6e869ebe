//! `-o -`: standard output, for the commands that write one stream — a WAV (`speak`, `codec
//! decode`) or a JSON document (`codec encode`). Commands whose `-o` names a directory or a
//! safetensors file refuse `-` rather than create something named `-`.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Whether `-o` asks for standard output.
pub fn is_stdout(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// Writes `bytes` to standard output (then the command's messages go to standard error).
pub fn write_stdout(bytes: &[u8]) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(bytes)
        .and_then(|()| out.flush())
        .context("cannot write to standard output")
}

/// Refuses `-o -` where the output (`what`) cannot be a stream.
pub fn refuse_stdout(output: Option<&Path>, what: &str) -> Result<()> {
    if output.is_some_and(is_stdout) {
        bail!(
            "-o - would be standard output, but this command writes {what}, which cannot go \
             there; give a path (./- for one named -)"
        );
    }
    Ok(())
}
