//! The implementations a benchmark compares, behind one [`Runner`].
//!
//! - [`Implementation::Specialized`]: the JIT kernel compiled for the call's
//!   exact B and S (a fully static key, `…b4.s16`);
//! - [`Implementation::Generic`]: the JIT kernel of the symbolic key
//!   (`…bany.sany`), which reads M at run time — one kernel serves every M;
//! - [`Implementation::Unspecialized`]: the same generator with K, the
//!   column counts and the cache layout read at run time too (one kernel
//!   for every shape of its dtypes; 256-bit tier only);
//! - all on the widest CPU tier this machine runs (`…cpu-avx2…` where it
//!   has AVX2), and again on the pure-Cranelift tier
//!   ([`Implementation::SpecializedCranelift`],
//!   [`Implementation::GenericCranelift`]), so a run shows what the 256-bit
//!   tier buys;
//! - [`Implementation::Reference`]: the plain Rust reference, one thread;
//! - the peers, written as a user of a GEMM library writes the op: multiply
//!   into an `[M, N]` f32 buffer, copy Q out, then scatter each valid token's
//!   K and V through the page table with
//!   [`PagedKVCacheCollection::locate`] / [`element_offset`](PagedKVCacheCollection::element_offset):
//!   - [`Implementation::GemmScatter`] — the `gemm` crate (what candle's CPU
//!     path uses), parallel on the context's worker pool;
//!   - [`Implementation::MatrixMultiplyScatter`] — `matrixmultiply::sgemm`
//!     (what ndarray uses), its columns split over the worker threads (its
//!     own threading is fixed by an environment variable at first use);
//!   - `Implementation::OpenBlasScatter` (only with the crate feature
//!     `openblas`, which links the system's `libopenblas`; see
//!     `scripts/install-openblas.sh`) — OpenBLAS's `cblas_sgemm`, called on
//!     the calling thread with OpenBLAS's own pool set to the context's
//!     thread count.
//!
//! The GEMM libraries are used f32-only here (`gemm` has no bf16). For bf16
//! and f16 the peers run as such a user would: the weight converted to f32
//! once when loaded (not timed; they then stream twice the weight bytes), X
//! widened per call, results rounded back when stored (timed).

use std::sync::Arc;

use half::slice::HalfFloatSliceExt;
use kvjit_core::{Backend, CodeTier, DType, PagedKVCacheCollection, TensorData};
use kvjit_jit::CaptureText;
use kvjit_op::Compiled;
use kvjit_op_fused_qkv::reference::fused_qkv_matmul;
use kvjit_op_fused_qkv::{JitKernel, QkvArgs};
use kvjit_runtime::DeviceContextPtr;

use super::problem::{ModelShape, Point, Problem, Weights, convert_to_f32};
use crate::{BenchError, Result};

/// Something a benchmark can time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Implementation {
    /// JIT kernel with B and S baked in, on the widest CPU tier (the
    /// 256-bit tier where the CPU has AVX2).
    Specialized,
    /// JIT kernel with B and S read at run time, on the widest CPU tier.
    Generic,
    /// The same generator with K, the column counts and the cache layout
    /// read at run time too (only the dtypes baked in; the 256-bit tier
    /// only, see [`Implementation::available`]).
    Unspecialized,
    /// [`Specialized`](Self::Specialized) on the pure-Cranelift tier.
    SpecializedCranelift,
    /// [`Generic`](Self::Generic) on the pure-Cranelift tier.
    GenericCranelift,
    /// The plain Rust reference (one thread).
    Reference,
    /// `gemm` crate into `[M, N]`, then copy Q and scatter K/V.
    GemmScatter,
    /// `matrixmultiply::sgemm` into `[M, N]`, then copy Q and scatter K/V.
    MatrixMultiplyScatter,
    /// OpenBLAS's `cblas_sgemm` into `[M, N]`, then copy Q and scatter K/V
    /// (crate feature `openblas`).
    #[cfg(feature = "openblas")]
    OpenBlasScatter,
}

