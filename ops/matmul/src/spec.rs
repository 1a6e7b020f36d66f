//! The specs of the matmul kernels — one GEMM ([`MatmulSpec`]) and what its
//! epilogue does ([`Epilogue`]) — and their call contracts: `[a, b]`
//! ([`MatmulSpec`] itself), `[a, b, other]` ([`EpilogueMatmulSpec`]) and
//! `[a, gate, up]` ([`SwigluMatmulSpec`]), one check and one f64 reference
//! for all three.

use kvjit_core::{Backend, CodeTier, DType, KernelKey, KernelSpec, KeyField, PagedKVCacheCollection, Result, Tensor};
use kvjit_op::gemm::{WeightOrientation, same_data};
use kvjit_op::rows::{Rows, expect_rows};
use kvjit_op::{Call, CallContract, TensorArg, store_f64};
use kvjit_runtime::OutputSpec;

/// What the GEMM's epilogue computes from a row of C = a·b (and, where it
/// takes one, the same row of an operand `other`, or of C' = a·up).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// C (`mo.matmul`).
    None,
    /// `silu(C)`.
    Silu,
    /// `C + other`.
    Add,
    /// `C · other`.
    Mul,
    /// `silu(C) · other`.
    SiluMul,
    /// `silu(C) · C'`, C' from the sibling weight `up`.
    SwiGlu,
}

impl Epilogue {
    /// The kernel name of a GEMM with this epilogue: `matmul`,
    /// `matmul_silu`, `matmul_add`, `matmul_mul`, `matmul_silu_mul`,
    /// `swiglu_matmul`.
    pub fn kernel_name(self) -> &'static str {
        match self {
            Self::None => "matmul",
            Self::Silu => "matmul_silu",
            Self::Add => "matmul_add",
            Self::Mul => "matmul_mul",
            Self::SiluMul => "matmul_silu_mul",
            Self::SwiGlu => "swiglu_matmul",
        }
    }

    /// Sibling weights the GEMM multiplies by (2 for SwiGLU).
    pub fn weights(self) -> usize {
        if self == Self::SwiGlu { 2 } else { 1 }
    }

    /// Whether it reads an operand `other` of the result's shape.
    pub fn has_operand(self) -> bool {
        matches!(self, Self::Add | Self::Mul | Self::SiluMul)
    }

    /// The epilogue in f64 on C (and `other` or C'): the reference's
    /// arithmetic.
    pub fn apply(self, c: f64, operand: f64) -> f64 {
        let silu = kvjit_op_silu::reference::silu;
        match self {
            Self::None => c,
            Self::Silu => silu(c),
            Self::Add => c + operand,
            Self::Mul => c * operand,
            Self::SiluMul | Self::SwiGlu => silu(c) * operand,
        }
    }
}

/// Everything a matmul kernel bakes in: backend (with the CPU code tier),
/// dtype, K and (when every leading dim of `a` is static) the row count,
/// N, how the weight holds its columns, and the epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulSpec {
    /// Target, and on the CPU the (resolved) code tier.
    pub backend: Backend,
    /// Dtype of `a` and the result (and of float weights).
    pub dtype: DType,
    /// The weights' dtype: `dtype`, or a weight block format
    /// ([`DType::BLOCK_FORMATS`]) decoded by the kernel as it reads.
    pub weights: DType,
    /// K (the row width of `a`) and, if static, the row count M.
    pub rows: Rows,
    /// Columns of the result, N.
    pub n: usize,
    /// `[N, K]` (`transpose_b`) or `[K, N]` weights.
    pub orientation: WeightOrientation,
    /// What the epilogue computes.
    pub epilogue: Epilogue,
}

impl MatmulSpec {
    /// K.
    pub fn k(&self) -> usize {
        self.rows.width
    }

    /// The code tier of a CPU spec (`None` for CUDA).
    pub fn tier(&self) -> Option<CodeTier> {
        self.backend.cpu_tier()
    }

