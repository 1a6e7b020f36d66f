//! The CUDA kernel of the op: precompiled PTX variants of
//! `cuda/fused_qkv.cu`, chosen per [`KernelKey`] when the graph is built,
//! launched through [`kvjit_cuda`].
//!
//! **Variants.** A variant is one `extern "C"` kernel of the `.cu`, for one
//! schedule ([`Schedule`]: `decode` for M = B·S ≤ 16, streaming the weight
//! once; `prefill` for larger M, tensor-core tiles) and one pair of compute
//! (f32, bf16, f16) and cache dtypes (f32, bf16, f16, f8e4m3). Its name is
//! the symbol of [`variant_key`], which is derived from the op's own
//! [`FusedQkvSpec`]'s key — the `.cu` spells the same names through one
//! macro, and a test checks every name this module can ask for against both
//! committed PTX files. Head size, Hkv, q_dim and K are run-time arguments:
//! the epilogue needs only `kv_dim = Hkv·D` and the K→V stride, so baking D
//! in would multiply the PTX without changing any instruction. So is an FP8
//! cache's granularity g: it only bounds the quantizing epilogue's loops.
//! What the key does decide, [`choose_variants`] decides at build time: both
//! dtypes, the schedule when B and S are static (generic keys load both
//! schedules and pick by M per call), and the refusals — `K % 8 != 0` (rows
//! are read as 16-byte vectors), an FP8 cache without a granularity dividing
//! D, or dimensions past the kernels' 32-bit indexing.
//!
//! **PTX.** `cuda/fused_qkv.compute_80.ptx` and `.compute_90.ptx` are
//! generated from the `.cu` by `scripts/gen-ptx.sh` with the pinned CUDA 13.0
//! toolchain and committed; each starts with the SHA-256 of the `.cu` it came
//! from, and a unit test fails when the `.cu` changed without regenerating.
//! The device loads the newest image not newer than itself.
//!
//! **A call.** The op's check validates exactly as for the CPU kernels
//! (the spec's [`CallContract`], which computes each
//! row's cache offset on the host, the pass that checks the page table),
//! and only then does `run` touch the device: upload X (and W unless it
//! is the graph constant, which is uploaded once per device), launch the
//! fused kernel, gather the K/V rows it wrote into one staging buffer, and
//! download Q and the staged rows into host staging copies. Only when every
//! device step succeeded are Q copied into the output and the rows into the
//! host cache, so a device error leaves both exactly as they were.
//!
//! **Per-context state.** The loaded functions, the uploaded constant weight
//! and the scratch buffers are kept in the [`DeviceContextPtr`] the kernel
//! ran on, and freed when that context (or this kernel) is dropped.
//!
//! **FP8 caches** (`f8e4m3`, the `…_kvf8e4m3` variants): the kernel writes
//! one-byte codes into the blocks and one f32 scale per g-block into the
//! cache's scales, quantizing in its epilogue exactly as
//! `kvjit_core::fp8::quantize_block` does (see the `.cu` header: K/V are
//! staged as f32 in a scratch buffer, and the block completing a g-block's
//! columns quantizes it, counted with per-g-block counters the host zeroes
//! before every launch: `ready_counters`). Beside the fused launch, the
//! call gathers the written rows' scales too (the f32 gather kernel on
//! offsets / g, as the scales have the blocks' layout with D replaced by
//! D / g) and commits them with the codes.
//!
//! **The cache stays on the device.** Each cache's blocks (and an FP8
//! cache's scales) live in device buffers kept across calls and steps
//! ([`CudaDevice::with_kv_cache`], keyed by the host cache's identity and
//! layout), uploaded when first seen and again only after a host-side write
//! (the host cache's blocks generation moved; writes to the scales move it
//! too). Kernels write K/V there; the host copy — which the `Kernel`
//! interface and the callers read (`--output`, tests, the next step's
//! validation) — receives exactly the rows written, from the staging
//! buffer, after which the device copy is marked current
//! ([`CudaDevice::kv_cache_synced`]). Per step only X, the row offsets, Q and
//! the new K/V rows cross the bus; a caller's or a CPU kernel's edit of the
//! host blocks between steps is seen by the next CUDA call.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use kvjit_core::{
    Backend, CacheElement, DType, Error, KernelKey, KernelSpec, KvCacheParams, PagedKVCacheCollection, Result, Target,
    Tensor,
};
use kvjit_cuda::{CudaDevice, CudaError, DeviceBuffer, Function, KernelArg, LaunchShape, PtxImage};
use kvjit_op::checks::StepDims;
use kvjit_op::{Call as OpCall, CallContract, OpKernel};
use kvjit_runtime::{DeviceContextPtr, KernelStateOwner, RuntimeError};

use crate::spec::KERNEL_NAME;
use crate::{CallShape, CheckedCall, FusedQkvSpec};
use kvjit_op::gemm::same_data;

/// The CUDA source every variant is compiled from.
pub const CUDA_SOURCE: &str = include_str!("../cuda/fused_qkv.cu");

/// The PTX of [`CUDA_SOURCE`], one image per virtual architecture.
pub const PTX: [PtxImage; 2] = [
    PtxImage { arch: 80, ptx: include_str!("../cuda/fused_qkv.compute_80.ptx") },
    PtxImage { arch: 90, ptx: include_str!("../cuda/fused_qkv.compute_90.ptx") },
];

/// The module name [`PTX`] is loaded under.
pub const PTX_MODULE: &str = "fused_qkv";

// Launch geometry; the `.cu` defines the same constants (checked by a test).
/// Threads per block of every kernel.
pub const THREADS: u32 = 256;
/// The most rows (B·S) the decode schedule serves.
pub const DECODE_MAX_ROWS: usize = 16;
const DEC_MMA_COLS: u32 = 16;
const DEC_SIMT_COLS: u32 = 4;
const PF_TILE: u32 = 128;
const PS_TILE: u32 = 64;
/// Rows the kernels index: 32-bit ints, and prefill grids at most 65535 row
/// tiles of 64.
const MAX_ROWS: usize = 65535 * PS_TILE as usize;

/// How a variant schedules the GEMM (see `cuda/fused_qkv.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// M ≤ [`DECODE_MAX_ROWS`]: every weight element is read once (bf16/f16:
    /// `mma.sync` with X as one 16-row tile, split-K over 8 warps; f32: SIMT).
    Decode,
    /// Larger M: 128×128 tensor-core tiles, 3-stage `cp.async` pipeline
    /// (f32: SIMT 64×64 tiles).
    Prefill,
}

impl Schedule {
    /// Both schedules.
    pub const ALL: [Schedule; 2] = [Schedule::Decode, Schedule::Prefill];

    /// Its name in variant keys.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Decode => "decode",
            Schedule::Prefill => "prefill",
        }
    }

    /// The schedule that serves `rows` rows.
    pub fn for_rows(rows: usize) -> Self {
        if rows <= DECODE_MAX_ROWS { Schedule::Decode } else { Schedule::Prefill }
    }

    /// Grid and block for `rows` × `n` outputs of compute dtype `dtype`.
    pub fn launch_shape(self, dtype: DType, rows: usize, n: usize) -> LaunchShape {
        let blocks = |len: usize, tile: u32| len.div_ceil(tile as usize) as u32;
        let simt = dtype == DType::F32;
        let grid = match self {
            Schedule::Decode => (blocks(n, if simt { DEC_SIMT_COLS } else { DEC_MMA_COLS }), 1, 1),
            Schedule::Prefill => {
                let tile = if simt { PS_TILE } else { PF_TILE };
                (blocks(n, tile), blocks(rows, tile), 1)
            }
        };
        LaunchShape { grid, block: (THREADS, 1, 1) }
    }
}