/// How many peers exist only with a crate feature and are built in.
const OPTIONAL_PEERS: usize = cfg!(feature = "openblas") as usize;

impl Implementation {
    /// Every implementation, in report order.
    pub const ALL: [Implementation; 8 + OPTIONAL_PEERS] = [
        Implementation::Specialized,
        Implementation::Generic,
        Implementation::Unspecialized,
        Implementation::SpecializedCranelift,
        Implementation::GenericCranelift,
        Implementation::Reference,
        Implementation::GemmScatter,
        Implementation::MatrixMultiplyScatter,
        #[cfg(feature = "openblas")]
        Implementation::OpenBlasScatter,
    ];

    /// The peers (GEMM library + scatter).
    pub const PEERS: [Implementation; 2 + OPTIONAL_PEERS] = [
        Implementation::GemmScatter,
        Implementation::MatrixMultiplyScatter,
        #[cfg(feature = "openblas")]
        Implementation::OpenBlasScatter,
    ];

    /// Identifier used in benchmark ids, JSON and `--impls`.
    pub fn id(self) -> &'static str {
        match self {
            Implementation::Specialized => "specialized",
            Implementation::Generic => "generic",
            Implementation::Unspecialized => "unspecialized",
            Implementation::SpecializedCranelift => "specialized_cranelift",
            Implementation::GenericCranelift => "generic_cranelift",
            Implementation::Reference => "reference",
            Implementation::GemmScatter => "gemm_scatter",
            Implementation::MatrixMultiplyScatter => "matrixmultiply_scatter",
            #[cfg(feature = "openblas")]
            Implementation::OpenBlasScatter => "openblas_scatter",
        }
    }

    /// Name for tables and plots.
    pub fn label(self) -> &'static str {
        match self {
            Implementation::Specialized => "kvjit specialized",
            Implementation::Generic => "kvjit generic",
            Implementation::Unspecialized => "kvjit unspecialized",
            Implementation::SpecializedCranelift => "kvjit specialized (Cranelift tier)",
            Implementation::GenericCranelift => "kvjit generic (Cranelift tier)",
            Implementation::Reference => "reference",
            Implementation::GemmScatter => "gemm+scatter",
            Implementation::MatrixMultiplyScatter => "matrixmultiply+scatter",
            #[cfg(feature = "openblas")]
            Implementation::OpenBlasScatter => "OpenBLAS+scatter",
        }
    }

    /// The CPU tier a JIT implementation builds its kernels for.
    pub fn cpu_tier(self) -> Option<CodeTier> {
        match self {
            Implementation::Specialized | Implementation::Generic | Implementation::Unspecialized => {
                Some(crate::problem::widest_tier())
            }
            Implementation::SpecializedCranelift | Implementation::GenericCranelift => Some(CodeTier::Cranelift),
            _ => None,
        }
    }

    /// Whether this machine runs it: the unspecialized kernel exists on the
    /// 256-bit tier only (a CPU with AVX2, FMA and F16C).
    pub fn available(self) -> bool {
        self != Implementation::Unspecialized || kvjit_jit::microkernel::avx2_available()
    }

    /// Parse an [`id`](Self::id).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        Self::ALL.into_iter().find(|i| i.id() == text).ok_or_else(|| {
            let ids: Vec<&str> = Self::ALL.iter().map(|i| i.id()).collect();
            format!("unknown implementation '{text}': known are {}", ids.join(", "))
        })
    }
}

fn jit_error(source: kvjit_jit::JitError) -> BenchError {
    let key = match &source {
        kvjit_jit::JitError::Unsupported { key, .. } => key.clone(),
        _ => "a benchmark kernel".into(),
    };
    BenchError::Compile { key, source }
}

/// JIT kernels for one spec, one per weight layer (they share one compiled
/// function through the kernel cache; each packs its own layer's weight, as
/// each node of a model does).
pub type LayerKernels = Arc<Vec<Compiled<JitKernel>>>;

