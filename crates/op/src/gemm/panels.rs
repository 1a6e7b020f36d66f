//! The packed weight layout of the GEMM kernels: how the columns of C (the
//! rows of a `[N, K]` weight, or the columns of a `[K, N]` one) are cut into
//! panels of the tier's width (8 columns on the Cranelift tier, 16 on the
//! 256-bit tier), k-major (`[K][width]`), one run of panels per segment
//! (the fused QKV op's Q, K and V), each zero-padded to a whole panel.
//! With `weights` sibling weights (a SwiGLU's gate and up), panel p of
//! every weight sits side by side: a work item (a "panel group") holds the
//! same columns of each.
//!
//! This file is the packing code and nothing else: its own text is hashed
//! into [`layout_version`], which every layout id names. A packed weight
//! stored by an older build (a compiled artifact) is refused by a build
//! whose packing differs, whatever the change, with no version to bump by
//! hand. Keep code that does not decide where a weight element goes out of
//! this file (every edit here retires the artifacts made before it).

use std::sync::OnceLock;

use kvjit_core::{DType, Error, Result, Tensor, TensorData};
use sha2::{Digest, Sha256};

/// The version of the packed layout: the first 16 hex digits of the
/// SHA-256 of this file's text and of the block panels' packing code
/// ([`kvjit_jit::quant::PACKING_SOURCE`]) (line endings normalized to
/// `\n`), computed once. Any change to the packing code changes it.
pub fn layout_version() -> &'static str {
    static VERSION: OnceLock<String> = OnceLock::new();
    VERSION.get_or_init(|| {
        let texts = [include_str!("panels.rs"), kvjit_jit::quant::PACKING_SOURCE];
        let source: Vec<u8> = texts.iter().flat_map(|t| t.bytes()).filter(|&b| b != b'\r').collect();
        Sha256::digest(&source)[..8].iter().map(|b| format!("{b:02x}")).collect()
    })
}

/// How a weight holds the columns of C.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightOrientation {
    /// `[N, K]`: row n is column n of C (`a·bᵀ`, `transpose_b = true`).
    NK,
    /// `[K, N]`: column n is column n of C (`a·b`).
    KN,
}

/// A run of columns of C, and the panel groups that hold them.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    /// The segment's first column, in the weight.
    pub first_column: usize,
    /// Its columns.
    pub columns: usize,
    /// Its first panel group.
    pub first_panel: usize,
}

impl Segment {
    /// Panel groups of the segment (panels of `nr` columns).
    pub fn panels(&self, nr: usize) -> usize {
        self.columns.div_ceil(nr)
    }
}

/// How the weight's columns are cut into panels.
#[derive(Clone, Debug)]
pub struct PanelLayout {
    segments: Vec<Segment>,
    k: usize,
    /// Columns per panel.
    nr: usize,
    /// Sibling weights whose panels sit side by side (1, or 2 for SwiGLU).
    weights: usize,
    orientation: WeightOrientation,
    /// Who packs this layout (`fused_qkv`, `matmul`), named in its id.
    owner: &'static str,
}

impl PanelLayout {
    /// The layout of `weights` sibling weights of `n` columns (the sum of
    /// `segment_columns`) over `k`, held as `orientation`, in panels of
    /// `panel_columns` columns (the tier's
    /// [`Schedule::panel_columns`](super::Schedule::panel_columns)).
    pub fn new(
        owner: &'static str,
        segment_columns: &[usize],
        k: usize,
        panel_columns: usize,
        weights: usize,
        orientation: WeightOrientation,
    ) -> Self {
        let nr = panel_columns;
        let (mut first_column, mut first_panel) = (0, 0);
        let segments = segment_columns
            .iter()
            .map(|&columns| {
                let segment = Segment { first_column, columns, first_panel };
                first_column += columns;
                first_panel += segment.panels(nr);
                segment
            })
            .collect();
        Self { segments, k, nr, weights, orientation, owner }
    }

    /// The segments, in column order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// K.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Columns per panel.
    pub fn panel_columns(&self) -> usize {
        self.nr
    }

    /// Sibling weights per panel group.
    pub fn weights(&self) -> usize {
        self.weights
    }

    /// Columns of C per weight, N.
    pub fn n(&self) -> usize {
        self.segments.iter().map(|s| s.columns).sum()
    }

    /// Panel groups in all (the work items of a launch).
    pub fn total_panels(&self) -> usize {
        self.segments.iter().map(|s| s.panels(self.nr)).sum()
    }

    /// Names this layout and everything it depends on (the prepared
    /// constant's [`layout`](kvjit_core::PreparedConstant::layout)): the
    /// owner, the packing code's [`layout_version`], the panel width, the
    /// sibling count, orientation, dtype, K and the segments' columns.
    pub fn id(&self, dtype: DType) -> String {
        let columns: Vec<String> = self.segments.iter().map(|s| s.columns.to_string()).collect();
        format!(
            "{}.panels.{}.nr{}.w{}.{:?}.{dtype}.k{}.cols{}",
            self.owner,
            layout_version(),
            self.nr,
            self.weights,
            self.orientation,
            self.k,
            columns.join("+")
        )
    }

    /// The dtype of the panels made from weights of `weights`: the same,
    /// except a weight block format in panels narrower than the 256-bit
    /// tier's (the Cranelift tier's), which is dequantized to f32 as it is
    /// packed (the 256-bit tier's micro-kernels decode blocks as they read;
    /// Cranelift's tile reads floats).
    pub fn panel_dtype(&self, weights: DType) -> DType {
        match weights.is_block_format() && self.nr != kvjit_jit::microkernel::TILE_COLUMNS {
            true => DType::F32,
            false => weights,
        }
    }

