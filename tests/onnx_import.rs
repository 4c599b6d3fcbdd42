//! The ONNX importer end to end, on models built here with the protobuf types: weights become
//! parameters, shape subgraphs fold at import, symbolic dims take the sizes given, external data
//! is read from beside the model, and what cannot be imported (an op, an attribute, a malformed
//! or hostile file) is an error that says what and where, never a panic. The runner's `import`,
//! and `run`/`inspect` on `.onnx` files, are checked at the end.

use prost::Message;
use rustytorch::ops::testing::{assert_close, rand_tensor};
use rustytorch::{CompileOptions, DType, Device, HostTensor, TensorType};
use rustytorch_onnx::proto::{
    attribute_proto::AttributeType, tensor_proto::DataType, tensor_shape_proto, type_proto,
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, StringStringEntryProto,
    TensorProto, TensorShapeProto, TypeProto, ValueInfoProto,
};
use rustytorch_onnx::{import_bytes, import_file, ImportError, ImportOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("onnx-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A tensor value info with fixed (`Ok`) or symbolic (`Err`) dims.
fn value_info(name: &str, elem: DataType, dims: &[Result<i64, &str>]) -> ValueInfoProto {
    use tensor_shape_proto::{dimension::Value, Dimension};
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem as i32),
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|d| Dimension {
                            value: Some(match d {
                                Ok(n) => Value::DimValue(*n),
                                Err(p) => Value::DimParam(p.to_string()),
                            }),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn f32_info(name: &str, dims: &[i64]) -> ValueInfoProto {
    let d: Vec<Result<i64, &str>> = dims.iter().map(|&n| Ok(n)).collect();
    value_info(name, DataType::Float, &d)
}

fn f32_init(name: &str, t: &HostTensor) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: t.dims().iter().map(|&d| d as i64).collect(),
        data_type: Some(DataType::Float as i32),
        float_data: t.to_vec::<f32>().unwrap(),
        ..Default::default()
    }
}

fn i64_init(name: &str, v: &[i64]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: vec![v.len() as i64],
        data_type: Some(DataType::Int64 as i32),
        raw_data: Some(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        ..Default::default()
    }
}

fn node(op: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<AttributeProto>) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        attribute: attrs,
        ..Default::default()
    }
}

fn int_attr(name: &str, v: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Int as i32),
        i: Some(v),
        ..Default::default()
    }
}