fn layer_kernels(spec: kvjit_op_fused_qkv::FusedQkvSpec, weights: &Weights, tier: CodeTier) -> Result<LayerKernels> {
    let spec = kvjit_op_fused_qkv::FusedQkvSpec { backend: Backend::Cpu(tier), ..spec };
    let kernels = weights
        .layers
        .iter()
        .map(|w| JitKernel::new(spec, Some(w.clone()), CaptureText::default()).map(Compiled::new).map_err(jit_error))
        .collect::<Result<Vec<_>>>()?;
    Ok(Arc::new(kernels))
}

/// The generic JIT kernels of a shape on the widest CPU tier (weights
/// packed now, as for graph constants); they serve every M of that shape,
/// dtype and page size.
pub fn generic_kernels(shape: &ModelShape, dtype: DType, page_size: usize, weights: &Weights) -> Result<LayerKernels> {
    layer_kernels(shape.spec(dtype, page_size, None), weights, crate::problem::widest_tier())
}

/// One implementation, ready to run calls of one [`Problem`].
pub struct Runner {
    implementation: Implementation,
    state: State,
    /// The weight layer of the next call: calls cycle through them.
    next_layer: usize,
}

enum State {
    Jit(LayerKernels),
    Reference,
    Peer(PeerBuffers),
}

/// The peers' per-call buffers: X widened to f32 (non-f32 dtypes), and C.
struct PeerBuffers {
    x: Vec<f32>,
    c: Vec<f32>,
}

impl PeerBuffers {
    fn new(point: &Point) -> Self {
        let x_len = if point.dtype == DType::F32 { 0 } else { point.m * point.shape.k };
        Self { x: vec![0.0; x_len], c: vec![0.0; point.m * point.shape.n()] }
    }
}

impl Runner {
    /// A runner for `implementation` on `problem`. `generic` are the
    /// shape's generic kernels (made here when `None` and needed).
    pub fn new(implementation: Implementation, problem: &Problem, generic: Option<&LayerKernels>) -> Result<Self> {
        let point = &problem.point;
        let state = match implementation {
            Implementation::Specialized | Implementation::SpecializedCranelift => {
                let spec = point.shape.spec(point.dtype, point.page_size, Some((problem.batch, problem.seq)));
                let tier = implementation.cpu_tier().unwrap_or(CodeTier::Cranelift);
                State::Jit(layer_kernels(spec, &problem.weights, tier)?)
            }
            Implementation::Generic => State::Jit(match generic {
                Some(kernels) => kernels.clone(),
                None => generic_kernels(&point.shape, point.dtype, point.page_size, &problem.weights)?,
            }),
            Implementation::GenericCranelift => {
                let spec = point.shape.spec(point.dtype, point.page_size, None);
                State::Jit(layer_kernels(spec, &problem.weights, CodeTier::Cranelift)?)
            }
            Implementation::Unspecialized => {
                let spec = point.shape.spec(point.dtype, point.page_size, None);
                let kernels = problem
                    .weights
                    .layers
                    .iter()
                    .map(|w| JitKernel::unspecialized(spec, Some(w.clone())).map(Compiled::new).map_err(jit_error))
                    .collect::<Result<Vec<_>>>()?;
                State::Jit(Arc::new(kernels))
            }
            Implementation::Reference => State::Reference,
            Implementation::GemmScatter | Implementation::MatrixMultiplyScatter => State::Peer(PeerBuffers::new(point)),
            #[cfg(feature = "openblas")]
            Implementation::OpenBlasScatter => {
                openblas::check_available()?;
                State::Peer(PeerBuffers::new(point))
            }
        };
        Ok(Self { implementation, state, next_layer: 0 })
    }

    /// Which implementation this is.
    pub fn implementation(&self) -> Implementation {
        self.implementation
    }

    /// The canonical kernel key of a JIT implementation.
    pub fn kernel_key(&self) -> Option<String> {
        match &self.state {
            State::Jit(kernels) => Some(kvjit_runtime::Kernel::key(&kernels[0]).to_string()),
            _ => None,
        }
    }

