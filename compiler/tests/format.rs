//! Graph files: round trips of a graph holding every op variant (embedded, safetensors and
//! init-only parameters), a committed golden file of every op (its encoding, and its values on the
//! CPU), and malformed files, which must each give an error, never a panic.

use proptest::prelude::*;
use rustytorch_compiler::format::{
    from_bytes, load, save, to_bytes, ParamStorage, HEADER_LEN, MAGIC, VERSION,
};
use rustytorch_compiler::text::print;
use rustytorch_compiler::{CompileError, Graph, Init, NodeId};
use rustytorch_ops::*;
use std::collections::HashMap;
use std::path::PathBuf;

fn t(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

fn geom(n: usize, stride: usize, padding: usize) -> ConvGeom {
    ConvGeom {
        stride: vec![stride; n],
        padding: vec![padding; n],
        dilation: vec![1; n],
        layout: Default::default(),
    }
}

/// Adds one node of every op variant from [`Op::samples`], its operands fresh graph inputs named
/// `op.k`; the `input`, `param` and `constant` samples become a declared input, a parameter with
/// a seeded initializer and a constant of seeded integers. Returns the nodes with their op names.
fn add_samples(g: &mut Graph) -> Vec<(String, NodeId)> {
    let mut nodes = vec![];
    for (i, (op, tys)) in Op::samples().into_iter().enumerate() {
        let name = op.name().to_string();
        let id = match op {
            Op::Input { ty, .. } => g.add_input(&name, ty).unwrap(),
            Op::Param { ty, .. } => g
                .add_param(&name, ty, Init::kaiming_uniform(4, i as u64), true)
                .unwrap(),
            Op::Constant { ty, .. } => {
                g.add_constant(testing::rand_tensor(&ty, i as u64, 0.0, 2.0))
            }
            op => {
                let ins: Vec<NodeId> = tys
                    .into_iter()
                    .enumerate()
                    .map(|(k, ty)| g.add_input(&format!("{name}.{k}"), ty).unwrap())
                    .collect();
                g.add(op, &ins).unwrap_or_else(|e| panic!("{name}: {e}"))
            }
        };
        nodes.push((name, id));
    }
    nodes
}

/// A graph with at least one node of every op variant (and every unary, binary and reduction),
/// parameters of several dtypes with and without data, constants, outputs, an update and a guard.
fn every_op_graph() -> Graph {
    let mut g = Graph::new();
    let f = F64Bits::new;
    let add = |g: &mut Graph, op: Op, ins: &[NodeId]| -> NodeId {
        let name = op.to_string();
        g.add(op, ins).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let x = g.add_input("x", t(DType::F32, &[4, 5])).unwrap();
    let img = g.add_input("img", t(DType::F32, &[2, 3, 8, 8])).unwrap();
    let labels = g.add_input("labels", t(DType::I64, &[4])).unwrap();
    let flags = g.add_input("flags", t(DType::Bool, &[4, 5])).unwrap();
    let w = g
        .add_param(
            "w",
            t(DType::F32, &[5, 6]),
            Init::kaiming_uniform(5, 3),
            true,
        )
        .unwrap();
    let bias = g
        .add_param("bias", t(DType::F32, &[6]), Init::zeros(), true)
        .unwrap();
    let cw = g
        .add_param(
            "conv.w",
            t(DType::F32, &[4, 3, 3, 3]),
            Init::Normal {
                mean: 0.0,
                std: 0.1,
                seed: 11,
            },
            true,
        )
        .unwrap();
    let cb = g
        .add_param("conv.b", t(DType::F32, &[4]), Init::Full(0.5), true)
        .unwrap();
    let h16 = g
        .add_param("h16", t(DType::F16, &[3]), Init::Data, true)
        .unwrap();
    let hb = g
        .add_param("hb", t(DType::BF16, &[2, 2]), Init::Data, false)
        .unwrap();
    let step = g
        .add_param("step", t(DType::I64, &[]), Init::zeros(), false)
        .unwrap();
    let mom = g
        .add_param("momentum", t(DType::F32, &[5, 6]), Init::zeros(), false)
        .unwrap();
    // Parameter data: trained weights for some, including odd floats.
    let data = |g: &mut Graph, name: &str, v: HostTensor| {
        g.params.iter_mut().find(|p| p.name == name).unwrap().data = Some(v);
    };
    let wv: Vec<f32> = (0..30).map(|i| (i as f32 * 0.37).sin()).collect();
    data(&mut g, "w", HostTensor::from_vec(wv, [5, 6]).unwrap());
    data(
        &mut g,
        "h16",
        HostTensor::from_vec(vec![f16::from_f32(1.5), f16::NAN, f16::NEG_INFINITY], [3]).unwrap(),
    );
    data(
        &mut g,
        "hb",
        HostTensor::from_vec(
            vec![
                bf16::from_f32(-0.0),
                bf16::MAX,
                bf16::MIN_POSITIVE,
                bf16::ONE,
            ],
            [2, 2],
        )
        .unwrap(),
    );
    data(&mut g, "step", HostTensor::scalar(41i64));

    // Leaves.
    let c = g.add_constant(HostTensor::from_vec(vec![1i32, -2, 3], [3]).unwrap());
    let cbool =
        g.add_constant(HostTensor::from_vec(vec![true, false, true, true, false], [5]).unwrap());
    let cu8 = g.add_constant(HostTensor::from_vec(vec![0u8, 255], [2]).unwrap());
    let cf64 = g.add_constant(HostTensor::from_vec(vec![f64::MIN_POSITIVE, -1e300], [2]).unwrap());
    let full = add(
        &mut g,
        Op::Full {
            value: f(0.25),
            ty: t(DType::F32, &[]),
        },
        &[],
    );
    let iota = add(
        &mut g,
        Op::Iota {
            axis: 1,
            ty: t(DType::I64, &[4, 5]),
        },
        &[],
    );
    let ru = add(
        &mut g,
        Op::RandUniform {
            low: f(-1.0),
            high: f(1.0),
            seed: 5,
            ty: t(DType::F32, &[4, 5]),
        },
        &[],
    );
    let rn = add(
        &mut g,
        Op::RandNormal {
            mean: f(0.0),
            std: f(2.0),
            seed: 6,
            ty: t(DType::F64, &[3]),
        },
        &[],
    );

    // Elementwise.
    let mut outs = vec![];
    for u in text::UNARY_OPS {
        let input = match u {
            UnaryOp::Not => flags,
            _ => x,
        };
        outs.push(add(&mut g, Op::Unary(u), &[input]));
    }
    for b in text::BINARY_OPS {
        let (l, r) = match b {
            BinaryOp::And | BinaryOp::Or => (flags, cbool),
            _ => (x, full),
        };
        outs.push(add(&mut g, Op::Binary(b), &[l, r]));
    }
    let sel = add(&mut g, Op::Where, &[flags, x, ru]);
    let xi = add(&mut g, Op::Cast { to: DType::I32 }, &[x]);
    let iota_f = add(&mut g, Op::Cast { to: DType::F32 }, &[iota]);
    let fused = add(
        &mut g,
        Op::Fused(Box::new(FusedKernel {
            n_inputs: 2,
            instrs: vec![
                FusedInstr {
                    op: Op::Binary(BinaryOp::Mul),
                    args: vec![0, 1],
                    dtype: DType::F32,
                },
                FusedInstr {
                    op: Op::Full {
                        value: f(0.5),
                        ty: t(DType::F32, &[]),
                    },
                    args: vec![],
                    dtype: DType::F32,
                },
                FusedInstr {
                    op: Op::Binary(BinaryOp::Add),
                    args: vec![2, 3],
                    dtype: DType::F32,
                },
                FusedInstr {
                    op: Op::Unary(UnaryOp::Exp),
                    args: vec![4],
                    dtype: DType::F32,
                },
            ],
            out: t(DType::F32, &[4, 5]),
        })),
        &[sel, iota_f],
    );

    // Reductions.
    for k in text::REDUCE_KINDS {
        let input = match k {
            ReduceKind::Any | ReduceKind::All => flags,
            _ => fused,
        };
        outs.push(add(
            &mut g,
            Op::Reduce {
                kind: k,
                axes: vec![1],
                keep_dims: k == ReduceKind::Sum,
            },
            &[input],
        ));
    }
    outs.push(add(
        &mut g,
        Op::ArgReduce {
            kind: ArgKind::ArgMax,
            axis: 1,
            keep_dims: false,
        },
        &[x],
    ));
    outs.push(add(
        &mut g,
        Op::ArgReduce {
            kind: ArgKind::ArgMin,
            axis: 0,
            keep_dims: true,
        },
        &[xi],
    ));

    // Linear algebra.
    let mm = add(
        &mut g,
        Op::Matmul {
            trans_a: false,
            trans_b: false,
        },
        &[x, w],
    );
    let mmt = add(
        &mut g,
        Op::Matmul {
            trans_a: true,
            trans_b: false,
        },
        &[x, x],
    );
    let epi = add(
        &mut g,
        Op::MatmulEpilogue {
            trans_a: false,
            trans_b: false,
            bias: true,
            act: Activation::GeluTanh,
            accumulate: false,
        },
        &[x, w, bias],
    );
    let acc = add(
        &mut g,
        Op::MatmulEpilogue {
            trans_a: false,
            trans_b: false,
            bias: true,
            act: Activation::None,
            accumulate: true,
        },
        &[x, w, bias, mm],
    );
    outs.extend([mm, mmt, epi, acc]);

    // Movement.
    let r = add(
        &mut g,
        Op::Reshape {
            shape: Shape::new([2, 2, 5]),
        },
        &[x],
    );
    let p = add(
        &mut g,
        Op::Permute {
            perm: vec![2, 0, 1],
        },
        &[r],
    );
    let e = add(
        &mut g,
        Op::Expand {
            shape: Shape::new([3, 6]),
        },
        &[bias],
    );
    let s = add(
        &mut g,
        Op::Slice {
            starts: vec![1, 0],
            ends: vec![4, 5],
            steps: vec![2, 2],
        },
        &[x],
    );
    let cat = add(&mut g, Op::Concat { axis: 0 }, &[x, ru, fused]);
    let pad = add(
        &mut g,
        Op::Pad {
            pads: vec![(1, 0), (0, 2)],
            value: f(f64::NEG_INFINITY),
        },
        &[x],
    );
    outs.extend([p, e, s, cat, pad]);

    // Normalization.
    let ln_w = g
        .add_param("ln.w", t(DType::F32, &[5]), Init::ones(), true)
        .unwrap();
    outs.push(add(&mut g, Op::Softmax { axis: 1 }, &[x]));
    outs.push(add(&mut g, Op::LogSoftmax { axis: 0 }, &[x]));
    outs.push(add(
        &mut g,
        Op::LayerNorm {
            eps: f(1e-5),
            weight: true,
            bias: false,
        },
        &[x, ln_w],
    ));
    outs.push(add(
        &mut g,
        Op::RmsNorm {
            eps: f(1e-6),
            weight: false,
        },
        &[x],
    ));

    // Indexing.
    let gidx = add(
        &mut g,
        Op::Slice {
            starts: vec![0, 0],
            ends: vec![4, 2],
            steps: vec![1, 1],
        },
        &[iota],
    );
    let gathered = add(&mut g, Op::Gather { axis: 1 }, &[x, gidx]);
    outs.push(add(
        &mut g,
        Op::ScatterAdd { axis: 1 },
        &[x, gidx, gathered],
    ));
    let rows = add(
        &mut g,
        Op::Slice {
            starts: vec![1],
            ends: vec![4],
            steps: vec![1],
        },
        &[labels],
    );
    let picked = add(&mut g, Op::IndexSelect { axis: 0 }, &[x, rows]);
    outs.push(add(&mut g, Op::IndexAdd { axis: 0 }, &[x, rows, picked]));

    // Convolution and pooling.
    let conv = add(
        &mut g,
        Op::Conv {
            geom: geom(2, 1, 1),
            groups: 1,
            bias: true,
            act: rustytorch_ops::Activation::None,
        },
        &[img, cw, cb],
    );
    outs.push(add(
        &mut g,
        Op::ConvGradInput {
            geom: geom(2, 1, 1),
            groups: 1,
            input_shape: Shape::new([2, 3, 8, 8]),
        },
        &[conv, cw],
    ));
    outs.push(add(
        &mut g,
        Op::ConvGradWeight {
            geom: geom(2, 1, 1),
            groups: 1,
            weight_shape: Shape::new([4, 3, 3, 3]),
        },
        &[img, conv],
    ));
    let pool = add(
        &mut g,
        Op::Pool {
            kind: PoolKind::Max,
            kernel: vec![2, 2],
            geom: geom(2, 2, 0),
        },
        &[conv],
    );
    let avg = PoolKind::Avg {
        count_include_pad: true,
    };
    outs.push(add(
        &mut g,
        Op::Pool {
            kind: avg,
            kernel: vec![3, 3],
            geom: geom(2, 1, 1),
        },
        &[conv],
    ));
    outs.push(add(
        &mut g,
        Op::PoolGrad {
            kind: PoolKind::Max,
            kernel: vec![2, 2],
            geom: geom(2, 2, 0),
        },
        &[conv, pool],
    ));

    // Attention.
    let corner = conv_slice(&mut g, conv);
    let q = add(
        &mut g,
        Op::Reshape {
            shape: Shape::new([1, 2, 4, 4]),
        },
        &[corner],
    );
    let mask = add(
        &mut g,
        Op::Slice {
            starts: vec![0, 0],
            ends: vec![4, 4],
            steps: vec![1, 1],
        },
        &[x],
    );
    let att = add(
        &mut g,
        Op::Attention {
            causal: Causal::TopLeft,
            mask: AttnMask::Additive,
            scale: f(0.5),
            layout: AttnLayout::Bhsd,
        },
        &[q, q, q, mask],
    );
    for wrt in 0..3 {
        outs.push(add(
            &mut g,
            Op::AttentionGrad {
                causal: Causal::TopLeft,
                mask: AttnMask::Additive,
                scale: f(0.5),
                wrt,
                layout: AttnLayout::Bhsd,
            },
            &[q, q, q, mask, att],
        ));
    }
    // The same in the [B, S, H, D] layout (recorded in the layout table).
    let att_bshd = add(
        &mut g,
        Op::Attention {
            causal: Causal::BottomRight,
            mask: AttnMask::None,
            scale: f(0.5),
            layout: AttnLayout::Bshd,
        },
        &[q, q, q],
    );
    outs.push(add(
        &mut g,
        Op::AttentionGrad {
            causal: Causal::BottomRight,
            mask: AttnMask::None,
            scale: f(0.5),
            wrt: 1,
            layout: AttnLayout::Bshd,
        },
        &[q, q, q, att_bshd],
    ));

    // Losses.
    let ce = add(
        &mut g,
        Op::CrossEntropy {
            reduction: Reduction::Mean,
            ignore_index: -100,
        },
        &[x, labels],
    );
    let ceg = add(
        &mut g,
        Op::CrossEntropyGrad {
            reduction: Reduction::Mean,
            ignore_index: -100,
        },
        &[x, labels, ce],
    );
    outs.push(ceg);

    // Tables.
    let one = add(
        &mut g,
        Op::Full {
            value: f(1.0),
            ty: t(DType::I64, &[]),
        },
        &[],
    );
    let next = add(&mut g, Op::Binary(BinaryOp::Add), &[step, one]);
    g.updates.push((6, next));
    let new_mom = add(&mut g, Op::Binary(BinaryOp::Mul), &[mom, full]);
    g.updates.push((7, new_mom));
    let finite = add(&mut g, Op::Unary(UnaryOp::IsFinite), &[ce]);
    g.guards.push(("finite.loss".into(), finite));
    for (name, id) in add_samples(&mut g) {
        g.add_output(&format!("sample.{name}"), id).unwrap();
    }
    g.node_mut(ce).unwrap().name = Some("loss value".into());
    g.add_output("loss", ce).unwrap();
    for (i, o) in outs.iter().enumerate() {
        g.add_output(&format!("o{i}"), *o).unwrap();
    }
    for (i, o) in [c, cu8, cf64, rn, h16, hb].iter().enumerate() {
        g.add_output(&format!("leaf{i}"), *o).unwrap();
    }
    g.verify().unwrap();
    g
}

/// A [1,2,4,4] corner of a conv output, as a query for attention.
fn conv_slice(g: &mut Graph, conv: NodeId) -> NodeId {
    g.add(
        Op::Slice {
            starts: vec![0, 0, 0, 0],
            ends: vec![1, 2, 4, 4],
            steps: vec![1, 1, 1, 1],
        },
        &[conv],
    )
    .unwrap()
}

fn assert_same(a: &Graph, b: &Graph) {
    assert_eq!(print(a), print(b));
    for (p, q) in a.params.iter().zip(&b.params) {
        assert_eq!(p.name, q.name);
        assert_eq!(p.init, q.init);
        assert_eq!(p.trainable, q.trainable);
    }
    assert_eq!(a.params.len(), b.params.len());
    assert_eq!(a.constants, b.constants);
}

/// Bitwise equality of tensors (NaNs included).
fn same_bits(a: &HostTensor, b: &HostTensor) -> bool {
    a.ty() == b.ty()
        && match (a.data(), b.data()) {
            (Data::F32(x), Data::F32(y)) => x
                .iter()
                .map(|v| v.to_bits())
                .eq(y.iter().map(|v| v.to_bits())),
            (Data::F16(x), Data::F16(y)) => x
                .iter()
                .map(|v| v.to_bits())
                .eq(y.iter().map(|v| v.to_bits())),
            (Data::BF16(x), Data::BF16(y)) => x
                .iter()
                .map(|v| v.to_bits())
                .eq(y.iter().map(|v| v.to_bits())),
            _ => a == b,
        }
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rustytorch-format-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn the_sample_graph_holds_every_op_variant() {
    let g = every_op_graph();
    let mut seen = [false; Op::VARIANT_COUNT];
    for id in g.node_ids() {
        seen[g.node(id).unwrap().op.variant_index()] = true;
    }
    let missing: Vec<usize> = (0..Op::VARIANT_COUNT).filter(|i| !seen[*i]).collect();
    assert!(
        missing.is_empty(),
        "variants missing from the sample graph: {missing:?}"
    );
}

#[test]
fn embedded_round_trip_keeps_everything() {
    let g = every_op_graph();
    let bytes = to_bytes(&g, ParamStorage::Embedded).unwrap();
    assert_eq!(&bytes[..8], &MAGIC);
    let back = from_bytes(&bytes).unwrap();
    back.verify().unwrap();
    assert_same(&g, &back);
    for (p, q) in g.params.iter().zip(&back.params) {
        match (&p.data, &q.data) {
            (None, None) => {}
            (Some(a), Some(b)) => assert!(same_bits(a, b), "{}", p.name),
            _ => panic!("data of `{}` changed presence", p.name),
        }
    }
    // Saving the loaded graph again gives the same bytes.
    assert_eq!(to_bytes(&back, ParamStorage::Embedded).unwrap(), bytes);
    // The text form of the loaded graph parses back too.
    let reparsed = rustytorch_compiler::text::parse(&print(&back)).unwrap();
    assert_eq!(print(&reparsed), print(&back));
}

#[test]
fn init_only_drops_values_and_keeps_initializers() {
    let g = every_op_graph();
    let bytes = to_bytes(&g, ParamStorage::InitOnly).unwrap();
    assert!(bytes.len() < to_bytes(&g, ParamStorage::Embedded).unwrap().len());
    let back = from_bytes(&bytes).unwrap();
    assert!(back.params.iter().all(|p| p.data.is_none()));
    for (p, q) in g.params.iter().zip(&back.params) {
        assert_eq!(
            (&p.name, &p.init, &p.ty, p.trainable),
            (&q.name, &q.init, &q.ty, q.trainable)
        );
    }
    assert_eq!(back.constants, g.constants);
}

#[test]
fn safetensors_sidecar_round_trip_and_checks() {
    let dir = tmp_dir("st");
    let path = dir.join("model.rtg");
    let side = dir.join("model.rtg.safetensors");
    let g = every_op_graph();
    save(&g, &path, ParamStorage::Safetensors).unwrap();
    assert!(side.exists());
    let back = load(&path).unwrap();
    assert_same(&g, &back);
    for (p, q) in g.params.iter().zip(&back.params) {
        assert_eq!(p.data.is_some(), q.data.is_some(), "{}", p.name);
        if let (Some(a), Some(b)) = (&p.data, &q.data) {
            assert!(same_bits(a, b), "{}", p.name);
        }
    }
    // The body needs its sidecar: from_bytes alone says so.
    let e = from_bytes(&std::fs::read(&path).unwrap()).unwrap_err();
    assert!(e.to_string().contains("safetensors"), "{e}");

    // A sidecar whose tensor has the wrong shape, one missing a tensor, and none at all.
    let wrong = |tensors: Vec<(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)>| {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.to_string(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        std::fs::write(&side, safetensors::serialize(views, &None).unwrap()).unwrap();
        load(&path).unwrap_err().to_string()
    };
    let e = wrong(vec![(
        "w",
        safetensors::Dtype::F32,
        vec![6, 5],
        vec![0; 120],
    )]);
    assert!(e.contains("shape"), "{e}");
    let e = wrong(vec![(
        "w",
        safetensors::Dtype::F64,
        vec![5, 6],
        vec![0; 240],
    )]);
    assert!(e.contains("dtype"), "{e}");
    let e = wrong(vec![(
        "w",
        safetensors::Dtype::F32,
        vec![5, 6],
        vec![0; 120],
    )]);
    assert!(e.contains("missing"), "{e}");
    std::fs::write(&side, b"not safetensors").unwrap();
    assert!(matches!(load(&path), Err(CompileError::Format(_))));
    std::fs::remove_file(&side).unwrap();
    assert!(matches!(load(&path), Err(CompileError::Io { .. })));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_graph_without_data_writes_no_sidecar() {
    let dir = tmp_dir("nodata");
    let path = dir.join("m.rtg");
    let mut g = every_op_graph();
    for p in &mut g.params {
        p.data = None;
    }
    save(&g, &path, ParamStorage::Safetensors).unwrap();
    assert!(!dir.join("m.rtg.safetensors").exists());
    assert_same(&g, &load(&path).unwrap());
    assert!(matches!(
        load(&dir.join("absent.rtg")),
        Err(CompileError::Io { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------- the golden file

/// The committed graph file of every op, and the values beside it.
const GOLDEN: &str = "every_op.rtg";
/// Its inputs (`input.NAME`) and the outputs the CPU kernels give for them (`output.NAME`).
const GOLDEN_VALUES: &str = "every_op.values.safetensors";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// One node of every op variant, each an output named by its op.
fn golden_graph() -> Graph {
    let mut g = Graph::new();
    for (name, id) in add_samples(&mut g) {
        g.add_output(&name, id).unwrap();
    }
    g.verify().unwrap();
    g
}

/// Seeded inputs: floats in [-1, 1), integers in {0, 1} (valid indices and targets for every
/// sample), random bools; a sample's operand `op.k` is made by `testing::sample_input`, which
/// also makes a sparse op's row pointers valid.
fn golden_inputs(g: &Graph) -> Vec<(String, HostTensor)> {
    let samples: HashMap<String, (Op, Vec<TensorType>, usize)> = Op::samples()
        .into_iter()
        .flat_map(|(op, tys)| {
            (0..tys.len())
                .map(|k| (format!("{}.{k}", op.name()), (op.clone(), tys.clone(), k)))
                .collect::<Vec<_>>()
        })
        .collect();
    g.inputs
        .iter()
        .enumerate()
        .map(|(i, input)| {
            let seed = 1000 + i as u64;
            let value = match samples.get(&input.name) {
                Some((op, tys, k)) => testing::sample_input(op, tys, *k, seed),
                None => testing::sample_input(
                    &Op::Unary(UnaryOp::Neg),
                    std::slice::from_ref(&input.ty),
                    0,
                    seed,
                ),
            };
            (input.name.clone(), value)
        })
        .collect()
}

/// Runs a graph node by node with the CPU kernels; returns its outputs by name.
fn run_cpu(g: &Graph, inputs: &HashMap<String, HostTensor>) -> Vec<(String, HostTensor)> {
    let mut values: HashMap<NodeId, HostTensor> = HashMap::new();
    for id in g.topo_order().unwrap() {
        let node = g.node(id).unwrap();
        let value = match &node.op {
            Op::Input { index, .. } => {
                let name = &g.inputs[*index as usize].name;
                inputs
                    .get(name)
                    .unwrap_or_else(|| panic!("no value for input `{name}`"))
                    .clone()
            }
            Op::Param { index, .. } => {
                let p = &g.params[*index as usize];
                match &p.data {
                    Some(d) => d.clone(),
                    None => p.init.materialize(&p.ty).unwrap(),
                }
            }
            Op::Constant { index, .. } => g.constants[*index as usize].clone(),
            op => {
                let args: Vec<&HostTensor> = node.inputs.iter().map(|i| &values[i]).collect();
                eval_cpu(op, &args).unwrap_or_else(|e| panic!("{op}: {e}"))
            }
        };
        assert_eq!(value.ty(), node.ty, "{}", node.op);
        values.insert(id, value);
    }
    g.outputs
        .iter()
        .map(|(name, id)| (name.clone(), values[id].clone()))
        .collect()
}

/// Writes the golden file and its values (run with `RUSTYTORCH_BLESS=1` after a deliberate change
/// of the op set or the encoding; bump the format version when an old file would read differently).
fn bless(g: &Graph) {
    let inputs = golden_inputs(g);
    let outputs = run_cpu(g, &inputs.iter().cloned().collect());
    let mut values: Vec<(String, HostTensor)> = inputs
        .into_iter()
        .map(|(n, t)| (format!("input.{n}"), t))
        .collect();
    values.extend(outputs.into_iter().map(|(n, t)| (format!("output.{n}"), t)));
    std::fs::create_dir_all(fixture("")).unwrap();
    save(g, &fixture(GOLDEN), ParamStorage::Embedded).unwrap();
    std::fs::write(
        fixture(GOLDEN_VALUES),
        rustytorch_compiler::format::safetensors_bytes(&values).unwrap(),
    )
    .unwrap();
}

#[test]
fn the_golden_file_reads_as_the_graph_of_every_op() {
    let g = golden_graph();
    if std::env::var_os("RUSTYTORCH_BLESS").is_some_and(|v| v == "1") {
        bless(&g);
    }
    let bytes = std::fs::read(fixture(GOLDEN))
        .expect("tests/fixtures/every_op.rtg is missing: run with RUSTYTORCH_BLESS=1");
    assert_eq!(
        u32::from_le_bytes(bytes[8..12].try_into().unwrap()),
        VERSION,
        "the golden file is this build's format version"
    );
    let back = from_bytes(&bytes).unwrap_or_else(|e| {
        panic!("the golden file no longer loads ({e}): the op encoding changed")
    });
    back.verify().unwrap();
    assert_same(&g, &back);
    assert_eq!(
        back.outputs
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        g.outputs
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
    );
    for (p, q) in g.params.iter().zip(&back.params) {
        assert_eq!((&p.ty, &p.data), (&q.ty, &q.data), "{}", p.name);
    }
    assert_eq!(
        to_bytes(&g, ParamStorage::Embedded).unwrap(),
        bytes,
        "the graph of every op encodes differently from the golden file"
    );
}

#[test]
fn the_golden_file_runs_to_its_recorded_values() {
    let graph = load(&fixture(GOLDEN)).unwrap();
    let got = runs_to_recorded_values(&graph, GOLDEN_VALUES);
    assert_eq!(got, Op::VARIANT_COUNT);
}

/// The golden file as version 1 wrote it (frozen: never blessed again), with its values.
const GOLDEN_V1: &str = "every_op_v1.rtg";
const GOLDEN_V1_VALUES: &str = "every_op_v1.values.safetensors";

#[test]
fn a_version_1_file_still_loads_and_runs() {
    let bytes = std::fs::read(fixture(GOLDEN_V1)).unwrap();
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 1);
    let graph = from_bytes(&bytes).unwrap();
    assert!(graph.dims.named.is_empty() && graph.dims.shapes.is_empty());
    assert!(runs_to_recorded_values(&graph, GOLDEN_V1_VALUES) > 30);
    // Saved again, it is this build's version and reads back the same.
    let again = to_bytes(&graph, ParamStorage::Embedded).unwrap();
    assert_eq!(
        u32::from_le_bytes(again[8..12].try_into().unwrap()),
        VERSION
    );
    assert_same(&graph, &from_bytes(&again).unwrap());
}

/// The golden file as version 2 wrote it (frozen: never blessed again), with its values. Its
/// convolutions and pooling have no layout table and read as channels-first.
const GOLDEN_V2: &str = "every_op_v2.rtg";
const GOLDEN_V2_VALUES: &str = "every_op_v2.values.safetensors";

#[test]
fn a_version_2_file_still_loads_as_channels_first() {
    let bytes = std::fs::read(fixture(GOLDEN_V2)).unwrap();
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 2);
    let graph = from_bytes(&bytes).unwrap();
    let mut convs = 0;
    for id in graph.topo_order().unwrap() {
        if let Op::Conv { geom, .. }
        | Op::ConvGradInput { geom, .. }
        | Op::ConvGradWeight { geom, .. }
        | Op::Pool { geom, .. }
        | Op::PoolGrad { geom, .. } = &graph.node(id).unwrap().op
        {
            assert_eq!(geom.layout, rustytorch_ops::Layout::ChannelsFirst);
            convs += 1;
        }
    }
    assert_eq!(convs, 5);
    // Every variant of its day: all but `all_reduce`, `fused_row` and `matmul_act_grad`, added
    // after version 2.
    assert_eq!(
        runs_to_recorded_values(&graph, GOLDEN_V2_VALUES),
        Op::VARIANT_COUNT - 3
    );
    let again = to_bytes(&graph, ParamStorage::Embedded).unwrap();
    assert_same(&graph, &from_bytes(&again).unwrap());
}

/// The golden file as version 3 wrote it (frozen: never blessed again), with its values: the
/// same schema as version 4, whose layout table may also name attention nodes.
const GOLDEN_V3: &str = "every_op_v3.rtg";
const GOLDEN_V3_VALUES: &str = "every_op_v3.values.safetensors";

#[test]
fn a_version_3_file_still_loads_and_runs() {
    let bytes = std::fs::read(fixture(GOLDEN_V3)).unwrap();
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 3);
    let graph = from_bytes(&bytes).unwrap();
    // Every variant but `matmul_act_grad`, added after version 4.
    assert_eq!(
        runs_to_recorded_values(&graph, GOLDEN_V3_VALUES),
        Op::VARIANT_COUNT - 1
    );
    let again = to_bytes(&graph, ParamStorage::Embedded).unwrap();
    assert_same(&graph, &from_bytes(&again).unwrap());
}

/// The golden file as version 4 wrote it (frozen: never blessed again), with its values. It has
/// no table of convolution activations: its convolution reads without one.
const GOLDEN_V4: &str = "every_op_v4.rtg";
const GOLDEN_V4_VALUES: &str = "every_op_v4.values.safetensors";

#[test]
fn a_version_4_file_still_loads_without_activations() {
    let bytes = std::fs::read(fixture(GOLDEN_V4)).unwrap();
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 4);
    let graph = from_bytes(&bytes).unwrap();
    let mut convs = 0;
    for id in graph.topo_order().unwrap() {
        if let Op::Conv { act, .. } = &graph.node(id).unwrap().op {
            assert_eq!(*act, rustytorch_ops::Activation::None);
            convs += 1;
        }
    }
    assert_eq!(convs, 1);
    // Every variant of its day.
    assert_eq!(
        runs_to_recorded_values(&graph, GOLDEN_V4_VALUES),
        Op::VARIANT_COUNT
    );
    let again = to_bytes(&graph, ParamStorage::Embedded).unwrap();
    assert_same(&graph, &from_bytes(&again).unwrap());
}

/// The golden file as version 5 wrote it (frozen: never blessed again), with its values. It has
/// no table of accumulating matmuls: its `matmul_epilogue` nodes read without an accumulated
/// operand.
const GOLDEN_V5: &str = "every_op_v5.rtg";
const GOLDEN_V5_VALUES: &str = "every_op_v5.values.safetensors";

#[test]
fn a_version_5_file_still_loads_without_accumulation() {
    let bytes = std::fs::read(fixture(GOLDEN_V5)).unwrap();
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 5);
    let graph = from_bytes(&bytes).unwrap();
    let mut epis = 0;
    for id in graph.topo_order().unwrap() {
        if let Op::MatmulEpilogue { accumulate, .. } = &graph.node(id).unwrap().op {
            assert!(!accumulate);
            epis += 1;
        }
    }
    assert_eq!(epis, 1);
    assert_eq!(
        runs_to_recorded_values(&graph, GOLDEN_V5_VALUES),
        Op::VARIANT_COUNT
    );
    let again = to_bytes(&graph, ParamStorage::Embedded).unwrap();
    assert_same(&graph, &from_bytes(&again).unwrap());
}

/// The golden file as version 6 wrote it (frozen: never blessed again), with its values. It has
/// no table of packed attention ops, and none of its attention nodes is packed.
const GOLDEN_V6: &str = "every_op_v6.rtg";
const GOLDEN_V6_VALUES: &str = "every_op_v6.values.safetensors";

#[test]
fn a_version_6_file_still_loads() {
    let bytes = std::fs::read(fixture(GOLDEN_V6)).unwrap();
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 6);
    let graph = from_bytes(&bytes).unwrap();
    for id in graph.topo_order().unwrap() {
        if let Op::Attention { layout, .. } | Op::AttentionGrad { layout, .. } =
            &graph.node(id).unwrap().op
        {
            assert_ne!(*layout, AttnLayout::Packed);
        }
    }
    assert_eq!(
        runs_to_recorded_values(&graph, GOLDEN_V6_VALUES),
        Op::VARIANT_COUNT
    );
    let again = to_bytes(&graph, ParamStorage::Embedded).unwrap();
    assert_same(&graph, &from_bytes(&again).unwrap());
}

/// A convolution's activation keeps it through a file (the current golden file holds one too).
#[test]
fn conv_activation_round_trips() {
    let g = golden_graph();
    let acts = |g: &Graph| {
        g.topo_order()
            .unwrap()
            .into_iter()
            .filter_map(|id| match &g.node(id).unwrap().op {
                Op::Conv { act, .. } => Some(*act),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(acts(&g), vec![rustytorch_ops::Activation::GeluErf]);
    let back = from_bytes(&to_bytes(&g, ParamStorage::Embedded).unwrap()).unwrap();
    assert_eq!(acts(&back), acts(&g));
    assert_same(&g, &back);
}

/// Attention in the `[B, S, H, D]` layout keeps it through a file; a version 3 file whose layout
/// table names attention is refused (version 3 had no such layout).
#[test]
fn attention_layout_round_trips() {
    let g = every_op_graph();
    let bshd = |g: &Graph| {
        g.topo_order()
            .unwrap()
            .into_iter()
            .filter(|&id| {
                matches!(&g.node(id).unwrap().op,
                    Op::Attention { layout, .. } | Op::AttentionGrad { layout, .. }
                        if *layout == AttnLayout::Bshd)
            })
            .count()
    };
    assert_eq!(bshd(&g), 2);
    let bytes = to_bytes(&g, ParamStorage::Embedded).unwrap();
    let back = from_bytes(&bytes).unwrap();
    assert_eq!(bshd(&back), 2);
    assert_same(&g, &back);
    let e = from_bytes(&as_version_3(&g, &bytes))
        .unwrap_err()
        .to_string();
    assert!(e.contains("which is not a convolution or pooling"), "{e}");
}

/// `bytes` (a file of `g` in this build's version) as a version 3 file: the same body without
/// the trailing tables of convolution activations (a u64 length, then 8 bytes an entry: the node
/// and the activation's variant) and of accumulating matmuls (a u64 length, then a u32 node an
/// entry), with its header's length and checksum made to match.
fn as_version_3(g: &Graph, bytes: &[u8]) -> Vec<u8> {
    let accums = g
        .topo_order()
        .unwrap()
        .into_iter()
        .filter(|&id| {
            matches!(
                &g.node(id).unwrap().op,
                Op::MatmulEpilogue {
                    accumulate: true,
                    ..
                }
            )
        })
        .count();
    let acts = g
        .topo_order()
        .unwrap()
        .into_iter()
        .filter(|&id| {
            matches!(&g.node(id).unwrap().op,
                Op::Conv { act, .. } if *act != rustytorch_ops::Activation::None)
        })
        .count();
    let packed = g
        .topo_order()
        .unwrap()
        .into_iter()
        .filter(|&id| {
            matches!(&g.node(id).unwrap().op,
                Op::Attention { layout, .. } | Op::AttentionGrad { layout, .. }
                    if *layout == AttnLayout::Packed)
        })
        .count();
    let body = &bytes[24..bytes.len() - 8 - 8 * acts - 8 - 4 * accums - 8 - 4 * packed];
    let mut out = bytes[..8].to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((body.len() as u64).to_le_bytes());
    out.extend(crc32fast::hash(body).to_le_bytes());
    out.extend(body);
    out
}

/// A channels-last node keeps its layout through a file (the current golden file holds one too).
#[test]
fn channels_last_layout_round_trips() {
    let g = golden_graph();
    let last = |g: &Graph| {
        g.topo_order()
            .unwrap()
            .into_iter()
            .filter(|&id| {
                matches!(&g.node(id).unwrap().op,
                    Op::ConvGradInput { geom, .. } if geom.layout == rustytorch_ops::Layout::ChannelsLast)
            })
            .count()
    };
    assert_eq!(last(&g), 1);
    let back = from_bytes(&to_bytes(&g, ParamStorage::Embedded).unwrap()).unwrap();
    assert_eq!(last(&back), 1);
    assert_same(&g, &back);
}

/// Runs `graph` on the inputs recorded in the fixture `values` and checks its outputs against
/// the recorded ones; returns how many outputs it checked.
fn runs_to_recorded_values(graph: &Graph, file: &str) -> usize {
    let values = rustytorch_compiler::format::safetensors_tensors(
        &std::fs::read(fixture(file)).unwrap(),
        file,
    )
    .unwrap();
    let mut inputs = HashMap::new();
    let mut want = HashMap::new();
    for (name, t) in values {
        if let Some(n) = name.strip_prefix("input.") {
            inputs.insert(n.to_string(), t);
        } else if let Some(n) = name.strip_prefix("output.") {
            want.insert(n.to_string(), t);
        } else {
            panic!("unexpected tensor `{name}` in {file}");
        }
    }
    assert_eq!(inputs.len(), graph.inputs.len());
    let got = run_cpu(graph, &inputs);
    assert_eq!(got.len(), want.len());
    let n = got.len();
    for (name, t) in got {
        let w = &want[&name];
        assert_eq!(t.ty(), w.ty(), "output `{name}`");
        testing::assert_close(
            &t.to_f64_vec(),
            &w.to_f64_vec(),
            testing::tolerance(t.dtype()),
            &format!("output `{name}`"),
        );
    }
    n
}

/// A small valid file for the corruption tests.
fn small_file() -> Vec<u8> {
    let mut g = Graph::new();
    let x = g.add_input("x", t(DType::F32, &[2, 3])).unwrap();
    let w = g
        .add_param("w", t(DType::F32, &[3]), Init::Data, true)
        .unwrap();
    g.params[0].data = Some(HostTensor::from_vec(vec![1.0f32, 2.0, 3.0], [3]).unwrap());
    let y = g.add(Op::Binary(BinaryOp::Mul), &[x, w]).unwrap();
    let s = g
        .add(
            Op::Reduce {
                kind: ReduceKind::Sum,
                axes: vec![1],
                keep_dims: false,
            },
            &[y],
        )
        .unwrap();
    g.add_output("s", s).unwrap();
    to_bytes(&g, ParamStorage::Embedded).unwrap()
}

fn format_msg(bytes: &[u8]) -> String {
    match from_bytes(bytes) {
        Err(CompileError::Format(m)) => m,
        other => panic!("expected a format error, got {other:?}"),
    }
}

fn with_header(version: u32, body_len: u64, crc: u32, body: &[u8]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&body_len.to_le_bytes());
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(body);
    out
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = small_file();
    from_bytes(&bytes).unwrap();
    for n in 0..bytes.len() {
        let m = format_msg(&bytes[..n]);
        if n >= HEADER_LEN {
            assert!(m.starts_with("truncated: header says"), "{n}: {m}");
        } else {
            assert!(m.starts_with("truncated: the file has"), "{n}: {m}");
        }
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(format_msg(&longer).contains("after the"));
}

#[test]
fn every_flipped_byte_is_an_error() {
    let bytes = small_file();
    for i in 0..bytes.len() {
        for mask in [0x01u8, 0x80] {
            let mut b = bytes.clone();
            b[i] ^= mask;
            let m = format_msg(&b);
            if i >= HEADER_LEN {
                assert!(m.starts_with("checksum mismatch"), "{i}: {m}");
            }
        }
    }
}

#[test]
fn header_errors_say_what_is_wrong() {
    let bytes = small_file();
    let body = &bytes[HEADER_LEN..];
    let crc = crc32fast::hash(body);
    assert_eq!(
        format_msg(b"PK\x03\x04 a zip file"),
        "not a RustyTorch graph file (bad magic)"
    );
    assert!(format_msg(b"").starts_with("truncated"));
    assert!(format_msg(b"RTGRAPH\0").starts_with("truncated"));
    let m = format_msg(&with_header(9, body.len() as u64, crc, body));
    assert_eq!(
        m,
        format!("format version 9 is newer than this build supports ({VERSION})")
    );
    assert!(format_msg(&with_header(0, body.len() as u64, crc, body)).contains("version 0"));
    let m = format_msg(&with_header(VERSION, u64::MAX, crc, body));
    assert_eq!(
        m,
        format!(
            "truncated: header says {} body bytes, file has {}",
            u64::MAX,
            body.len()
        )
    );
    let m = format_msg(&with_header(VERSION, 1 << 40, crc, &body[..10]));
    assert_eq!(
        m,
        format!(
            "truncated: header says {} body bytes, file has 10",
            1u64 << 40
        )
    );
    assert!(
        format_msg(&with_header(VERSION, body.len() as u64, crc ^ 1, body))
            .starts_with("checksum mismatch")
    );
    // A valid checksum over garbage reaches the decoder, which refuses it.
    let junk = vec![0xffu8; 64];
    let m = format_msg(&with_header(VERSION, 64, crc32fast::hash(&junk), &junk));
    assert!(m.starts_with("malformed body"), "{m}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random bodies behind a valid header (checksum included) are refused without a panic.
    #[test]
    fn random_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let file = with_header(VERSION, body.len() as u64, crc32fast::hash(&body), &body);
        let _ = from_bytes(&file);
    }

    /// Valid bodies with a few bytes changed (checksum recomputed) load or fail cleanly; what
    /// loads is a valid graph.
    #[test]
    fn mutated_bodies_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)
    ) {
        let file = small_file();
        let mut body = file[HEADER_LEN..].to_vec();
        for (i, v) in edits {
            let i = i.index(body.len());
            body[i] = v;
        }
        let file = with_header(VERSION, body.len() as u64, crc32fast::hash(&body), &body);
        if let Ok(g) = from_bytes(&file) {
            prop_assert!(g.verify().is_ok());
        }
    }
}

#[test]
fn every_dtype_round_trips_in_graph_files_and_safetensors() {
    // Dtypes are numbered in declaration order; the ones added after format version 1 (i8, i16,
    // u16, u32, u64) come last, so older files read as before.
    assert_eq!(
        &DType::ALL[8..],
        &[DType::I8, DType::I16, DType::U16, DType::U32, DType::U64]
    );
    let mut g = Graph::new();
    let mut named = Vec::new();
    for (k, d) in DType::ALL.into_iter().enumerate() {
        let x = g.add_input(&format!("x_{d}"), t(d, &[3])).unwrap();
        let mut v =
            testing::rand_tensor(&t(DType::F64, &[2, 3]), k as u64, -100.0, 100.0).to_f64_vec();
        // Extremes: -∞ and +∞ saturate to an integer dtype's minimum and maximum.
        v[0] = f64::NEG_INFINITY;
        v[1] = f64::INFINITY;
        let value = HostTensor::from_vec(v, [2, 3]).unwrap().cast(d);
        named.push((format!("c_{d}"), value.clone()));
        let c = g.add_constant(value);
        let xf = g.add(Op::Cast { to: DType::F64 }, &[x]).unwrap();
        let cf = g.add(Op::Cast { to: DType::F64 }, &[c]).unwrap();
        let s = g.add(Op::Binary(BinaryOp::Add), &[cf, xf]).unwrap();
        g.add_output(&format!("y_{d}"), s).unwrap();
    }
    let bytes = to_bytes(&g, ParamStorage::Embedded).unwrap();
    let back = from_bytes(&bytes).unwrap();
    back.verify().unwrap();
    assert_same(&g, &back);
    assert_eq!(to_bytes(&back, ParamStorage::Embedded).unwrap(), bytes);
    // safetensors (parameter sidecars and state files) carry every dtype too.
    let st = rustytorch_compiler::format::safetensors_bytes(&named).unwrap();
    let mut read = rustytorch_compiler::format::safetensors_tensors(&st, "t.safetensors").unwrap();
    read.sort_by(|a, b| a.0.cmp(&b.0));
    named.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(read.len(), named.len());
    for ((n, a), (m, b)) in named.iter().zip(&read) {
        assert_eq!(n, m);
        assert!(same_bits(a, b), "{n}");
    }
}
