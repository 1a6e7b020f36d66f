//! Compiled graph artifacts: compile once, start instantly.
//!
//! An artifact holds what building a graph needs and nothing else: the
//! specialized graph, every node's kernel key, and every constant — in its
//! kernel's prepared layout (packed weight panels) where every consumer of
//! the constant prepared it alike, else plain. Loading maps the file and
//! borrows every constant from the mapping: no packing, no copies; only the
//! kernels' machine code is generated again.
//!
//! File layout (all integers little-endian):
//!
//! | bytes | content |
//! | --- | --- |
//! | 0..8 | magic `KVJITART` |
//! | 8..16 | header length H (u64) |
//! | 16..16+H | header: JSON ([`ArtifactHeader`]) |
//! | … | zero padding to a multiple of [`ARTIFACT_ALIGN`] |
//! | data | the constants, each at an offset (from the data start) that is a multiple of [`ARTIFACT_ALIGN`] |
//!
//! Every range is checked against the real file size before anything is
//! mapped.
//!
//! # Staleness
//!
//! The header says what the artifact needs of the kvjit and the machine
//! that loads it. A reader refuses it as [`ArtifactError::Stale`] (and
//! `kvjit run` then rebuilds from the graph file beside it, if any) when,
//! in this order:
//!
//! 1. `version` is not [`ARTIFACT_VERSION`] (this file layout);
//! 2. `kvjit_version` is not this kvjit's release (`CARGO_PKG_VERSION`);
//! 3. `cpu_requires` names something this CPU lacks ([`missing_cpu_features`]
//!    against [`cpu_features`]): the architecture, and for JIT kernels of
//!    the 256-bit tier AVX2, FMA and F16C, which its micro-kernels use
//!    ([`cpu_requirements`]). Nothing else about the CPU counts: an artifact
//!    holds no machine code. Its kernels are generated again at load, by
//!    Cranelift for the loading host's ISA (`kvjit_jit::host_isa`: the
//!    features `cranelift_native` detects there, AVX-512 included, are used
//!    by the new code, never assumed from the artifact), on the tier the
//!    artifact was made for (`cpu_tier`, which records what `auto` resolved
//!    to). So an artifact made on an AVX-512 machine loads on an AVX2-only
//!    one and the reverse;
//! 4. `layout_version` is not this build's packed-weight layout version,
//!    when a constant is stored in a kernel's layout: the hash of the
//!    packing code ([`kvjit_op::gemm::layout_version`]), so a
//!    change to the packing retires older artifacts with no number to bump
//!    by hand (each stored layout id names the version too, and a kernel
//!    takes only its own);
//! 5. when compiled ([`LoadedArtifact::compile`]), the kernel keys derived
//!    here differ from the recorded `kernel_keys`.
//!
//! `build` ([`KVJIT_BUILD`], a hash of the sources the writing kvjit was
//! compiled from) is recorded to say which build made the artifact, and not
//! checked: two builds that pack weights alike and derive the same kernel
//! keys read each other's artifacts.

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvjit_core::{CpuTier, DType, MappedBytes, PreparedConstant, Target, Tensor, WeightLoad};
use kvjit_graph::{Graph, ValueDef, graph_from_json_prepared, graph_to_json, specialize};
use kvjit_runtime::{BuildOptions, Executable, KernelImpl, Slot};
use serde::{Deserialize, Serialize};

use crate::{CompileOptions, Registry, Result, compile};

/// The first bytes of every artifact.
pub const ARTIFACT_MAGIC: &[u8; 8] = b"KVJITART";
/// The `format` marker in an artifact's header.
pub const ARTIFACT_FORMAT: &str = "kvjit-artifact";
/// The artifact version this build writes and reads.
pub const ARTIFACT_VERSION: u32 = 2;
/// This build of kvjit: `src-` and 16 hex digits of the SHA-256 of the
/// sources it was compiled from (see the crate's `build.rs`); it changes
/// with any change to them. Artifacts record it.
pub const KVJIT_BUILD: &str = env!("KVJIT_BUILD");
/// Alignment of the data section and of every constant in it: a page, so
/// every constant maps aligned for any dtype and vector load.
pub const ARTIFACT_ALIGN: u64 = 4096;
/// Largest header a reader accepts (the header is JSON of the graph and the
/// constant table; 64 MiB is far above any real graph).
const MAX_HEADER_BYTES: u64 = 64 << 20;

