//! RustyTorch: a graph-compiling deep-learning runtime.
//!
//! Build a lazy graph with [`GraphBuilder`] and [`Tensor`] handles (or load a graph file), compile
//! it for a [`Device`] (`Device::Auto` picks the CPU or a GPU from an estimate of the graph's
//! cost), and run it with host tensors; parameters and optimizer state stay on the device between
//! runs:
//!
//! ```
//! use rustytorch::prelude::*;
//!
//! let g = GraphBuilder::new();
//! let x = g.input("x", DType::F32, [2, 3]);
//! let w = g.param("w", [3, 4], Init::kaiming_uniform(3, 1));
//! let b = g.param("b", [4], Init::zeros());
//! let y = x.matmul(&w).add(&b).gelu();
//! let mut exe = rustytorch::compile(&g, &[&y], Device::Cpu).unwrap();
//! let out = exe.run(&[("x", HostTensor::from_vec(vec![1.0f32; 6], [2, 3]).unwrap())]).unwrap();
//! assert_eq!(out[0].dims(), &[2, 4]);
//! ```

pub mod data;
pub mod dlpack;
pub mod executable;
pub mod models;
pub mod npy;
pub mod parallel;
pub mod profile;
pub mod sparse;
pub mod stats;
pub mod trace;

pub use dlpack::{DlpackTensor, Imported};
pub use executable::{
    compile, compile_graph, compile_with, workload, Anomaly, CompileOptions, Executable, LossScale,
    LossScaleStatus, NonFinitePolicy, Outputs, ShapeCacheStats,
};
pub use rustytorch_codegen as codegen;
pub use rustytorch_compiler as compiler;
pub use rustytorch_compiler::{
    AdamW, CompileError, DimExpr, Graph, GraphBuilder, Init, Optimizer, Sgd, StepOptions, Tensor,
    TrainStep,
};
pub use rustytorch_onnx as onnx;
pub use rustytorch_ops as ops;
pub use rustytorch_ops::{DType, HostTensor, Shape, TensorType};
pub use rustytorch_runtime as runtime;
pub use rustytorch_runtime::device::Placement;
pub use rustytorch_runtime::{Device, MemoryStats, TransferStats};

/// What a program using RustyTorch usually needs.
pub mod prelude {
    pub use crate::{
        compile, compile_graph, compile_with, AdamW, CompileOptions, DType, Device, DimExpr,
        Executable, Graph, GraphBuilder, HostTensor, Init, LossScale, NonFinitePolicy, Sgd, Shape,
        StepOptions, Tensor, TensorType,
    };
    pub use rustytorch_compiler::ConvOpts;
    pub use rustytorch_ops::{Activation, AttnLayout, AttnMask, Causal, Reduction};
}

/// Errors of the public API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Building, verifying or transforming the graph failed.
    #[error(transparent)]
    Compile(#[from] rustytorch_compiler::CompileError),
    /// Lowering failed.
    #[error(transparent)]
    Codegen(#[from] rustytorch_codegen::CodegenError),
    /// Execution failed.
    #[error(transparent)]
    Runtime(#[from] rustytorch_runtime::RuntimeError),
    /// An op-level error.
    #[error(transparent)]
    Op(#[from] rustytorch_ops::OpError),
    /// A value given to `run` does not fit the graph.
    #[error("input `{name}`: {reason}")]
    Input {
        /// The input's name.
        name: String,
        /// What was expected.
        reason: String,
    },
    /// A gradient was NaN or infinite; the step's updates were not applied.
    #[error("non-finite gradient for parameter `{param}`: the update was not applied")]
    NonFinite {
        /// The parameter.
        param: String,
    },
    /// Anomaly mode: a step produced a NaN or infinite value (the op, step and source).
    #[error("{0}")]
    Anomaly(Box<executable::Anomaly>),
    /// A DLPack tensor could not be exchanged (unsupported dtype or device, bad version ...).
    #[error("dlpack: {0}")]
    Dlpack(String),
    /// A file could not be read or written.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
}

/// The public API's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
