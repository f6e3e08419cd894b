//! Tidy: the layering rules of DESIGN.md §2, enforced.
//!
//! The pure crates (model, sched, sim, and later control and node) must not
//! have tokio, an HTTP stack or a database in their dependency closure, and
//! their sources must not read the wall clock, ambient randomness or the
//! environment, nor use hash-ordered collections (whose iteration order could
//! reach a decision). A line may opt out with `tidy: allow(<reason>)`.
//! Nowhere may code carry ignored tests or the unfinished-code macros.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

const PURE_CRATES: [&str; 5] = [
    "muster-model",
    "muster-sched",
    "muster-sim",
    "muster-control",
    "muster-node",
];

const FORBIDDEN_DEPENDENCIES: [&str; 18] = [
    "tokio",
    "async-std",
    "smol",
    "mio",
    "hyper",
    "h2",
    "http",
    "reqwest",
    "axum",
    "tower",
    "sqlx",
    "rusqlite",
    "libsqlite3-sys",
    "postgres",
    "tokio-postgres",
    "diesel",
    "redis",
    "getrandom",
];

const FORBIDDEN_CALLS: [&str; 12] = [
    "Instant::now",
    "SystemTime::now",
    "thread_rng",
    "rand::rng()",
    "OsRng",
    "from_entropy",
    "from_os_rng",
    "env::var",
    "std::env::args",
    "HashMap",
    "HashSet",
    "std::net::",
];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

fn metadata() -> serde_json::Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let host = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .arg("-vV")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("host: ").map(str::to_string))
        })
        .unwrap_or_else(|| "x86_64-unknown-linux-gnu".to_string());
    let output = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--filter-platform",
            &host,
        ])
        .current_dir(workspace_root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON")
}

/// Package name of every package in the normal (non-dev, non-build)
/// dependency closure of `root`.
fn normal_closure(metadata: &serde_json::Value, root: &str) -> Option<BTreeSet<String>> {
    let packages = metadata["packages"].as_array()?;
    let names: BTreeMap<&str, &str> = packages
        .iter()
        .filter_map(|p| Some((p["id"].as_str()?, p["name"].as_str()?)))
        .collect();
    let root_id = packages
        .iter()
        .find(|p| p["name"] == root && p["source"].is_null())?["id"]
        .as_str()?;
    let nodes: BTreeMap<&str, &serde_json::Value> = metadata["resolve"]["nodes"]
        .as_array()?
        .iter()
        .filter_map(|n| Some((n["id"].as_str()?, n)))
        .collect();
    let mut seen = BTreeSet::new();
    let mut stack = vec![root_id];
    while let Some(id) = stack.pop() {
        if !seen.insert(id) {
            continue;
        }
        let Some(node) = nodes.get(id) else { continue };
        for dep in node["deps"].as_array().into_iter().flatten() {
            let normal = dep["dep_kinds"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|kind| kind["kind"].is_null());
            if normal && let Some(pkg) = dep["pkg"].as_str() {
                stack.push(pkg);
            }
        }
    }
    Some(
        seen.into_iter()
            .filter(|id| *id != root_id)
            .filter_map(|id| names.get(id).map(|n| n.to_string()))
            .collect(),
    )
}

#[test]
fn pure_crates_have_no_runtime_network_or_database_dependencies() {
    let metadata = metadata();
    let mut checked = 0;
    for krate in PURE_CRATES {
        let Some(closure) = normal_closure(&metadata, krate) else {
            continue; // not written yet
        };
        checked += 1;
        let bad: Vec<&String> = closure
            .iter()
            .filter(|name| FORBIDDEN_DEPENDENCIES.contains(&name.as_str()))
            .collect();
        assert!(
            bad.is_empty(),
            "{krate} is a pure crate but depends on {bad:?}; move that code to a shell crate"
        );
    }
    assert!(checked >= 2, "the tidy test found no pure crates to check");
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn pure_crates_read_no_clock_randomness_or_environment() {
    let root = workspace_root();
    let mut violations = Vec::new();
    for krate in PURE_CRATES {
        let mut files = Vec::new();
        rust_files(&root.join("crates").join(krate).join("src"), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).expect("readable source");
            for (number, line) in text.lines().enumerate() {
                if line.contains("tidy: allow(") {
                    continue;
                }
                for call in FORBIDDEN_CALLS {
                    if line.contains(call) {
                        violations.push(format!(
                            "{}:{}: `{call}` in a pure crate",
                            file.display(),
                            number + 1
                        ));
                    }
                }
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

#[test]
fn no_ignored_tests_or_stubs() {
    let root = workspace_root();
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    let needles = [
        concat!("#[", "ignore"),
        concat!("todo", "!("),
        concat!("unimplemented", "!("),
    ];
    let mut violations = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable source");
        for (number, line) in text.lines().enumerate() {
            for needle in needles {
                if line.contains(needle) {
                    violations.push(format!("{}:{}: {needle}", file.display(), number + 1));
                }
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}