    /// The shape each weight has.
    pub fn weight_shape(&self) -> [usize; 2] {
        match self.orientation {
            WeightOrientation::NK => [self.n, self.k()],
            WeightOrientation::KN => [self.k(), self.n],
        }
    }

    /// Check a call against the spec: `a` `[..., K]` (with the baked row
    /// count, if any), each weight of [`weight_shape`](Self::weight_shape)
    /// — or, for a kernel holding packed panels, that very tensor — and
    /// `other` of the result's shape. Writes nothing.
    pub fn check_call(&self, tensors: &[&Tensor], packed: Option<&Tensor>) -> Result<MatmulCall> {
        let a = tensors[0];
        let rows = expect_rows("a", a, self.rows, self)?;
        let weight_names: &[&'static str] = if self.epilogue.weights() == 2 { &["gate", "up"] } else { &["b"] };
        let weights = &tensors[1..=weight_names.len()];
        let all_packed = weights.len() == 1 && packed.is_some_and(|p| same_data(p, weights[0]));
        if !all_packed {
            for (&name, weight) in weight_names.iter().zip(weights) {
                kvjit_core::expect_arg(name, weight, self.weights)?;
                if weight.shape() != self.weight_shape() {
                    let expected = format!("{:?} (baked into {})", self.weight_shape(), self.key());
                    return Err(kvjit_core::Error::NotBuiltFor { arg: name, expected, got: weight.shape().to_vec() });
                }
            }
        }
        let mut output = a.shape().to_vec();
        *output.last_mut().expect("expect_rows checked a has rank ≥ 1") = self.n;
        if self.epilogue.has_operand() {
            let other = tensors[2];
            if other.shape() != output.as_slice() {
                return Err(kvjit_core::shape_mismatch("other", format!("{output:?} (the matmul's result)"), other));
            }
        }
        Ok(MatmulCall { rows, output })
    }

    /// The reference: every element of C in f64 from the f32 values of `a`
    /// and the weights, the epilogue in f64, rounded once to the dtype.
    pub fn reference_call(&self, checked: &MatmulCall, call: Call<'_, '_>) -> Result<()> {
        let (m, n, k) = (checked.rows, self.n, self.k());
        let a = call.tensors[0].to_f32_vec()?;
        let weight = |t: &Tensor| -> Result<Vec<f64>> { Ok(t.to_f32_vec()?.into_iter().map(f64::from).collect()) };
        let b = weight(call.tensors[1])?;
        let operand = match self.epilogue {
            Epilogue::SwiGlu => Some(weight(call.tensors[2])?),
            e if e.has_operand() => Some(call.tensors[2].to_f32_vec()?.into_iter().map(f64::from).collect()),
            _ => None,
        };
        let at = |w: &[f64], col: usize, kk: usize| match self.orientation {
            WeightOrientation::NK => w[col * k + kk],
            WeightOrientation::KN => w[kk * n + col],
        };
        let mut out = vec![0f64; m * n];
        for r in 0..m {
            let row = &a[r * k..][..k];
            for col in 0..n {
                let dot = |w: &[f64]| row.iter().enumerate().map(|(kk, &x)| f64::from(x) * at(w, col, kk)).sum::<f64>();
                let c = dot(&b);
                let operand = match (&operand, self.epilogue) {
                    (Some(up), Epilogue::SwiGlu) => dot(up),
                    (Some(other), _) => other[r * n + col],
                    (None, _) => 0.0,
                };
                out[r * n + col] = self.epilogue.apply(c, operand);
            }
        }
        store_f64(&mut call.outputs[0], &out)
    }
}

/// What a checked matmul call learned: its rows M and the result's shape.
#[derive(Clone, Debug)]
pub struct MatmulCall {
    /// Rows of `a`, M.
    pub rows: usize,
    /// The result's shape, `[..., N]`.
    pub output: Vec<usize>,
}

impl KernelSpec for MatmulSpec {
    /// `matmul_add.cpu-avx2.bf16.k4096.n4096.rowsany.tb1`: the epilogue in
    /// the name, the CPU tier in the target, then K, N, the row count and
    /// whether the weight is `[N, K]` (`tb1`) or `[K, N]` (`tb0`); block
    /// weights add their format (`…tb1.wq4_1`).
    fn key_name(&self) -> KernelKey {
        let key = KernelKey::new(self.epilogue.kernel_name(), self.backend.target(), self.dtype);
        let key = match self.tier() {
            Some(tier) => key.with_variant(tier.name()),
            None => key,
        };
        let key = key
            .with("k", KeyField::size(self.k()))
            .with("n", KeyField::size(self.n))
            .with("rows", KeyField::dim(self.rows.rows))
            .with("tb", KeyField::Static(u64::from(self.orientation == WeightOrientation::NK)));
        match self.weights == self.dtype {
            true => key,
            false => key.with("w", KeyField::DType(self.weights)),
        }
    }
}

/// A matmul spec with its call contract: the one GEMM every matmul
/// kernel's code and check are made from.
pub trait MatmulContract: CallContract<Checked = MatmulCall> + Copy + Send + Sync {
    /// The GEMM.
    fn gemm(&self) -> &MatmulSpec;
}

impl MatmulContract for MatmulSpec {
    fn gemm(&self) -> &MatmulSpec {
        self
    }
}

/// `[a, b]`: `mo.matmul` and `kvjit.matmul_silu`.
impl CallContract for MatmulSpec {
    type Checked = MatmulCall;
    const TENSORS: &'static [TensorArg] = &[TensorArg::compute("a"), TensorArg::checked("b")];

