//! Fuzz target: the safetensors input loader — `tensors_from_safetensors`,
//! `PagedKVCacheCollection::from_tensors` and the CLI's
//! `Scenario::from_tensors` (`kvjit run --inputs FILE`) — on arbitrary bytes,
//! then a run of a tiny two-layer graph with the JIT and the reference
//! kernels (`fuzz/src/lib.rs` lists the properties).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvjit_fuzz::safetensors_inputs(data));
