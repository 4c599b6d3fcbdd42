//! Named dims: symbolic shapes from the builder, specialization, binding, and both formats.

use rustytorch_compiler::format::{from_bytes, to_bytes, ParamStorage};
use rustytorch_compiler::{text, CompileError, ConvOpts, DimExpr, Graph, GraphBuilder, Init};
use rustytorch_ops::{DType, Shape, TensorType};

/// A small CNN over `[batch, 1, 8, 8]` images, flattened before two linear layers.
fn cnn() -> (GraphBuilder, Graph) {
    let g = GraphBuilder::new();
    let batch = g.dim("batch", 16);
    let x = g.input_dims(
        "x",
        DType::F32,
        &[batch.clone(), 1.into(), 8.into(), 8.into()],
    );
    let c = g.param("c", [4, 1, 3, 3], Init::kaiming_uniform(9, 1));
    let w = g.param("w", [64, 10], Init::kaiming_uniform(64, 2));
    let h = x.conv(&c, None, &ConvOpts::default().padding(&[1])).relu();
    let h = h.max_pool(&[2], &[2], &[0]); // [batch, 4, 4, 4]
    assert_eq!(
        h.sym_dims(),
        vec![batch.clone(), 4.into(), 4.into(), 4.into()]
    );
    let flat = h.flatten(1);
    assert_eq!(flat.sym_dims(), vec![batch.clone(), 64.into()]);
    let logits = flat.matmul(&w);
    assert_eq!(logits.sym_dims(), vec![batch.clone(), 10.into()]);
    g.output("probs", &logits.softmax(-1));
    g.output("class", &logits.argmax(-1, false));
    let graph = g.graph().unwrap();
    (g, graph)
}

fn dims(s: &str) -> Vec<DimExpr> {
    s.split(',').map(|d| DimExpr::parse(d).unwrap()).collect()
}

#[test]
fn dim_expressions_parse_print_and_divide() {
    let e = DimExpr::parse("4*seq*batch").unwrap();
    assert_eq!(e.to_string(), "4*batch*seq");
    assert_eq!(DimExpr::parse("batch").unwrap().as_name(), Some("batch"));
    assert_eq!(DimExpr::parse("12").unwrap().as_fixed(), Some(12));
    assert_eq!(
        e.div(&DimExpr::named("seq")).unwrap().to_string(),
        "4*batch"
    );
    assert!(e.div(&DimExpr::named("heads")).is_none());
    assert!(DimExpr::parse("2x").is_err() && DimExpr::parse("").is_err());
    let size = |n: &str| (n == "batch").then_some(3).or((n == "seq").then_some(5));
    assert_eq!(e.eval(&size), Some(60));
}

#[test]
fn the_builder_tracks_named_dims_through_ops() {
    let g = GraphBuilder::new();
    let b = g.dim("batch", 4);
    let s = g.dim("seq", 6);
    let x = g.input_dims("x", DType::F32, &[b.clone(), s.clone(), 8.into()]);
    let w = g.param("w", [8, 8], Init::kaiming_uniform(8, 3));
    let y = x.matmul(&w).gelu();
    assert_eq!(y.sym_dims(), dims("batch,seq,8"));
    let flat = y.reshape_infer(&[-1, 8]);
    assert_eq!(flat.sym_dims(), dims("batch*seq,8"));
    let back = flat.reshape([4, 6, 8]);
    assert_eq!(back.sym_dims(), dims("batch,seq,8"));
    let t = back.transpose(0, 1).sum(&[2], false);
    assert_eq!(t.sym_dims(), dims("seq,batch"));
    let cat = g.concat(&[&x, &x], 0);
    assert_eq!(cat.sym_dims(), dims("2*batch,seq,8"));
    let sl = x.slice(2, 0, 4, 1);
    assert_eq!(sl.sym_dims(), dims("batch,seq,4"));
    let heads = x.reshape_dims(&[b.clone(), s.clone(), 2.into(), 4.into()]);
    assert_eq!(heads.sym_dims(), dims("batch,seq,2,4"));
    g.output("t", &t);
    g.output("heads", &heads);
    g.output("cat", &cat);
    g.output("sl", &sl);
    let graph = g.graph().unwrap();
    graph.verify().unwrap();
    let at = graph.specialize(&[3, 5]).unwrap();
    assert!(at.dims.named.is_empty());
    let ty = |name: &str| {
        let id = at.outputs.iter().find(|(n, _)| n == name).unwrap().1;
        at.ty(id).clone()
    };
    assert_eq!(ty("t"), TensorType::new(DType::F32, [5, 3]));
    assert_eq!(ty("heads"), TensorType::new(DType::F32, [3, 5, 2, 4]));
    assert_eq!(ty("cat"), TensorType::new(DType::F32, [6, 5, 8]));
    assert_eq!(ty("sl"), TensorType::new(DType::F32, [3, 5, 4]));
    at.verify().unwrap();
}