/// Why an artifact cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ArtifactError {
    /// Not a kvjit artifact, or one whose parts do not fit the file.
    #[error("{}: not a valid kvjit artifact: {problem}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// An artifact this kvjit or this CPU cannot use as it is (see
    /// [Staleness](self#staleness)): made by another release or with
    /// another packed layout, for kernels this CPU cannot run, or whose
    /// kernel keys differ from this build's.
    #[error(
        "{}: stale artifact: made for {what} {made}, but this is {here}; compile it again (kvjit compile GRAPH -o {})",
        path.display(),
        path.display()
    )]
    Stale {
        /// The file.
        path: PathBuf,
        /// What differs.
        what: &'static str,
        /// The artifact's value.
        made: String,
        /// This build's value.
        here: String,
    },
}

/// An artifact's header.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArtifactHeader {
    /// Always [`ARTIFACT_FORMAT`].
    pub format: String,
    /// [`ARTIFACT_VERSION`] when written.
    pub version: u32,
    /// The kvjit release that wrote it (checked).
    pub kvjit_version: String,
    /// The build that wrote it ([`KVJIT_BUILD`]; recorded, not checked).
    pub build: String,
    /// The target its kernels were built for.
    pub target: Target,
    /// `fast` or `reference`.
    pub implementation: String,
    /// The CPU tier its kernels are built for wherever it is loaded: for
    /// JIT kernels on the CPU, the tier `auto` resolved to on the machine
    /// that wrote it; otherwise as asked.
    #[serde(default)]
    pub cpu_tier: CpuTier,
    /// What the CPU that loads it must have: the architecture, then the
    /// features its kernels need ([`cpu_requirements`]).
    pub cpu_requires: Vec<String>,
    /// Whether its graph is fused when it is compiled (`kvjit compile
    /// --no-fuse` writes false); the stored graph is the unfused one.
    #[serde(default = "fused_by_default")]
    pub fuse: bool,
    /// The packed-weight layout version of the build that wrote it
    /// ([`kvjit_op::gemm::layout_version`]).
    pub layout_version: String,
    /// The graph file it was compiled from, if any (a plain file name
    /// beside the artifact), to rebuild from when the artifact is stale.
    pub source_graph: Option<String>,
    /// The specialized graph, as graph-file JSON (every constant declared
    /// with its logical type and stored below).
    pub graph: serde_json::Value,
    /// Every node's kernel key, in node order.
    pub kernel_keys: Vec<String>,
    /// The stored constants.
    pub constants: Vec<StoredConstant>,
}

/// Artifacts written before fusion existed compile fused, like graphs.
fn fused_by_default() -> bool {
    true
}

/// One constant in an artifact's data section.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredConstant {
    /// The graph constant's name.
    pub name: String,
    /// Dtype of the stored data.
    pub dtype: DType,
    /// Shape of the stored data (the packed shape when prepared).
    pub shape: Vec<usize>,
    /// Byte offset from the data start (a multiple of [`ARTIFACT_ALIGN`]).
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// The kernel layout the data is in, when prepared.
    pub layout: Option<String>,
}

/// What [`write_artifact`] wrote.
#[derive(Clone, Debug)]
pub struct ArtifactSummary {
    /// File size.
    pub bytes: u64,
    /// Constants stored in a kernel's prepared layout.
    pub prepared: usize,
    /// Constants stored plain.
    pub plain: usize,
}

/// The CPU features of this machine, as [`cpu_requirements`] names them:
/// the architecture, then the x86-64 features detected of those kvjit's
/// kernels may use.
pub fn cpu_features() -> Vec<String> {
    #[allow(unused_mut, reason = "only x86-64 adds features to the list")]
    let mut features = vec![std::env::consts::ARCH.to_string()];
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! detect {
            ($($f:tt),*) => {
                $(if std::arch::is_x86_feature_detected!($f) {
                    features.push($f.to_string());
                })*
            };
        }
        detect!("sse4.1", "avx", "avx2", "fma", "f16c", "avx512f");
    }
    features
}

