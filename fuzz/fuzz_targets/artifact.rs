//! Fuzz target: the compiled-artifact reader (`kvjit run model.kvjit`) —
//! `load_artifact` and `LoadedArtifact::compile` on arbitrary bytes, then a
//! run of what loads (`fuzz/src/lib.rs`, `artifact_file`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvjit_fuzz::artifact_file(data));
