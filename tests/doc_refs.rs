//! Keeps the references from code and scripts to the documentation honest.
//!
//! Scanned: every `.rs` and `.md` file under `src/`, `crates/`, `tests/` and `examples/`, every
//! file under `scripts/` and `.ci/`, `docs/*.md`, `README.md`, `Cargo.toml`, `build.rs`, each
//! crate's manifest and build script, and `configs/` (files that are
//! not UTF-8 text are skipped, and so is this file, which has to spell out the forbidden forms).
//!
//! What counts as a reference, and what fails:
//! - `docs/NAME.md` anywhere: the file must exist.
//! - `docs/NAME.md §N`, N a section number such as `4`, `4.1` or `10.3` (a `.` that is not
//!   followed by a digit ends the number, so `§2.` at the end of a sentence is section 2): the
//!   file must have a heading with that number. The reference may go on with more numbers of
//!   the same file, joined by `,`, `/`, `and` or `or`: `docs/model.md §5.2, §5.4 and §7`.
//! - Inside `docs/NAME.md` itself a bare `§N` means a section of that same file.
//! - Anywhere else a `§` that is not part of such a reference fails (it would be ambiguous),
//!   except on the line after one that contains `doc-refs: allow-next-line` (for strings that
//!   are data, such as an identity stored in checkpoints).
//! - Any reference to the design notes and specification that live outside the repository
//!   fails: the old `spec §…` / `spec Q…` / `DESIGN §…` forms, `DESIGN.md`, `spec/qwen3-tts`,
//!   and `../shared`.
//!
//! How headings are matched: a line of `docs/NAME.md` outside fenced code blocks that starts
//! with one or more `#`, a space, then the number, then `.` + space, a space, or the end of the
//! line. `## 4. Talker` is section 4 and `### 4.1 Architecture` section 4.1. Numbers must be
//! unique within a file, and a `N.M` heading must come after (under) the `N` heading.
//!
//! Every failure is printed as `file:line: what`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The section numbers of one document, or the problems with its headings.
fn headings(text: &str) -> (BTreeSet<String>, Vec<(usize, String)>) {
    let mut found = BTreeSet::new();
    let mut problems = Vec::new();
    let mut fenced = false;
    let mut current_top: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let rest = line.trim_start_matches('#');
        let Some(rest) = rest.strip_prefix(' ') else {
            continue;
        };
        let Some(num) = section_number(rest) else {
            continue;
        };
        let after = &rest[num.len()..];
        if !(after.is_empty() || after.starts_with(". ") || after.starts_with(' ') || after == ".")
        {
            continue;
        }
        if !found.insert(num.clone()) {
            problems.push((i + 1, format!("section {num} has more than one heading")));
        }
        match num.split_once('.') {
            None => current_top = Some(num.clone()),
            Some((top, _)) => {
                if current_top.as_deref() != Some(top) {
                    problems.push((i + 1, format!("heading {num} is not under a heading {top}")));
                }
            }
        }
    }
    (found, problems)
}

/// The section number at the start of `s`: digits, then `.digits` groups (a `.` not followed
/// by a digit is not part of it).
fn section_number(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut end = 0;
    while end < b.len() && b[end].is_ascii_digit() {
        end += 1;
    }
    if end == 0 {
        return None;
    }
    while end + 1 < b.len() && b[end] == b'.' && b[end + 1].is_ascii_digit() {
        end += 1;
        while end < b.len() && b[end].is_ascii_digit() {
            end += 1;
        }
    }
    Some(s[..end].to_string())
}

/// The documents: name (`model.md`) → section numbers.
type Docs = BTreeMap<String, BTreeSet<String>>;

/// The forbidden forms, built at run time so that this file does not contain them.
fn forbidden() -> Vec<(String, &'static str)> {
    let sect = '\u{a7}';
    vec![
        (
            format!("spec {sect}"),
            "a section of the old external specification",
        ),
        (
            format!("Spec {sect}"),
            "a section of the old external specification",
        ),
        (
            format!("DESIGN {sect}"),
            "a section of the old external design notes",
        ),
        (["DESIGN", ".md"].concat(), "the old external design notes"),
        (
            ["spec/", "qwen3-tts"].concat(),
            "the old external specification",
        ),
        (["..", "/shared"].concat(), "a path outside the repository"),
    ]
}