/// The key naming a CUDA variant: the op's kernel key reduced to what the
/// variant bakes in (compute and cache dtype) under the op name plus the
/// schedule, e.g. `fused_qkv_bshd_paged_decode.cuda.bf16.kvbf16`. Its
/// [`symbol`](KernelKey::symbol) is the `extern "C"` kernel name.
pub fn variant_key(spec: &FusedQkvSpec, schedule: Schedule) -> KernelKey {
    let key = FusedQkvSpec { backend: Backend::Cuda, ..*spec }.key_name();
    let cache = key.get("kv").expect("the key always records the cache dtype");
    KernelKey::new(&format!("{}_{}", key.op(), schedule.name()), key.target(), key.dtype()).with("kv", cache)
}

/// The key naming the row-gather kernel for a cache dtype, e.g.
/// `fused_qkv_bshd_paged_gather.cuda.bf16`.
pub fn gather_key(cache_dtype: DType) -> KernelKey {
    KernelKey::new(&format!("{KERNEL_NAME}_gather"), Target::Cuda, cache_dtype)
}

/// The key naming the E4M3 convert probe: `fused_qkv_bshd_paged_e4m3_probe.cuda.f32`,
/// a test kernel converting f32 values with the architecture's convert (the
/// hardware's on sm_90) and with the software one the sm_80 variants use.
pub fn e4m3_probe_key() -> KernelKey {
    KernelKey::new(&format!("{KERNEL_NAME}_e4m3_probe"), Target::Cuda, DType::F32)
}

/// Every kernel name this module can ask the PTX for.
pub fn all_kernel_symbols() -> Vec<String> {
    let floats = [DType::F32, DType::BF16, DType::F16];
    let caches = [DType::F32, DType::BF16, DType::F16, DType::F8E4M3];
    let mut symbols = Vec::new();
    for dtype in floats {
        for cache_dtype in caches {
            let spec = FusedQkvSpec {
                backend: Backend::Cuda,
                dtype,
                weights: dtype,
                cache: KvCacheParams {
                    element: CacheElement::new(cache_dtype, (cache_dtype == DType::F8E4M3).then_some(1))
                        .expect("a cache dtype, with a granularity for f8e4m3"),
                    num_layers: 1,
                    page_size: 1,
                    num_kv_heads: 1,
                    head_size: 1,
                },
                k: 8,
                q_dim: 1,
                step: StepDims { batch: None, seq: None },
                sizes: crate::Sizes::Baked,
            };
            symbols.extend(Schedule::ALL.map(|s| variant_key(&spec, s).symbol()));
        }
        symbols.push(gather_key(dtype).symbol());
    }
    symbols.push(gather_key(DType::F8E4M3).symbol());
    symbols.push(e4m3_probe_key().symbol());
    symbols
}

/// The variants a kernel key uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VariantPlan {
    /// The decode variant, unless B·S is static and larger than [`DECODE_MAX_ROWS`].
    pub decode: Option<KernelKey>,
    /// The prefill variant, unless B·S is static and at most [`DECODE_MAX_ROWS`].
    pub prefill: Option<KernelKey>,
    /// The row-gather kernel for the cache dtype.
    pub gather: KernelKey,
    /// FP8 caches: the gather kernel for the f32 scales of the rows written.
    pub scale_gather: Option<KernelKey>,
}

impl VariantPlan {
    /// The schedule serving a call of `rows` rows, if this plan has it.
    pub fn schedule_for(&self, rows: usize) -> Option<Schedule> {
        let schedule = Schedule::for_rows(rows);
        let have = match schedule {
            Schedule::Decode => self.decode.is_some(),
            Schedule::Prefill => self.prefill.is_some(),
        };
        have.then_some(schedule)
    }
}

fn fits_i32(v: usize) -> bool {
    i32::try_from(v).is_ok()
}

/// Map a kernel key to the variants that serve it, or say why none does.
pub fn choose_variants(spec: &FusedQkvSpec) -> std::result::Result<VariantPlan, String> {
    if spec.backend != Backend::Cuda {
        return Err(format!("{} is not a CUDA key", spec.key()));
    }
    if !spec.dtype.is_compute_float() {
        return Err(format!("CUDA variants exist for f32, bf16 and f16 compute dtypes, not {}", spec.dtype));
    }
    if spec.weights != spec.dtype {
        return Err(format!("the CUDA kernels read weights of the compute dtype, not {} blocks", spec.weights));
    }
    let quantized = spec.cache.dtype() == DType::F8E4M3;
    if !spec.cache.dtype().is_compute_float() && !quantized {
        return Err(format!(
            "CUDA variants exist for f32, bf16, f16 and f8e4m3 cache dtypes, not {}",
            spec.cache.dtype()
        ));
    }
    // An FP8 cache needs its granularity, dividing D (what the cache itself requires).
    spec.cache.validate().map_err(|e| e.to_string())?;
    if !spec.k.is_multiple_of(8) {
        return Err(format!(
            "the CUDA kernels read rows of hidden_state and weight as 16-byte vectors and need K % 8 == 0, got K = {}",
            spec.k
        ));
    }
    let kv_dim = spec.kv_dim();
    let n = spec.q_dim.checked_add(2 * kv_dim);
    if ![spec.k, spec.q_dim, kv_dim].into_iter().all(fits_i32) || !n.is_some_and(fits_i32) {
        return Err(format!(
            "the CUDA kernels index K, q_dim and N with 32-bit ints; K = {}, q_dim = {}, kv_dim = {kv_dim} is too large",
            spec.k, spec.q_dim
        ));
    }
    let rows = match (spec.step.batch, spec.step.seq) {
        (Some(b), Some(s)) => match b.checked_mul(s).filter(|&m| m <= MAX_ROWS) {
            Some(m) => Some(m),
            None => return Err(format!("B·S = {b}·{s} rows is more than the CUDA kernels' {MAX_ROWS}")),
        },
        _ => None,
    };
    Ok(VariantPlan {
        decode: rows.is_none_or(|m| m <= DECODE_MAX_ROWS).then(|| variant_key(spec, Schedule::Decode)),
        prefill: rows.is_none_or(|m| m > DECODE_MAX_ROWS).then(|| variant_key(spec, Schedule::Prefill)),
        gather: gather_key(spec.cache.dtype()),
        scale_gather: quantized.then(|| gather_key(DType::F32)),
    })
}

/// A CUDA error as the `Kernel` interface's error type: `Error::Device`
/// with the typed [`CudaError`] as its source (get it back with
/// `Error::device_error::<CudaError>()`). Messages read
/// `device error: CUDA: cuLaunchKernel failed: CUDA_ERROR_…: …`.
pub fn device_error(error: CudaError) -> Error {
    Error::device("CUDA", error)
}

/// The scalars of one launch, each checked to fit the kernel's parameter type.
#[derive(Clone, Copy, Debug)]
struct LaunchDims {
    rows: usize,
    m: i32,
    k: i32,
    n: i32,
    q_dim: i32,
    kv_dim: i32,
    kv_stride: i64,
    /// An FP8 cache's values per scale; 0 for other caches.
    g: i32,
}