    /// Run one call with the next weight layer: Q into `problem.output`,
    /// K/V into `problem.cache`.
    pub fn run(&mut self, problem: &mut Problem, ctx: &DeviceContextPtr) -> Result<()> {
        let p = problem;
        let l = self.next_layer % p.weights.count();
        self.next_layer = l + 1;
        let weight = &p.weights.layers[l];
        match &mut self.state {
            State::Jit(kernels) => {
                let out = p.output.as_bytes_mut();
                kernels[l].kernel().run_into(
                    QkvArgs {
                        hidden_state: &p.hidden,
                        weight,
                        kv_collection: &mut p.cache,
                        layer_idx: &p.layer,
                        valid_lengths: &p.valid,
                    },
                    out,
                    ctx,
                )?;
            }
            State::Reference => {
                fused_qkv_matmul(&p.hidden, weight, &mut p.cache, &p.layer, &p.valid, &mut p.output)?;
            }
            State::Peer(buffers) => {
                let PeerBuffers { x, c } = buffers;
                let x: &[f32] = match p.hidden.data() {
                    TensorData::F32(values) => values,
                    _ => {
                        convert_to_f32(&p.hidden, &mut x[..]);
                        &x[..]
                    }
                };
                let (m, n, k) = (p.point.m, p.point.shape.n(), p.point.shape.k);
                let w = p.weights.as_f32(l);
                match self.implementation {
                    Implementation::GemmScatter => gemm_f32(m, n, k, x, w, c, ctx),
                    #[cfg(feature = "openblas")]
                    Implementation::OpenBlasScatter => openblas::sgemm_f32(m, n, k, x, w, c, threads_of(ctx))?,
                    _ => matrixmultiply_f32(m, n, k, x, w, c, ctx),
                }
                scatter(p, c)?;
            }
        }
        Ok(())
    }
}

fn threads_of(ctx: &DeviceContextPtr) -> usize {
    ctx.cpu_context().map_or(1, |c| c.threads())
}

/// `c[M, N] = x[M, K] · w[N, K]ᵀ` with the `gemm` crate, on the context's pool.
fn gemm_f32(m: usize, n: usize, k: usize, x: &[f32], w: &[f32], c: &mut [f32], ctx: &DeviceContextPtr) {
    assert!(x.len() >= m * k && w.len() >= n * k && c.len() >= m * n, "peer buffers sized for the problem");
    let threads = threads_of(ctx);
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    let mut call = move || {
        // SAFETY: the assert above: x is [m, k] and w is [n, k], both
        // row-major, read here as lhs [m, k] (row stride k) and rhs [k, n]
        // (column stride k, i.e. w transposed); c is [m, n] row-major and not
        // aliased by either.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                k as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            )
        }
    };
    match ctx.cpu_context() {
        Some(cpu) => cpu.rayon_pool().expect("starting the peer's rayon pool").install(call),
        None => call(),
    }
}

/// `c[M, N] = x[M, K] · w[N, K]ᵀ` with `matrixmultiply::sgemm`, the N
/// columns split evenly (in multiples of 8) over the context's threads.
fn matrixmultiply_f32(m: usize, n: usize, k: usize, x: &[f32], w: &[f32], c: &mut [f32], ctx: &DeviceContextPtr) {
    assert!(x.len() >= m * k && w.len() >= n * k && c.len() >= m * n, "peer buffers sized for the problem");
    let threads = threads_of(ctx).clamp(1, n.div_ceil(8).max(1));
    let (x_at, w_at, c_at) = (x.as_ptr() as usize, w.as_ptr() as usize, c.as_mut_ptr() as usize);
    let columns = |t: usize| ((n.div_ceil(8) * t / threads) * 8).min(n);
    let run = move |first: usize, end: usize| {
        // SAFETY: the assert above: x [m, k] and w [n, k] are row-major; this
        // call reads w's rows first..end (as the [k, end - first] matrix with
        // column stride k) and writes only columns first..end of c [m, n]
        // (row stride n); the ranges of different calls are disjoint, so no
        // two threads write one element.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                end - first,
                1.0,
                x_at as *const f32,
                k as isize,
                1,
                (w_at as *const f32).add(first * k),
                1,
                k as isize,
                0.0,
                (c_at as *mut f32).add(first),
                n as isize,
                1,
            )
        }
    };
    match ctx.cpu_context() {
        Some(cpu) if threads > 1 => cpu.rayon_pool().expect("starting the peer's rayon pool").scope(|s| {
            for t in 0..threads {
                let (first, end) = (columns(t), columns(t + 1));
                if end > first {
                    s.spawn(move |_| run(first, end));
                }
            }
        }),
        _ => run(0, n),
    }
}

