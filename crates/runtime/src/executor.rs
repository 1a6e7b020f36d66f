//! Running executables.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvjit_core::{PagedKVCacheCollection, Tensor};

use crate::executable::shape_string;
use crate::{DeviceContextPtr, Executable, Result, RuntimeError, ShapeDim, Slot};

/// How long one step took.
#[derive(Clone, Copy, Debug)]
pub struct StepTiming {
    /// The step: its index in [`Executable::steps`] (its label and kernel
    /// are there; recorded as an index so that timing a step costs no
    /// formatting or allocation).
    pub step: usize,
    /// Wall time of the kernel call.
    pub elapsed: Duration,
}

/// What a run produced.
#[derive(Debug)]
pub struct RunOutput {
    /// Graph outputs by name.
    pub outputs: BTreeMap<String, Tensor>,
    /// Per-step timings, in step order.
    pub timings: Vec<StepTiming>,
    /// The most bytes of step outputs held at once during the run (views
    /// counted once, in their producer): with every output kept, their sum;
    /// less where a large run released outputs after their last reader
    /// ([`RELEASE_DEAD_ABOVE`]).
    pub peak_output_bytes: u64,
}

/// A run whose step outputs take more bytes than this in all releases each
/// output of at least [`RELEASE_MIN_BYTES`] after the last step that reads
/// it (a long prefill: its activations for every layer would otherwise
/// stay until the run ends — 14 GB for 20,000 SmolLM2 tokens). Smaller
/// runs (decode steps) keep every output, for the next run to reuse.
pub const RELEASE_DEAD_ABOVE: u64 = 256 << 20;
/// The smallest output a large run releases early.
pub const RELEASE_MIN_BYTES: u64 = 64 << 10;

/// Runs executables on one device context.
///
/// Between runs it keeps the step outputs of its last run that nothing
/// else holds (not graph outputs the caller kept, not views), and the next
/// run makes each step output in the buffer the same step output had when
/// dtype and size agree: a decode loop then allocates no activations after
/// its first step. What is kept is at most what the last run had live at
/// its end; a run of other shapes replaces it.
pub struct Executor {
    ctx: DeviceContextPtr,
    spare: Mutex<SpareOutputs>,
}

/// Step outputs kept from the last run, by step index and output index.
type SpareOutputs = Vec<Vec<Option<Tensor>>>;

/// Sizes bound to symbols during one run, with where each was first seen.
#[derive(Default)]
struct Bindings(HashMap<String, (usize, String)>);

impl Bindings {
    fn check(
        &mut self,
        dim: &ShapeDim,
        size: usize,
        from: impl Fn() -> String,
    ) -> std::result::Result<bool, RuntimeError> {
        match dim {
            ShapeDim::Static(want) => Ok(*want == size),
            ShapeDim::Symbol(symbol) => match self.0.get(symbol) {
                Some((first, first_from)) if *first != size => Err(RuntimeError::SymbolConflict {
                    symbol: symbol.clone(),
                    first: *first,
                    first_from: first_from.clone(),
                    second: size,
                    second_from: from(),
                }),
                Some(_) => Ok(true),
                None => {
                    self.0.insert(symbol.clone(), (size, from()));
                    Ok(true)
                }
            },
        }
    }
}

impl Executor {
    /// An executor whose kernels run on `ctx`.
    pub fn new(ctx: DeviceContextPtr) -> Self {
        Self { ctx, spare: Mutex::new(Vec::new()) }
    }

    /// The context kernels get.
    pub fn context(&self) -> &DeviceContextPtr {
        &self.ctx
    }

    /// Run `exe` once. Inputs and caches are matched by name; every input is
    /// checked against its declared dtype and dims (symbols must agree across
    /// inputs and caches) and every kernel checks its arguments, all before
    /// the first kernel writes anything. (A check that depends on the
    /// *values* of a tensor an earlier node computes would see them unwritten;
    /// the kernel checks again when it runs, so memory safety never depends
    /// on the plan. No shipped op takes index values from another node.)
    /// Caches are written in place; their lengths are not advanced.
    pub fn run(
        &self,
        exe: &Executable,
        inputs: &BTreeMap<String, Tensor>,
        caches: &mut BTreeMap<String, PagedKVCacheCollection>,
    ) -> Result<RunOutput> {
        let mut named: Vec<(&str, &mut PagedKVCacheCollection)> =
            caches.iter_mut().map(|(name, cache)| (name.as_str(), cache)).collect();
        self.run_with_caches(exe, inputs, &mut named)
    }