impl LaunchDims {
    fn new(shape: &CallShape, params: &KvCacheParams) -> Result<Self> {
        let rows = shape.batch * shape.seq;
        let too_large = |what: &str, expected: String, got: Vec<usize>| Error::ShapeMismatch {
            arg: what.into(),
            expected: format!("{expected} (the CUDA kernels' indexing limit)"),
            got,
        };
        if rows > MAX_ROWS {
            return Err(too_large(
                "hidden_state",
                format!("at most {MAX_ROWS} rows B·S"),
                vec![shape.batch, shape.seq],
            ));
        }
        let int = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| too_large(what, format!("a size below {}", i32::MAX), vec![v]))
        };
        let kv_stride = params.num_layers * params.page_size * shape.kv_dim;
        Ok(Self {
            rows,
            m: int(rows, "hidden_state")?,
            k: int(shape.k, "hidden_state")?,
            n: int(shape.n, "weight")?,
            q_dim: int(shape.q_dim, "weight")?,
            kv_dim: int(shape.kv_dim, "kv_collection")?,
            kv_stride: i64::try_from(kv_stride)
                .map_err(|_| too_large("kv_collection", "a smaller cache".into(), vec![]))?,
            g: int(params.scale_granularity().unwrap_or(0), "kv_collection")?,
        })
    }

    /// An FP8 cache's granularity g, if the cache is FP8.
    fn granularity(&self) -> Option<usize> {
        (self.g > 0).then_some(self.g as usize)
    }

    /// FP8: bytes of the f32 K/V staging buffer, `[M, 2·kv_dim]`.
    fn kv_scratch_bytes(&self) -> usize {
        self.rows * 2 * self.kv_dim as usize * 4
    }

    /// FP8: bytes of the per-(row tile, g-block) counters, for the smallest
    /// row tile (64, the f32 prefill's; decode has one row tile).
    fn counter_bytes(&self) -> usize {
        let blocks = 2 * self.kv_dim as usize / self.g as usize;
        self.rows.div_ceil(PS_TILE as usize) * blocks * 4
    }
}