#[test]
fn a_cnn_specializes_to_other_batches() {
    let (_, graph) = cnn();
    for b in [1, 5, 16, 33] {
        let at = graph.specialize(&[b]).unwrap();
        at.verify().unwrap();
        assert_eq!(at.inputs[0].ty, TensorType::new(DType::F32, [b, 1, 8, 8]));
        let probs = at.outputs[0].1;
        assert_eq!(at.ty(probs).shape, Shape::new([b, 10]));
    }
}

#[test]
fn binding_names_the_inputs_that_disagree() {
    let g = GraphBuilder::new();
    let b = g.dim("batch", 4);
    let x = g.input_dims("x", DType::F32, &[b.clone(), 3.into()]);
    let y = g.input_dims("y", DType::I64, std::slice::from_ref(&b));
    g.output("l", &x.cross_entropy(&y));
    let graph = g.graph().unwrap();
    let (sx, sy) = (Shape::new([5, 3]), Shape::new([5]));
    assert_eq!(graph.bind_dims(&[(0, &sx), (1, &sy)]).unwrap(), vec![5]);
    let sy7 = Shape::new([7]);
    let e = graph.bind_dims(&[(0, &sx), (1, &sy7)]).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, CompileError::Bind { .. }), "{m}");
    assert!(
        m.contains("input `y`") && m.contains("`batch` is 7") && m.contains("5 in input `x`"),
        "{m}"
    );
    let bad = Shape::new([5, 4]);
    let m = graph.bind_dims(&[(0, &bad)]).unwrap_err().to_string();
    assert!(m.contains("input `x`") && m.contains("f32[batch,3]"), "{m}");
    let rank = Shape::new([5]);
    assert!(graph.bind_dims(&[(0, &rank)]).is_err());
}

#[test]
fn a_shape_that_no_longer_fits_names_the_op() {
    // The reshape target is written fixed, so it holds at batch 16 only.
    let src = "graph {\n  dim batch = 16\n  %0 = input x : f32[batch,4]\n  \
               %1 = reshape[shape=64](%0) : f32[64]\n  output y = %1\n}\n";
    let graph = text::parse(src).unwrap();
    graph.specialize(&[16]).unwrap();
    let e = graph.specialize(&[5]).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, CompileError::Specialize { .. }), "{m}");
    assert!(
        m.starts_with("at batch=5: reshape") && m.contains("[5,4]"),
        "{m}"
    );
}

#[test]
fn named_dims_round_trip_through_text_and_graph_files() {
    let (_, graph) = cnn();
    let ir = text::print(&graph);
    assert!(ir.contains("  dim batch = 16\n"), "{ir}");
    assert!(ir.contains("input x : f32[batch,1,8,8]"), "{ir}");
    assert!(ir.contains(": f32[batch,64]"), "{ir}");
    let parsed = text::parse(&ir).unwrap();
    assert_eq!(text::print(&parsed), ir);
    assert_eq!(parsed.dims, {
        let mut d = graph.dims.clone();
        // The parsed graph numbers its nodes densely; compare through the text instead.
        d.shapes = parsed.dims.shapes.clone();
        d
    });
    let bytes = to_bytes(&graph, ParamStorage::Embedded).unwrap();
    let loaded = from_bytes(&bytes).unwrap();
    assert_eq!(text::print(&loaded), ir);
    let again = from_bytes(&to_bytes(&parsed, ParamStorage::Embedded).unwrap()).unwrap();
    assert_eq!(text::print(&again), ir);
    assert_eq!(
        loaded.specialize(&[5]).unwrap().inputs[0].ty,
        TensorType::new(DType::F32, [5, 1, 8, 8])
    );
}

