//! One op as a one-node graph on a device, unoptimized so that the op itself is what runs: the
//! device tests compare it with the CPU kernels or a float64 reference.
#![allow(dead_code)]

use rustytorch::compiler::Graph;
use rustytorch::ops::Op;
use rustytorch::prelude::*;

/// Runs `op` over `inputs` on `device`; the error says whether compiling or running failed.
pub fn run_one_op(op: &Op, inputs: &[HostTensor], device: Device) -> Result<HostTensor, String> {
    let mut g = Graph::new();
    let mut ids = vec![];
    for (i, x) in inputs.iter().enumerate() {
        ids.push(g.add_input(&format!("x{i}"), x.ty()).unwrap());
    }
    let y = g.add(op.clone(), &ids).unwrap();
    g.add_output("y", y).unwrap();
    let opts = CompileOptions {
        optimize: false,
        ..CompileOptions::default()
    };
    let mut exe =
        rustytorch::compile_graph(&g, device, &opts).map_err(|e| format!("compile: {e}"))?;
    let names: Vec<String> = (0..inputs.len()).map(|i| format!("x{i}")).collect();
    let args: Vec<(&str, HostTensor)> = names
        .iter()
        .zip(inputs)
        .map(|(n, x)| (n.as_str(), x.clone()))
        .collect();
    let out = exe.run(&args).map_err(|e| format!("run: {e}"))?;
    Ok(out.into_vec().remove(0))
}
