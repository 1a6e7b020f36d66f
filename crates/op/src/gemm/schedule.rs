//! The loop-nest sizes of each CPU tier: panel width, register tile rows,
//! block rows, and the 256-bit tier's k blocks.

use kvjit_core::CodeTier;
use kvjit_jit::microkernel::{MAX_TILE_ROWS, TILE_COLUMNS};

/// Columns per weight panel of the Cranelift tier (two F32X4 vectors).
pub const NR: usize = 8;
/// Rows per register tile of the Cranelift tier.
pub const MR: usize = 4;
/// Rows per block of the Cranelift tier: the X block that stays in cache
/// while panels stream by.
pub const MC: usize = 64;

/// The loop-nest sizes of a tier (see the module docs for the loops).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Columns per weight panel (the packed layout's width).
    pub panel_columns: usize,
    /// Rows of the largest register tile.
    pub tile_rows: usize,
    /// Rows per block (the X block kept in cache while panels stream by).
    pub block_rows: usize,
}

impl Schedule {
    /// The schedule of a tier.
    pub fn of(tier: CodeTier) -> Self {
        match tier {
            CodeTier::Avx2 => {
                Schedule { panel_columns: TILE_COLUMNS, tile_rows: MAX_TILE_ROWS, block_rows: AVX2_BLOCK_ROWS }
            }
            CodeTier::Cranelift => Schedule { panel_columns: NR, tile_rows: MR, block_rows: MC },
        }
    }
}

/// Rows per block of the 256-bit tier: 32 tiles of 6 rows, an X block of
/// 3 MiB at K = 4096 (in L3 while each thread's panels stream by; each
/// panel stays in L2 for the block's 32 tiles).
pub const AVX2_BLOCK_ROWS: usize = 192;

/// Bytes of a k block of a panel on the 256-bit tier, as f32 (half a 32 KiB
/// L1): 256 values of k × 16 columns.
pub const AVX2_BLOCK_BYTES: usize = 16 << 10;
/// k values per iteration of the micro-kernel loop (amortizes the loop's
/// overhead and the accumulator moves on its back edge).
pub const K_UNROLL: usize = 4;