/// What a CPU must have to run kernels built for `target` with
/// `implementation` on `tier` (resolved, not `auto`): the architecture
/// kvjit was built for, and for JIT kernels of the 256-bit tier the
/// features its micro-kernels use
/// ([`kvjit_jit::microkernel::AVX2_TIER_FEATURES`]: AVX2, FMA and F16C). The Cranelift tier
/// needs nothing more: its code is generated on the loading host.
pub fn cpu_requirements(target: Target, implementation: KernelImpl, tier: CpuTier) -> Vec<String> {
    let mut required = vec![std::env::consts::ARCH.to_string()];
    if target == Target::Cpu && implementation == KernelImpl::Fast && tier == CpuTier::Avx2 {
        required.extend(kvjit_jit::microkernel::AVX2_TIER_FEATURES.map(String::from));
    }
    required
}

/// The entries of `required` (an artifact's `cpu_requires`) that `host`
/// (a machine's [`cpu_features`]) lacks, in order; empty when that machine
/// runs the artifact's kernels. A pure function of its arguments, so any
/// host can be asked about.
pub fn missing_cpu_features<'a>(required: &'a [String], host: &[String]) -> Vec<&'a str> {
    required.iter().filter(|feature| !host.contains(feature)).map(String::as_str).collect()
}

fn implementation_name(implementation: KernelImpl) -> &'static str {
    match implementation {
        KernelImpl::Fast => "fast",
        KernelImpl::Reference => "reference",
    }
}

/// Compile `graph` with `options` and write the artifact to `path` (written
/// to a temporary file beside it, then renamed into place). `source_graph`
/// names the graph file it came from, recorded if it is a plain file name
/// in the artifact's folder.
pub fn write_artifact(
    graph: &Graph,
    registry: &Registry,
    options: &CompileOptions,
    path: &Path,
    source_graph: Option<&Path>,
) -> Result<ArtifactSummary> {
    let backend = options.backend()?;
    let specialized = specialize(graph, registry.ops(), backend, &options.bindings)?;
    let exe = compile(specialized.graph(), registry, options)?;
    let graph = specialized.graph();
    let stored = stored_forms(graph, &exe);

    let mut constants = Vec::with_capacity(stored.len());
    let mut offset = 0u64;
    for (name, data, layout) in &stored {
        let len = data.as_bytes().len() as u64;
        constants.push(StoredConstant {
            name: name.clone(),
            dtype: data.dtype(),
            shape: data.shape().to_vec(),
            offset,
            len,
            layout: layout.clone(),
        });
        offset = (offset + len).next_multiple_of(ARTIFACT_ALIGN);
    }
    let mut graph_json: serde_json::Value =
        serde_json::from_str(&graph_to_json(graph, None)).map_err(kvjit_graph::GraphError::from)?;
    // Constants are stored as data, never regenerated from a recipe.
    if let Some(values) = graph_json.get_mut("values").and_then(|v| v.as_array_mut()) {
        for value in values {
            if let Some(entry) = value.as_object_mut() {
                entry.remove("init");
            }
        }
    }
    let source_graph = source_graph.and_then(|source| {
        let same_folder = source.parent().map(absolute) == path.parent().map(absolute);
        same_folder.then(|| source.file_name()?.to_str().map(str::to_string)).flatten()
    });
    // JIT kernels on the CPU were built for the tier `auto` resolves to
    // here (or the one asked for, which compiled, so it resolves): the
    // artifact records that tier, and runs on it wherever it is loaded.
    let jit_on_cpu = options.target == Target::Cpu && options.build.implementation == KernelImpl::Fast;
    let cpu_tier = match (jit_on_cpu, backend.cpu_tier()) {
        (true, Some(tier)) => tier.requested(),
        _ => options.build.cpu_tier,
    };
    let header = ArtifactHeader {
        format: ARTIFACT_FORMAT.to_string(),
        version: ARTIFACT_VERSION,
        kvjit_version: env!("CARGO_PKG_VERSION").to_string(),
        build: KVJIT_BUILD.to_string(),
        target: options.target,
        implementation: implementation_name(options.build.implementation).to_string(),
        cpu_tier,
        cpu_requires: cpu_requirements(options.target, options.build.implementation, cpu_tier),
        fuse: options.fuse,
        layout_version: kvjit_op::gemm::layout_version().to_string(),
        source_graph,
        graph: graph_json,
        kernel_keys: exe.steps().iter().map(|s| s.kernel.key().to_string()).collect(),
        constants,
    };
    let header_bytes = serde_json::to_vec(&header).map_err(kvjit_graph::GraphError::from)?;
    let data_start = (16 + header_bytes.len() as u64).next_multiple_of(ARTIFACT_ALIGN);

    let io = |source| kvjit_core::Error::Io { path: path.to_path_buf(), source };
    let temp = path.with_file_name(format!(
        ".{}.tmp{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("artifact"),
        std::process::id()
    ));
    let write = || -> std::io::Result<u64> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(&temp)?);
        out.write_all(ARTIFACT_MAGIC)?;
        out.write_all(&(header_bytes.len() as u64).to_le_bytes())?;
        out.write_all(&header_bytes)?;
        let mut written = 16 + header_bytes.len() as u64;
        for ((_, data, _), entry) in stored.iter().zip(&header.constants) {
            let start = data_start + entry.offset;
            std::io::copy(&mut std::io::Read::take(std::io::repeat(0), start - written), &mut out)?;
            out.write_all(data.as_bytes())?;
            written = start + entry.len;
        }
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        Ok(written)
    };
    let bytes = write().map_err(io);
    let bytes = match bytes {
        Ok(bytes) => bytes,
        Err(e) => {
            let _ = std::fs::remove_file(&temp);
            return Err(e.into());
        }
    };
    std::fs::rename(&temp, path).map_err(io)?;
    let prepared = stored.iter().filter(|(_, _, layout)| layout.is_some()).count();
    Ok(ArtifactSummary { bytes, prepared, plain: stored.len() - prepared })
}