/// OpenBLAS, loaded from the system at run time (`libopenblas.so.0`, LP64:
/// 32-bit `int` dimensions, as Debian's `libopenblas-dev` ships it); the three
/// functions used are declared here as in OpenBLAS's `cblas.h`.
///
/// Loaded rather than linked so that `OPENBLAS_THREAD_TIMEOUT` can be set
/// before OpenBLAS starts its pool (its constructor reads it): by default its
/// idle workers spin for 2²⁸ cycles (~0.1 s) after each call, and in the
/// interleaved samples that spin lands on whichever implementation runs next
/// (measured: kvjit's bf16 M = 4 in `bench --quick` 3.72 ms behind OpenBLAS,
/// 2.51 ms with the spin off). The bench sets the shortest timeout OpenBLAS
/// takes (2⁴ cycles) unless the environment already sets one.
#[cfg(feature = "openblas")]
mod openblas {
    use std::ffi::c_int;
    use std::sync::OnceLock;

    use crate::error::{BenchError, Result};

    /// `CblasRowMajor` (`enum CBLAS_ORDER`, passed as an `int`).
    const ROW_MAJOR: c_int = 101;
    /// `CblasNoTrans` (`enum CBLAS_TRANSPOSE`).
    const NO_TRANS: c_int = 111;
    /// `CblasTrans`.
    const TRANS: c_int = 112;
    /// The library's name as Debian installs it (the runtime package's
    /// soname, present without the `-dev` package).
    const LIBRARY: &str = "libopenblas.so.0";

    /// `cblas_sgemm` (LP64), as `cblas.h` declares it.
    type Sgemm = unsafe extern "C" fn(
        order: c_int,
        trans_a: c_int,
        trans_b: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f32,
        a: *const f32,
        lda: c_int,
        b: *const f32,
        ldb: c_int,
        beta: f32,
        c: *mut f32,
        ldc: c_int,
    );
    /// `cblas_sgemv` (LP64), as `cblas.h` declares it.
    type Sgemv = unsafe extern "C" fn(
        order: c_int,
        trans: c_int,
        m: c_int,
        n: c_int,
        alpha: f32,
        a: *const f32,
        lda: c_int,
        x: *const f32,
        incx: c_int,
        beta: f32,
        y: *mut f32,
        incy: c_int,
    );
    /// `openblas_set_num_threads`.
    type SetNumThreads = unsafe extern "C" fn(c_int);

    /// The loaded library and the functions the peer calls.
    struct OpenBlas {
        sgemm: Sgemm,
        sgemv: Sgemv,
        set_num_threads: SetNumThreads,
        /// Keeps the functions above mapped.
        _library: libloading::Library,
    }