fn model(
    nodes: Vec<NodeProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    inits: Vec<TensorProto>,
) -> ModelProto {
    ModelProto {
        ir_version: Some(9),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(17),
        }],
        graph: Some(GraphProto {
            name: Some("test".into()),
            node: nodes,
            input: inputs,
            output: outputs,
            initializer: inits,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn run(graph: &rustytorch::compiler::Graph, inputs: &[(&str, HostTensor)]) -> Vec<HostTensor> {
    let mut exe =
        rustytorch::compile_graph(graph, Device::Cpu, &CompileOptions::inference()).unwrap();
    let outs = exe.run(inputs).unwrap();
    outs.iter().map(|(_, t)| t.clone()).collect()
}

fn f32t(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

/// Row-major `[m,k]·[k,n]` in f64.
fn matmul_ref(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    out
}

/// An MLP as an exporter writes it: MatMul + Add + Relu, then Gemm with transB.
fn mlp_model(batch: Result<i64, &str>) -> (ModelProto, [HostTensor; 4]) {
    let w1 = rand_tensor(&f32t(&[4, 5]), 1, -1.0, 1.0);
    let b1 = rand_tensor(&f32t(&[5]), 2, -1.0, 1.0);
    let w2 = rand_tensor(&f32t(&[3, 5]), 3, -1.0, 1.0);
    let b2 = rand_tensor(&f32t(&[3]), 4, -1.0, 1.0);
    let m = model(
        vec![
            node("MatMul", &["x", "w1"], &["h0"], vec![]),
            node("Add", &["h0", "b1"], &["h1"], vec![]),
            node("Relu", &["h1"], &["h"], vec![]),
            node(
                "Gemm",
                &["h", "w2", "b2"],
                &["y"],
                vec![int_attr("transB", 1)],
            ),
        ],
        vec![value_info("x", DataType::Float, &[batch, Ok(4)])],
        vec![f32_info("y", &[])],
        vec![
            f32_init("w1", &w1),
            f32_init("b1", &b1),
            f32_init("w2", &w2),
            f32_init("b2", &b2),
        ],
    );
    (m, [w1, b1, w2, b2])
}

fn mlp_ref(x: &[f64], n: usize, w: &[HostTensor; 4]) -> Vec<f64> {
    let [w1, b1, w2, b2] = w.clone().map(|t| t.to_f64_vec());
    let mut h = matmul_ref(x, &w1, n, 4, 5);
    for (i, v) in h.iter_mut().enumerate() {
        *v = (*v + b1[i % 5]).max(0.0);
    }
    // w2 is [3, 5] used transposed.
    let mut w2t = vec![0.0; 15];
    for i in 0..3 {
        for j in 0..5 {
            w2t[j * 3 + i] = w2[i * 5 + j];
        }
    }
    let mut y = matmul_ref(&h, &w2t, n, 5, 3);
    for (i, v) in y.iter_mut().enumerate() {
        *v += b2[i % 3];
    }
    y
}

#[test]
fn mlp_weights_become_parameters_and_values_match_f64() {
    let (m, w) = mlp_model(Ok(2));
    let g = import_bytes(&m.encode_to_vec(), None, &ImportOptions::default()).unwrap();
    let names: Vec<&str> = g.params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["w1", "b1", "w2", "b2"]);
    assert!(g.params.iter().all(|p| p.trainable && p.data.is_some()));
    assert_eq!(g.param_count(), 20 + 5 + 15 + 3);
    let x = rand_tensor(&f32t(&[2, 4]), 9, -2.0, 2.0);
    let y = &run(&g, &[("x", x.clone())])[0];
    assert_eq!(y.dims(), &[2, 3]);
    assert_close(&y.to_f64_vec(), &mlp_ref(&x.to_f64_vec(), 2, &w), 1e-5, "y");
}

#[test]
fn symbolic_dims_become_named_dims() {
    let (m, w) = mlp_model(Err("batch"));
    let bytes = m.encode_to_vec();
    // A named dim of default size 1: one executable runs every batch size.
    let g = import_bytes(&bytes, None, &ImportOptions::default()).unwrap();
    assert!(g.has_named_dims());
    assert_eq!(g.inputs[0].ty.shape.dims(), &[1, 4]);
    assert_eq!(g.sym_type_text(g.inputs[0].node), "f32[batch,4]");
    let mut exe = rustytorch::compile_graph(&g, Device::Cpu, &CompileOptions::inference()).unwrap();
    for n in [1, 5, 16] {
        let x = rand_tensor(&f32t(&[n, 4]), 10 + n as u64, -2.0, 2.0);
        let y = exe.run(&[("x", x.clone())]).unwrap()[0].clone();
        assert_eq!(y.dims(), &[n, 3]);
        assert_close(&y.to_f64_vec(), &mlp_ref(&x.to_f64_vec(), n, &w), 1e-5, "y");
    }
    // --dim sets the default size.
    let g = import_bytes(&bytes, None, &ImportOptions::default().dim("batch", 3)).unwrap();
    assert_eq!(g.inputs[0].ty.shape.dims(), &[3, 4]);
    // Fixed dims: the size must be given.
    let fixed = ImportOptions {
        fixed_dims: true,
        ..Default::default()
    };
    let msg = import_bytes(&bytes, None, &fixed).unwrap_err().to_string();
    assert!(
        msg.contains("`batch`") && msg.contains("--dim batch=N"),
        "{msg}"
    );
    let g = import_bytes(&bytes, None, &fixed.clone().dim("batch", 5)).unwrap();
    assert!(!g.has_named_dims());
    let x = rand_tensor(&f32t(&[5, 4]), 15, -2.0, 2.0);
    let y = &run(&g, &[("x", x.clone())])[0];
    assert_close(&y.to_f64_vec(), &mlp_ref(&x.to_f64_vec(), 5, &w), 1e-5, "y");
}

/// `y = reshape(x, [shape(x)[0], -1])` spelled as exporters do: Shape, Gather, Unsqueeze, Concat.
#[test]
fn shape_subgraphs_fold_at_import() {
    let idx = TensorProto {
        name: Some("zero".into()),
        data_type: Some(DataType::Int64 as i32),
        int64_data: vec![0],
        ..Default::default()
    };
    let m = model(
        vec![
            node("Shape", &["x"], &["s"], vec![]),
            node("Gather", &["s", "zero"], &["n"], vec![int_attr("axis", 0)]),
            node("Unsqueeze", &["n", "ax0"], &["n1"], vec![]),
            node(
                "Concat",
                &["n1", "minus1"],
                &["target"],
                vec![int_attr("axis", 0)],
            ),
            node("Reshape", &["x", "target"], &["flat"], vec![]),
            node("Exp", &["flat"], &["y"], vec![]),
        ],
        vec![f32_info("x", &[3, 2, 4])],
        vec![f32_info("y", &[])],
        vec![idx, i64_init("ax0", &[0]), i64_init("minus1", &[-1])],
    );
    let g = import_bytes(&m.encode_to_vec(), None, &ImportOptions::default()).unwrap();
    let ops: Vec<&str> = g
        .topo_order()
        .unwrap()
        .into_iter()
        .map(|id| g.node(id).unwrap().op.name())
        .collect();
    assert_eq!(
        ops,
        ["input", "reshape", "exp"],
        "the shape arithmetic is folded"
    );
    let x = rand_tensor(&f32t(&[3, 2, 4]), 5, -1.0, 1.0);
    let y = &run(&g, &[("x", x.clone())])[0];
    assert_eq!(y.dims(), &[3, 8]);
    let want: Vec<f64> = x.to_f64_vec().iter().map(|v| v.exp()).collect();
    assert_close(&y.to_f64_vec(), &want, 1e-6, "y");
}

#[test]
fn conv_pool_softmax_block_matches_f64() {
    // Conv 3×3 (pads 1) + Relu + MaxPool 2×2 + Flatten + Softmax, against a direct f64 loop.
    let w = rand_tensor(&f32t(&[2, 1, 3, 3]), 21, -1.0, 1.0);
    let pads = AttributeProto {
        name: Some("pads".into()),
        r#type: Some(AttributeType::Ints as i32),
        ints: vec![1, 1, 1, 1],
        ..Default::default()
    };
    let ks = AttributeProto {
        name: Some("kernel_shape".into()),
        r#type: Some(AttributeType::Ints as i32),
        ints: vec![2, 2],
        ..Default::default()
    };
    let strides = AttributeProto {
        name: Some("strides".into()),
        ints: vec![2, 2],
        r#type: Some(AttributeType::Ints as i32),
        ..Default::default()
    };
    let m = model(
        vec![
            node("Conv", &["x", "w"], &["c"], vec![pads]),
            node("Relu", &["c"], &["r"], vec![]),
            node("MaxPool", &["r"], &["p"], vec![ks, strides]),
            node("Flatten", &["p"], &["f"], vec![]),
            node("Softmax", &["f"], &["y"], vec![]),
        ],
        vec![f32_info("x", &[1, 1, 4, 4])],
        vec![f32_info("y", &[])],
        vec![f32_init("w", &w)],
    );
    let g = import_bytes(&m.encode_to_vec(), None, &ImportOptions::default()).unwrap();
    let x = rand_tensor(&f32t(&[1, 1, 4, 4]), 22, -1.0, 1.0);
    let y = &run(&g, &[("x", x.clone())])[0];
    let (xv, wv) = (x.to_f64_vec(), w.to_f64_vec());
    let mut conv = vec![0.0; 2 * 16];
    for o in 0..2 {
        for i in 0..4i64 {
            for j in 0..4i64 {
                let mut s = 0.0;
                for a in 0..3i64 {
                    for b in 0..3i64 {
                        let (yi, xj) = (i + a - 1, j + b - 1);
                        if (0..4).contains(&yi) && (0..4).contains(&xj) {
                            s += xv[(yi * 4 + xj) as usize] * wv[o * 9 + (a * 3 + b) as usize];
                        }
                    }
                }
                conv[o * 16 + (i * 4 + j) as usize] = s.max(0.0);
            }
        }
    }
    let mut pooled = Vec::new();
    for o in 0..2 {
        for i in 0..2 {
            for j in 0..2 {
                let mut m = f64::NEG_INFINITY;
                for a in 0..2 {
                    for b in 0..2 {
                        m = m.max(conv[o * 16 + (2 * i + a) * 4 + 2 * j + b]);
                    }
                }
                pooled.push(m);
            }
        }
    }
    let mx = pooled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = pooled.iter().map(|v| (v - mx).exp()).sum();
    let want: Vec<f64> = pooled.iter().map(|v| (v - mx).exp() / z).collect();
    assert_eq!(y.dims(), &[1, 8]);
    assert_close(&y.to_f64_vec(), &want, 1e-5, "y");
}

#[test]
fn external_data_is_read_from_beside_the_model() {
    let dir = scratch("external");
    let w = rand_tensor(&f32t(&[3, 2]), 31, -1.0, 1.0);
    let bytes: Vec<u8> = w
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let mut file = vec![0u8; 16]; // the data starts at offset 16
    file.extend_from_slice(&bytes);
    std::fs::write(dir.join("weights.bin"), &file).unwrap();
    let kv = |k: &str, v: &str| StringStringEntryProto {
        key: Some(k.into()),
        value: Some(v.into()),
    };
    let ext = |location: &str| TensorProto {
        name: Some("w".into()),
        dims: vec![3, 2],
        data_type: Some(DataType::Float as i32),
        data_location: Some(1),
        external_data: vec![
            kv("location", location),
            kv("offset", "16"),
            kv("length", "24"),
        ],
        ..Default::default()
    };
    let mk = |location: &str| {
        model(
            vec![node("MatMul", &["x", "w"], &["y"], vec![])],
            vec![f32_info("x", &[1, 3])],
            vec![f32_info("y", &[])],
            vec![ext(location)],
        )
    };
    let path = dir.join("m.onnx");
    std::fs::write(&path, mk("weights.bin").encode_to_vec()).unwrap();
    let g = import_file(&path, &ImportOptions::default()).unwrap();
    assert_eq!(g.params[0].data.as_ref().unwrap(), &w);

    for (location, want) in [
        ("../weights.bin", "relative path inside"),
        ("/etc/passwd", "relative path inside"),
        ("missing.bin", "missing.bin"),
    ] {
        std::fs::write(&path, mk(location).encode_to_vec()).unwrap();
        let e = import_file(&path, &ImportOptions::default()).unwrap_err();
        assert!(e.to_string().contains(want), "{location}: {e}");
    }
    // Without a folder there is nothing to read external data from.
    let e = import_bytes(
        &mk("weights.bin").encode_to_vec(),
        None,
        &Default::default(),
    );
    assert!(e.unwrap_err().to_string().contains("model's folder"));
}

#[test]
fn unsupported_ops_and_attributes_name_the_node() {
    let mk = |n: NodeProto| {
        model(
            vec![n],
            vec![f32_info("x", &[2, 3])],
            vec![f32_info("y", &[])],
            vec![],
        )
    };
    let mut n = node("NonMaxSuppression", &["x"], &["y"], vec![]);
    n.name = Some("nms_1".into());
    let e = import_bytes(&mk(n).encode_to_vec(), None, &Default::default()).unwrap_err();
    assert!(matches!(e, ImportError::Node { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains("`nms_1`") && msg.contains("NonMaxSuppression"),
        "{msg}"
    );

    let n = node("Relu", &["x"], &["y"], vec![int_attr("bogus", 1)]);
    let msg = import_bytes(&mk(n).encode_to_vec(), None, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("(Relu)") && msg.contains("attribute `bogus`"),
        "{msg}"
    );

    let n = node(
        "MaxPool",
        &["x"],
        &["y"],
        vec![int_attr("storage_order", 1)],
    );
    let msg = import_bytes(&mk(n).encode_to_vec(), None, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("(MaxPool)"), "{msg}");

    let mut n = node("Relu", &["x"], &["y"], vec![]);
    n.domain = Some("com.example".into());
    let msg = import_bytes(&mk(n).encode_to_vec(), None, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("com.example"), "{msg}");
}

#[test]
fn malformed_and_hostile_models_are_errors() {
    let (m, _) = mlp_model(Ok(2));
    let bytes = m.encode_to_vec();
    // Every truncation, and bytes flipped at many offsets: an error or a graph, never a panic.
    for cut in (0..bytes.len()).step_by(7) {
        let _ = import_bytes(&bytes[..cut], None, &Default::default());
    }
    for k in (0..bytes.len()).step_by(5) {
        let mut b = bytes.clone();
        b[k] ^= 0xa5;
        let _ = import_bytes(&b, None, &Default::default());
    }
    let e = import_bytes(b"\xff\xff\xff\xff not a model", None, &Default::default());
    assert!(matches!(e, Err(ImportError::Decode(_))), "{e:?}");

    // A tensor claiming far more elements than its data: rejected before any allocation.
    let mut huge = f32_init("w1", &rand_tensor(&f32t(&[4, 5]), 1, -1.0, 1.0));
    huge.dims = vec![1 << 40, 1 << 30];
    let mut m2 = m.clone();
    m2.graph.as_mut().unwrap().initializer[0] = huge;
    let msg = import_bytes(&m2.encode_to_vec(), None, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("too large"), "{msg}");

    // Raw data of the wrong length.
    let mut short = i64_init("w1", &[1, 2, 3]);
    short.dims = vec![4];
    let mut m3 = m.clone();
    m3.graph.as_mut().unwrap().initializer[0] = short;
    let msg = import_bytes(&m3.encode_to_vec(), None, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("raw data"), "{msg}");

    // No opset, an old opset, no graph.
    let mut m4 = m.clone();
    m4.opset_import.clear();
    assert!(import_bytes(&m4.encode_to_vec(), None, &Default::default()).is_err());
    m4.opset_import = vec![OperatorSetIdProto {
        domain: Some(String::new()),
        version: Some(3),
    }];
    let msg = import_bytes(&m4.encode_to_vec(), None, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("opset 3"), "{msg}");
    let mut m5 = m;
    m5.graph = None;
    assert!(import_bytes(&m5.encode_to_vec(), None, &Default::default()).is_err());
}

fn cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_rustytorch"))
        .args(args)
        .output()
        .expect("the rustytorch binary runs")
}

#[test]
fn runner_imports_runs_and_inspects_onnx() {
    let dir = scratch("cli");
    let (m, w) = mlp_model(Err("batch"));
    let path = dir.join("mlp.onnx");
    std::fs::write(&path, m.encode_to_vec()).unwrap();
    let p = |x: &Path| x.to_str().unwrap().to_string();

    // import with --dim, then run the graph file.
    let rtg = dir.join("mlp.rtg");
    let o = cli(&["import", &p(&path), "-o", &p(&rtg), "--dim", "batch=3"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let g = rustytorch::compiler::format::load(&rtg).unwrap();
    assert_eq!(g.inputs[0].ty.shape.dims(), &[3, 4]);

    // run takes the .onnx directly; the batch comes from the input file.
    let x = rand_tensor(&f32t(&[5, 4]), 41, -1.0, 1.0);
    rustytorch::npy::write_npy(&dir.join("x.npy"), &x).unwrap();
    let out = dir.join("out");
    let o = cli(&[
        "run",
        &p(&path),
        "--input",
        &format!("x={}", p(&dir.join("x.npy"))),
        "--out",
        &p(&out),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let y = rustytorch::npy::read_npy(&out.join("y.npy")).unwrap();
    assert_close(&y.to_f64_vec(), &mlp_ref(&x.to_f64_vec(), 5, &w), 1e-5, "y");

    // inspect prints the IR, the named dim in it.
    let o = cli(&["inspect", &p(&path)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("matmul") && out.contains("batch"), "{out}");

    // Without --dim the batch is a named dim (default 1) in the graph file and its IR text.
    let rtir = dir.join("mlp.rtir");
    let o = cli(&["import", &p(&path), "-o", &p(&rtir)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&rtir).unwrap();
    assert!(text.contains("f32[batch,4]"), "{text}");

    // A malformed file.
    std::fs::write(dir.join("bad.onnx"), b"garbage").unwrap();
    let o = cli(&["inspect", &p(&dir.join("bad.onnx"))]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a valid ONNX model"));

    let o = cli(&["import", "--supported-ops"]);
    assert!(String::from_utf8_lossy(&o.stdout)
        .lines()
        .any(|l| l == "Conv"));
}

/// GELU as PyTorch exports it (`x/√2`, Erf, `+1`, `·x`, `·0.5`): the scalars stay constants, and
/// the optimizer recognizes the whole as one `gelu`.
#[test]
fn exported_erf_gelu_is_recognized() {
    let scalar = |name: &str, v: f32| TensorProto {
        name: Some(name.into()),
        data_type: Some(DataType::Float as i32),
        float_data: vec![v],
        ..Default::default()
    };
    let m = model(
        vec![
            node("Div", &["x", "sqrt2"], &["a"], vec![]),
            node("Erf", &["a"], &["e"], vec![]),
            node("Add", &["e", "one"], &["e1"], vec![]),
            node("Mul", &["x", "e1"], &["p"], vec![]),
            node("Mul", &["p", "half"], &["y"], vec![]),
        ],
        vec![f32_info("x", &[4, 6])],
        vec![f32_info("y", &[])],
        vec![
            scalar("sqrt2", std::f32::consts::SQRT_2),
            scalar("one", 1.0),
            scalar("half", 0.5),
        ],
    );
    let g = import_bytes(&m.encode_to_vec(), None, &ImportOptions::default()).unwrap();
    assert!(g.params.is_empty(), "scalars are constants, not parameters");
    let mut exe = rustytorch::compile_graph(&g, Device::Cpu, &CompileOptions::inference()).unwrap();
    let ir = rustytorch::compiler::text::print(exe.optimized_graph());
    assert!(ir.contains("gelu") && !ir.contains("erf"), "{ir}");
    let x = rand_tensor(&f32t(&[4, 6]), 51, -4.0, 4.0);
    let y = exe.run(&[("x", x.clone())]).unwrap()[0].clone();
    let want: Vec<f64> = x
        .to_f64_vec()
        .iter()
        .map(|&v| 0.5 * v * (1.0 + rustytorch::ops::elementwise::erf(v / 2f64.sqrt())))
        .collect();
    assert_close(&y.to_f64_vec(), &want, 1e-5, "y");
}

/// MaxPool with dilation 2 and its Indices output (flattened `(n·C + c)·H·W + h·W + w`),
/// against a direct loop; AveragePool with the same dilation and uneven padding.
#[test]
fn dilated_pooling_and_max_indices_match_f64() {
    let ints = |name: &str, v: &[i64]| AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Ints as i32),
        ints: v.to_vec(),
        ..Default::default()
    };
    let attrs = |pads: &[i64]| {
        vec![
            ints("kernel_shape", &[2, 2]),
            ints("dilations", &[2, 2]),
            ints("pads", pads),
        ]
    };
    let m = model(
        vec![
            node("MaxPool", &["x"], &["y", "i"], attrs(&[0, 0, 0, 0])),
            node("AveragePool", &["x"], &["a"], attrs(&[1, 0, 0, 1])),
        ],
        vec![f32_info("x", &[1, 2, 5, 5])],
        vec![f32_info("y", &[]), f32_info("i", &[]), f32_info("a", &[])],
        vec![],
    );
    let g = import_bytes(&m.encode_to_vec(), None, &ImportOptions::default()).unwrap();
    let x = rand_tensor(&f32t(&[1, 2, 5, 5]), 61, -1.0, 1.0);
    let outs = run(&g, &[("x", x.clone())]);
    let xv = x.to_f64_vec();
    let (mut y, mut idx, mut avg) = (vec![], vec![], vec![]);
    for c in 0..2 {
        for h in 0..3 {
            for w in 0..3 {
                let mut best = (f64::NEG_INFINITY, 0usize);
                for (a, b) in [(0, 0), (0, 2), (2, 0), (2, 2)] {
                    let at = c * 25 + (h + a) * 5 + w + b;
                    if xv[at] > best.0 {
                        best = (xv[at], at);
                    }
                }
                y.push(best.0);
                idx.push(best.1 as f64);
            }
        }
        // Pads: one row on top, one column on the right: the padded input is 6×6, out 4×4.
        for h in 0..4i64 {
            for w in 0..4i64 {
                let (mut s, mut n) = (0.0, 0.0);
                for (a, b) in [(0, 0), (0, 2), (2, 0), (2, 2)] {
                    let (hh, ww) = (h + a - 1, w + b);
                    if (0..5).contains(&hh) && (0..5).contains(&ww) {
                        s += xv[c * 25 + (hh * 5 + ww) as usize];
                        n += 1.0;
                    }
                }
                avg.push(s / n);
            }
        }
    }
    assert_close(&outs[0].to_f64_vec(), &y, 1e-6, "y");
    assert_eq!(outs[1].dtype(), DType::I64);
    assert_eq!(outs[1].to_f64_vec(), idx);
    assert_close(&outs[2].to_f64_vec(), &avg, 1e-6, "a");
}

/// ConvTranspose (1-D, stride 2, uneven pads, output padding, bias) against the scatter form
/// `y[o, s·i + k] += x[c, i]·w[c, o, k]`, then cropped.
#[test]
fn conv_transpose_matches_f64() {
    let ints = |name: &str, v: &[i64]| AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Ints as i32),
        ints: v.to_vec(),
        ..Default::default()
    };
    let w = rand_tensor(&f32t(&[2, 3, 3]), 71, -1.0, 1.0);
    let b = rand_tensor(&f32t(&[3]), 72, -1.0, 1.0);
    let m = model(
        vec![node(
            "ConvTranspose",
            &["x", "w", "b"],
            &["y"],
            vec![
                ints("strides", &[2]),
                ints("pads", &[1, 0]),
                ints("output_padding", &[1]),
            ],
        )],
        vec![f32_info("x", &[1, 2, 4])],
        vec![f32_info("y", &[])],
        vec![f32_init("w", &w), f32_init("b", &b)],
    );
    let g = import_bytes(&m.encode_to_vec(), None, &ImportOptions::default()).unwrap();
    let x = rand_tensor(&f32t(&[1, 2, 4]), 73, -1.0, 1.0);
    let y = &run(&g, &[("x", x.clone())])[0];
    let (xv, wv, bv) = (x.to_f64_vec(), w.to_f64_vec(), b.to_f64_vec());
    // Full length 2·(4 − 1) + 1 + 3 = 10; pads drop the first element.
    let mut full = vec![0.0; 3 * 10];
    for c in 0..2 {
        for o in 0..3 {
            for i in 0..4 {
                for k in 0..3 {
                    full[o * 10 + 2 * i + k] += xv[c * 4 + i] * wv[(c * 3 + o) * 3 + k];
                }
            }
        }
    }
    let want: Vec<f64> = (0..3)
        .flat_map(|o| (1..10).map(move |j| (o, j)))
        .map(|(o, j)| full[o * 10 + j] + bv[o])
        .collect();
    assert_eq!(y.dims(), &[1, 3, 9]);
    assert_close(&y.to_f64_vec(), &want, 1e-5, "y");
}

/// A direct einsum in f64: sums the product of the operands over every assignment of the
/// letters.
fn einsum_ref(eq: &str, ops: &[(&[usize], Vec<f64>)]) -> (Vec<usize>, Vec<f64>) {
    let (lhs, out) = eq.split_once("->").unwrap();
    let terms: Vec<Vec<char>> = lhs.split(',').map(|t| t.chars().collect()).collect();
    let mut letters: Vec<char> = Vec::new();
    let mut size = std::collections::HashMap::new();
    for (t, (dims, _)) in terms.iter().zip(ops) {
        for (k, &c) in t.iter().enumerate() {
            size.insert(c, dims[k]);
            if !letters.contains(&c) {
                letters.push(c);
            }
        }
    }
    let out: Vec<char> = out.chars().collect();
    let odims: Vec<usize> = out.iter().map(|c| size[c]).collect();
    let mut res = vec![0.0; odims.iter().product()];
    let total: usize = letters.iter().map(|c| size[c]).product();
    for flat in 0..total {
        let mut rem = flat;
        let mut val = std::collections::HashMap::new();
        for &c in letters.iter().rev() {
            val.insert(c, rem % size[&c]);
            rem /= size[&c];
        }
        let at = |t: &[char]| t.iter().fold(0, |a, c| a * size[c] + val[c]);
        let p: f64 = terms.iter().zip(ops).map(|(t, (_, v))| v[at(t)]).product();
        res[at(&out)] += p;
    }
    (odims, res)
}

/// Einsum lowered to permutes, reshapes, sums and batched matmuls, against the direct sum.
#[test]
fn einsum_matches_f64() {
    let cases: &[(&str, &[&[usize]])] = &[
        ("bij,bjk->bik", &[&[2, 3, 4], &[2, 4, 5]]),
        ("ij->ji", &[&[3, 4]]),
        ("ij->", &[&[3, 4]]),
        ("bhid,bhjd->bhij", &[&[1, 2, 3, 4], &[1, 2, 5, 4]]),
        ("i,i->", &[&[6], &[6]]),
        ("ij,jk,kl->il", &[&[2, 3], &[3, 4], &[4, 2]]),
        ("ik,jk->kij", &[&[2, 3], &[4, 3]]),
        ("abc,cd->bd", &[&[2, 3, 4], &[4, 5]]),
        ("...ij,...jk->...ik", &[&[2, 3, 4], &[2, 4, 5]]),
        ("...ij->...ji", &[&[2, 2, 3, 4]]),
    ];
    // The reference spells ellipses with letters.
    let spelled = |eq: &str, rank: usize| {
        let e = rank.saturating_sub(2);
        eq.replace("...", &"PQRS"[..e])
    };
    for (n, &(eq, shapes)) in cases.iter().enumerate() {
        let names: Vec<String> = (0..shapes.len()).map(|k| format!("x{k}")).collect();
        let refs: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let attr = AttributeProto {
            name: Some("equation".into()),
            r#type: Some(AttributeType::String as i32),
            s: Some(eq.as_bytes().to_vec()),
            ..Default::default()
        };
        let inputs = shapes
            .iter()
            .zip(&names)
            .map(|(d, name)| f32_info(name, &d.iter().map(|&v| v as i64).collect::<Vec<_>>()))
            .collect();
        let m = model(
            vec![node("Einsum", &refs, &["y"], vec![attr])],
            inputs,
            vec![f32_info("y", &[])],
            vec![],
        );
        let g = import_bytes(&m.encode_to_vec(), None, &ImportOptions::default())
            .unwrap_or_else(|e| panic!("{eq}: {e}"));
        let xs: Vec<HostTensor> = shapes
            .iter()
            .enumerate()
            .map(|(k, d)| rand_tensor(&f32t(d), 80 + 10 * n as u64 + k as u64, -1.0, 1.0))
            .collect();
        let feeds: Vec<(&str, HostTensor)> = names
            .iter()
            .map(|s| s.as_str())
            .zip(xs.iter().cloned())
            .collect();
        let y = &run(&g, &feeds)[0];
        let ops: Vec<(&[usize], Vec<f64>)> = shapes
            .iter()
            .zip(&xs)
            .map(|(d, x)| (*d, x.to_f64_vec()))
            .collect();
        let (dims, want) = einsum_ref(&spelled(eq, shapes[0].len()), &ops);
        assert_eq!(y.dims(), dims.as_slice(), "{eq}");
        assert_close(&y.to_f64_vec(), &want, 1e-5, eq);
    }
}

/// Hostile sizes in attributes and constant inputs: errors (or graph nodes computed at run
/// time), never a panic or an allocation of their size at import.
#[test]
fn hostile_sizes_are_errors_not_allocations() {
    let i64s = |name: &str, v: &[i64]| i64_init(name, v);
    let ints = |name: &str, v: &[i64]| AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Ints as i32),
        ints: v.to_vec(),
        ..Default::default()
    };
    let x = || vec![f32_info("x", &[2, 3])];
    let cases: Vec<(&str, ModelProto)> = vec![
        (
            "ConstantOfShape of 2^38 elements",
            model(
                vec![
                    node("ConstantOfShape", &["shape"], &["c"], vec![]),
                    node("Add", &["c", "x"], &["y"], vec![]),
                ],
                x(),
                vec![f32_info("y", &[])],
                vec![i64s("shape", &[1 << 19, 1 << 19, 3])],
            ),
        ),
        (
            "Range of 2^40 elements",
            model(
                vec![node("Range", &["s", "l", "d"], &["y"], vec![])],
                x(),
                vec![f32_info("y", &[])],
                vec![i64s("s", &[0]), i64s("l", &[1 << 40]), i64s("d", &[1])],
            ),
        ),
        (
            "Slice with step i64::MIN",
            model(
                vec![node(
                    "Slice",
                    &["x", "st", "en", "ax", "sp"],
                    &["y"],
                    vec![],
                )],
                x(),
                vec![f32_info("y", &[])],
                vec![
                    i64s("st", &[-1]),
                    i64s("en", &[i64::MIN]),
                    i64s("ax", &[1]),
                    i64s("sp", &[i64::MIN]),
                ],
            ),
        ),
        (
            "edge padding of 2^62",
            model(
                vec![node(
                    "Pad",
                    &["x", "p"],
                    &["y"],
                    vec![AttributeProto {
                        name: Some("mode".into()),
                        r#type: Some(AttributeType::String as i32),
                        s: Some(b"edge".to_vec()),
                        ..Default::default()
                    }],
                )],
                x(),
                vec![f32_info("y", &[])],
                vec![i64s("p", &[0, 1 << 62, 0, 0])],
            ),
        ),
        (
            "MaxPool with a 2^62 kernel",
            model(
                vec![node(
                    "MaxPool",
                    &["x4"],
                    &["y"],
                    vec![
                        ints("kernel_shape", &[1 << 62, 1 << 62]),
                        ints("dilations", &[3, 3]),
                    ],
                )],
                vec![f32_info("x4", &[1, 1, 4, 4])],
                vec![f32_info("y", &[])],
                vec![],
            ),
        ),
    ];
    for (what, m) in cases {
        // Either outcome is fine as long as it returns: the point is no panic and no huge
        // allocation.
        let r = std::panic::catch_unwind(|| {
            import_bytes(&m.encode_to_vec(), None, &ImportOptions::default()).map(|_| ())
        });
        assert!(r.is_ok(), "{what}: the import panicked");
    }
}