#[test]
fn graphs_without_named_dims_print_as_before() {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [2, 3]);
    g.output("y", &x.reshape_infer(&[-1]).exp());
    let ir = text::print(&g.graph().unwrap());
    assert!(!ir.contains("dim "), "{ir}");
    assert!(
        ir.contains("input x : f32[2,3]") && ir.contains(": f32[6]"),
        "{ir}"
    );
}

#[test]
fn bad_named_dims_in_text_are_errors() {
    let err = |src: &str| text::parse(src).unwrap_err().to_string();
    let m = err("graph {\n  %0 = input x : f32[batch,4]\n}\n");
    assert!(m.contains("unknown named dim `batch`"), "{m}");
    let m = err("graph {\n  dim b = 2\n  dim b = 2\n}\n");
    assert!(m.contains("declared twice"), "{m}");
    let m = err("graph {\n  dim b = 0\n}\n");
    assert!(m.contains("default size 0"), "{m}");
    let m = err("graph {\n  dim b = 2\n  %0 = param w : f32[b] = full(0.0)\n}\n");
    assert!(m.contains("bad dimension"), "{m}");
    // A written type that disagrees with the op at the default sizes.
    let m = err("graph {\n  dim b = 2\n  %0 = input x : f32[b,4]\n  %1 = exp(%0) : f32[4,b]\n}\n");
    assert!(m.contains("f32[4,b]"), "{m}");
    let m = err("graph {\n  %0 = input x : f32[2]\n  dim b = 2\n}\n");
    assert!(m.contains("before the first node"), "{m}");
}

#[test]
fn a_parameter_cannot_take_a_named_dim() {
    let g = GraphBuilder::new();
    let b = g.dim("batch", 4);
    let x = g.input_dims("x", DType::F32, &[b.clone(), 3.into()]);
    g.output("y", &x.exp());
    let mut graph = g.graph().unwrap();
    let p = graph
        .add_param("w", TensorType::new(DType::F32, [4]), Init::zeros(), true)
        .unwrap();
    graph.set_sym_shape(p, vec![b]).unwrap();
    let m = graph.verify().unwrap_err().to_string();
    assert!(m.contains("param") && m.contains("fixed shapes"), "{m}");
}

#[test]
fn a_split_product_follows_its_names_or_stays_fixed() {
    // Embedding-style: ids [batch, seq] flattened, rows gathered, then split back.
    let split = |b: usize, s: usize| {
        let g = GraphBuilder::new();
        let bd = g.dim("batch", b);
        let sd = g.dim("seq", s);
        let x = g.input_dims("x", DType::F32, &[bd, sd, 8.into()]);
        let flat = x.reshape_infer(&[-1, 8]);
        flat.reshape([b, s, 8]).sym_dims()
    };
    assert_eq!(split(2, 3), dims("batch,seq,8"));
    assert_eq!(split(3, 2), dims("batch,seq,8"));
    // Same default sizes: which name is which cannot be told, so the shape stays fixed.
    assert_eq!(split(4, 4), dims("4,4,8"));
}

#[test]
fn generated_leaves_can_follow_named_dims() {
    // A causal mask over a named sequence length: iota rows >= iota columns.
    let g = GraphBuilder::new();
    let s = g.dim("seq", 5);
    let x = g.input_dims("x", DType::F32, &[s.clone(), s.clone()]);
    let rows = g.iota_dims(0, DType::I64, &[s.clone(), s.clone()]);
    let cols = g.iota_dims(1, DType::I64, &[s.clone(), s.clone()]);
    let mask = rows.ge(&cols);
    let neg = g.full_dims(-1e9, DType::F32, &[s.clone(), s.clone()]);
    let y = g.where_(&mask, &x, &neg).softmax(-1);
    assert_eq!(y.sym_dims(), dims("seq,seq"));
    g.output("y", &y);
    let graph = g.graph().unwrap();
    let at = graph.specialize(&[7]).unwrap();
    assert_eq!(at.ty(at.outputs[0].1).shape, Shape::new([7, 7]));
    let ir = text::print(&graph);
    assert!(
        ir.contains(": i64[seq,seq]") && ir.contains(": f32[seq,seq]"),
        "{ir}"
    );
    assert_eq!(text::print(&text::parse(&ir).unwrap()), ir);
    let m = g.full_dims(0.0, DType::F32, &[DimExpr::named("heads")]);
    assert!(m.id().is_none());
    let e = g.check().unwrap_err().to_string();
    assert!(e.contains("heads"), "{e}");
}
