//! [`OpKernel`]: what an op's kernel declares — how a call is checked
//! ([`CallContract`], once per op, shared by all its kernels) and how a
//! checked call runs — and [`Compiled`], the one [`Kernel`] impl over it.
//!
//! Written once here, for every op: the arity error, the dtype and
//! contiguity check of every tensor whose dtype the signature fixes, the
//! check of the outputs against the shapes the call gives, and the order
//! that makes a kernel safe to hand anything — every argument is checked
//! before [`OpKernel::run`] is called, so nothing is written for a call
//! that is refused.

use kvjit_core::{DType, Error, KernelKey, KernelSpec, PagedKVCacheCollection, PreparedConstant, Result, Tensor};
use kvjit_runtime::{CodeInfo, DeviceContextPtr, Kernel, OutputSpec};

/// The dtype a tensor argument must have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgDType {
    /// The compute dtype the spec's key names.
    Compute,
    /// This dtype.
    Exactly(DType),
    /// Any (the op's check says which).
    Checked,
}

/// One tensor argument of a kernel call: its name and dtype rule.
#[derive(Clone, Copy, Debug)]
pub struct TensorArg {
    /// Name, as in the op's documentation and errors.
    pub name: &'static str,
    /// Which dtype it must have.
    pub dtype: ArgDType,
}

impl TensorArg {
    /// A tensor of the compute dtype.
    pub const fn compute(name: &'static str) -> Self {
        Self { name, dtype: ArgDType::Compute }
    }

    /// A u32 tensor (`layer_idx`, `valid_lengths`, token ids).
    pub const fn u32(name: &'static str) -> Self {
        Self { name, dtype: ArgDType::Exactly(DType::U32) }
    }

    /// A tensor whose dtype the op's check decides.
    pub const fn checked(name: &'static str) -> Self {
        Self { name, dtype: ArgDType::Checked }
    }

    /// A paged op's layer index (a u32 scalar), by the name MAX gives it.
    pub const LAYER_IDX: Self = Self::u32("layer_idx");
    /// A paged op's valid lengths (u32 `[B]`), by the name MAX gives it.
    pub const VALID_LENGTHS: Self = Self::u32("valid_lengths");
}

/// A paged op's one cache argument, by the name MAX gives it
/// ([`CallContract::CACHES`]).
pub const KV_COLLECTION: &[&str] = &["kv_collection"];

/// How a kernel call is checked: declared once per op (on its spec),
/// shared by every kernel of the op.
pub trait CallContract: KernelSpec {
    /// What a successful check learns about a call (its sizes, plans),
    /// handed to [`OpKernel::run`].
    type Checked: Send;
    /// The tensor arguments, in order.
    const TENSORS: &'static [TensorArg];
    /// The caches, in order (names).
    const CACHES: &'static [&'static str] = &[];
    /// The outputs, in order (names).
    const OUTPUTS: &'static [&'static str] = &["output"];

    /// Check a call (arity and the declared dtypes already checked) against
    /// the contract and against what the spec bakes in; write nothing.
    fn check(&self, tensors: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> Result<Self::Checked>;

    /// The dtype and shape of each output of a checked call.
    fn outputs(&self, checked: &Self::Checked) -> Vec<OutputSpec>;

    /// Run a checked call with the op's reference implementation (plain
    /// Rust, f64 where it matters): the [`Reference`] kernel every fast
    /// kernel is tested against.
    fn reference(&self, checked: Self::Checked, call: Call<'_, '_>) -> Result<()>;
}

/// The reference kernel of any op: its spec's
/// [`reference`](CallContract::reference) behind [`OpKernel`] (wrap it in
/// [`Compiled`], as [`Op::build_reference`](crate::Op::build_reference)
/// does).
#[derive(Clone, Debug)]
pub struct Reference<S>(pub S);

impl<S> Reference<S> {
    /// The reference kernel of `spec`.
    pub fn new(spec: S) -> Self {
        Self(spec)
    }
}

impl<S: CallContract> OpKernel for Reference<S> {
    type Spec = S;
    const IMPLEMENTATION: &'static str = "reference";

    fn spec(&self) -> &S {
        &self.0
    }

    fn run(&self, checked: S::Checked, call: Call<'_, '_>, _: &DeviceContextPtr) -> Result<()> {
        self.0.reference(checked, call)
    }
}

/// One kernel of an op: how it runs a checked call. Wrap it in
/// [`Compiled`] to hand it to the runtime.
pub trait OpKernel: Send + Sync + 'static {
    /// The op's spec, which says how calls are checked.
    type Spec: CallContract;
    /// Which implementation this is, in a word (`jit`, `reference`, `cuda`).
    const IMPLEMENTATION: &'static str;
    /// Whether the kernel computes nothing: its one output is its first
    /// tensor input seen with the checked shape ([`Kernel::is_view`]).
    const IS_VIEW: bool = false;

    /// The spec the kernel was built for.
    fn spec(&self) -> &Self::Spec;

    /// Check a call; by default the spec's check. (A kernel holding a
    /// prepared constant also accepts that very tensor as its argument.)
    fn check(
        &self,
        tensors: &[&Tensor],
        caches: &[&PagedKVCacheCollection],
    ) -> Result<<Self::Spec as CallContract>::Checked> {
        self.spec().check(tensors, caches)
    }

    /// Run a call that [`check`](Self::check) accepted on exactly these
    /// arguments, with outputs of the shapes it gave.
    fn run(
        &self,
        checked: <Self::Spec as CallContract>::Checked,
        call: Call<'_, '_>,
        ctx: &DeviceContextPtr,
    ) -> Result<()>;

    /// What the kernel knows about its generated code.
    fn code_info(&self) -> CodeInfo {
        CodeInfo::default()
    }

    /// Constant inputs the kernel keeps in its own layout.
    fn prepared_constants(&self) -> Vec<(usize, PreparedConstant)> {
        Vec::new()
    }
}

