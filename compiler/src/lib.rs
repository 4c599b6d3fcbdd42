//! RustyTorch's compiler: the [`Graph`] IR on petgraph, the [`GraphBuilder`]/[`Tensor`] builder
//! API, the verifier, autodiff, the e-graph optimizer, fusion, memory planning, the IR text format
//! and graph files.

pub mod accumulate;
pub mod attn_layout;
pub mod attn_packed;
pub mod autocast;
pub mod autodiff;
pub mod builder;
pub mod dims;
pub mod error;
pub mod graph;
pub mod optim;
pub mod passes;
pub mod sparse;

pub use autodiff::grad;
pub use builder::{ConvOpts, GraphBuilder, Tensor};
pub use dims::{DimExpr, NamedDim};
pub use error::{CompileError, Result};
pub use graph::{Graph, Init, InputDef, Node, NodeId, ParamDef};
pub use optim::{grad_buckets, AdamW, GradSync, Optimizer, Sgd, StepOptions, TrainStep};
pub use sparse::CsrPattern;
pub mod format;
pub mod fuse;
pub mod inspect;
pub mod layout;
pub mod optimize;
pub mod plan;
pub use plan::MemoryPlan;
pub mod text;