fn absolute(path: &Path) -> PathBuf {
    let path = if path.as_os_str().is_empty() { Path::new(".") } else { path };
    path.canonicalize().unwrap_or_else(|_| path.to_path_buf())
}

/// For each constant of the compiled graph (in [`Slot::Constant`] order):
/// its name, the data to store and, when prepared, its layout. A constant
/// is stored prepared when every kernel that reads it prepared it in one
/// layout; otherwise plain (and kernels prepare it again at load).
fn stored_forms(graph: &Graph, exe: &Executable) -> Vec<(String, Arc<Tensor>, Option<String>)> {
    graph
        .constants()
        .zip(exe.constants())
        .enumerate()
        .map(|(index, ((_, value), plain))| {
            let name = value.name.clone().unwrap_or_default();
            let mut prepared_forms = exe.steps().iter().flat_map(|step| {
                let prepared = step.kernel.prepared_constants();
                step.inputs
                    .iter()
                    .enumerate()
                    .filter(|(_, slot)| **slot == Slot::Constant(index))
                    .map(|(input, _)| prepared.iter().find(|(i, _)| *i == input).map(|(_, p)| p.clone()))
                    .collect::<Vec<_>>()
            });
            let first = prepared_forms.next().flatten();
            let all_alike = prepared_forms
                .all(|p| p.is_some_and(|p| first.as_ref().is_some_and(|f: &PreparedConstant| f.layout == p.layout)));
            match (first, &value.def) {
                (Some(prepared), _) if all_alike => (name, prepared.data, Some(prepared.layout)),
                (_, ValueDef::Prepared { data }) => (name, data.data.clone(), Some(data.layout.clone())),
                _ => (name, plain.clone(), None),
            }
        })
        .collect()
}

/// An artifact, loaded: the specialized graph (constants borrowed from the
/// mapped file) and the options to compile it with.
pub struct LoadedArtifact {
    /// The file it was read from.
    pub path: PathBuf,
    /// The header as read.
    pub header: ArtifactHeader,
    /// The specialized graph, with prepared constants where stored so.
    pub graph: Graph,
    /// Target and build the artifact was made for.
    pub options: CompileOptions,
}

impl LoadedArtifact {
    /// Build the executable: JIT-compile the kernels (or pick CUDA
    /// variants) over the mapped constants; no packing. The kernel keys
    /// must be the ones the artifact recorded.
    pub fn compile(&self, registry: &Registry) -> Result<Executable> {
        let exe = compile(&self.graph, registry, &self.options)?;
        let keys: Vec<String> = exe.steps().iter().map(|s| s.kernel.key().to_string()).collect();
        if keys != self.header.kernel_keys {
            // The first step whose key differs, and the counts (the whole
            // lists run to hundreds of keys).
            let made = &self.header.kernel_keys;
            let step = made.iter().zip(&keys).position(|(a, b)| a != b).unwrap_or(made.len().min(keys.len()));
            let describe = |list: &[String]| {
                let at = list.get(step).map_or("none", String::as_str);
                format!("{} kernels (step {step}: {at})", list.len())
            };
            return Err(ArtifactError::Stale {
                path: self.path.clone(),
                what: "kernel keys",
                made: describe(made),
                here: describe(&keys),
            }
            .into());
        }
        Ok(exe)
    }
}