/// The arguments of a checked call, as [`OpKernel::run`] gets them.
pub struct Call<'c, 'm> {
    /// Tensor inputs, in signature order.
    pub tensors: &'c [&'c Tensor],
    /// Caches, in signature order.
    pub caches: &'c mut [&'m mut PagedKVCacheCollection],
    /// Outputs, checked against the call's output shapes.
    pub outputs: &'c mut [Tensor],
}

impl<'c> Call<'c, '_> {
    /// The tensor inputs as an array (the arity was checked).
    pub fn tensors<const N: usize>(&self) -> [&'c Tensor; N] {
        self.tensors.try_into().expect("the arity was checked against the signature")
    }
}

/// The dtype and contiguity of every tensor whose dtype `S`'s signature
/// fixes ([`CallContract::TENSORS`], in order; `compute` is the key's
/// dtype): what [`Compiled`] checks before the op's check, and what a
/// kernel run outside the runtime (into raw output bytes) checks the same
/// way.
pub fn check_dtypes<S: CallContract>(compute: DType, tensors: &[&Tensor]) -> Result<()> {
    for (arg, tensor) in S::TENSORS.iter().zip(tensors) {
        let dtype = match arg.dtype {
            ArgDType::Compute => compute,
            ArgDType::Exactly(dtype) => dtype,
            ArgDType::Checked => continue,
        };
        kvjit_core::expect_arg(arg.name, tensor, dtype)?;
    }
    Ok(())
}

/// An [`OpKernel`] behind the runtime's [`Kernel`] interface, with the key
/// of its spec.
pub struct Compiled<K: OpKernel> {
    key: KernelKey,
    kernel: K,
}

impl<K: OpKernel> Compiled<K> {
    /// Wrap `kernel`.
    pub fn new(kernel: K) -> Self {
        Self { key: kernel.spec().key(), kernel }
    }

    /// The kernel itself.
    pub fn kernel(&self) -> &K {
        &self.kernel
    }

    /// The arity and declared dtypes of the inputs, then the op's check.
    fn checked(
        &self,
        tensors: &[&Tensor],
        caches: &[&PagedKVCacheCollection],
        outputs: Option<usize>,
    ) -> Result<<K::Spec as CallContract>::Checked> {
        check_signature::<K::Spec>(self.key.dtype(), tensors, caches, outputs)?;
        self.kernel.check(tensors, caches)
    }
}

/// What every entry to a kernel of spec `S` checks first: as many tensors,
/// caches (and, when given, outputs) as the signature declares
/// ([`Error::KernelArguments`], naming it), and the dtype and contiguity
/// of every tensor it declares a dtype for ([`check_dtypes`]).
pub fn check_signature<S: CallContract>(
    compute: DType,
    tensors: &[&Tensor],
    caches: &[&PagedKVCacheCollection],
    outputs: Option<usize>,
) -> Result<()> {
    let arity_ok = tensors.len() == S::TENSORS.len()
        && caches.len() == S::CACHES.len()
        && outputs.is_none_or(|n| n == S::OUTPUTS.len());
    if !arity_ok {
        let names: Vec<&str> = S::TENSORS.iter().map(|a| a.name).collect();
        let expected = format!(
            "{} tensors ({}), {} KV caches and {} outputs",
            names.len(),
            names.join(", "),
            S::CACHES.len(),
            S::OUTPUTS.len()
        );
        let mut got = vec![tensors.len(), caches.len()];
        got.extend(outputs);
        return Err(Error::KernelArguments { expected, got });
    }
    check_dtypes::<S>(compute, tensors)
}

impl<K: OpKernel> Kernel for Compiled<K> {
    fn key(&self) -> &KernelKey {
        &self.key
    }

    fn implementation(&self) -> &'static str {
        K::IMPLEMENTATION
    }

    fn code_info(&self) -> CodeInfo {
        self.kernel.code_info()
    }

    fn is_view(&self) -> bool {
        K::IS_VIEW
    }

    fn check(&self, tensors: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> Result<Vec<OutputSpec>> {
        let checked = self.checked(tensors, caches, None)?;
        Ok(self.kernel.spec().outputs(&checked))
    }

    fn prepared_constants(&self) -> Vec<(usize, PreparedConstant)> {
        self.kernel.prepared_constants()
    }

    fn run(
        &self,
        tensors: &[&Tensor],
        caches: &mut [&mut PagedKVCacheCollection],
        outputs: &mut [Tensor],
        ctx: &DeviceContextPtr,
    ) -> Result<()> {
        let shared: Vec<&PagedKVCacheCollection> = caches.iter().map(|c| &**c).collect();
        let checked = self.checked(tensors, &shared, Some(outputs.len()))?;
        drop(shared);
        let expected = self.kernel.spec().outputs(&checked);
        for ((name, output), (dtype, shape)) in K::Spec::OUTPUTS.iter().zip(outputs.iter()).zip(&expected) {
            kvjit_core::expect_arg(name, output, *dtype)?;
            if output.shape() != shape.as_slice() {
                return Err(kvjit_core::shape_mismatch(name, format!("{shape:?}"), output));
            }
        }
        self.kernel.run(checked, Call { tensors, caches, outputs }, ctx)
    }
}