fn le_bytes(values: &[i64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Device buffers reused from call to call (grown when too small).
#[derive(Default)]
struct Scratch {
    x: Option<DeviceBuffer>,
    w: Option<DeviceBuffer>,
    out: Option<DeviceBuffer>,
    row_off: Option<DeviceBuffer>,
    written: Option<DeviceBuffer>,
    staged: Option<DeviceBuffer>,
    /// FP8: the written rows' scale offsets (`written / g`).
    scale_written: Option<DeviceBuffer>,
    /// FP8: their scales, gathered.
    staged_scales: Option<DeviceBuffer>,
    /// FP8: K/V as f32 before quantization, `[M, 2·kv_dim]`.
    kv_scratch: Option<DeviceBuffer>,
    /// FP8: one counter per (row tile, g-block); zeroed before every launch
    /// ([`ready_counters`]).
    counters: Option<DeviceBuffer>,
}

/// What one kernel keeps per device context: its functions, the constant
/// weight, scratch buffers. Kept in the context
/// ([`DeviceContextPtr::with_kernel_state`]), so it is freed with it.
struct DeviceState {
    decode: Option<Function>,
    prefill: Option<Function>,
    gather: Function,
    /// FP8 caches: the f32 gather, for the scales.
    scale_gather: Option<Function>,
    weight: Option<DeviceBuffer>,
    scratch: Scratch,
}

/// The host side of one call, validated.
struct Call<'a> {
    dtype: DType,
    schedule: Schedule,
    dims: LaunchDims,
    hidden: &'a [u8],
    weight: &'a [u8],
    weight_is_constant: bool,
    row_off: &'a [i64],
    written: &'a [i64],
    /// The host cache, whose device copy the kernel writes.
    cache: &'a PagedKVCacheCollection,
    /// The layout tag of that copy.
    cache_tag: u64,
}

impl DeviceState {
    fn new(device: &CudaDevice, plan: &VariantPlan) -> kvjit_cuda::Result<Self> {
        let load = |key: &KernelKey| device.function(PTX_MODULE, &PTX, &key.symbol());
        Ok(Self {
            decode: plan.decode.as_ref().map(load).transpose()?,
            prefill: plan.prefill.as_ref().map(load).transpose()?,
            gather: load(&plan.gather)?,
            scale_gather: plan.scale_gather.as_ref().map(load).transpose()?,
            weight: None,
            scratch: Scratch::default(),
        })
    }

    /// Everything on the device. Returns with `output` holding Q and
    /// `staged` the K/V rows written (`[written, 2, kv_dim]`, cache dtype),
    /// followed for an FP8 cache by their scales (`[written, 2, kv_dim / g]`
    /// f32), both host staging buffers the caller commits.
    fn execute(
        &mut self,
        device: &CudaDevice,
        call: &Call<'_>,
        output: &mut [u8],
        staged: &mut [u8],
    ) -> kvjit_cuda::Result<()> {
        let upload = |slot: &mut Option<DeviceBuffer>, bytes: &[u8]| -> kvjit_cuda::Result<()> {
            let buffer = device.ensure(slot, bytes.len())?;
            device.upload(bytes, buffer)
        };
        let d = call.dims;
        let g = d.granularity();
        let scale_bytes = g.map_or(0, |g| call.written.len() * 2 * (d.kv_dim as usize / g) * 4);
        let (staged_codes, staged_scales) = staged.split_at_mut(staged.len() - scale_bytes);
        let s = &mut self.scratch;
        upload(&mut s.x, call.hidden)?;
        upload(&mut s.row_off, &le_bytes(call.row_off))?;
        upload(&mut s.written, &le_bytes(call.written))?;
        device.ensure(&mut s.out, output.len())?;
        device.ensure(&mut s.staged, staged_codes.len())?;
        if let Some(g) = g {
            let scale_offsets: Vec<i64> = call.written.iter().map(|&o| o / g as i64).collect();
            upload(&mut s.scale_written, &le_bytes(&scale_offsets))?;
            device.ensure(&mut s.staged_scales, staged_scales.len())?;
            device.ensure(&mut s.kv_scratch, d.kv_scratch_bytes())?;
            ready_counters(&mut s.counters, d.counter_bytes(), |c, n| device.ensure(c, n), |c| device.zero(c))?;
        }
        if !call.weight_is_constant {
            upload(&mut s.w, call.weight)?;
        } else if self.weight.is_none() {
            upload(&mut self.weight, call.weight)?;
        }

        let s = &self.scratch;
        let present = "uploaded or allocated above";
        let (x, out, row_off, written, staged_dev) = (
            s.x.as_ref().expect(present),
            s.out.as_ref().expect(present),
            s.row_off.as_ref().expect(present),
            s.written.as_ref().expect(present),
            s.staged.as_ref().expect(present),
        );
        let w = if call.weight_is_constant { &self.weight } else { &s.w }.as_ref().expect(present);
        let fused = match call.schedule {
            Schedule::Decode => self.decode.as_ref(),
            Schedule::Prefill => self.prefill.as_ref(),
        }
        .expect("DeviceState::new loaded every schedule of the plan, and the plan served this call");
        let fused_shape = call.schedule.launch_shape(call.dtype, d.rows, d.n as usize);
        let gather_shape = LaunchShape { grid: (call.written.len() as u32, 1, 1), block: (THREADS, 1, 1) };
        let gather = &self.gather;

        device.with_kv_cache(call.cache, call.cache_tag, |copy| {
            let blocks = &copy.blocks;
            let shape_args = [
                KernelArg::I32(d.m),
                KernelArg::I32(d.k),
                KernelArg::I32(d.n),
                KernelArg::I32(d.q_dim),
                KernelArg::I32(d.kv_dim),
                KernelArg::I64(d.kv_stride),
            ];
            match g {
                None => {
                    let mut args = vec![
                        KernelArg::Buffer(x),
                        KernelArg::Buffer(w),
                        KernelArg::Buffer(out),
                        KernelArg::Buffer(blocks),
                        KernelArg::Buffer(row_off),
                    ];
                    args.extend(shape_args);
                    // SAFETY: `args` follow KVJIT_FUSED_PARAMS (x, w, out, blocks,
                    // row_off, M, K, N, q_dim, kv_dim, kv_stride) of the variant
                    // named by `variant_key(spec, schedule)`, whose element types are
                    // the spec's dtypes, which `check_against_spec` confirmed for
                    // hidden_state, weight and the cache. Bounds: `check_call`
                    // proved X is [M, K] and W is [N, K] (uploaded whole), out holds
                    // M·q_dim elements (`check_output`), K % 8 == 0
                    // (`choose_variants`, for the 16-byte loads), `blocks` is the
                    // whole resident copy of the cache's blocks (the key includes
                    // their size), and `row_off` holds M offsets from
                    // `cache_row_offsets`, each inside `blocks` with its V row
                    // kv_stride further and no two equal — what `check_call`
                    // established for every valid token; padded rows are -1 and
                    // store nothing.
                    unsafe { device.launch(fused, fused_shape, &args) }?;
                }
                Some(_) => {
                    let present = "an FP8 cache's copy has scales, and its buffers were allocated above";
                    let scales = copy.scales.as_ref().expect(present);
                    let (kv_scratch, counters) =
                        (s.kv_scratch.as_ref().expect(present), s.counters.as_ref().expect(present));
                    let mut args = vec![
                        KernelArg::Buffer(x),
                        KernelArg::Buffer(w),
                        KernelArg::Buffer(out),
                        KernelArg::Buffer(blocks),
                        KernelArg::Buffer(scales),
                        KernelArg::Buffer(row_off),
                    ];
                    args.extend(shape_args);
                    args.extend([KernelArg::I32(d.g), KernelArg::Buffer(kv_scratch), KernelArg::Buffer(counters)]);
                    // SAFETY: `args` follow KVJIT_FP8_PARAMS (x, w, out, blocks,
                    // scales, row_off, M, K, N, q_dim, kv_dim, kv_stride, g,
                    // scratch, counters) of the `_kvf8e4m3` variant of the spec's
                    // compute dtype. Bounds as for the other variants (above), plus:
                    // `scales` is the whole resident copy of the cache's scales,
                    // [P, 2, L, page, Hkv, D / g] with g dividing D (the cache's
                    // params, checked against the spec), so every written block's
                    // scale (offset / g) is inside it; `kv_scratch` holds
                    // M·2·kv_dim f32 (`kv_scratch_bytes`); `counters` holds
                    // ceil(M / 64)·2·kv_dim / g u32, at least the row tiles of
                    // either schedule, zeroed on the stream before this launch
                    // (`ready_counters`).
                    unsafe { device.launch(fused, fused_shape, &args) }?;
                }
            }
            if !call.written.is_empty() {
                let args = [
                    KernelArg::Buffer(blocks),
                    KernelArg::Buffer(written),
                    KernelArg::I32(d.kv_dim),
                    KernelArg::I64(d.kv_stride),
                    KernelArg::Buffer(staged_dev),
                ];
                // SAFETY: `args` follow the gather kernel's parameters
                // (blocks, offs, kv_dim, kv_stride, staged) for the cache
                // dtype; one block per entry of `written`, which are the
                // valid offsets of `row_off` (in bounds, see above), and
                // `staged_dev` holds written·2·kv_dim elements (allocated
                // from the codes part of `staged`).
                unsafe { device.launch(gather, gather_shape, &args) }?;
                if let (Some(_), Some(scale_gather)) = (g, self.scale_gather.as_ref()) {
                    let present = "an FP8 cache's copy has scales, and its buffers were allocated above";
                    // `d.g`: g, converted to i32 (checked) with the other dims.
                    let per_head = d.kv_dim / d.g;
                    let args = [
                        KernelArg::Buffer(copy.scales.as_ref().expect(present)),
                        KernelArg::Buffer(s.scale_written.as_ref().expect(present)),
                        KernelArg::I32(per_head),
                        KernelArg::I64(d.kv_stride / i64::from(d.g)),
                        KernelArg::Buffer(s.staged_scales.as_ref().expect(present)),
                    ];
                    // SAFETY: the f32 gather's parameters on the scales,
                    // which have the blocks' layout with D replaced by D / g:
                    // a written row's K scales start at its offset / g (an
                    // integer, as g divides the offset) and its V scales
                    // kv_stride / g further, kv_dim / g of each, inside the
                    // scales by the same argument as the rows inside the
                    // blocks; `staged_scales` holds written·2·kv_dim / g f32.
                    unsafe { device.launch(scale_gather, gather_shape, &args) }?;
                }
            }
            Ok(())
        })?;
        device.download(out, output)?;
        device.download(staged_dev, staged_codes)?;
        if let Some(staged_scales_dev) = s.staged_scales.as_ref().filter(|_| g.is_some()) {
            device.download(staged_scales_dev, staged_scales)?;
        }
        device.synchronize()
    }
}

/// FP8: ready the completion counters (one u32 per row tile and g-block,
/// see the `.cu` header) for a launch: grow their buffer in `slot` to
/// `bytes` if it is smaller (`ensure`), then zero all of it (`zero`: a
/// memset on the stream, so it lands before the launch issued after it).
///
/// On every call, not only when the buffer grows: a complete launch leaves
/// the counters zero, but one that failed part-way (a device error, a
/// timeout) may leave counts behind, and the next launch would then
/// quantize a g-block before all its column tiles landed, or never. The
/// memset costs the buffer's bytes, `ceil(M / 64)·2·kv_dim / g·4` for the
/// largest M served so far: 64 B for a Llama 3 8B decode step (kv_dim
/// 1024, g 128), 8 KiB for an 8192-token prefill. (`ensure` and `zero` are
/// parameters so that a test can run this without a GPU.)
fn ready_counters<'a, B>(
    slot: &'a mut Option<B>,
    bytes: usize,
    ensure: impl FnOnce(&'a mut Option<B>, usize) -> kvjit_cuda::Result<&'a mut B>,
    zero: impl FnOnce(&mut B) -> kvjit_cuda::Result<()>,
) -> kvjit_cuda::Result<&'a mut B> {
    let counters = ensure(slot, bytes)?;
    zero(counters)?;
    Ok(counters)
}

/// Tells apart resident copies of the same host memory used with another
/// layout.
fn layout_tag(params: &KvCacheParams) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    ("fused_qkv blocks", params).hash(&mut hasher);
    hasher.finish()
}

/// The op's CUDA kernel for one spec (see the module docs; wrap it in
/// [`kvjit_op::Compiled`] for the runtime's `Kernel` interface).
///
/// Tensor inputs, in order: `hidden_state`, `weight`, `layer_idx`,
/// `valid_lengths`; one cache; one output. Runs only on a CUDA
/// [`DeviceContextPtr`]; building it needs no GPU.
pub struct CudaKernel {
    spec: FusedQkvSpec,
    key: KernelKey,
    plan: VariantPlan,
    weight: Option<Arc<Tensor>>,
    /// The key under which each context keeps this kernel's device state.
    state_owner: KernelStateOwner,
}