    /// Loads OpenBLAS once per process; a missing library or symbol is a
    /// one-line error naming the install script.
    fn library() -> Result<&'static OpenBlas> {
        static LOADED: OnceLock<std::result::Result<OpenBlas, String>> = OnceLock::new();
        LOADED
            .get_or_init(load)
            .as_ref()
            .map_err(|why| BenchError::PeerNotLoaded { peer: "OpenBLAS", why: why.clone() })
    }

    fn load() -> std::result::Result<OpenBlas, String> {
        const TIMEOUT: &str = "OPENBLAS_THREAD_TIMEOUT";
        if std::env::var_os(TIMEOUT).is_none() {
            // SAFETY: set_var is unsound only against a concurrent getenv
            // from C code (Rust's own readers take the environment lock).
            // This runs once, inside OnceLock's initializer, while the
            // peer is set up: no sample is running, the bench's other
            // threads (its rayon pool, the kernels' idle workers) run no C
            // code, and OpenBLAS is not loaded yet. (A llama.cpp child
            // started later inherits the variable; it only changes how long
            // an OpenBLAS there spins.)
            unsafe { std::env::set_var(TIMEOUT, "4") };
        }
        let hint = "run scripts/install-openblas.sh";
        // SAFETY: loading runs OpenBLAS's constructor, which only reads the
        // environment and starts its thread pool; the library has no other
        // initialization side effects on this process.
        let library = unsafe { libloading::Library::new(LIBRARY) }.map_err(|e| format!("{e} ({hint})"))?;
        // SAFETY: each symbol is looked up with the C signature `cblas.h`
        // (LP64) and OpenBLAS's `openblas_config.h` declare for it.
        unsafe {
            let symbol = |name: &str| format!("{LIBRARY} has no `{name}` ({hint})");
            let sgemm = *library.get::<Sgemm>(b"cblas_sgemm\0").map_err(|_| symbol("cblas_sgemm"))?;
            let sgemv = *library.get::<Sgemv>(b"cblas_sgemv\0").map_err(|_| symbol("cblas_sgemv"))?;
            let set_num_threads = *library
                .get::<SetNumThreads>(b"openblas_set_num_threads\0")
                .map_err(|_| symbol("openblas_set_num_threads"))?;
            Ok(OpenBlas { sgemm, sgemv, set_num_threads, _library: library })
        }
    }

    /// Fails with a clear message when OpenBLAS cannot be loaded; called
    /// when the peer is set up, so a run fails before it measures anything.
    pub(super) fn check_available() -> Result<()> {
        library().map(|_| ())
    }

    /// `c[M, N] = x[M, K] · w[N, K]ᵀ` with `cblas_sgemm` on the calling
    /// thread (with `cblas_sgemv` when M = 1, as a user multiplying one
    /// vector calls it — OpenBLAS's GEMV streams the weight at the read
    /// roof), OpenBLAS's own pool set to `threads` first (a process-wide
    /// setting; cheap when unchanged).
    pub(super) fn sgemm_f32(
        m: usize,
        n: usize,
        k: usize,
        x: &[f32],
        w: &[f32],
        c: &mut [f32],
        threads: usize,
    ) -> Result<()> {
        assert!(x.len() >= m * k && w.len() >= n * k && c.len() >= m * n, "peer buffers sized for the problem");
        let blas = library()?;
        let dim = |d: usize| c_int::try_from(d).expect("GEMM dimensions fit OpenBLAS's 32-bit int");
        let (mi, ni, ki) = (dim(m), dim(n), dim(k));
        let threads = dim(threads.max(1));
        // SAFETY: no pointers cross; `threads` is at least 1 and fits in an
        // int (checked just above), the range OpenBLAS documents; it clamps
        // the count to its compile-time maximum and takes its server lock
        // when it grows its pool.
        unsafe { (blas.set_num_threads)(threads) };
        if m == 1 {
            // SAFETY: the assert and `dim` checks above: w is [n, k]
            // row-major (A, lda = k), x holds k values (one row, incx 1),
            // c holds n (incy 1); c is a unique borrow, so it aliases
            // neither input.
            unsafe {
                (blas.sgemv)(ROW_MAJOR, NO_TRANS, ni, ki, 1.0, w.as_ptr(), ki, x.as_ptr(), 1, 0.0, c.as_mut_ptr(), 1)
            };
            return Ok(());
        }
        // SAFETY: the assert and `dim` checks above: x is [m, k] row-major
        // (A, not transposed, lda = k), w is [n, k] row-major, read as
        // Bᵀ [k, n] (B transposed, ldb = k), and c is [m, n] row-major
        // (ldc = n), each at least that long; every dimension fits in an int;
        // c is a unique borrow, so it aliases neither input; OpenBLAS returns
        // only when the product is written.
        unsafe {
            (blas.sgemm)(
                ROW_MAJOR,
                NO_TRANS,
                TRANS,
                mi,
                ni,
                ki,
                1.0,
                x.as_ptr(),
                ki,
                w.as_ptr(),
                ki,
                0.0,
                c.as_mut_ptr(),
                ni,
            )
        };
        Ok(())
    }
}

