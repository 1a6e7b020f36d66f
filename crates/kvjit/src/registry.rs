//! The one place every op kvjit ships is listed: one line per op, the
//! op's definition wrapped in [`Defined`].

use std::collections::HashMap;
use std::sync::Arc;

use kvjit_graph::{OpDef, OpRegistry};
use kvjit_op::Defined;
use kvjit_runtime::KernelBuilder;

use crate::{Error, Result};

/// Op definitions (for building and validating graphs) and their kernel
/// builders (for compiling them), registered together.
#[derive(Clone, Default)]
pub struct Registry {
    ops: OpRegistry,
    kernels: HashMap<&'static str, Arc<dyn KernelBuilder>>,
}

impl Registry {
    /// Register an op that defines itself and builds its kernels.
    pub fn register<T: OpDef + KernelBuilder + 'static>(&mut self, op: T) -> Result<()> {
        let op = Arc::new(op);
        self.ops.register(op.clone())?;
        self.kernels.insert(op.name(), op);
        Ok(())
    }

    /// The op definitions, for [`GraphBuilder`](crate::GraphBuilder) and
    /// [`load_graph`](crate::load_graph).
    pub fn ops(&self) -> &OpRegistry {
        &self.ops
    }

    /// The kernel builder of an op, by canonical name.
    pub fn kernel_builder(&self, op: &str) -> Result<&Arc<dyn KernelBuilder>> {
        self.kernels.get(op).ok_or_else(|| Error::Usage(format!("op '{op}' has no kernels registered")))
    }
}

/// Every op kvjit ships.
pub fn standard_registry() -> Registry {
    let mut registry = Registry::default();
    let built_in = "built-in op names are distinct";
    registry.register(Defined(kvjit_op_fused_qkv::FusedQkvOp)).expect(built_in);
    registry.register(Defined(kvjit_op_reshape::ReshapeOp)).expect(built_in);
    registry.register(Defined(kvjit_op_rope::RopeOp)).expect(built_in);
    registry.register(Defined(kvjit_op_attention::MhaOp)).expect(built_in);
    registry.register(Defined(kvjit_op_silu::SiluOp)).expect(built_in);
    registry.register(Defined(kvjit_op_binary::AddOp)).expect(built_in);
    registry.register(Defined(kvjit_op_binary::MulOp)).expect(built_in);
    registry.register(Defined(kvjit_op_rms_norm::RmsNormOp)).expect(built_in);
    registry.register(Defined(kvjit_op_gather::GatherOp)).expect(built_in);
    registry.register(Defined(kvjit_op_last_token::LastTokenOp)).expect(built_in);
    registry.register(Defined(kvjit_op_matmul::MatmulOp)).expect(built_in);
    registry.register(Defined(kvjit_op_matmul::MatmulSiluOp)).expect(built_in);
    registry.register(Defined(kvjit_op_matmul::MatmulEpilogueOp)).expect(built_in);
    registry.register(Defined(kvjit_op_matmul::SwigluMatmulOp)).expect(built_in);
    registry
}