    /// [`run`](Self::run) with the caches named in place, so a caller keeps
    /// its caches where they live (fields of its own types, a `Vec`, …)
    /// across steps instead of moving them into a map and back:
    /// `executor.run_with_caches(&exe, &inputs, &mut [("kv_cache", &mut cache)])`.
    pub fn run_with_caches(
        &self,
        exe: &Executable,
        inputs: &BTreeMap<String, Tensor>,
        caches: &mut [(&str, &mut PagedKVCacheCollection)],
    ) -> Result<RunOutput> {
        for (i, (name, _)) in caches.iter().enumerate() {
            if caches[..i].iter().any(|(other, _)| other == name) {
                return Err(RuntimeError::DuplicateCache(name.to_string()));
            }
        }
        let input_refs = {
            let by_name: Vec<(&str, &PagedKVCacheCollection)> = caches.iter().map(|(n, c)| (*n, &**c)).collect();
            self.bind_inputs(exe, inputs, &by_name)?
        };
        let mut cache_refs = Self::cache_order(exe, caches)?;

        // Plan: every kernel checks its arguments and sizes its outputs, in
        // order, before any kernel runs. Earlier steps' outputs are allocated
        // here and passed to later checks (their shapes are final; their
        // values are written by the run).
        let mut spare = std::mem::take(&mut *self.spare());
        let mut produced: Vec<Vec<Tensor>> = Vec::with_capacity(exe.steps().len());
        let mut view_shapes: Vec<Option<Vec<usize>>> = Vec::with_capacity(exe.steps().len());
        for (index, step) in exe.steps().iter().enumerate() {
            let kernel_error =
                |source| RuntimeError::Kernel { step: step.label.clone(), key: step.kernel.key().to_string(), source };
            let args: Vec<&Tensor> =
                step.inputs.iter().map(|s| Self::resolve(exe, &input_refs, &produced, *s)).collect();
            let step_caches: Vec<&PagedKVCacheCollection> =
                step.caches.iter().map(|&c| &**cache_refs[c].as_ref().expect("every cache is present")).collect();
            let specs = step.kernel.check(&args, &step_caches).map_err(kernel_error)?;
            let outputs = if step.kernel.is_view() {
                // Later checks see the view of the (not yet written)
                // producer output; it is dropped before anything runs, so
                // the producer writes its own storage, and made again after
                // the producer ran.
                let [(_, shape)] = specs.as_slice() else {
                    return Err(RuntimeError::Plan(format!("view step {} has {} outputs", step.label, specs.len())));
                };
                view_shapes.push(Some(shape.clone()));
                vec![args[0].reshaped(shape).map_err(kernel_error)?]
            } else {
                view_shapes.push(None);
                let mut kept = spare.get_mut(index).map(std::mem::take).unwrap_or_default().into_iter();
                specs
                    .iter()
                    .map(|(dtype, shape)| match kept.next().flatten().map(|t| t.rezeroed(*dtype, shape)) {
                        Some(Ok(reused)) => Ok(reused),
                        // From 2 MiB on, mapped memory of its own: released
                        // to the system when the output is (the allocator
                        // would keep a heap chunk's pages).
                        _ => Tensor::zeros_in_huge_pages(*dtype, shape),
                    })
                    .collect::<kvjit_core::Result<Vec<_>>>()
                    .map_err(kernel_error)?
            };
            produced.push(outputs);
        }
        // What the plan did not reuse (a run of other shapes) goes now, not
        // after the run: it would only add to the run's peak memory.
        drop(spare);

        for (outputs, shape) in produced.iter_mut().zip(&view_shapes) {
            if shape.is_some() {
                outputs[0] = Tensor::zeros(outputs[0].dtype(), &[0]).map_err(|e| RuntimeError::Plan(e.to_string()))?;
            }
        }

        // Whether this run is large enough to release outputs after their
        // last reader (decode steps are not: they skip the schedule).
        let output_bytes = |t: &Tensor| t.as_bytes().len() as u64;
        let total: u64 = produced
            .iter()
            .zip(&view_shapes)
            .filter(|(_, view)| view.is_none())
            .flat_map(|(outputs, _)| outputs.iter().map(output_bytes))
            .sum();
        let release = total > RELEASE_DEAD_ABOVE;
        let dead_after = if release { Self::dead_after(exe, &produced, &view_shapes) } else { Vec::new() };
        // Released runs count outputs from their step on, while held.
        let (mut live, mut peak_output_bytes) = if release { (0, 0) } else { (total, total) };

        let mut timings = Vec::with_capacity(exe.steps().len());
        for (index, step) in exe.steps().iter().enumerate() {
            if release && view_shapes[index].is_none() {
                live += produced[index].iter().map(output_bytes).sum::<u64>();
                peak_output_bytes = peak_output_bytes.max(live);
            }
            let (earlier, rest) = produced.split_at_mut(index);
            let outputs = &mut rest[0];
            let args: Vec<&Tensor> = step.inputs.iter().map(|s| Self::resolve(exe, &input_refs, earlier, *s)).collect();
            let start = Instant::now();
            let mut step_caches: Vec<&mut PagedKVCacheCollection> = Vec::with_capacity(step.caches.len());
            let ran = match &view_shapes[index] {
                // A view: the consumer gets the producer's storage under the
                // new shape; nothing is computed or copied.
                Some(shape) => args[0].reshaped(shape).map(|view| outputs[0] = view),
                None => {
                    // Each step names distinct caches, so the borrows are
                    // disjoint; take them out of the table and put them back
                    // after the call.
                    for &c in &step.caches {
                        step_caches.push(std::mem::take(&mut cache_refs[c]).expect("cache used twice in one step"));
                    }
                    step.kernel.run(&args, &mut step_caches, outputs, &self.ctx)
                }
            };
            ran.map_err(|source| RuntimeError::Kernel {
                step: step.label.clone(),
                key: step.kernel.key().to_string(),
                source,
            })?;
            timings.push(StepTiming { step: index, elapsed: start.elapsed() });
            for (&c, cache) in step.caches.iter().zip(step_caches) {
                cache_refs[c] = Some(cache);
            }
            // Outputs no later step reads: released (their memory goes back
            // once no view shares it).
            for &(step, output) in dead_after.get(index).map_or(&[][..], Vec::as_slice) {
                let tensor = &mut produced[step][output];
                let bytes = output_bytes(tensor);
                let is_view = view_shapes[step].is_some();
                if is_view || bytes >= RELEASE_MIN_BYTES {
                    *tensor = Tensor::zeros(tensor.dtype(), &[0]).map_err(|e| RuntimeError::Plan(e.to_string()))?;
                    if !is_view {
                        live -= bytes;
                    }
                }
            }
        }

        let outputs = exe
            .outputs()
            .iter()
            .map(|(name, slot)| (name.clone(), Self::resolve(exe, &input_refs, &produced, *slot).clone()))
            .collect();
        self.keep_spare(produced, &view_shapes);
        Ok(RunOutput { outputs, timings, peak_output_bytes })
    }