/// Whether `path` starts with the artifact magic (how the CLI tells an
/// artifact from a graph file).
pub fn is_artifact(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 8];
    kvjit_core::open_regular_file(path).is_ok_and(|(mut file, _)| file.read_exact(&mut magic).is_ok())
        && &magic == ARTIFACT_MAGIC
}

/// Read, check and map an artifact. Refused, before anything is mapped:
/// a file that is not regular, a wrong magic, format or version, a header
/// that runs past the file, a constant range outside the data section,
/// misaligned, overlapping another or not its shape's byte size, a graph
/// with an `init` recipe (the writer never stores one); and, as
/// [`ArtifactError::Stale`], one made by another kvjit release, with
/// another packed layout, or for kernels this CPU lacks a feature of (see
/// [Staleness](self#staleness)).
pub fn load_artifact(path: &Path, registry: &Registry) -> Result<LoadedArtifact> {
    load_artifact_with(path, registry, WeightLoad::Map)
}

/// [`load_artifact`], with the constants mapped ([`WeightLoad::Map`]) or
/// read into memory advised to use huge pages ([`WeightLoad::Copy`]).
pub fn load_artifact_with(path: &Path, registry: &Registry, weights: WeightLoad) -> Result<LoadedArtifact> {
    let malformed =
        |problem: String| crate::Error::from(ArtifactError::Malformed { path: path.to_path_buf(), problem });
    let RawHeader { mut file, file_len, header_len, json: marker } = read_raw_header(path)?;
    let (format, version) = (marker.get("format").and_then(|f| f.as_str()), marker.get("version"));
    if format != Some(ARTIFACT_FORMAT) {
        return Err(malformed(format!("header format is {format:?}, expected {ARTIFACT_FORMAT:?}")));
    }
    if version.and_then(|v| v.as_u64()) != Some(ARTIFACT_VERSION as u64) {
        return Err(stale(
            path,
            "artifact version",
            version.map_or("none".into(), |v| v.to_string()),
            ARTIFACT_VERSION,
        ));
    }
    let header: ArtifactHeader = serde_json::from_value(marker).map_err(|e| malformed(format!("header: {e}")))?;
    if header.kvjit_version != env!("CARGO_PKG_VERSION") {
        return Err(stale(path, "kvjit", header.kvjit_version.clone(), env!("CARGO_PKG_VERSION")));
    }
    let implementation = match header.implementation.as_str() {
        "fast" => KernelImpl::Fast,
        "reference" => KernelImpl::Reference,
        other => return Err(malformed(format!("unknown implementation '{other}'"))),
    };
    let missing = missing_cpu_features(&header.cpu_requires, &cpu_features());
    if !missing.is_empty() {
        let here = format!("a CPU without {}", missing.join(", "));
        return Err(stale(path, "CPU features", header.cpu_requires.join(","), here));
    }
    let layout_version = kvjit_op::gemm::layout_version();
    if header.constants.iter().any(|c| c.layout.is_some()) && header.layout_version != layout_version {
        return Err(stale(path, "packed layout version", header.layout_version.clone(), layout_version));
    }
    // The writer stores every constant's data; a recipe would make the
    // graph loader generate data the file does not hold.
    let values = header.graph.get("values").and_then(|v| v.as_array()).map_or(&[][..], |v| v.as_slice());
    if let Some(value) = values.iter().find(|v| v.get("init").is_some()) {
        let name = value.get("name").and_then(|n| n.as_str()).unwrap_or("?");
        return Err(malformed(format!(
            "constant '{name}' has an \"init\" recipe; an artifact stores every constant's data, never a recipe"
        )));
    }

    let data_start = (16 + header_len).next_multiple_of(ARTIFACT_ALIGN);
    let data_len = file_len.saturating_sub(data_start);
    // Only the constants the graph declares are stored: a header listing
    // others (a crafted one held a million empty ones) is refused, not
    // mapped and ignored.
    let declared: HashSet<&str> = header.graph["values"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["kind"] == "constant")
        .filter_map(|v| v["name"].as_str())
        .collect();
    let mut names = HashSet::new();
    let mut ranges: Vec<(u64, u64, &str)> = Vec::new();
    for c in &header.constants {
        if !names.insert(c.name.as_str()) {
            return Err(malformed(format!("constant '{}' is stored twice", c.name)));
        }
        if !declared.contains(c.name.as_str()) {
            return Err(malformed(format!(
                "constant '{}' is stored, but the graph declares no constant of that name",
                c.name.escape_debug()
            )));
        }
        // Whole rows of blocks for a block format; the shape's bytes checked
        // without overflow.
        let expected = Tensor::storage_bytes(c.dtype, &c.shape)
            .map_err(|e| malformed(format!("constant '{}': {e}", c.name)))? as u64;
        if expected != c.len {
            return Err(malformed(format!(
                "constant '{}': {} bytes stored, but {}{:?} takes {expected}",
                c.name, c.len, c.dtype, c.shape
            )));
        }
        let end = c.offset.checked_add(c.len).filter(|&end| end <= data_len).ok_or_else(|| {
            malformed(format!(
                "constant '{}': bytes {}..{} run past the {data_len}-byte data section",
                c.name,
                c.offset,
                c.offset.saturating_add(c.len)
            ))
        })?;
        if !c.offset.is_multiple_of(ARTIFACT_ALIGN) {
            return Err(malformed(format!(
                "constant '{}': offset {} is not {ARTIFACT_ALIGN}-aligned",
                c.name, c.offset
            )));
        }
        ranges.push((c.offset, end, &c.name));
    }
    ranges.sort();
    if let Some(w) = ranges.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(malformed(format!("constants '{}' and '{}' overlap", w[0].2, w[1].2)));
    }

    let (map, base) = match weights {
        WeightLoad::Map => (kvjit_core::map_file(path, &file)?, data_start),
        WeightLoad::Copy => {
            let copied = kvjit_core::copy_to_anonymous(path, &mut file, data_start.min(file_len), data_len as usize)?;
            (copied, 0)
        }
    };
    let mut plain = BTreeMap::new();
    let mut prepared = BTreeMap::new();
    for c in &header.constants {
        let tensor = match &map {
            Some(map) => {
                let mapped = MappedBytes::new(map.clone(), (base + c.offset) as usize, c.len as usize, c.dtype)
                    .ok_or_else(|| malformed(format!("constant '{}' cannot be mapped aligned", c.name)))?;
                Tensor::from_mapped(&c.shape, mapped)?
            }
            None => Tensor::from_le_bytes(c.dtype, &c.shape, &[])?,
        };
        match &c.layout {
            Some(layout) => {
                prepared.insert(c.name.clone(), PreparedConstant { layout: layout.clone(), data: Arc::new(tensor) });
            }
            None => {
                plain.insert(c.name.clone(), tensor);
            }
        }
    }
    let graph_text = serde_json::to_string(&header.graph).map_err(kvjit_graph::GraphError::from)?;
    let graph = graph_from_json_prepared(&graph_text, registry.ops(), Some(&plain), &prepared)?;
    let options = CompileOptions {
        target: header.target,
        bindings: BTreeMap::new(),
        build: BuildOptions { implementation, cpu_tier: header.cpu_tier, ..BuildOptions::default() },
        memory_budget: None,
        fuse: header.fuse,
    };
    Ok(LoadedArtifact { path: path.to_path_buf(), header, graph, options })
}