    fn check(&self, tensors: &[&Tensor], _caches: &[&PagedKVCacheCollection]) -> Result<MatmulCall> {
        self.check_call(tensors, None)
    }

    fn outputs(&self, checked: &MatmulCall) -> Vec<OutputSpec> {
        vec![(self.dtype, checked.output.clone())]
    }

    fn reference(&self, checked: MatmulCall, call: Call<'_, '_>) -> Result<()> {
        self.reference_call(&checked, call)
    }
}

/// Declare a spec that wraps [`MatmulSpec`] with its own tensor arguments.
macro_rules! wrapped_spec {
    ($(#[$meta:meta])* $name:ident, [$($kind:ident $arg:literal),+]) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub struct $name(pub MatmulSpec);

        impl KernelSpec for $name {
            fn key_name(&self) -> KernelKey {
                self.0.key_name()
            }
        }

        impl MatmulContract for $name {
            fn gemm(&self) -> &MatmulSpec {
                &self.0
            }
        }

        impl CallContract for $name {
            type Checked = MatmulCall;
            const TENSORS: &'static [TensorArg] = &[$(TensorArg::$kind($arg)),+];

            fn check(&self, tensors: &[&Tensor], _caches: &[&PagedKVCacheCollection]) -> Result<MatmulCall> {
                self.0.check_call(tensors, None)
            }

            fn outputs(&self, checked: &MatmulCall) -> Vec<OutputSpec> {
                vec![(self.0.dtype, checked.output.clone())]
            }

            fn reference(&self, checked: MatmulCall, call: Call<'_, '_>) -> Result<()> {
                self.0.reference_call(&checked, call)
            }
        }
    };
}

wrapped_spec!(
    /// `[a, b, other]`: `kvjit.matmul_epilogue` (add, mul, silu_mul).
    EpilogueMatmulSpec,
    [compute "a", checked "b", compute "other"]
);

wrapped_spec!(
    /// `[a, gate, up]`: `kvjit.swiglu_matmul`.
    SwigluMatmulSpec,
    [compute "a", checked "gate", checked "up"]
);
