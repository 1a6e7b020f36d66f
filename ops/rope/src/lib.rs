//! Paged RoPE (`mo.fused_qk_rope.padded.paged`): under construction.
