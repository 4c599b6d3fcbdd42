//! Hostile graphs through every front end: tensors over the size limit (generator leaves and
//! parameter initializers from the builder API, IR text and graph files), shape arithmetic that
//! would overflow (an error naming the op, never a panic), and insane attributes, which IR text
//! and graph files must refuse alike because both end in the same verification.

use bincode::Options;
use rustytorch_compiler::format::{from_bytes, to_bytes, ParamStorage, HEADER_LEN};
use rustytorch_compiler::text::{parse, print};
use rustytorch_compiler::{CompileError, Graph, GraphBuilder, Init};
use rustytorch_ops::shape::{MAX_ELEMENTS, MAX_RANK};
use rustytorch_ops::*;

fn t(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

/// 2^48 elements: over the limit, and far over any machine's memory.
fn huge() -> TensorType {
    t(DType::F32, &[1 << 24, 1 << 24])
}

fn bincode_of(op: &Op) -> Vec<u8> {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
        .serialize(op)
        .unwrap()
}

/// `file` with the encoding of `from` (which must occur exactly once in the body) replaced by the
/// encoding of `to`; the header's length and checksum are recomputed, so only validation stands
/// between the file and the ops.
fn patch_op(file: &[u8], from: &Op, to: &Op) -> Vec<u8> {
    let (a, b) = (bincode_of(from), bincode_of(to));
    let body = &file[HEADER_LEN..];
    let hits: Vec<usize> = (0..=body.len() - a.len())
        .filter(|&i| body[i..i + a.len()] == a[..])
        .collect();
    assert_eq!(hits.len(), 1, "{from} occurs {} times", hits.len());
    let mut new = body[..hits[0]].to_vec();
    new.extend(&b);
    new.extend(&body[hits[0] + a.len()..]);
    let mut out = file[..HEADER_LEN].to_vec();
    out[12..20].copy_from_slice(&(new.len() as u64).to_le_bytes());
    out[20..24].copy_from_slice(&crc32fast::hash(&new).to_le_bytes());
    out.extend(new);
    out
}

/// A one-node graph: `op` over inputs of `tys` (the first input named `x`).
fn graph_of(op: &Op, tys: &[TensorType]) -> Graph {
    let mut g = Graph::new();
    let ins: Vec<NodeIdAlias> = tys
        .iter()
        .enumerate()
        .map(|(k, ty)| g.add_input(&format!("x{k}"), ty.clone()).unwrap())
        .collect();
    let y = g.add(op.clone(), &ins).unwrap();
    g.add_output("y", y).unwrap();
    g
}

type NodeIdAlias = rustytorch_compiler::NodeId;

fn text_err(text: &str) -> String {
    match parse(text) {
        Err(CompileError::Parse { reason, .. }) => reason,
        other => panic!("expected a parse error for\n{text}\ngot {other:?}"),
    }
}

fn file_err(bytes: &[u8]) -> String {
    match from_bytes(bytes) {
        Err(CompileError::Format(m)) => m,
        other => panic!("expected a format error, got {other:?}"),
    }
}

fn generators(ty: &TensorType) -> Vec<Op> {
    vec![
        Op::Full {
            value: F64Bits::new(0.0),
            ty: ty.clone(),
        },
        Op::Iota {
            axis: 0,
            ty: ty.clone(),
        },
        Op::RandUniform {
            low: F64Bits::new(-1.0),
            high: F64Bits::new(1.0),
            seed: 3,
            ty: ty.clone(),
        },
        Op::RandNormal {
            mean: F64Bits::new(0.0),
            std: F64Bits::new(1.0),
            seed: 3,
            ty: ty.clone(),
        },
    ]
}

#[test]
fn generator_leaves_over_the_limit_are_errors_in_every_front_end() {
    let small = t(DType::F32, &[2, 3]);
    for (op, big) in generators(&small).into_iter().zip(generators(&huge())) {
        let name = op.name();
        // The ops crate: inference and the CPU kernel refuse before allocating.
        let e = eval_cpu(&big, &[]).unwrap_err().to_string();
        assert!(e.starts_with(name) && e.contains("too large"), "{e}");
        // The builder: an error at the call, with the caller's location.
        let b = GraphBuilder::new();
        let y = b.apply(big.clone(), &[]);
        b.output("y", &y);
        let e = b.check().unwrap_err().to_string();
        assert!(e.contains("hostile.rs") && e.contains("too large"), "{e}");
        // IR text.
        let g = graph_of(&op, &[]);
        let text = print(&g).replace("2:3", "16777216:16777216");
        assert!(text_err(&text).contains("too large"), "{text}");
        let text = print(&g).replace("f32[2,3]", "f32[16777216,16777216]");
        assert!(text_err(&text).contains("too large"), "{text}");
        // Graph files.
        let file = to_bytes(&g, ParamStorage::InitOnly).unwrap();
        from_bytes(&file).unwrap();
        let m = file_err(&patch_op(&file, &op, &big));
        assert!(m.contains(name) && m.contains("too large"), "{m}");
    }
}

#[test]
fn parameter_initializers_over_the_limit_are_errors() {
    for init in [
        Init::zeros(),
        Init::kaiming_uniform(4, 1),
        Init::Normal {
            mean: 0.0,
            std: 1.0,
            seed: 2,
        },
    ] {
        let e = init.materialize(&huge()).unwrap_err().to_string();
        assert!(e.contains("too large"), "{e}");
        let b = GraphBuilder::new();
        let w = b.param("w", [1 << 24, 1 << 24], init.clone());
        b.output("w", &w);
        let e = b.check().unwrap_err().to_string();
        assert!(
            e.contains("hostile.rs") && e.starts_with(&format!("{}:", file!())),
            "{e}"
        );
        assert!(e.contains("param") && e.contains("too large"), "{e}");
    }
    let text = "graph {\n  %0 = param w : f32[16777216,16777216] = full(0.0)\n}\n";
    assert!(text_err(text).contains("too large"));
    let text = "graph {\n  %0 = input x : f32[1099511627776,2]\n}\n";
    assert!(text_err(text).contains("too large"));
    let text = format!(
        "graph {{\n  %0 = input x : f32[{}]\n}}\n",
        vec!["1"; 65].join(",")
    );
    assert!(text_err(&text).contains("rank 65"));
    // A graph file whose parameter type is patched to 2^48 elements.
    let mut g = Graph::new();
    let ty = t(DType::F32, &[2, 3]);
    let w = g.add_param("w", ty.clone(), Init::zeros(), true).unwrap();
    g.add_output("w", w).unwrap();
    let file = to_bytes(&g, ParamStorage::InitOnly).unwrap();
    let from = Op::Param { index: 0, ty };
    let m = file_err(&patch_op(
        &file,
        &from,
        &Op::Param {
            index: 0,
            ty: huge(),
        },
    ));
    assert!(m.contains("too large"), "{m}");
}

#[test]
fn a_type_within_the_limit_that_memory_cannot_hold_is_an_error() {
    // 2^40 f64 elements (8 TiB): within the element limit, so inference accepts it, but the
    // allocation fails and the kernel says so instead of aborting. Only where the kernel refuses
    // allocations larger than memory (overcommit off or heuristic).
    let mode = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap_or_default();
    if !matches!(mode.trim(), "0" | "2") {
        return;
    }
    let ty = t(DType::F64, &[MAX_ELEMENTS]);
    let e = Init::zeros().materialize(&ty).unwrap_err().to_string();
    assert!(e.contains("cannot allocate"), "{e}");
}

/// `infer` of one op family without the size checks of [`infer`], to reach its own arithmetic.
fn family_err(f: fn(&Op, &[&TensorType]) -> Result<TensorType>, op: &Op, tys: &[TensorType]) {
    let refs: Vec<&TensorType> = tys.iter().collect();
    let r = std::panic::catch_unwind(|| f(op, &refs));
    let e = match r {
        Ok(Err(e)) => e.to_string(),
        Ok(Ok(ty)) => panic!("{op} over {tys:?} inferred {ty}"),
        Err(_) => panic!("{op} over {tys:?} panicked"),
    };
    assert!(e.starts_with(op.name()), "{e}");
    let e2 = infer(op, &refs).unwrap_err().to_string();
    assert!(e2.starts_with(op.name()), "{e2}");
}

#[test]
fn overflowing_shape_arithmetic_is_an_error_naming_the_op() {
    const M: usize = usize::MAX;
    let f = |d: &[usize]| t(DType::F32, d);
    let g = |stride: usize, padding: usize, dilation: usize| ConvGeom {
        stride: vec![stride],
        padding: vec![padding],
        dilation: vec![dilation],
        layout: Default::default(),
    };
    // pad: before + size + after
    let pad = Op::Pad {
        pads: vec![(M, 1)],
        value: F64Bits::new(0.0),
    };
    family_err(movement::infer, &pad, &[f(&[2])]);
    let pad = Op::Pad {
        pads: vec![(1, 1)],
        value: F64Bits::new(0.0),
    };
    family_err(movement::infer, &pad, &[f(&[M - 1])]);
    // concat: the sum along the axis
    family_err(
        movement::infer,
        &Op::Concat { axis: 0 },
        &[f(&[M / 2 + 1]), f(&[M / 2 + 1])],
    );
    // reshape: element counts of the target and the input
    let reshape = Op::Reshape {
        shape: Shape::new([1 << 32, 1 << 32, 1 << 32]),
    };
    family_err(movement::infer, &reshape, &[f(&[4])]);
    let reshape = Op::Reshape {
        shape: Shape::new([4]),
    };
    family_err(movement::infer, &reshape, &[f(&[1 << 32, 1 << 32, 4])]);
    // expand: the target is checked against the limit
    let expand = Op::Expand {
        shape: Shape::new([M, M]),
    };
    assert!(infer(&expand, &[&f(&[1, 1])])
        .unwrap_err()
        .to_string()
        .starts_with("expand"));
    // conv: channels per group × groups, dilation × (kernel − 1), size + 2 × padding
    let conv = |geom, groups| Op::Conv {
        geom,
        groups,
        bias: false,
        act: rustytorch_ops::Activation::None,
    };
    family_err(
        conv::infer,
        &conv(g(1, 0, 1), 2),
        &[f(&[1, 4, 5]), f(&[4, M / 2 + 1, 1])],
    );
    family_err(
        conv::infer,
        &conv(g(1, 0, M), 1),
        &[f(&[1, 1, 5]), f(&[1, 1, 3])],
    );
    family_err(
        conv::infer,
        &conv(g(1, M / 2 + 1, 1), 1),
        &[f(&[1, 1, 5]), f(&[1, 1, 3])],
    );
    family_err(
        conv::infer,
        &conv(g(1, 1, 1), 1),
        &[f(&[1, 1, M - 1]), f(&[1, 1, 3])],
    );
    // pool: size + 2 × padding
    let pool = Op::Pool {
        kind: PoolKind::Max,
        kernel: vec![2],
        geom: g(1, 1, 1),
    };
    family_err(pool::infer, &pool, &[f(&[1, 1, M - 1])]);
}

#[test]
fn attributes_over_the_limits_are_refused_before_inference() {
    let x = t(DType::F32, &[2, 3]);
    for op in [
        Op::Reduce {
            kind: ReduceKind::Sum,
            axes: vec![usize::MAX],
            keep_dims: false,
        },
        Op::Permute {
            perm: vec![0; MAX_RANK + 1],
        },
        Op::Slice {
            starts: vec![0, 0],
            ends: vec![2, 3],
            steps: vec![1, MAX_ELEMENTS + 1],
        },
    ] {
        let e = infer(&op, &[&x]).unwrap_err().to_string();
        assert!(
            e.starts_with(op.name()) && (e.contains("too large") || e.contains("entries")),
            "{e}"
        );
    }
}

/// (a valid op, a broken variant of it, its input types): both formats must refuse the broken
/// one, with the same ops-crate message.
fn insane_ops() -> Vec<(Op, Op, Vec<TensorType>)> {
    let x = t(DType::F32, &[2, 3, 4]);
    let img = t(DType::F32, &[1, 2, 5, 5]);
    let w = t(DType::F32, &[2, 2, 3, 3]);
    let geom = |s: usize, p: usize| ConvGeom {
        stride: vec![s, s],
        padding: vec![p, p],
        dilation: vec![1, 1],
        layout: Default::default(),
    };
    let slice = |steps: Vec<usize>, ends: Vec<usize>| Op::Slice {
        starts: vec![0, 1, 0],
        ends,
        steps,
    };
    let pool = |k: usize, p: usize| Op::Pool {
        kind: PoolKind::Max,
        kernel: vec![k, k],
        geom: geom(2, p),
    };
    vec![
        (
            Op::Permute {
                perm: vec![2, 0, 1],
            },
            Op::Permute {
                perm: vec![2, 0, 0],
            },
            vec![x.clone()],
        ),
        (
            Op::Permute {
                perm: vec![2, 0, 1],
            },
            Op::Permute {
                perm: vec![2, 0, 7],
            },
            vec![x.clone()],
        ),
        (
            Op::Reduce {
                kind: ReduceKind::Sum,
                axes: vec![1],
                keep_dims: false,
            },
            Op::Reduce {
                kind: ReduceKind::Sum,
                axes: vec![3],
                keep_dims: false,
            },
            vec![x.clone()],
        ),
        (
            Op::Softmax { axis: 2 },
            Op::Softmax { axis: 3 },
            vec![x.clone()],
        ),
        (
            Op::Concat { axis: 1 },
            Op::Concat { axis: 3 },
            vec![x.clone(), x.clone()],
        ),
        (
            slice(vec![1, 1, 3], vec![2, 3, 4]),
            slice(vec![1, 1, 0], vec![2, 3, 4]),
            vec![x.clone()],
        ),
        (
            slice(vec![1, 1, 3], vec![2, 3, 4]),
            slice(vec![1, 1, 3], vec![2, 3, 5]),
            vec![x.clone()],
        ),
        (
            Op::Pad {
                pads: vec![(0, 0), (1, 2), (0, 1)],
                value: F64Bits::new(0.0),
            },
            Op::Pad {
                pads: vec![(0, 0), (1, 2)],
                value: F64Bits::new(0.0),
            },
            vec![x.clone()],
        ),
        (
            Op::Reshape {
                shape: Shape::new([6, 4]),
            },
            Op::Reshape {
                shape: Shape::new([6, 5]),
            },
            vec![x.clone()],
        ),
        (
            Op::Conv {
                geom: geom(1, 1),
                groups: 1,
                bias: false,
                act: rustytorch_ops::Activation::None,
            },
            Op::Conv {
                geom: geom(0, 1),
                groups: 1,
                bias: false,
                act: rustytorch_ops::Activation::None,
            },
            vec![img.clone(), w.clone()],
        ),
        (
            Op::Conv {
                geom: geom(1, 1),
                groups: 1,
                bias: false,
                act: rustytorch_ops::Activation::None,
            },
            Op::Conv {
                geom: geom(1, 1),
                groups: 0,
                bias: false,
                act: rustytorch_ops::Activation::None,
            },
            vec![img.clone(), w.clone()],
        ),
        (pool(2, 1), pool(2, 2), vec![img.clone()]),
        (pool(2, 1), pool(0, 0), vec![img.clone()]),
        (pool(2, 1), pool(7, 0), vec![img.clone()]),
    ]
}

#[test]
fn insane_attributes_are_refused_alike_by_ir_text_and_graph_files() {
    for (good, bad, tys) in insane_ops() {
        let refs: Vec<&TensorType> = tys.iter().collect();
        let why = infer(&bad, &refs).unwrap_err().to_string();
        let g = graph_of(&good, &tys);
        g.verify().unwrap();
        // IR text: the op's text replaced.
        let text = print(&g);
        let bad_text = text.replacen(&good.to_string(), &bad.to_string(), 1);
        assert_ne!(text, bad_text);
        let m = text_err(&bad_text);
        assert!(m.contains(&why), "{bad}: `{m}` lacks `{why}`");
        // Graph file: the op's encoding replaced behind a valid checksum.
        let file = to_bytes(&g, ParamStorage::Embedded).unwrap();
        let m = file_err(&patch_op(&file, &good, &bad));
        assert!(m.contains(&why), "{bad}: `{m}` lacks `{why}`");
    }
}

#[test]
fn verify_checks_the_tables_for_every_front_end() {
    let ty = t(DType::F32, &[2]);
    let mut g = Graph::new();
    let x = g.add_input("x", ty.clone()).unwrap();
    let w = g.add_param("w", ty.clone(), Init::Data, true).unwrap();
    let y = g.add(Op::Binary(BinaryOp::Mul), &[x, w]).unwrap();
    g.add_output("y", y).unwrap();
    g.verify().unwrap();
    // Parameter values of another type.
    let mut bad = g.clone();
    bad.params[0].data = Some(HostTensor::from_vec(vec![1.0f64, 2.0], [2]).unwrap());
    let e = bad.verify().unwrap_err().to_string();
    assert!(e.contains("its values are f64[2]"), "{e}");
    // A guard that is not a bool scalar.
    let mut bad = g.clone();
    bad.guards.push(("finite".into(), y));
    let e = bad.verify().unwrap_err().to_string();
    assert!(e.contains("not a bool scalar"), "{e}");
    let text = print(&g).replace("}\n", "  guard finite = %2\n}\n");
    assert!(text_err(&text).contains("not a bool scalar"), "{text}");
    // Names declared twice, edited into the tables directly.
    let mut bad = g.clone();
    bad.outputs.push(("y".into(), x));
    assert!(bad.verify().unwrap_err().to_string().contains("twice"));
    let mut bad = g.clone();
    bad.inputs[0].name = "x".into();
    let mut i2 = bad.inputs[0].clone();
    i2.node = w;
    bad.inputs.push(i2);
    assert!(bad.verify().is_err());
}
