//! [`CudaDevice`]: one GPU, the stream kvjit's kernels run on, the PTX
//! modules loaded on it, and the KV caches kept resident there.
//!
//! **One stream.** Every copy and launch goes to the device's stream in
//! order, so a launch sees the copies issued before it, and a download sees
//! the launches before it. Copies from pageable host memory return once the
//! host buffer may be reused (uploads) or has been filled (downloads), so
//! host slices never outlive a pending copy.
//!
//! **Resident KV caches.** The device copies of KV caches live in the device
//! ([`CudaDevice::with_kv_cache`], see `kv_cache.rs`), so they are freed with
//! it.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::kv_cache::{DeviceKvCache, KvCacheTable};
use crate::{CudaError, Result, probe};

/// PTX for one virtual architecture, generated ahead of time and embedded in
/// the binary.
#[derive(Clone, Copy, Debug)]
pub struct PtxImage {
    /// The `compute_XY` it targets, as `XY` (80, 90).
    pub arch: u32,
    /// The PTX text.
    pub ptx: &'static str,
}

impl PtxImage {
    /// The image a device of compute capability `(major, minor)` runs: the
    /// newest one not newer than the device (the driver JIT-compiles PTX for
    /// any later GPU, never for an earlier one).
    pub fn pick(images: &[PtxImage], (major, minor): (i32, i32)) -> Option<&PtxImage> {
        let device = u32::try_from(major * 10 + minor).ok()?;
        images.iter().filter(|image| image.arch <= device).max_by_key(|image| image.arch)
    }
}

/// A kernel of a loaded module.
#[derive(Clone, Debug)]
pub struct Function(CudaFunction);

/// Bytes of device memory held by live [`DeviceBuffer`]s, all devices.
static LIVE_DEVICE_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Bytes of device memory kvjit holds right now, over every device: the sum
/// of the allocations of all live [`DeviceBuffer`]s (scratch, uploaded
/// weights, resident caches). Tests use it to see that dropping a context
/// or a kernel gives its memory back.
pub fn live_device_bytes() -> usize {
    LIVE_DEVICE_BYTES.load(Ordering::SeqCst)
}

/// Device memory: `len` bytes (the allocation is at least one byte, and
/// 256-byte aligned like every `cuMemAlloc`).
pub struct DeviceBuffer {
    slice: CudaSlice<u8>,
    len: usize,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        LIVE_DEVICE_BYTES.fetch_sub(self.slice.len(), Ordering::SeqCst);
    }
}

impl DeviceBuffer {
    /// Bytes usable.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of its first byte (for libraries that take raw
    /// pointers, and for [`KernelArg::Address`]). Work on the buffer's
    /// stream is ordered after everything issued there before.
    pub fn address(&self) -> u64 {
        let (address, _record) = self.slice.device_ptr(self.slice.stream());
        address
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBuffer({} bytes)", self.len)
    }
}

/// One kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum KernelArg<'a> {
    /// A pointer to the start of a device buffer.
    Buffer(&'a DeviceBuffer),
    /// A raw device address, e.g. [`DeviceBuffer::address`] plus an offset.
    Address(u64),
    /// An `int`.
    I32(i32),
    /// A `long long`.
    I64(i64),
}

/// Grid and block of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
}