    /// Elements of the packed weight.
    pub fn packed_len(&self) -> usize {
        self.total_panels() * self.weights * self.k * self.nr
    }

    /// The shape each weight must have.
    pub fn weight_shape(&self) -> [usize; 2] {
        match self.orientation {
            WeightOrientation::NK => [self.n(), self.k],
            WeightOrientation::KN => [self.k, self.n()],
        }
    }

    /// Pack the sibling `weights` (one per [`weights`](Self::weights), each
    /// of [`weight_shape`](Self::weight_shape) and one float dtype or weight
    /// block format) into panels (zero-padded) of
    /// [`panel_dtype`](Self::panel_dtype). Block panels keep each k block's
    /// 16 columns together in the layout their micro-kernels read
    /// ([`kvjit_jit::quant::pack_panel`]).
    pub fn pack(&self, weights: &[&Tensor]) -> Result<Tensor> {
        // Panel by panel, column by column (see below). The panels go to
        // huge-page memory (few faults to make, few TLB misses to stream).
        fn pack_typed<T: Copy + Default + bytemuck::Pod>(layout: &PanelLayout, ws: &[&[T]], out: &mut [u8]) {
            let (k, nr, n) = (layout.k, layout.nr, layout.n());
            if k == 0 {
                return; // no elements: nothing to pack
            }
            let out: &mut [T] = bytemuck::cast_slice_mut(out);
            let mut panels = out.chunks_exact_mut(k * nr);
            for seg in &layout.segments {
                for p in 0..seg.panels(nr) {
                    let columns = nr.min(seg.columns - p * nr);
                    let first = seg.first_column + p * nr;
                    for w in ws {
                        let panel = panels.next().expect("packed_len counts every panel");
                        // Column by column: an `[N, K]` weight row is read as
                        // one sequential stream (reading the panel's rows
                        // side by side would make `nr` streams 4·K bytes
                        // apart, which share L1 sets), written at stride `nr`
                        // into the panel, which stays in cache.
                        for c in 0..nr {
                            let slots = panel[c..].iter_mut().step_by(nr);
                            if c >= columns {
                                slots.for_each(|slot| *slot = T::default());
                                continue;
                            }
                            match layout.orientation {
                                WeightOrientation::NK => {
                                    for (slot, &value) in slots.zip(&w[(first + c) * k..][..k]) {
                                        *slot = value;
                                    }
                                }
                                WeightOrientation::KN => {
                                    for (slot, &value) in slots.zip(w[first + c..].iter().step_by(n)) {
                                        *slot = value;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        let shape = [self.packed_len()];
        let dtype = weights[0].dtype();
        let expected = self.weight_shape();
        if let Some(w) = weights.iter().find(|w| w.dtype() != dtype || w.shape() != expected || !w.is_contiguous()) {
            return Err(kvjit_core::shape_mismatch("weight", format!("contiguous {dtype}{expected:?}"), w));
        }
        if dtype.is_block_format() {
            return self.pack_blocks(weights);
        }
        match dtype {
            DType::F32 => {
                let ws: Vec<&[f32]> = weights.iter().map(|w| w.as_slice::<f32>()).collect::<Result<_>>()?;
                Tensor::anonymous(DType::F32, &shape, |out| pack_typed(self, &ws, out))
            }
            DType::BF16 | DType::F16 => {
                fn bits(w: &Tensor) -> &[u16] {
                    match w.data() {
                        TensorData::BF16(x) => bytemuck::cast_slice(x),
                        TensorData::F16(x) => bytemuck::cast_slice(x),
                        _ => unreachable!("every weight has the first one's dtype"),
                    }
                }
                let ws: Vec<&[u16]> = weights.iter().map(|w| bits(w)).collect();
                Tensor::anonymous(dtype, &shape, |out| pack_typed(self, &ws, out))
            }
            _ => Err(Error::NotFloat { what: "weight".into(), dtype }),
        }
    }

    /// [`pack`](Self::pack) for weights of a block format: `[N, K]` rows of
    /// whole blocks, into block panels on the 256-bit tier, or dequantized
    /// into f32 panels (see [`panel_dtype`](Self::panel_dtype)).
    fn pack_blocks(&self, weights: &[&Tensor]) -> Result<Tensor> {
        let format = weights[0].dtype();
        let (k, nr) = (self.k, self.nr);
        if self.orientation != WeightOrientation::NK || !k.is_multiple_of(format.block().0) {
            let expected = format!("[N, K] rows of whole {}-weight {format} blocks", format.block().0);
            return Err(kvjit_core::shape_mismatch("weight", expected, weights[0]));
        }
        if self.panel_dtype(format) != format {
            let plain = weights
                .iter()
                .map(|w| Tensor::from_vec(w.shape(), w.to_f32_vec()?))
                .collect::<Result<Vec<Tensor>>>()?;
            let plain: Vec<&Tensor> = plain.iter().collect();
            return self.pack(&plain);
        }
        let row_bytes = format.storage_bytes(k).expect("K is a multiple of the block");
        let panel_bytes = kvjit_jit::quant::panel_bytes(format, k);
        Tensor::anonymous(format, &[self.packed_len()], |out| {
            let mut panels = out.chunks_exact_mut(panel_bytes);
            for seg in &self.segments {
                for p in 0..seg.panels(nr) {
                    let first = seg.first_column + p * nr;
                    let columns = nr.min(seg.columns - p * nr);
                    for w in weights {
                        let rows = &w.as_bytes()[first * row_bytes..][..columns * row_bytes];
                        let columns: Vec<&[u8]> = rows.chunks_exact(row_bytes).collect();
                        let panel = panels.next().expect("packed_len counts every panel");
                        kvjit_jit::quant::pack_panel(format, &columns, k, panel);
                    }
                }
            }
        })
    }
}
