//! The packed weight layout of the CPU kernels: how a `[N, K]` weight is
//! cut into panels of the tier's width (8 columns on the Cranelift tier, 16
//! on the 256-bit tier), k-major (`[K][width]`), one run of panels per Q, K
//! and V segment, each zero-padded to a whole panel.
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

use crate::FusedQkvSpec;

/// The version of the packed layout: the first 16 hex digits of the
/// SHA-256 of this file's text (line endings normalized to `\n`), computed
/// once. Any change to the packing code changes it.
pub fn layout_version() -> &'static str {
    static VERSION: OnceLock<String> = OnceLock::new();
    VERSION.get_or_init(|| {
        let source: Vec<u8> = include_str!("panels.rs").bytes().filter(|&b| b != b'\r').collect();
        Sha256::digest(&source)[..8].iter().map(|b| format!("{b:02x}")).collect()
    })
}

/// Where a segment's columns go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Destination {
    Q,
    K,
    V,
}

/// A run of columns with one destination, and its panels.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Segment {
    pub(crate) destination: Destination,
    pub(crate) first_column: usize,
    pub(crate) columns: usize,
    pub(crate) first_panel: usize,
}

impl Segment {
    pub(crate) fn panels(&self, nr: usize) -> usize {
        self.columns.div_ceil(nr)
    }
}

/// How the weight's columns are cut into panels.
#[derive(Clone, Copy, Debug)]
pub struct PanelLayout {
    pub(crate) segments: [Segment; 3],
    pub(crate) k: usize,
    /// Columns per panel.
    nr: usize,
}

impl PanelLayout {
    /// The layout for a spec, in panels of `panel_columns` columns (the
    /// tier's [`Schedule::panel_columns`](crate::cpu_jit::Schedule::panel_columns)).
    pub fn new(spec: &FusedQkvSpec, panel_columns: usize) -> Self {
        let nr = panel_columns;
        let kv = spec.kv_dim();
        let q = Segment { destination: Destination::Q, first_column: 0, columns: spec.q_dim, first_panel: 0 };
        let k =
            Segment { destination: Destination::K, first_column: spec.q_dim, columns: kv, first_panel: q.panels(nr) };
        let v = Segment {
            destination: Destination::V,
            first_column: spec.q_dim + kv,
            columns: kv,
            first_panel: q.panels(nr) + k.panels(nr),
        };
        Self { segments: [q, k, v], k: spec.k, nr }
    }

    /// Columns per panel.
    pub fn panel_columns(&self) -> usize {
        self.nr
    }

    /// Panels in all.
    pub fn total_panels(&self) -> usize {
        self.segments.iter().map(|s| s.panels(self.nr)).sum()
    }

    /// Names this layout and everything it depends on (the prepared
    /// constant's [`layout`](kvjit_core::PreparedConstant::layout)): the
    /// packing code's [`layout_version`], the panel width, dtype, K and
    /// the Q/K/V column counts.
    pub fn id(&self, dtype: DType) -> String {
        let [q, k, v] = self.segments.map(|s| s.columns);
        format!("fused_qkv.panels.{}.nr{}.{dtype}.k{}.cols{q}+{k}+{v}", layout_version(), self.nr, self.k)
    }

    /// Elements of the packed weight.
    pub fn packed_len(&self) -> usize {
        self.total_panels() * self.k * self.nr
    }

    /// Pack a `[N, K]` weight into panels (zero-padded), keeping its dtype.
    pub fn pack(&self, weight: &Tensor) -> Result<Tensor> {
        // Panel by panel, column by column (see below). The panels go to
        // huge-page memory (few faults to make, few TLB misses to stream).
        fn pack_typed<T: Copy + Default + bytemuck::Pod>(layout: &PanelLayout, w: &[T], out: &mut [u8]) {
            let (k, nr) = (layout.k, layout.nr);
            if k == 0 {
                return; // no elements: nothing to pack
            }
            let out: &mut [T] = bytemuck::cast_slice_mut(out);
            let mut panels = out.chunks_exact_mut(k * nr);
            for seg in &layout.segments {
                for p in 0..seg.panels(nr) {
                    let columns = nr.min(seg.columns - p * nr);
                    let first = seg.first_column + p * nr;
                    let panel = panels.next().expect("packed_len counts every panel");
                    // Column by column: each weight row is read as one
                    // sequential stream (reading the panel's rows side by
                    // side would make `nr` streams 4·K bytes apart, which
                    // share L1 sets), written at stride `nr` into the panel,
                    // which stays in cache.
                    for c in 0..nr {
                        let slots = panel[c..].iter_mut().step_by(nr);
                        if c < columns {
                            for (slot, &value) in slots.zip(&w[(first + c) * k..][..k]) {
                                *slot = value;
                            }
                        } else {
                            slots.for_each(|slot| *slot = T::default());
                        }
                    }
                }
            }
        }
        let shape = [self.packed_len()];
        match weight.data() {
            TensorData::F32(w) => Tensor::anonymous(DType::F32, &shape, |out| pack_typed(self, w, out)),
            TensorData::BF16(w) => Tensor::anonymous(DType::BF16, &shape, |out| pack_typed(self, w, out)),
            TensorData::F16(w) => Tensor::anonymous(DType::F16, &shape, |out| pack_typed(self, w, out)),
            TensorData::U32(_) | TensorData::F8E4M3(_) => {
                Err(Error::NotFloat { what: "weight".into(), dtype: weight.dtype() })
            }
        }
    }
}