/// One GPU with its stream (see the module docs).
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    compute_capability: (i32, i32),
    modules: Mutex<HashMap<(String, u32), Arc<CudaModule>>>,
    kv_caches: Mutex<KvCacheTable<DeviceKvCache>>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal())
            .field("name", &self.name)
            .field("compute_capability", &self.compute_capability)
            .finish()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The guarded tables stay consistent at every await-free step, so a panic
    // elsewhere while holding the lock leaves nothing half-done.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CudaDevice {
    /// Open device `ordinal` with a new stream. Fails with
    /// [`CudaError::Unavailable`] (never a panic) when CUDA cannot be used.
    pub fn new(ordinal: usize) -> Result<Arc<Self>> {
        let ctx =
            if ordinal == 0 { probe::device0()? } else { probe::probe(ordinal).map_err(CudaError::Unavailable)? };
        let stream = ctx.new_stream().map_err(|e| CudaError::driver("cuStreamCreate", e))?;
        let name = ctx.name().map_err(|e| CudaError::driver("cuDeviceGetName", e))?;
        let compute_capability = ctx.compute_capability().map_err(|e| CudaError::driver("cuDeviceGetAttribute", e))?;
        Ok(Arc::new(Self {
            ctx,
            stream,
            name,
            compute_capability,
            modules: Mutex::new(HashMap::new()),
            kv_caches: Mutex::new(KvCacheTable::default()),
        }))
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every copy and launch of this device goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Kernel `symbol` of module `module`, loading the module (the PTX image
    /// [`PtxImage::pick`] chooses for this device) on first use.
    pub fn function(&self, module: &str, images: &[PtxImage], symbol: &str) -> Result<Function> {
        let image = PtxImage::pick(images, self.compute_capability).ok_or_else(|| CudaError::NoPtxForDevice {
            module: module.into(),
            have: images.iter().map(|i| format!("compute_{}", i.arch)).collect::<Vec<_>>().join(", "),
            major: self.compute_capability.0,
            minor: self.compute_capability.1,
        })?;
        let loaded = {
            let mut modules = lock(&self.modules);
            match modules.get(&(module.to_string(), image.arch)) {
                Some(m) => m.clone(),
                None => {
                    let m = self.ctx.load_module(Ptx::from_src(image.ptx)).map_err(|e| {
                        CudaError::driver(format!("cuModuleLoadData({module}, compute_{})", image.arch), e)
                    })?;
                    modules.insert((module.to_string(), image.arch), m.clone());
                    m
                }
            }
        };
        loaded
            .load_function(symbol)
            .map(Function)
            .map_err(|e| CudaError::driver(format!("cuModuleGetFunction({symbol})"), e))
    }

    /// Uninitialized device memory of `bytes` bytes.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        // SAFETY: the memory is uninitialized; DeviceBuffer exposes it only
        // as a copy destination or a kernel argument, and every reader
        // (download, kernels) is told how many bytes the caller wrote.
        let slice = unsafe { self.stream.alloc::<u8>(bytes.max(1)) }
            .map_err(|e| CudaError::driver(format!("cuMemAlloc({bytes} bytes)"), e))?;
        LIVE_DEVICE_BYTES.fetch_add(slice.len(), Ordering::SeqCst);
        Ok(DeviceBuffer { slice, len: bytes })
    }

    /// Make `slot` hold a buffer of at least `bytes` bytes (reallocating only
    /// to grow) and return it.
    pub fn ensure<'a>(&self, slot: &'a mut Option<DeviceBuffer>, bytes: usize) -> Result<&'a mut DeviceBuffer> {
        if slot.as_ref().is_none_or(|b| b.len < bytes) {
            *slot = None; // free the old one first
            *slot = Some(self.alloc(bytes)?);
        }
        Ok(slot.as_mut().expect("set above"))
    }

    /// Copy `host` into the first `host.len()` bytes of `dst`.
    pub fn upload(&self, host: &[u8], dst: &mut DeviceBuffer) -> Result<()> {
        if host.len() > dst.len {
            return Err(CudaError::BufferTooSmall { what: "upload".into(), needed: host.len(), available: dst.len });
        }
        if host.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice.slice_mut(..host.len());
        self.stream.memcpy_htod(host, &mut view).map_err(|e| CudaError::driver("cuMemcpyHtoDAsync", e))
    }

    /// Set every byte of `dst` to zero (on the stream, after the work issued
    /// before it).
    pub fn zero(&self, dst: &mut DeviceBuffer) -> Result<()> {
        self.stream.memset_zeros(&mut dst.slice).map_err(|e| CudaError::driver("cuMemsetD8Async", e))
    }

    /// Copy the first `host.len()` bytes of `src` into `host`, waiting for
    /// every earlier launch on the stream.
    pub fn download(&self, src: &DeviceBuffer, host: &mut [u8]) -> Result<()> {
        if host.len() > src.len {
            return Err(CudaError::BufferTooSmall { what: "download".into(), needed: host.len(), available: src.len });
        }
        if host.is_empty() {
            return Ok(());
        }
        let view = src.slice.slice(..host.len());
        self.stream.memcpy_dtoh(&view, host).map_err(|e| CudaError::driver("cuMemcpyDtoHAsync", e))
    }

    /// Copy the first `bytes` bytes of `src` to `dst` on the device.
    pub fn copy(&self, src: &DeviceBuffer, dst: &mut DeviceBuffer, bytes: usize) -> Result<()> {
        if bytes > src.len || bytes > dst.len {
            return Err(CudaError::BufferTooSmall {
                what: "device copy".into(),
                needed: bytes,
                available: src.len.min(dst.len),
            });
        }
        if bytes == 0 {
            return Ok(());
        }
        let (from, mut to) = (src.slice.slice(..bytes), dst.slice.slice_mut(..bytes));
        self.stream.memcpy_dtod(&from, &mut to).map_err(|e| CudaError::driver("cuMemcpyDtoDAsync", e))
    }

    /// Milliseconds the work `issue` puts on the stream takes on the GPU,
    /// measured with CUDA events around it (waits for it to finish).
    pub fn elapsed_ms(&self, issue: impl FnOnce() -> Result<()>) -> Result<f32> {
        let event = || {
            self.ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| CudaError::driver("cuEventCreate", e))
        };
        let (start, end) = (event()?, event()?);
        start.record(&self.stream).map_err(|e| CudaError::driver("cuEventRecord", e))?;
        issue()?;
        end.record(&self.stream).map_err(|e| CudaError::driver("cuEventRecord", e))?;
        end.synchronize().map_err(|e| CudaError::driver("cuEventSynchronize", e))?;
        start.elapsed_ms(&end).map_err(|e| CudaError::driver("cuEventElapsedTime", e))
    }

    /// Wait for everything issued on the stream and report any error a
    /// kernel or an earlier asynchronous call left behind.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| CudaError::driver("cuStreamSynchronize", e))?;
        self.ctx.check_err().map_err(|e| CudaError::driver("an earlier asynchronous CUDA call", e))
    }

    /// Launch `function` on the stream with `args`.
    ///
    /// # Safety
    ///
    /// `args` must match the kernel's parameter list in number, order and
    /// type, and the kernel must access only memory inside the buffers it is
    /// given: the driver checks neither. Callers state which validation
    /// established that.
    pub unsafe fn launch(&self, function: &Function, shape: LaunchShape, args: &[KernelArg<'_>]) -> Result<()> {
        let mut builder = self.stream.launch_builder(&function.0);
        for arg in args {
            match arg {
                KernelArg::Buffer(buffer) => {
                    let buffer: &DeviceBuffer = buffer;
                    builder.arg(&buffer.slice)
                }
                KernelArg::Address(v) => builder.arg(v),
                KernelArg::I32(v) => builder.arg(v),
                KernelArg::I64(v) => builder.arg(v),
            };
        }
        let config = LaunchConfig { grid_dim: shape.grid, block_dim: shape.block, shared_mem_bytes: 0 };
        // SAFETY: the caller guarantees the arguments match the kernel and
        // keep its accesses in bounds (this function's contract); the
        // buffers are borrowed for the whole call and cudarc records the
        // launch on their events, so none is freed while the kernel runs.
        unsafe { builder.launch(config) }.map(|_| ()).map_err(|e| CudaError::driver("cuLaunchKernel", e))
    }

    /// The table of KV-cache copies (see `kv_cache.rs`).
    pub(crate) fn kv_caches(&self) -> std::sync::MutexGuard<'_, KvCacheTable<DeviceKvCache>> {
        lock(&self.kv_caches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_ptx_not_newer_than_the_device_is_picked() {
        let images = [PtxImage { arch: 80, ptx: "a" }, PtxImage { arch: 90, ptx: "b" }];
        assert_eq!(PtxImage::pick(&images, (8, 0)).map(|i| i.arch), Some(80));
        assert_eq!(PtxImage::pick(&images, (8, 9)).map(|i| i.arch), Some(80));
        assert_eq!(PtxImage::pick(&images, (9, 0)).map(|i| i.arch), Some(90));
        assert_eq!(PtxImage::pick(&images, (10, 0)).map(|i| i.arch), Some(90));
        assert_eq!(PtxImage::pick(&images, (7, 5)).map(|i| i.arch), None);
    }
}