/// The epilogue a GEMM-library user writes: Q rows copied into the output,
/// each valid token's K and V stored at its page slot.
fn scatter(p: &mut Problem, c: &[f32]) -> Result<()> {
    let shape = &p.point.shape;
    let (n, q_dim, kv_dim) = (shape.n(), shape.q_dim(), shape.kv_dim());
    let rows = p.batch * p.seq;
    let layer = p.layer.to_u32_vec()?[0] as usize;
    match p.output.data() {
        TensorData::F32(_) => {
            let out = p.output.as_mut_slice::<f32>()?;
            for r in 0..rows {
                out[r * q_dim..][..q_dim].copy_from_slice(&c[r * n..][..q_dim]);
            }
        }
        TensorData::BF16(_) => {
            let out = p.output.as_mut_slice::<half::bf16>()?;
            for r in 0..rows {
                out[r * q_dim..][..q_dim].convert_from_f32_slice(&c[r * n..][..q_dim]);
            }
        }
        TensorData::F16(_) => {
            let out = p.output.as_mut_slice::<half::f16>()?;
            for r in 0..rows {
                out[r * q_dim..][..q_dim].convert_from_f32_slice(&c[r * n..][..q_dim]);
            }
        }
        TensorData::U32(_) | TensorData::F8E4M3(_) | TensorData::Blocks(..) => {
            unreachable!("benchmark outputs are compute floats")
        }
    }
    let valid = p.valid.as_slice::<u32>()?;
    let cache: &mut PagedKVCacheCollection = &mut p.cache;
    let lengths = cache.cache_lengths().to_vec();
    for (b, &valid_length) in valid.iter().enumerate() {
        for t in 0..valid_length as usize {
            let r = b * p.seq + t;
            let (page, slot) = cache.locate(b, lengths[b] as usize + t)?;
            for kv in 0..2 {
                let start = cache.element_offset(page as usize, kv, layer, slot, 0, 0);
                let src = &c[r * n + q_dim + kv * kv_dim..][..kv_dim];
                match cache.blocks().dtype() {
                    DType::F32 => cache.blocks_slice_mut::<f32>()?[start..][..kv_dim].copy_from_slice(src),
                    DType::BF16 => {
                        cache.blocks_slice_mut::<half::bf16>()?[start..][..kv_dim].convert_from_f32_slice(src)
                    }
                    DType::F16 => cache.blocks_slice_mut::<half::f16>()?[start..][..kv_dim].convert_from_f32_slice(src),
                    DType::F8E4M3 => {
                        let g = cache.params().scale_granularity().expect("an f8e4m3 cache has a granularity");
                        let scale_start = start / g;
                        let (blocks, scales) = cache.blocks_and_scales_mut();
                        let scales = scales.expect("an f8e4m3 cache has scales");
                        let codes = blocks[start..][..kv_dim].chunks_exact_mut(g);
                        for ((codes, values), scale) in codes.zip(src.chunks_exact(g)).zip(&mut scales[scale_start..]) {
                            *scale = kvjit::fp8::quantize_block(values, codes);
                        }
                    }
                    _ => unreachable!("caches hold floats"),
                }
            }
        }
    }
    Ok(())
}
