//! [`Jit`]: the JIT kernel of an op whose fast CPU code is one compiled
//! function per spec. The op says how its spec compiles and launches
//! ([`JitSpec`]); the kernel struct, its [`OpKernel`] and [`CpuKernel`]
//! impls, and running into caller-owned bytes ([`Jit::run_into`]) are
//! written here once.

use std::sync::Arc;

use kvjit_core::{DType, Error, PagedKVCacheCollection, Result, Tensor};
use kvjit_jit::{CaptureText, JitError, JitFunction};
use kvjit_runtime::{CodeInfo, DeviceContextPtr};

use crate::{BoxError, Call, CallContract, Compiled, Constants, CpuBuild, CpuKernel, OpKernel, check_signature};

/// How an op's spec becomes JIT code and runs it.
pub trait JitSpec: CallContract {
    /// Whether the generated code serves this spec (refused at specialize
    /// with the reason otherwise). Default: every spec.
    fn supported(&self) -> std::result::Result<(), JitError> {
        Ok(())
    }

    /// Compile the code for this spec, or fetch it from the process-wide
    /// registry (`kvjit_jit::compile_or_fetch`).
    fn compile(&self, capture: CaptureText) -> std::result::Result<Arc<JitFunction>, JitError>;

    /// What the code handles beyond the contract, checked with every call
    /// before anything runs (attention's longest key span). Default: none.
    fn check_limits(&self, checked: &Self::Checked) -> Result<()> {
        let _ = checked;
        Ok(())
    }

    /// Run a call the spec checked (`checked` came from
    /// [`CallContract::check`] and [`check_limits`](Self::check_limits) on
    /// exactly these arguments), writing the one output into
    /// [`Launch::output`], which holds exactly its bytes.
    fn launch(&self, checked: &Self::Checked, call: Launch<'_, '_>) -> Result<()>;
}

/// A checked call, as [`JitSpec::launch`] runs it.
pub struct Launch<'c, 'm> {
    /// The spec's compiled code.
    pub code: &'c JitFunction,
    /// The tensor inputs, in signature order.
    pub tensors: &'c [&'c Tensor],
    /// The caches, in signature order.
    pub caches: &'c mut [&'m mut PagedKVCacheCollection],
    /// The output's bytes.
    pub output: &'c mut [u8],
    /// Where the work items run.
    pub ctx: &'c DeviceContextPtr,
}

impl<'c, 'm> Launch<'c, 'm> {
    /// The tensor inputs as an array (the arity was checked).
    pub fn tensors<const N: usize>(&self) -> [&'c Tensor; N] {
        self.tensors.try_into().expect("the arity was checked against the signature")
    }

    /// The call's one cache (the arity was checked).
    pub fn cache(&mut self) -> &mut PagedKVCacheCollection {
        self.caches[0]
    }
}

/// The JIT kernel of a spec: its code, compiled once per key.
pub struct Jit<S> {
    spec: S,
    /// The compute dtype the spec's key names.
    dtype: DType,
    code: Arc<JitFunction>,
}

impl<S: JitSpec> Jit<S> {
    /// Compile (or fetch) the code for `spec`, refusing a spec the code
    /// does not serve.
    pub fn new(spec: S, capture: CaptureText) -> std::result::Result<Self, JitError> {
        spec.supported()?;
        let code = spec.compile(capture)?;
        Ok(Self { dtype: spec.key_name().dtype(), spec, code })
    }

    /// The kernel behind the runtime's `Kernel` interface.
    pub fn compiled(spec: S, capture: CaptureText) -> std::result::Result<Compiled<Self>, JitError> {
        Ok(Compiled::new(Self::new(spec, capture)?))
    }

    /// Run with the one output written into `output`, bytes the caller owns
    /// (a test's guarded buffer, a benchmark's reused one), checked like
    /// `Kernel::run`: arity, dtypes, the contract and the kernel's limits,
    /// and `output`'s length against the output's bytes — nothing is
    /// written unless every check passes.
    pub fn run_into(
        &self,
        tensors: &[&Tensor],
        caches: &mut [&mut PagedKVCacheCollection],
        output: &mut [u8],
        ctx: &DeviceContextPtr,
    ) -> Result<()> {
        let shared: Vec<&PagedKVCacheCollection> = caches.iter().map(|c| &**c).collect();
        check_signature::<S>(self.dtype, tensors, &shared, None)?;
        let checked = OpKernel::check(self, tensors, &shared)?;
        drop(shared);
        let [(dtype, shape)] = <[_; 1]>::try_from(self.spec.outputs(&checked)).expect("a JIT kernel has one output");
        let expected = shape.iter().product::<usize>() * dtype.size_bytes();
        if output.len() != expected {
            return Err(Error::ByteCount { dtype, shape, expected, got: output.len() });
        }
        self.spec.launch(&checked, Launch { code: &self.code, tensors, caches, output, ctx })
    }
}

impl<S: JitSpec> OpKernel for Jit<S> {
    type Spec = S;
    const IMPLEMENTATION: &'static str = "jit";

    fn spec(&self) -> &S {
        &self.spec
    }

    fn check(&self, tensors: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> Result<S::Checked> {
        let checked = self.spec.check(tensors, caches)?;
        self.spec.check_limits(&checked)?;
        Ok(checked)
    }

    fn run(&self, checked: S::Checked, call: Call<'_, '_>, ctx: &DeviceContextPtr) -> Result<()> {
        let output = call.outputs[0].as_bytes_mut();
        self.spec.launch(&checked, Launch { code: &self.code, tensors: call.tensors, caches: call.caches, output, ctx })
    }

    fn code_info(&self) -> CodeInfo {
        self.code.code_info()
    }
}

impl<S: JitSpec> CpuKernel for Jit<S> {
    fn supported(spec: &S) -> std::result::Result<(), JitError> {
        spec.supported()
    }

    fn build(spec: &S, _: &Constants, build: &CpuBuild) -> std::result::Result<Self, BoxError> {
        Ok(Self::new(spec.clone(), build.capture)?)
    }
}