/// Checks one file's text; `own` is the document name when the file is `docs/NAME.md`.
fn check_text(path: &str, text: &str, own: Option<&str>, docs: &Docs) -> Vec<String> {
    let mut errors = Vec::new();
    let forbidden = forbidden();
    let mut allow_next = false;
    for (i, line) in text.lines().enumerate() {
        let at = format!("{path}:{}", i + 1);
        for (pattern, what) in &forbidden {
            if line.contains(pattern.as_str()) {
                errors.push(format!("{at}: `{pattern}` refers to {what}"));
            }
        }
        let lower = line.to_ascii_lowercase();
        if let Some(p) = lower.find("spec q") {
            if lower[p + 6..].starts_with(|c: char| c.is_ascii_digit()) {
                errors.push(format!(
                    "{at}: an open question of the old external specification (use docs/model.md §13)"
                ));
            }
        }
        let allowed = allow_next;
        allow_next = line.contains("doc-refs: allow-next-line");
        errors.extend(
            check_line(line, own, docs, allowed)
                .into_iter()
                .map(|e| format!("{at}: {e}")),
        );
    }
    errors
}

/// The references of one line (see the module docs); returns the problems.
fn check_line(line: &str, own: Option<&str>, docs: &Docs, allow_bare: bool) -> Vec<String> {
    let mut errors = Vec::new();
    let mut attributed = BTreeSet::new(); // byte offsets of `§` that belong to a reference
    let mut from = 0;
    while let Some(p) = line[from..].find("docs/") {
        let start = from + p + "docs/".len();
        from = start;
        let name_len = line[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.'))
            .unwrap_or(line.len() - start);
        let name = line[start..start + name_len].trim_end_matches('.');
        if !name.ends_with(".md") || name.len() <= 3 {
            continue; // `docs/` or a directory mention, not a document
        }
        let Some(sections) = docs.get(name) else {
            errors.push(format!("docs/{name} does not exist"));
            continue;
        };
        let mut pos = start + name.len();
        let mut first = true;
        loop {
            let rest = &line[pos..];
            let skip = if first {
                rest.len() - rest.trim_start().len()
            } else {
                match joiner(rest) {
                    Some(n) => n,
                    None => break,
                }
            };
            let after = &rest[skip..];
            let Some(num_text) = after.strip_prefix('\u{a7}') else {
                break;
            };
            let sign = pos + skip;
            let Some(num) = section_number(num_text) else {
                errors.push(format!("a section sign after docs/{name} without a number"));
                attributed.insert(sign);
                break;
            };
            attributed.insert(sign);
            if !sections.contains(&num) {
                errors.push(format!("docs/{name} has no heading numbered {num}"));
            }
            pos = sign + '\u{a7}'.len_utf8() + num.len();
            first = false;
        }
        from = pos.max(from);
    }
    for (p, _) in line.match_indices('\u{a7}') {
        if attributed.contains(&p) {
            continue;
        }
        let num = section_number(&line[p + '\u{a7}'.len_utf8()..]);
        match (own, num) {
            (Some(name), Some(num)) => {
                if !docs[name].contains(&num) {
                    errors.push(format!("docs/{name} has no heading numbered {num}"));
                }
            }
            _ if allow_bare => {}
            (Some(_), None) => errors.push("a section sign without a number".to_string()),
            (None, num) => errors.push(format!(
                "`\u{a7}{}` does not say which document it means (write docs/NAME.md \u{a7}N)",
                num.unwrap_or_default()
            )),
        }
    }
    errors
}

/// Length of a joiner between two section numbers of one reference (`, `, `/`, ` and `, ` or `),
/// up to the next `§`.
fn joiner(rest: &str) -> Option<usize> {
    let t = rest.trim_start();
    let lead = rest.len() - t.len();
    let word = [",", "/", "and ", "or "]
        .iter()
        .find(|j| t.starts_with(**j))
        .map(|j| j.len())?;
    let t2 = &t[word..];
    let gap = t2.len() - t2.trim_start().len();
    t2[gap..].starts_with('\u{a7}').then_some(lead + word + gap)
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}

fn load_docs(root: &Path) -> (Docs, Vec<String>) {
    let mut docs = Docs::new();
    let mut errors = Vec::new();
    let mut files = Vec::new();
    walk(&root.join("docs"), &mut files);
    for f in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "md"))
    {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let text = fs::read_to_string(f).unwrap_or_default();
        let (found, problems) = headings(&text);
        errors.extend(
            problems
                .into_iter()
                .map(|(line, what)| format!("docs/{name}:{line}: {what}")),
        );
        docs.insert(name, found);
    }
    (docs, errors)
}