    /// Per step, the outputs `(step, output)` that no later step reads and
    /// that are not graph outputs: released after that step runs. A view
    /// shares its producer's storage, which lives until the last read of
    /// either.
    fn dead_after(
        exe: &Executable,
        produced: &[Vec<Tensor>],
        view_shapes: &[Option<Vec<usize>>],
    ) -> Vec<Vec<(usize, usize)>> {
        let mut last_read: Vec<Vec<usize>> =
            produced.iter().enumerate().map(|(index, outputs)| vec![index; outputs.len()]).collect();
        for (index, step) in exe.steps().iter().enumerate() {
            for slot in &step.inputs {
                if let Slot::StepOutput { step, output } = *slot {
                    last_read[step][output] = last_read[step][output].max(index);
                }
            }
        }
        for (_, slot) in exe.outputs() {
            if let Slot::StepOutput { step, output } = *slot {
                last_read[step][output] = usize::MAX;
            }
        }
        // Steps run in order, so a view's producer comes first (and its own
        // producer, if a view, before it).
        let mut storage_of: Vec<Option<(usize, usize)>> = vec![None; exe.steps().len()];
        for (index, step) in exe.steps().iter().enumerate() {
            if view_shapes[index].is_some()
                && let Some(&Slot::StepOutput { step: source, output }) = step.inputs.first()
            {
                let root = storage_of[source].unwrap_or((source, output));
                storage_of[index] = Some(root);
                last_read[root.0][root.1] = last_read[root.0][root.1].max(last_read[index][0]);
            }
        }
        let mut dead_after: Vec<Vec<(usize, usize)>> = vec![Vec::new(); exe.steps().len()];
        for (step, reads) in last_read.iter().enumerate() {
            for (output, &last) in reads.iter().enumerate() {
                if last != usize::MAX {
                    dead_after[last].push((step, output));
                }
            }
        }
        dead_after
    }