impl CudaKernel {
    /// The kernel for `spec`, or [`RuntimeError::TargetUnavailable`] naming
    /// the key when no variant serves it. `weight` is the weight when it is
    /// a graph constant (uploaded once per device instead of every call).
    pub fn new(spec: FusedQkvSpec, weight: Option<Arc<Tensor>>) -> std::result::Result<Self, RuntimeError> {
        let key = spec.key();
        let plan = choose_variants(&spec).map_err(|why| RuntimeError::TargetUnavailable {
            target: Target::Cuda,
            reason: format!("no CUDA variant serves {key}: {why}"),
        })?;
        Ok(Self { spec, key, plan, weight, state_owner: KernelStateOwner::new() })
    }

    /// The variants this kernel uses.
    pub fn plan(&self) -> &VariantPlan {
        &self.plan
    }
}

impl CudaKernel {
    /// A checked call, staged, then committed: `device_work` fills a host
    /// staging copy of Q and of the K/V rows written (`[written, 2, kv_dim]`,
    /// cache dtype, then for an FP8 cache their scales `[written, 2, kv_dim
    /// / g]` f32); only when it succeeds are Q copied into the output and
    /// the rows into the host cache. A device error therefore leaves output
    /// and cache exactly as they were. `ready` is the context check,
    /// reported after the argument checks and before any device work.
    fn run_staged(
        &self,
        checked: CheckedCall,
        (tensors, cache, output): (&[&Tensor], &mut PagedKVCacheCollection, &mut Tensor),
        ready: Result<()>,
        device_work: impl FnOnce(&Call<'_>, &mut [u8], &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let CheckedCall { shape, row_offsets: row_off } = checked;
        let (hidden, weight) = (tensors[0], tensors[1]);
        let dims = LaunchDims::new(&shape, cache.params())?;
        ready?;
        let Some(schedule) = self.plan.schedule_for(dims.rows) else {
            // The check matched static B and S, so the plan has it.
            return Err(Error::ShapeMismatch {
                arg: "hidden_state".into(),
                expected: format!("the shape {} was built for", self.key),
                got: hidden.shape().to_vec(),
            });
        };
        if dims.rows == 0 {
            return Ok(());
        }
        let written: Vec<i64> = row_off.iter().copied().filter(|&o| o >= 0).collect();
        let params = *cache.params();
        let elem = params.dtype().size_bytes();
        let row_bytes = shape.kv_dim * elem;
        // FP8: the scales of a row's K (then V) head blocks, kv_dim / g of each.
        let row_scales = params.scale_granularity().map_or(0, |g| shape.kv_dim / g);
        let mut q = vec![0u8; output.as_bytes().len()];
        let mut staged = vec![0u8; written.len() * 2 * (row_bytes + row_scales * 4)];
        {
            let call = Call {
                dtype: self.spec.dtype,
                schedule,
                dims,
                hidden: hidden.as_bytes(),
                weight: weight.as_bytes(),
                weight_is_constant: self.weight.as_deref().is_some_and(|c| same_data(c, weight)),
                row_off: &row_off,
                written: &written,
                cache,
                cache_tag: layout_tag(&params),
            };
            device_work(&call, &mut q, &mut staged)?;
        }

        // Commit: Q into the output, and the K/V rows the kernel wrote on
        // the device into the host cache (offsets validated by check_call,
        // as on the device), with an FP8 cache's scales (at offset / g: the
        // scales have the blocks' layout with D replaced by D / g).
        output.as_bytes_mut().copy_from_slice(&q);
        let kv_stride = dims.kv_stride as usize;
        let (staged_rows, staged_scales) = staged.split_at(written.len() * 2 * row_bytes);
        let (host, host_scales) = cache.blocks_and_scales_mut();
        for (&off, rows) in written.iter().zip(staged_rows.chunks_exact(2 * row_bytes)) {
            let (k, v) = rows.split_at(row_bytes);
            let off = off as usize;
            host[off * elem..][..row_bytes].copy_from_slice(k);
            host[(off + kv_stride) * elem..][..row_bytes].copy_from_slice(v);
        }
        if let (Some(g), Some(host_scales)) = (params.scale_granularity(), host_scales) {
            let values: Vec<f32> =
                staged_scales.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))).collect();
            for (&off, scales) in written.iter().zip(values.chunks_exact(2 * row_scales)) {
                let (k, v) = scales.split_at(row_scales);
                let off = off as usize;
                host_scales[off / g..][..row_scales].copy_from_slice(k);
                host_scales[(off + kv_stride) / g..][..row_scales].copy_from_slice(v);
            }
        }
        Ok(())
    }
}

impl OpKernel for CudaKernel {
    type Spec = FusedQkvSpec;
    const IMPLEMENTATION: &'static str = "cuda";

    fn spec(&self) -> &FusedQkvSpec {
        &self.spec
    }

    /// The spec's check, and the sizes the kernels' 32-bit indexing takes.
    fn check(&self, tensors: &[&Tensor], caches: &[&PagedKVCacheCollection]) -> Result<CheckedCall> {
        let checked = self.spec.check(tensors, caches)?;
        LaunchDims::new(&checked.shape, caches[0].params())?;
        Ok(checked)
    }

