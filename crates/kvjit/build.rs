//! Names the build: `KVJIT_BUILD` = `src-` and the first 16 hex digits of
//! the SHA-256 of every source the kvjit library is compiled from (the
//! `src` folders, manifests and CUDA sources of the workspace crates it
//! links, and the lock file), so it differs between any two builds whose
//! code differs and is equal for the same sources, with or without git (a
//! fresh clone, a source tarball). Compiled artifacts record it.
//!
//! Cargo runs this again whenever a file in those folders changes
//! (`rerun-if-changed` on a folder watches everything below it).

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// Workspace crates the library links (relative to the workspace root).
const CRATES: [&str; 6] =
    ["crates/core", "crates/graph", "crates/jit", "crates/cuda", "crates/runtime", "crates/kvjit"];

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let root = manifest.join("../..");
    let mut inputs: Vec<PathBuf> = vec![root.join("Cargo.lock"), root.join("Cargo.toml"), manifest.join("build.rs")];
    let mut crates: Vec<PathBuf> = CRATES.iter().map(|c| root.join(c)).collect();
    if let Ok(ops) = std::fs::read_dir(root.join("ops")) {
        crates.extend(ops.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.join("Cargo.toml").is_file()));
    }
    for krate in crates {
        inputs.push(krate.join("Cargo.toml"));
        inputs.push(krate.join("src"));
        inputs.push(krate.join("cuda"));
    }
    // Outside a workspace (a packaged crate): its own sources only.
    inputs.retain(|p| p.exists());
    if inputs.is_empty() {
        inputs.push(manifest.join("src"));
    }

    let mut files = Vec::new();
    for input in &inputs {
        println!("cargo:rerun-if-changed={}", input.display());
        collect(input, &mut files);
    }
    files.sort();
    let mut hash = Sha256::new();
    for file in &files {
        let relative = file.strip_prefix(&root).unwrap_or(file);
        let bytes = std::fs::read(file).unwrap_or_default();
        hash.update(relative.to_string_lossy().replace('\\', "/").as_bytes());
        hash.update([0]);
        // Line endings normalized, as a checkout may convert them.
        hash.update(bytes.iter().copied().filter(|&b| b != b'\r').collect::<Vec<_>>());
        hash.update([0]);
    }
    let digest: String = hash.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect();
    println!("cargo:rustc-env=KVJIT_BUILD=src-{digest}");
}

/// Every file at or below `path`.
fn collect(path: &Path, files: &mut Vec<PathBuf>) {
    match std::fs::read_dir(path) {
        Ok(entries) => {
            for entry in entries.filter_map(|e| e.ok()) {
                collect(&entry.path(), files);
            }
        }
        Err(_) if path.is_file() => files.push(path.to_path_buf()),
        Err(_) => {}
    }
}