/// The files the test scans, relative to the repository root.
fn scanned(root: &Path) -> Vec<PathBuf> {
    let mut all = Vec::new();
    for dir in ["src", "crates", "tests", "examples"] {
        let mut files = Vec::new();
        walk(&root.join(dir), &mut files);
        all.extend(
            files
                .into_iter()
                .filter(|f| f.extension().is_some_and(|e| e == "rs" || e == "md")),
        );
    }
    for dir in ["scripts", ".ci", "configs", "docs"] {
        walk(&root.join(dir), &mut all);
    }
    for f in ["README.md", "Cargo.toml", "build.rs"] {
        all.push(root.join(f));
    }
    // Each crate's manifest and build script.
    if let Ok(crates) = std::fs::read_dir(root.join("crates")) {
        for dir in crates.flatten() {
            all.push(dir.path().join("Cargo.toml"));
            all.push(dir.path().join("build.rs"));
        }
    }
    let me = root.join("tests").join("doc_refs.rs");
    all.retain(|f| f.is_file() && *f != me);
    all
}

#[test]
fn every_doc_reference_resolves() {
    let root = root();
    let (docs, mut errors) = load_docs(&root);
    for required in [
        "architecture.md",
        "model.md",
        "training.md",
        "performance.md",
    ] {
        if !docs.contains_key(required) {
            errors.push(format!("docs/{required} is missing"));
        }
    }
    let files = scanned(&root);
    assert!(files.len() > 50, "found only {} files to scan", files.len());
    for f in &files {
        let Ok(text) = fs::read_to_string(f) else {
            continue; // not UTF-8 text
        };
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let own = rel
            .strip_prefix("docs/")
            .filter(|n| n.ends_with(".md") && !n.contains('/'));
        errors.extend(check_text(&rel, &text, own, &docs));
    }
    assert!(
        errors.is_empty(),
        "{} broken documentation reference(s):\n{}",
        errors.len(),
        errors.join("\n")
    );
}

#[cfg(test)]
mod checker {
    use super::*;

    fn docs() -> Docs {
        let (model, problems) = headings(
            "# Title\n## 0. Scope\n## 4. Talker\n### 4.1 Architecture\n```\n## 9. not a heading\n```\n## 10. Fine-tuning\n### 10.3 Loss\n",
        );
        assert!(problems.is_empty(), "{problems:?}");
        Docs::from([("model.md".to_string(), model)])
    }

    #[test]
    fn headings_are_numbered_sections_outside_code_blocks() {
        let d = docs();
        let got: Vec<&str> = d["model.md"].iter().map(String::as_str).collect();
        assert_eq!(got, ["0", "10", "10.3", "4", "4.1"]);
        let (_, problems) = headings("## 1. A\n## 1. B\n### 2.1 C\n");
        assert_eq!(problems.len(), 2, "{problems:?}");
    }

    #[test]
    fn good_references_pass() {
        let d = docs();
        for line in [
            "// docs/model.md §4.1: RMSNorm in f32",
            "/// (docs/model.md §4, §10.3 and §0) and docs/model.md §4.1/§10.",
            "see docs/model.md §10.3.",
            "the map is in docs/model.md",
        ] {
            assert!(check_line(line, None, &d, false).is_empty(), "{line}");
        }
        assert!(check_line("bare §4.1 inside the doc", Some("model.md"), &d, false).is_empty());
        assert!(check_text(
            "x.rs",
            "// doc-refs: allow-next-line\nconst S: &str = \"§10.2\";",
            None,
            &d
        )
        .is_empty());
    }

    #[test]
    fn broken_references_fail() {
        let d = docs();
        let cases = [
            ("// docs/model.md §4.2", "no heading numbered 4.2"),
            ("// docs/model.md §4.1, §11", "no heading numbered 11"),
            ("// docs/nothing.md §1", "docs/nothing.md does not exist"),
            ("// see §4.1", "does not say which document"),
            (
                "// docs/model.md §4, and then §10",
                "does not say which document",
            ),
        ];
        for (line, want) in cases {
            let e = check_line(line, None, &d, false);
            assert!(e.iter().any(|e| e.contains(want)), "{line}: {e:?}");
        }
        let e = check_line("see §12", Some("model.md"), &d, false);
        assert!(
            e.iter().any(|e| e.contains("no heading numbered 12")),
            "{e:?}"
        );
        let sect = '\u{a7}';
        for line in [
            format!("// spec {sect}4.1"),
            format!("// (DESIGN {sect}5)"),
            ["// see ..", "/shared/notes.md"].concat(),
            ["// DESIGN", ".md"].concat(),
            "// spec Q5".to_string(),
        ] {
            assert!(!check_text("x.rs", &line, None, &d).is_empty(), "{line}");
        }
    }
}

