//! Fuzz target: the GGUF reader (`kvjit_gguf::Gguf`) — header, metadata,
//! tensor table and the dequantization of every tensor — on arbitrary bytes
//! (`fuzz/src/lib.rs`, `gguf_file`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kvjit_fuzz::gguf_file(data));