    fn run(&self, checked: CheckedCall, call: OpCall<'_, '_>, ctx: &DeviceContextPtr) -> Result<()> {
        let device = ctx.cuda_context().map(|cuda| cuda.device());
        let ready = match device {
            Some(_) => Ok(()),
            None => Err(device_error(CudaError::Unavailable(format!(
                "{} runs on a CUDA device context, not a {} one",
                self.key,
                ctx.target()
            )))),
        };
        let OpCall { tensors, caches, outputs } = call;
        let args = (tensors, &mut *caches[0], &mut outputs[0]);
        self.run_staged(checked, args, ready, |call, q, staged| {
            let device = device.expect("run_staged returns the context error before any device work");
            // This kernel's functions, constant weight and scratch live in
            // the context and are freed with it (or with this kernel).
            ctx.with_kernel_state(
                &self.state_owner,
                || DeviceState::new(device, &self.plan).map_err(device_error),
                |state| state.execute(device, call, q, staged).map_err(device_error),
            )
        })?;
        // The kernel wrote the same rows into the device copy and (committed)
        // into the host blocks: the copy is current, not stale.
        if let Some(device) = device {
            device.kv_cache_synced(caches[0], layout_tag(caches[0].params()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::*;

    fn spec(dtype: DType, k: usize, batch: Option<usize>, seq: Option<usize>) -> FusedQkvSpec {
        FusedQkvSpec {
            backend: Backend::Cuda,
            dtype,
            weights: dtype,
            cache: KvCacheParams {
                element: CacheElement::new(dtype, None).unwrap(),
                num_layers: 32,
                page_size: 16,
                num_kv_heads: 8,
                head_size: 128,
            },
            k,
            q_dim: 4096,
            step: kvjit_op::checks::StepDims { batch, seq },
            sizes: crate::Sizes::Baked,
        }
    }

    /// A `.cu` edited without `scripts/gen-ptx.sh` must fail the build's
    /// tests: every committed PTX names the SHA-256 of the source it came from.
    #[test]
    fn committed_ptx_was_generated_from_this_cu() {
        let sha: String = Sha256::digest(CUDA_SOURCE.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
        for image in &PTX {
            let header = image
                .ptx
                .lines()
                .take(5)
                .find_map(|l| l.strip_prefix("// kvjit-source-sha256: "))
                .unwrap_or_else(|| panic!("compute_{} PTX has no kvjit-source-sha256 header", image.arch));
            assert_eq!(
                header, sha,
                "cuda/fused_qkv.compute_{}.ptx was generated from another fused_qkv.cu: run scripts/gen-ptx.sh",
                image.arch
            );
            assert!(image.ptx.contains(&format!(".target sm_{}", image.arch)), "compute_{} PTX", image.arch);
            assert!(image.ptx.contains("\n.version 9.0\n"), "driver 580 loads PTX ISA 9.0 (CUDA 13.0), not newer");
        }
    }

    /// Every kernel name this module can ask for is an entry of both images.
    #[test]
    fn every_variant_the_rust_side_names_is_in_the_ptx() {
        let symbols = all_kernel_symbols();
        // (3 compute x 4 cache dtypes) x 2 schedules, 4 gathers, the E4M3 probe
        assert_eq!(symbols.len(), 3 * 4 * 2 + 4 + 1);
        for image in &PTX {
            for symbol in &symbols {
                assert!(
                    image.ptx.contains(&format!(".visible .entry {symbol}(")),
                    "{symbol} missing from compute_{} PTX",
                    image.arch
                );
            }
            assert_eq!(image.ptx.matches(".visible .entry ").count(), symbols.len(), "no unnamed extra kernels");
        }
        for symbol in [
            "fused_qkv_bshd_paged_decode_cuda_bf16_kvbf16",
            "fused_qkv_bshd_paged_decode_cuda_f32_kvf8e4m3",
            "fused_qkv_bshd_paged_prefill_cuda_f16_kvf8e4m3",
            "fused_qkv_bshd_paged_gather_cuda_f8e4m3",
            "fused_qkv_bshd_paged_e4m3_probe_cuda_f32",
        ] {
            assert!(symbols.contains(&symbol.to_string()), "{symbol}");
        }
    }

    /// The FP8 variants convert with the hardware's cvt on sm_90 only: the
    /// instruction is in the compute_90 image and not in the compute_80 one
    /// (which runs the software convert).
    #[test]
    fn the_hardware_e4m3_convert_is_in_the_sm90_image_only() {
        let cvt = "cvt.rn.satfinite.e4m3x2.f32";
        let [sm80, sm90] = &PTX;
        assert!(!sm80.ptx.contains(cvt), "compute_80 has no E4M3 convert instruction");
        assert!(sm90.ptx.contains(cvt), "compute_90 converts with {cvt}");
        // The quotient x / scale and amax / 448 must round exactly as the
        // reference's f32 division: IEEE division only, no approximation.
        for image in &PTX {
            assert!(!image.ptx.contains("div.approx"), "compute_{}: approximate division", image.arch);
            assert!(!image.ptx.contains("div.full"), "compute_{}: approximate division", image.arch);
        }
    }

    /// The launch geometry mirrored here is the one the `.cu` defines.
    #[test]
    fn launch_constants_match_the_cu() {
        for line in [
            format!("constexpr int THREADS = {THREADS};"),
            format!("constexpr int DEC_MAX_M = {DECODE_MAX_ROWS};"),
            format!("constexpr int DEC_MMA_COLS = {DEC_MMA_COLS};"),
            format!("constexpr int DEC_SIMT_COLS = {DEC_SIMT_COLS};"),
            format!("constexpr int PF_BM = {PF_TILE}, PF_BN = {PF_TILE},"),
            format!("constexpr int PS_BM = {PS_TILE}, PS_BN = {PS_TILE},"),
            format!("constexpr float E4M3_MAX = {}.f;", kvjit_core::fp8::E4M3_MAX),
        ] {
            assert!(CUDA_SOURCE.contains(&line), "fused_qkv.cu does not say `{line}`");
        }
    }

    #[test]
    fn variant_names_come_from_the_kernel_key() {
        let s = spec(DType::BF16, 4096, None, None);
        assert_eq!(variant_key(&s, Schedule::Decode).to_string(), "fused_qkv_bshd_paged_decode.cuda.bf16.kvbf16");
        assert_eq!(variant_key(&s, Schedule::Prefill).symbol(), "fused_qkv_bshd_paged_prefill_cuda_bf16_kvbf16");
        // a CPU spec still names the CUDA variant
        let cpu = FusedQkvSpec {
            backend: Backend::Cpu(kvjit_core::CodeTier::Cranelift),
            cache: KvCacheParams { element: CacheElement::F32, ..s.cache },
            ..s
        };
        assert_eq!(variant_key(&cpu, Schedule::Decode).symbol(), "fused_qkv_bshd_paged_decode_cuda_bf16_kvf32");
        assert_eq!(gather_key(DType::F16).symbol(), "fused_qkv_bshd_paged_gather_cuda_f16");
    }

    fn fp8_spec(dtype: DType, g: Option<usize>) -> FusedQkvSpec {
        let spec = spec(dtype, 4096, None, None);
        FusedQkvSpec {
            cache: KvCacheParams { element: CacheElement::new(DType::F8E4M3, g).unwrap(), ..spec.cache },
            ..spec
        }
    }

    /// A spec with an f8e4m3 cache maps to the `_kvf8e4m3` variants of its
    /// compute dtype (any g dividing D: g is a run-time argument), the u8
    /// gather for the codes and the f32 gather for the scales.
    #[test]
    fn fp8_caches_map_to_the_fp8_variants() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for g in [1, 32, 128] {
                let plan = choose_variants(&fp8_spec(dtype, Some(g))).unwrap();
                let name = |s: &str| format!("fused_qkv_bshd_paged_{s}_cuda_{dtype}_kvf8e4m3");
                assert_eq!(plan.decode.unwrap().symbol(), name("decode"));
                assert_eq!(plan.prefill.unwrap().symbol(), name("prefill"));
                assert_eq!(plan.gather.symbol(), "fused_qkv_bshd_paged_gather_cuda_f8e4m3");
                assert_eq!(plan.scale_gather.unwrap().symbol(), "fused_qkv_bshd_paged_gather_cuda_f32");
            }
        }
        assert_eq!(
            variant_key(&fp8_spec(DType::BF16, Some(128)), Schedule::Decode).to_string(),
            "fused_qkv_bshd_paged_decode.cuda.bf16.kvf8e4m3"
        );
        let plain = choose_variants(&spec(DType::BF16, 4096, None, None)).unwrap();
        assert_eq!(plain.scale_gather, None);
        // Every name an FP8 plan asks for is in both images.
        let symbols = all_kernel_symbols();
        let plan = choose_variants(&fp8_spec(DType::F16, Some(64))).unwrap();
        for key in [plan.decode, plan.prefill, Some(plan.gather), plan.scale_gather].into_iter().flatten() {
            assert!(symbols.contains(&key.symbol()), "{key}");
        }
        // A CudaKernel builds for it (no GPU needed).
        let kernel = CudaKernel::new(fp8_spec(DType::BF16, Some(128)), None).unwrap();
        assert!(kernel.plan().scale_gather.is_some());
    }

    #[test]
    fn fp8_caches_without_a_valid_granularity_are_refused() {
        // Without a granularity, or with one on a float cache, there is no
        // cache element to build a spec of.
        assert!(CacheElement::new(DType::F8E4M3, None).unwrap_err().to_string().contains("scale_granularity"));
        assert!(CacheElement::new(DType::BF16, Some(128)).unwrap_err().to_string().contains("f8e4m3 caches only"));
        let why = choose_variants(&fp8_spec(DType::BF16, Some(48))).unwrap_err();
        assert!(why.contains("must divide head_size 128, got 48"), "{why}");
        let why =
            choose_variants(&FusedQkvSpec { dtype: DType::F8E4M3, ..fp8_spec(DType::BF16, Some(128)) }).unwrap_err();
        assert!(why.contains("f32, bf16 and f16 compute dtypes, not f8e4m3"), "{why}");
    }

    #[test]
    fn static_keys_get_one_schedule_generic_keys_both() {
        let decode = choose_variants(&spec(DType::BF16, 4096, Some(4), Some(4))).unwrap();
        assert!(decode.decode.is_some() && decode.prefill.is_none());
        assert_eq!(decode.schedule_for(16), Some(Schedule::Decode));
        let prefill = choose_variants(&spec(DType::BF16, 4096, Some(1), Some(17))).unwrap();
        assert!(prefill.decode.is_none() && prefill.prefill.is_some());
        for (b, s) in [(None, None), (Some(4), None), (None, Some(1))] {
            let generic = choose_variants(&spec(DType::F16, 4096, b, s)).unwrap();
            assert_eq!(generic.schedule_for(1), Some(Schedule::Decode));
            assert_eq!(generic.schedule_for(16), Some(Schedule::Decode));
            assert_eq!(generic.schedule_for(17), Some(Schedule::Prefill));
            assert_eq!(generic.schedule_for(2048), Some(Schedule::Prefill));
        }
    }

    #[test]
    fn keys_no_variant_serves_are_refused_with_the_reason() {
        let why = choose_variants(&spec(DType::F32, 4100, None, None)).unwrap_err();
        assert!(why.contains("K % 8 == 0, got K = 4100"), "{why}");
        let why = choose_variants(&spec(DType::F32, 4096, Some(1 << 20), Some(1 << 20))).unwrap_err();
        assert!(why.contains("rows"), "{why}");
        let why = choose_variants(&FusedQkvSpec {
            backend: Backend::Cpu(kvjit_core::CodeTier::Cranelift),
            ..spec(DType::F32, 8, None, None)
        })
        .unwrap_err();
        assert!(why.contains("not a CUDA key"), "{why}");
        let err = CudaKernel::new(spec(DType::BF16, 12, None, None), None).err().expect("refused");
        assert_eq!(
            err.to_string(),
            "CUDA target unavailable: no CUDA variant serves \
             fused_qkv_bshd_paged.cuda.bf16.k12.q4096.hkv8.d128.p16.l32.kvbf16.bany.sany: the CUDA kernels read rows \
             of hidden_state and weight as 16-byte vectors and need K % 8 == 0, got K = 12"
        );
    }

    /// A small valid call: B = 2, S = 3 (valid lengths 3 and 1), K = 8,
    /// q_dim = 8, Hkv = 1, D = 4, page size 2, random values everywhere.
    fn small_call() -> (CudaKernel, [Tensor; 4], PagedKVCacheCollection, Tensor) {
        use rand::{SeedableRng, rngs::StdRng};
        let params =
            KvCacheParams { element: CacheElement::F32, num_layers: 1, page_size: 2, num_kv_heads: 1, head_size: 4 };
        let spec = FusedQkvSpec {
            backend: Backend::Cuda,
            dtype: DType::F32,
            weights: DType::F32,
            cache: params,
            k: 8,
            q_dim: 8,
            step: StepDims { batch: None, seq: None },
            sizes: crate::Sizes::Baked,
        };
        let mut rng = StdRng::seed_from_u64(5);
        let mut cache = PagedKVCacheCollection::new(params, 8, 2, 4).unwrap();
        cache.reserve(&[3, 1]).unwrap();
        cache.set_blocks(Tensor::random(DType::F32, cache.blocks().shape(), &mut rng, -1.0, 1.0).unwrap()).unwrap();
        let inputs = [
            Tensor::random(DType::F32, &[2, 3, 8], &mut rng, -1.0, 1.0).unwrap(),
            Tensor::random(DType::F32, &[16, 8], &mut rng, -1.0, 1.0).unwrap(),
            Tensor::scalar_u32(0),
            Tensor::from_vec(&[2], vec![3u32, 1]).unwrap(),
        ];
        let output = Tensor::random(DType::F32, &[2, 3, 8], &mut rng, -1.0, 1.0).unwrap();
        (CudaKernel::new(spec, None).unwrap(), inputs, cache, output)
    }

    /// A device error after Q came back (here: the device work fills the Q
    /// staging buffer and part of the rows, then fails) leaves the output and
    /// the cache byte for byte as they were. Before the fix, Q was downloaded
    /// straight into the output ahead of the K/V rows.
    #[test]
    fn a_device_error_half_way_writes_neither_output_nor_cache() {
        let (kernel, inputs, mut cache, mut output) = small_call();
        let (cache_before, output_before) = (cache.blocks().as_bytes().to_vec(), output.as_bytes().to_vec());
        let inputs: Vec<&Tensor> = inputs.iter().collect();
        let checked = kernel.check(&inputs, &[&cache]).unwrap();
        let result = kernel.run_staged(checked, (&inputs, &mut cache, &mut output), Ok(()), |_call, q, staged| {
            q.fill(0xab);
            staged[..4].fill(0xcd);
            Err(device_error(CudaError::Unavailable("injected failure after Q was downloaded".into())))
        });
        let error = result.unwrap_err().to_string();
        assert!(error.contains("injected failure"), "{error}");
        assert_eq!(output.as_bytes(), output_before, "the output changed though the call failed");
        assert_eq!(cache.blocks().as_bytes(), cache_before, "the cache changed though the call failed");
    }

    /// When the device work succeeds, exactly the staged Q and the staged
    /// rows of valid tokens land in the host output and cache; padded tokens'
    /// slots and every other byte stay.
    #[test]
    fn a_successful_call_commits_q_and_exactly_the_valid_rows() {
        let (kernel, inputs, mut cache, mut output) = small_call();
        let before = cache.clone();
        let inputs: Vec<&Tensor> = inputs.iter().collect();
        let checked = kernel.check(&inputs, &[&cache]).unwrap();
        kernel
            .run_staged(checked, (&inputs, &mut cache, &mut output), Ok(()), |call, q, staged| {
                assert_eq!(call.written.len(), 4, "3 + 1 valid tokens");
                for (i, v) in q.chunks_exact_mut(4).enumerate() {
                    v.copy_from_slice(&(i as f32).to_le_bytes());
                }
                for (i, v) in staged.chunks_exact_mut(4).enumerate() {
                    v.copy_from_slice(&(1000.0 + i as f32).to_le_bytes());
                }
                Ok(())
            })
            .unwrap();
        let q = output.to_f32_vec().unwrap();
        assert!(q.iter().enumerate().all(|(i, &v)| v == i as f32), "{q:?}");
        let blocks = cache.blocks().to_f32_vec().unwrap();
        let old = before.blocks().to_f32_vec().unwrap();
        let mut expected = old.clone();
        let tokens = [(0usize, 0usize), (0, 1), (0, 2), (1, 0)];
        for (row, &(b, t)) in tokens.iter().enumerate() {
            let page = before.lookup_table()[b * 4 + t / 2] as usize;
            for kv in 0..2 {
                for d in 0..4 {
                    let at = before.element_offset(page, kv, 0, t % 2, 0, d);
                    expected[at] = 1000.0 + (row * 8 + kv * 4 + d) as f32;
                }
            }
        }
        assert_eq!(blocks, expected);
    }

    /// An FP8 call's commit: the staged codes land at the written rows'
    /// K/V offsets and the staged scales at offset / g (K, then V), and
    /// nothing else changes — blocks or scales.
    #[test]
    fn an_fp8_call_commits_codes_and_scales_of_exactly_the_valid_rows() {
        use rand::{SeedableRng, rngs::StdRng};
        let (g, d) = (2, 4);
        let spec = FusedQkvSpec {
            backend: Backend::Cuda,
            dtype: DType::F32,
            weights: DType::F32,
            cache: KvCacheParams {
                element: CacheElement::F8E4M3 { scale_granularity: g },
                num_layers: 2,
                page_size: 2,
                num_kv_heads: 2,
                head_size: d,
            },
            k: 8,
            q_dim: 8,
            step: StepDims { batch: None, seq: None },
            sizes: crate::Sizes::Baked,
        };
        let mut rng = StdRng::seed_from_u64(9);
        let mut cache = PagedKVCacheCollection::new(spec.cache, 8, 2, 4).unwrap();
        cache.reserve(&[3, 1]).unwrap();
        cache.set_blocks(Tensor::random(DType::F8E4M3, cache.blocks().shape(), &mut rng, -1.0, 1.0).unwrap()).unwrap();
        cache
            .set_scales(Tensor::random(DType::F32, cache.scales().unwrap().shape(), &mut rng, 1.0, 2.0).unwrap())
            .unwrap();
        let inputs = [
            Tensor::random(DType::F32, &[2, 3, 8], &mut rng, -1.0, 1.0).unwrap(),
            Tensor::random(DType::F32, &[24, 8], &mut rng, -1.0, 1.0).unwrap(),
            Tensor::scalar_u32(1),
            Tensor::from_vec(&[2], vec![3u32, 1]).unwrap(),
        ];
        let mut output = Tensor::zeros(DType::F32, &[2, 3, 8]).unwrap();
        let kernel = CudaKernel::new(spec, None).unwrap();
        let before = cache.clone();
        let inputs: Vec<&Tensor> = inputs.iter().collect();
        let (kv_dim, row_scales) = (2 * d, 2 * d / g); // a row's K (or V) values, and their scales
        let checked = kernel.check(&inputs, &[&cache]).unwrap();
        kernel
            .run_staged(checked, (&inputs, &mut cache, &mut output), Ok(()), |call, _q, staged| {
                assert_eq!(usize::try_from(call.dims.g), Ok(g));
                assert_eq!(staged.len(), 4 * 2 * (kv_dim + row_scales * 4), "4 rows of codes, then scales");
                let (codes, scales) = staged.split_at_mut(4 * 2 * kv_dim);
                for (i, c) in codes.iter_mut().enumerate() {
                    *c = i as u8;
                }
                for (i, v) in scales.chunks_exact_mut(4).enumerate() {
                    v.copy_from_slice(&(1000.0 + i as f32).to_le_bytes());
                }
                Ok(())
            })
            .unwrap();
        let (mut want_codes, mut want_scales) =
            (before.blocks().as_bytes().to_vec(), before.scales().unwrap().to_f32_vec().unwrap());
        let tokens = [(0usize, 0usize), (0, 1), (0, 2), (1, 0)];
        for (row, &(b, t)) in tokens.iter().enumerate() {
            let page = before.lookup_table()[b * 4 + t / 2] as usize;
            for kv in 0..2 {
                for head in 0..2 {
                    for x in 0..d {
                        let at = before.element_offset(page, kv, 1, t % 2, head, x);
                        want_codes[at] = (row * 2 * kv_dim + kv * kv_dim + head * d + x) as u8;
                    }
                    for block in 0..d / g {
                        let at = before.scale_offset(page, kv, 1, t % 2, head, block);
                        want_scales[at] =
                            1000.0 + (row * 2 * row_scales + kv * row_scales + head * d / g + block) as f32;
                    }
                }
            }
        }
        assert_eq!(cache.blocks().as_bytes(), want_codes);
        assert_eq!(cache.scales().unwrap().to_f32_vec().unwrap(), want_scales);
    }

    /// A host stand-in for `CudaDevice::ensure`: a new buffer holds garbage,
    /// as `cuMemAlloc`'s does.
    fn ensure_host(slot: &mut Option<Vec<u32>>, bytes: usize) -> kvjit_cuda::Result<&mut Vec<u32>> {
        if slot.as_ref().is_none_or(|b| b.len() * 4 < bytes) {
            *slot = Some(vec![0xdead_beef; bytes / 4]);
        }
        Ok(slot.as_mut().expect("set above"))
    }

    /// The FP8 completion counters are zero at every launch, whatever the
    /// launch before left in them: here each launch fails part-way, leaving
    /// counts behind, and the next call reuses the buffer at the same size,
    /// a smaller one, or grows it. Before the fix they were zeroed only when
    /// the buffer grew.
    #[test]
    fn fp8_counters_are_zeroed_before_every_launch_even_after_a_failed_one() {
        let mut slot = None;
        for (bytes, what) in [(64, "first call"), (64, "same size"), (32, "smaller"), (128, "grown"), (128, "same")] {
            let counters = ready_counters(&mut slot, bytes, ensure_host, |c| {
                c.fill(0);
                Ok(())
            })
            .unwrap();
            assert!(counters.len() * 4 >= bytes, "{what}: {} counters", counters.len());
            assert!(counters.iter().all(|&c| c == 0), "{what}: counters left by the failed launch: {counters:?}");
            // The launch fails after some blocks counted themselves in.
            counters[0] = 1;
            counters[bytes / 4 - 1] += 2;
        }
        // A failure in the memset is the call's error.
        let failed = ready_counters(&mut slot, 16, ensure_host, |_| Err(CudaError::Unavailable("memset".into())));
        assert!(failed.is_err());
    }

    /// The context check comes after the argument checks, and before any
    /// device work.
    #[test]
    fn a_non_cuda_context_is_refused_before_any_device_work() {
        let (kernel, inputs, mut cache, mut output) = small_call();
        let before = output.as_bytes().to_vec();
        let ctx = DeviceContextPtr::cpu(1).unwrap();
        let inputs: Vec<&Tensor> = inputs.iter().collect();
        let kernel = kvjit_op::Compiled::new(kernel);
        let error =
            kvjit_runtime::Kernel::run(&kernel, &inputs, &mut [&mut cache], std::slice::from_mut(&mut output), &ctx)
                .unwrap_err();
        assert!(error.to_string().contains("runs on a CUDA device context, not a cpu one"), "{error}");
        assert_eq!(output.as_bytes(), before);
        assert_eq!(ctx.kernel_states(), 0, "nothing was kept in a context the kernel cannot use");
    }

    #[test]
    fn launch_shapes_cover_every_output() {
        let decode = Schedule::Decode.launch_shape(DType::BF16, 1, 6144);
        assert_eq!(decode.grid, (384, 1, 1));
        assert_eq!(Schedule::Decode.launch_shape(DType::F32, 16, 6145).grid, (1537, 1, 1));
        assert_eq!(Schedule::Prefill.launch_shape(DType::BF16, 2048, 6144).grid, (48, 16, 1));
        assert_eq!(Schedule::Prefill.launch_shape(DType::F32, 129, 65).grid, (2, 3, 1));
        assert_eq!(decode.block, (256, 1, 1));
    }
}