/// The graph file an artifact was compiled from, when its header names one
/// that lies in the artifact's folder (confined like a graph file's weights
/// path: a plain relative name resolving inside the folder, a regular
/// file). Read even from a stale artifact, to rebuild from.
pub fn source_graph_beside(path: &Path) -> Option<PathBuf> {
    let header = read_raw_header(path).ok()?.json;
    let name = header.get("source_graph")?.as_str()?;
    kvjit_graph::confined_weights_path(path, name).ok()
}

/// An artifact's file, opened, with its header as JSON (not yet checked
/// against [`ArtifactHeader`]).
struct RawHeader {
    file: std::fs::File,
    file_len: u64,
    header_len: u64,
    json: serde_json::Value,
}

/// Open `path` (a regular file), check its preamble — the magic, a header
/// length inside the file — and parse the header as JSON.
fn read_raw_header(path: &Path) -> Result<RawHeader> {
    use std::io::Read;
    let malformed =
        |problem: String| crate::Error::from(ArtifactError::Malformed { path: path.to_path_buf(), problem });
    let io = |source| kvjit_core::Error::Io { path: path.to_path_buf(), source };
    let (mut file, file_len) = kvjit_core::open_regular_file(path)?;
    if file_len < 16 {
        return Err(malformed(format!("{file_len} bytes is too short for the 16-byte preamble")));
    }
    let mut preamble = [0u8; 16];
    file.read_exact(&mut preamble).map_err(io)?;
    if &preamble[..8] != ARTIFACT_MAGIC {
        return Err(malformed("it does not start with KVJITART".into()));
    }
    let header_len = u64::from_le_bytes(preamble[8..].try_into().expect("8 bytes"));
    if header_len > file_len - 16 || header_len > MAX_HEADER_BYTES {
        return Err(malformed(format!("header length {header_len} runs past the end of the {file_len}-byte file")));
    }
    let mut header_bytes = Vec::with_capacity(header_len as usize);
    (&mut file).take(header_len).read_to_end(&mut header_bytes).map_err(io)?;
    if header_bytes.len() as u64 != header_len {
        return Err(malformed("the file ended inside its header".into()));
    }
    let json = kvjit_core::json::parse_strict(&header_bytes).map_err(|e| malformed(format!("header: {e}")))?;
    Ok(RawHeader { file, file_len, header_len, json })
}