/// The crate graph docs/architecture.md §3 draws (`NAME ─► DEPS` lines) is the manifests' own:
/// every crate under `crates/` has a line, and its line names exactly the workspace crates its
/// `[dependencies]` list.
#[test]
fn the_crate_graph_drawn_is_the_manifests() {
    let root = root();
    let doc = fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let mut drawn: BTreeMap<String, BTreeSet<String>> = doc
        .lines()
        .filter_map(|l| l.split_once('─'))
        .filter(|(name, rest)| name.trim().starts_with("vc-") && rest.starts_with('►'))
        .map(|(name, rest)| {
            let deps = rest.trim_start_matches('►').split_whitespace();
            let deps = deps.filter(|d| d.starts_with("vc-")).map(String::from);
            (name.trim().to_string(), deps.collect())
        })
        .collect();
    let mut built = BTreeMap::new();
    for dir in fs::read_dir(root.join("crates")).unwrap().flatten() {
        let manifest = fs::read_to_string(dir.path().join("Cargo.toml")).unwrap();
        let manifest: toml::Table = manifest.parse().unwrap();
        let name = manifest["package"]["name"].as_str().unwrap().to_string();
        let deps = manifest
            .get("dependencies")
            .and_then(|d| d.as_table())
            .map(|d| d.keys().filter(|k| k.starts_with("vc-")).cloned().collect())
            .unwrap_or_default();
        built.insert(name, deps);
    }
    // The two crates with no workspace dependency share one line.
    let bottom = doc
        .lines()
        .find(|l| l.ends_with(": none of ours"))
        .expect("docs/architecture.md §3 names the crates that depend on none of ours");
    for name in bottom.trim_end_matches(": none of ours").split(',') {
        drawn.entry(name.trim().to_string()).or_default();
    }
    assert_eq!(
        drawn, built,
        "docs/architecture.md §3 against crates/*/Cargo.toml"
    );
}

/// The repository paths one line names: each run of path characters that starts at one of the
/// top-level folders (`scripts/`, `tests/`, `docs/`, `crates/`, `configs/`, `examples/`, `.ci/`)
/// and not inside a longer path, with the punctuation that ends a sentence trimmed. A run
/// followed by `*`, `{`, `$` or `<` is a pattern, not a path, and is left out. (`src/` is left
/// out: in a crate's manifest it means that crate's own folder.)
fn repo_paths(text: &str) -> Vec<String> {
    const ROOTS: [&str; 7] = [
        "scripts/",
        "tests/",
        "docs/",
        "crates/",
        "configs/",
        "examples/",
        ".ci/",
    ];
    let is_path = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    let mut found = Vec::new();
    for root in ROOTS {
        for (at, _) in text.match_indices(root) {
            if text[..at].chars().next_back().is_some_and(is_path) {
                continue;
            }
            let rest = &text[at..];
            let end = rest.find(|c: char| !is_path(c)).unwrap_or(rest.len());
            if rest[end..].starts_with(['*', '{', '$', '<']) {
                continue;
            }
            found.push(rest[..end].trim_end_matches(['.', ',']).to_string());
        }
    }
    found
}

/// Every repository path a scanned file names exists, so that no moved or renamed file leaves
/// its old name behind in the docs, the tests or a script. `examples/NAME` may name the
/// example (`examples/NAME.rs`), as cargo does.
#[test]
fn every_repository_path_named_exists() {
    assert_eq!(
        repo_paths("run scripts/ci/test.sh. See docs/, not x/scripts/y, scripts/bench* or docs/$f"),
        ["scripts/ci/test.sh", "docs/"]
    );
    let root = root();
    let exists = |path: &str| {
        root.join(path).exists()
            || (path.starts_with("examples/") && root.join(format!("{path}.rs")).exists())
    };
    let mut errors = Vec::new();
    for f in scanned(&root) {
        let Ok(text) = fs::read_to_string(&f) else {
            continue; // not UTF-8 text
        };
        let rel = f.strip_prefix(&root).unwrap_or(&f).display().to_string();
        for (i, line) in text.lines().enumerate() {
            for path in repo_paths(line) {
                if !exists(&path) {
                    errors.push(format!("{rel}:{}: {path} does not exist", i + 1));
                }
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}
