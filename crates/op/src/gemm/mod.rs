//! The GEMM driver every matmul-shaped kernel is built on (`mo.matmul`,
//! its fused epilogues and siblings, the fused QKV op): C = X·W with W a
//! weight packed once into panels, emitted by Cranelift for one spec on
//! one CPU tier, each finished row of C handed to the op's [`Epilogue`]
//! while it is in registers (a plain store; a residual add, SiLU, SwiGLU;
//! Q to an output and K/V into a paged cache).
//!
//! Everything the spec fixes is a constant in the code: K, the segments'
//! column counts, dtypes and — for a fully specialized key — the row count
//! M. Only the innermost tile differs between the tiers ([`Schedule::of`]):
//! the Cranelift tier computes a tile of F32X4 FMAs in registers, the
//! 256-bit tier calls the ahead-of-time AVX2 micro-kernel
//! ([`kvjit_jit::microkernel`]) on activations packed per 6-row tile
//! ([`pack_activations`]). With M ≤ block_rows (decode) every weight panel
//! is read from memory exactly once for all rows, and the panel groups are
//! split between the worker threads: the kernel streams the weight once.
//! Each output element is computed by one call with the same code whatever
//! the thread count, so results are bit-identical for any number of
//! threads.
//!
//! The pieces: the loop-nest sizes ([`Schedule`]), the packed weight
//! layout ([`PanelLayout`], `panels.rs`), the emitter ([`GemmEmitter`]
//! with the [`Epilogue`] trait and the store/load helpers), and the host
//! side here: the tier check ([`code_tier`]), a graph constant's packed
//! copy ([`PackedWeights`]) and the activations as the tiers read them
//! ([`activations`]).

mod emit;
mod panels;
mod schedule;

use std::borrow::Cow;
use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use kvjit_core::{CodeTier, CpuTier, DType, PreparedConstant, Result, Tensor, TensorData, bf16, f16};
use kvjit_jit::JitError;
use kvjit_jit::microkernel::{self, MAX_TILE_ROWS};

pub use emit::{
    Epilogue, GemmBases, GemmEmitter, PanelAt, Scratch, SegmentBounds, addressable, displacements, gemv_per_row,
    gemv_rows, gemv_rows_on, load_columns, store_columns,
};
pub use panels::{PanelLayout, Segment, WeightOrientation, layout_version};
pub use schedule::{AVX2_BLOCK_BYTES, AVX2_BLOCK_ROWS, K_UNROLL, MC, MR, NR, Schedule};

/// The code tier a CPU spec's GEMM runs on: the tier its backend names
/// (`tier`, `None` for a CUDA spec), checked to run on this CPU (a 256-bit
/// spec made on another machine is refused, not run).
pub fn code_tier(tier: Option<CodeTier>, key: &kvjit_core::KernelKey) -> Result<CodeTier, JitError> {
    match tier {
        Some(CodeTier::Avx2) if !microkernel::avx2_available() => Err(JitError::TierUnavailable {
            tier: CpuTier::Avx2,
            needs: "an x86-64 CPU with AVX2, FMA and F16C",
            arch: std::env::consts::ARCH,
        }),
        Some(tier) => Ok(tier),
        None => Err(JitError::Unsupported { key: key.to_string(), reason: "not a CPU spec".into() }),
    }
}

/// A graph constant's weights (absent when they came prepared from an
/// artifact) and their panels, packed once at build.
pub struct PackedWeights {
    plain: Vec<Arc<Tensor>>,
    packed: Arc<Tensor>,
}

impl PackedWeights {
    /// Pack the sibling weights `plain` into `layout` now.
    pub fn pack(layout: &PanelLayout, plain: Vec<Arc<Tensor>>) -> Result<Self> {
        let refs: Vec<&Tensor> = plain.iter().map(|w| &**w).collect();
        let packed = Arc::new(layout.pack(&refs)?);
        Ok(Self { plain, packed })
    }

    /// Panels made earlier (a prepared constant from an artifact), checked
    /// to be `layout`'s panels of `dtype`; otherwise `Err((expected, got))`,
    /// each naming a layout id, dtype and shape, for the op's error.
    pub fn prepared(
        layout: &PanelLayout,
        dtype: DType,
        prepared: &PreparedConstant,
    ) -> std::result::Result<Self, (String, String)> {
        let expected = layout.id(dtype);
        let data = &prepared.data;
        if prepared.layout != expected
            || data.dtype() != dtype
            || data.shape() != [layout.packed_len()]
            || !data.is_contiguous()
        {
            return Err((
                format!("{expected} ({dtype}[{}])", layout.packed_len()),
                format!("{} ({}{:?})", prepared.layout, data.dtype(), data.shape()),
            ));
        }
        Ok(Self { plain: Vec::new(), packed: data.clone() })
    }

    /// The packed panels.
    pub fn packed(&self) -> &Arc<Tensor> {
        &self.packed
    }