fn stale(path: &Path, what: &'static str, made: String, here: impl ToString) -> crate::Error {
    ArtifactError::Stale { path: path.to_path_buf(), what, made, here: here.to_string() }.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features(list: &[&str]) -> Vec<String> {
        let mut all = vec![std::env::consts::ARCH.to_string()];
        all.extend(list.iter().map(|f| f.to_string()));
        all
    }

    #[test]
    fn an_artifact_needs_of_the_loading_cpu_only_what_its_kernels_use() {
        let avx2_only = features(&["sse4.1", "avx", "avx2", "fma", "f16c"]);
        let avx512 = features(&["sse4.1", "avx", "avx2", "fma", "f16c", "avx512f"]);
        let no_f16c = features(&["sse4.1", "avx", "avx2", "fma"]);
        let sse_only = features(&["sse4.1"]);
        let other_arch = vec!["some-other-arch".to_string()];

        // The 256-bit tier's requirement is the same whoever writes it, and
        // met by AVX2-only and AVX-512 hosts alike.
        let avx2_tier = cpu_requirements(Target::Cpu, KernelImpl::Fast, CpuTier::Avx2);
        assert_eq!(avx2_tier, features(&["avx2", "fma", "f16c"]));
        assert!(missing_cpu_features(&avx2_tier, &avx2_only).is_empty());
        assert!(missing_cpu_features(&avx2_tier, &avx512).is_empty());
        assert_eq!(missing_cpu_features(&avx2_tier, &no_f16c), ["f16c"]);
        assert_eq!(missing_cpu_features(&avx2_tier, &sse_only), ["avx2", "fma", "f16c"]);

        // Cranelift code is generated on the loading host: only the
        // architecture counts. Reference and CUDA kernels use no CPU tier.
        let cranelift = cpu_requirements(Target::Cpu, KernelImpl::Fast, CpuTier::Cranelift);
        for required in [
            &cranelift,
            &cpu_requirements(Target::Cpu, KernelImpl::Reference, CpuTier::Avx2),
            &cpu_requirements(Target::Cuda, KernelImpl::Fast, CpuTier::Avx2),
        ] {
            assert_eq!(required, &features(&[]));
            for host in [&avx2_only, &avx512, &no_f16c, &sse_only] {
                assert!(missing_cpu_features(required, host).is_empty(), "{required:?} on {host:?}");
            }
            assert_eq!(missing_cpu_features(required, &other_arch), [std::env::consts::ARCH]);
        }

        // This machine: it runs the 256-bit tier exactly when the JIT
        // says it does.
        let here = missing_cpu_features(&avx2_tier, &cpu_features()).is_empty();
        assert_eq!(here, kvjit_jit::microkernel::avx2_available());
    }
}
