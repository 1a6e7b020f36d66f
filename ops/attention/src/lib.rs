//! Paged flash attention (`mo.mha.padded.paged`): under construction.
