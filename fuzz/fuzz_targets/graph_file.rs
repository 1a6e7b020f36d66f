//! Fuzz target: the graph-file loader (`graph_from_json`) on arbitrary
//! bytes — JSON text, optionally followed by a NUL byte and a safetensors
//! weights file — then a save/load round trip, the compile step with both
//! kernel implementations, and, for graphs the demo scenario can feed, a run
//! with each compared (`fuzz/src/lib.rs` lists the properties).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvjit_fuzz::graph_file(data));