    /// The panels to use for a call whose weights are `weights`, if they
    /// are these very constants (the same allocations), or the packed
    /// tensor itself.
    pub fn panels_for(&self, weights: &[&Tensor]) -> Option<&Tensor> {
        let same = |a: &Tensor, b: &Tensor| same_data(a, b);
        let is_plain = self.plain.len() == weights.len() && self.plain.iter().zip(weights).all(|(p, w)| same(p, w));
        let is_packed = weights.len() == 1 && same(&self.packed, weights[0]);
        (is_plain || is_packed).then_some(&*self.packed)
    }
}

/// Whether two tensors are the very same bytes (one allocation, one shape
/// and dtype): how a call's weight is recognized as the constant a kernel
/// packed. Equal contents in another allocation do not count: a caller may
/// change its own tensor between calls.
pub fn same_data(a: &Tensor, b: &Tensor) -> bool {
    a.dtype() == b.dtype() && a.shape() == b.shape() && std::ptr::eq(a.as_bytes(), b.as_bytes())
}

/// The activations of a call as the kernel's tiles read them.
pub enum Activations<'a> {
    /// f32 rows, or tiles of rows ([`pack_activations`]).
    F32(Cow<'a, [f32]>),
    /// One row quantized per 32 values for an integer GEMV on block
    /// panels ([`kvjit_jit::quant::quantize_activations`]).
    Q8(Vec<u8>),
}

impl Activations<'_> {
    /// The address the kernel reads ([`GemmBases::x`]).
    pub fn as_ptr(&self) -> *const u8 {
        match self {
            Activations::F32(x) => x.as_ptr().cast(),
            Activations::Q8(x) => x.as_ptr(),
        }
    }
}

/// The activations of `rows` rows of K as the tier's tiles read them for
/// panels of `panels` ([`PanelLayout::panel_dtype`]), and the tile step
/// ([`GemmBases::x_step`]): f32 rows (widened from bf16/f16), packed in
/// tiles of 6 rows on the 256-bit tier when there is more than one row;
/// up to [`gemv_rows`] rows against block panels with an integer GEMV,
/// each row quantized per block of 32, row after row (what the emitter's
/// GEMV per row reads: the same rule, [`gemv_per_row`], on the same row
/// count).
pub fn activations(x: &Tensor, rows: usize, k: usize, tier: CodeTier, panels: DType) -> (Activations<'_>, usize) {
    let plain = rows_as_f32(x);
    match tier {
        CodeTier::Avx2 if gemv_per_row(tier, panels, rows) => {
            // K is a multiple of 32, so the rows' blocks follow each other
            // row after row: one call quantizes them all.
            let mut q = vec![0u8; rows * quantized_row_bytes(k)];
            kvjit_jit::quant::quantize_activations(&plain, &mut q);
            (Activations::Q8(q), 1)
        }
        CodeTier::Avx2 if rows > 1 => {
            (Activations::F32(Cow::Owned(pack_activations(&plain, rows, k, MAX_TILE_ROWS))), MAX_TILE_ROWS)
        }
        _ => (Activations::F32(plain), 1),
    }
}

/// Bytes of one row of K activations quantized per block of 32 for the
/// integer GEMV (rows follow each other at this stride).
fn quantized_row_bytes(k: usize) -> usize {
    k / 32 * kvjit_jit::quant::Q8_ACTIVATION_BLOCK_BYTES
}

/// The 256-bit tier's activation layout: rows in tiles of `step`, each
/// tile k-major with its rows interleaved (`[M/step][K][step]`, the last
/// tile zero-padded), so a tile's micro-kernel reads one sequential stream
/// of x instead of `step` rows 4·K bytes apart (which share L1 sets when K is
/// a multiple of 1024).
pub fn pack_activations(x: &[f32], rows: usize, k: usize, step: usize) -> Vec<f32> {
    let tiles = rows.div_ceil(step);
    let mut packed = vec![0f32; tiles * k * step];
    if k == 0 {
        return packed; // no elements
    }
    for (t, tile) in packed.chunks_exact_mut(k * step).enumerate() {
        for i in 0..step.min(rows - t * step) {
            let row = &x[(t * step + i) * k..][..k];
            for (slot, &value) in tile[i..].iter_mut().step_by(step).zip(row) {
                *slot = value;
            }
        }
    }
    packed
}

/// A float tensor's elements as f32 (borrowed when already f32).
///
/// # Panics
/// On a u32 or f8e4m3 tensor: callers pass activations their check
/// accepted as f32, bf16 or f16.
pub fn rows_as_f32(x: &Tensor) -> Cow<'_, [f32]> {
    let convert = |len: usize, f: &dyn Fn(&mut [f32])| {
        let mut out = vec![0f32; len];
        f(&mut out);
        Cow::Owned(out)
    };
    match x.data() {
        TensorData::F32(x) => Cow::Borrowed(x),
        TensorData::BF16(x) => convert(x.len(), &|out| <[bf16]>::convert_to_f32_slice(x, out)),
        TensorData::F16(x) => convert(x.len(), &|out| <[f16]>::convert_to_f32_slice(x, out)),
        TensorData::U32(_) | TensorData::F8E4M3(_) | TensorData::Blocks(..) => {
            unreachable!("the check accepts activations of the compute floats only")
        }
    }
}