    /// The step outputs kept from the last run (a poisoned lock still
    /// holds whole tensors: nothing is written under it).
    fn spare(&self) -> std::sync::MutexGuard<'_, SpareOutputs> {
        self.spare.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keep this run's step outputs that nothing else holds for the next
    /// run (views are dropped first: they share their producer's storage).
    fn keep_spare(&self, mut produced: Vec<Vec<Tensor>>, view_shapes: &[Option<Vec<usize>>]) {
        for (outputs, shape) in produced.iter_mut().zip(view_shapes) {
            if shape.is_some() {
                outputs.clear();
            }
        }
        *self.spare() = produced
            .into_iter()
            .map(|outputs| outputs.into_iter().map(|t| Some(t).filter(Tensor::holds_storage_alone)).collect())
            .collect();
    }

    fn resolve<'a>(exe: &'a Executable, inputs: &[&'a Tensor], produced: &'a [Vec<Tensor>], slot: Slot) -> &'a Tensor {
        match slot {
            Slot::Input(i) => inputs[i],
            Slot::Constant(i) => exe.constant(i),
            Slot::StepOutput { step, output } => &produced[step][output],
        }
    }

    /// Match inputs by name and check dtypes, dims and symbol bindings.
    fn bind_inputs<'a>(
        &self,
        exe: &Executable,
        inputs: &'a BTreeMap<String, Tensor>,
        caches: &[(&str, &PagedKVCacheCollection)],
    ) -> Result<Vec<&'a Tensor>> {
        let known = || {
            exe.inputs()
                .iter()
                .map(|i| i.name.as_str())
                .chain(exe.caches().iter().map(|c| c.name.as_str()))
                .collect::<Vec<_>>()
        };
        let stray_input = inputs.keys().find(|name| !exe.inputs().iter().any(|i| &i.name == *name));
        let stray_cache =
            caches.iter().map(|(name, _)| *name).find(|name| !exe.caches().iter().any(|c| c.name == *name));
        if let Some(name) = stray_input.map(String::as_str).or(stray_cache) {
            return Err(RuntimeError::UnexpectedInput { name: name.to_string(), known: known().join(", ") });
        }
        let mut bindings = Bindings::default();
        let mut refs = Vec::with_capacity(exe.inputs().len());
        for spec in exe.inputs() {
            let tensor = inputs.get(&spec.name).ok_or_else(|| RuntimeError::MissingInput {
                name: spec.name.clone(),
                expected: format!("{}{}", spec.dtype, shape_string(&spec.shape)),
            })?;
            if tensor.dtype() != spec.dtype {
                return Err(RuntimeError::InputDType {
                    name: spec.name.clone(),
                    expected: spec.dtype,
                    got: tensor.dtype(),
                });
            }
            let shape_error = || RuntimeError::InputShape {
                name: spec.name.clone(),
                expected: shape_string(&spec.shape),
                got: tensor.shape().to_vec(),
            };
            if tensor.shape().len() != spec.shape.len() {
                return Err(shape_error());
            }
            for (axis, (dim, &size)) in spec.shape.iter().zip(tensor.shape()).enumerate() {
                if !bindings.check(dim, size, || format!("{} axis {axis}", spec.name))? {
                    return Err(shape_error());
                }
            }
            refs.push(tensor);
        }
        for spec in exe.caches() {
            let cache = caches
                .iter()
                .find(|(name, _)| *name == spec.name)
                .map(|(_, cache)| *cache)
                .ok_or_else(|| RuntimeError::MissingCache(spec.name.clone()))?;
            if cache.params() != &spec.params {
                return Err(RuntimeError::CacheMismatch {
                    name: spec.name.clone(),
                    problem: format!("layout is {:?}, the graph expects {:?}", cache.params(), spec.params),
                });
            }
            for (what, dim, size) in [
                ("num_pages", &spec.num_pages, cache.num_pages()),
                ("batch", &spec.batch, cache.batch_size()),
                ("max_pages_per_seq", &spec.max_pages_per_seq, cache.max_pages_per_seq()),
            ] {
                if !bindings.check(dim, size, || format!("cache {} {what}", spec.name))? {
                    return Err(RuntimeError::CacheMismatch {
                        name: spec.name.clone(),
                        problem: format!("{what} is {size}, the graph expects {dim}"),
                    });
                }
            }
        }
        Ok(refs)
    }

    fn cache_order<'c>(
        exe: &Executable,
        caches: &'c mut [(&str, &mut PagedKVCacheCollection)],
    ) -> Result<Vec<Option<&'c mut PagedKVCacheCollection>>> {
        let mut by_name: HashMap<&str, &'c mut PagedKVCacheCollection> =
            caches.iter_mut().map(|(name, cache)| (*name, &mut **cache)).collect();
        exe.caches()
            .iter()
            .map(|spec| {
                by_name
                    .remove(spec.name.as_str())
                    .map(Some)
                    .ok_or_else(|| RuntimeError::MissingCache(spec.name.clone()))
            })
            .collect()
    }
}
