//! The IR text format: printing, parsing back, and parse errors with line numbers.

use rustytorch_compiler::text::{parse, print, print_elided, print_node};
use rustytorch_compiler::{CompileError, ConvOpts, Graph, GraphBuilder, Init};
use rustytorch_ops::{Activation, Causal, DType, HostTensor, Op, TensorType};

/// A small model touching many op families, with parameters, state, constants, an update and a
/// guard.
fn model() -> Graph {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [2, 3, 8, 8]);
    let y = b.input("labels", DType::I64, [2]);
    let w = b.param("conv.w", [4, 3, 3, 3], Init::kaiming_uniform(27, 1));
    let cb = b.param("conv.b", [4], Init::zeros());
    let h = x
        .conv(&w, Some(&cb), &ConvOpts::default().padding(&[1]))
        .relu()
        .max_pool(&[2], &[], &[0]);
    let h = h.flatten(1);
    let w1 = b.param(
        "w1",
        [64, 16],
        Init::Normal {
            mean: 0.0,
            std: 0.02,
            seed: 9,
        },
    );
    let b1 = b.param("b1", [16], Init::Full(0.1));
    let h = h.matmul_epilogue(&w1, Some(&b1), Activation::GeluTanh);
    let h = h.layer_norm(None, None, 1e-5);
    let q = h.reshape([2, 2, 2, 4]);
    let a = q.attention(&q, &q, None, Causal::TopLeft, None);
    let h2 = a.reshape([2, 16]).softmax(-1).add(&h).mul_scalar(0.5);
    let emb = b.param_typed(
        "emb",
        TensorType::new(DType::F32, [16, 3]),
        Init::Data,
        true,
    );
    b.with_graph(|g| {
        let p = g.params.iter_mut().find(|p| p.name == "emb").unwrap();
        let vals: Vec<f32> = (0..48).map(|i| (i as f32 - 20.0) / 7.0).collect();
        p.data = Some(HostTensor::from_vec(vals, [16, 3]).unwrap());
    });
    let logits = h2.matmul(&emb);
    let table = b.constant(HostTensor::from_vec(vec![1.5f32, -2.0, 0.25], [3]).unwrap());
    let logits = logits.add(&table).pad(&[(0, 0), (1, 1)], f64::NEG_INFINITY);
    let loss = logits.cross_entropy(&y);
    let steps = b.param_typed(
        "step",
        TensorType::new(DType::I64, []),
        Init::zeros(),
        false,
    );
    let one = b.constant(HostTensor::scalar(1i64));
    b.update(&steps, &steps.add(&one));
    b.output("loss", &loss);
    b.output("pred", &logits.argmax(-1, false));
    b.output("any_big", &logits.gt_scalar(3.0).any(&[1], false));
    let mut g = b.graph().expect("model builds");
    let fin = g
        .add(
            rustytorch_ops::Op::Unary(rustytorch_ops::UnaryOp::IsFinite),
            &[g.outputs[0].1],
        )
        .unwrap();
    g.guards.push(("finite.loss".into(), fin));
    g.verify().unwrap();
    g
}

#[test]
fn print_parse_print_is_identical() {
    let g = model();
    let text = print(&g);
    let back = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    back.verify().unwrap();
    assert_eq!(print(&back), text);
    assert_eq!(back.len(), g.len());
    assert_eq!(back.inputs.len(), 2);
    assert_eq!(back.params.len(), g.params.len());
    let emb = back.param_by_name("emb").unwrap();
    assert_eq!(emb.data, g.param_by_name("emb").unwrap().data);
    assert!(!back.param_by_name("step").unwrap().trainable);
    assert_eq!(back.updates.len(), 1);
    assert_eq!(back.guards[0].0, "finite.loss");
    // The text reads as documented.
    for needle in [
        "graph {",
        "%0 = input x : f32[2,3,8,8]",
        "%1 = input labels : i64[2]",
        "= param conv.w : f32[4,3,3,3] = uniform(",
        "= param w1 : f32[64,16] = normal(0.0, 0.02, seed=9)",
        "= state step : i64[] = full(0.0)",
        "= param emb : f32[16,3] = data [-2.857143, -2.7142856,",
        "= constant : f32[3] = [1.5, -2.0, 0.25]",
        "conv[stride=1:1,padding=1:1,dilation=1:1,groups=1,bias](%0, %2, %3) : f32[2,4,8,8]",
        "pad[pads=0/0:1/1,value=-inf]",
        "output loss = %",
        "update step <- %",
        "guard finite.loss = %",
    ] {
        assert!(text.contains(needle), "missing `{needle}` in\n{text}");
    }
}

/// A graph with one node of every op variant (from `Op::samples`), operands as graph inputs.
fn every_op() -> Graph {
    let mut g = Graph::new();
    for (i, (op, tys)) in Op::samples().into_iter().enumerate() {
        let name = op.name();
        let id = match op {
            Op::Input { ty, .. } => g.add_input(name, ty).unwrap(),
            Op::Param { ty, .. } => g.add_param(name, ty, Init::ones(), false).unwrap(),
            Op::Constant { ty, .. } => g.add_constant(HostTensor::zeros(&ty)),
            op => {
                let ins: Vec<_> = tys
                    .into_iter()
                    .enumerate()
                    .map(|(k, ty)| g.add_input(&format!("{i}.{k}"), ty).unwrap())
                    .collect();
                g.add(op, &ins).unwrap()
            }
        };
        g.add_output(name, id).unwrap();
    }
    g
}

#[test]
fn every_op_prints_and_parses_back() {
    let g = every_op();
    let text = print(&g);
    let back = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    back.verify().unwrap();
    assert_eq!(print(&back), text);
    let mut seen = [false; Op::VARIANT_COUNT];
    for id in back.node_ids() {
        seen[back.node(id).unwrap().op.variant_index()] = true;
    }
    assert!(seen.iter().all(|s| *s), "{text}");
    for (op, _) in Op::samples() {
        if !op.is_leaf() {
            assert!(text.contains(&format!("= {op}(")), "no `{op}` in\n{text}");
        }
    }
}

#[test]
fn printing_numbers_densely_in_topological_order() {
    let g = model();
    let text = print(&g);
    let mut defined = std::collections::HashSet::new();
    for (k, line) in text
        .lines()
        .filter(|l| l.trim_start().starts_with('%'))
        .enumerate()
    {
        let line = line.trim();
        let (label, rest) = line.split_once(" = ").unwrap();
        assert_eq!(label, format!("%{k}"));
        for (i, _) in rest.match_indices('%') {
            let n: String = rest[i + 1..]
                .chars()
                .take_while(|c| c.is_ascii_digit())
                .collect();
            assert!(
                defined.contains(&n),
                "{line}: %{n} used before its definition"
            );
        }
        defined.insert(k.to_string());
    }
}

#[test]
fn names_and_odd_values_round_trip() {
    let mut g = Graph::new();
    let x = g
        .add_input(
            "input with spaces \"quoted\"",
            TensorType::new(DType::BF16, [3]),
        )
        .unwrap();
    let c = g.add_constant(HostTensor::from_vec(vec![true, false, true], [3]).unwrap());
    let f = g.add_constant(HostTensor::from_vec(vec![f32::NAN, -0.0, f32::INFINITY], [3]).unwrap());
    let z = g.add_constant(HostTensor::from_vec(Vec::<f64>::new(), [0, 4]).unwrap());
    g.node_mut(c).unwrap().name = Some("mask".into());
    let xf = g
        .add(rustytorch_ops::Op::Cast { to: DType::F32 }, &[x])
        .unwrap();
    let s = g.add(rustytorch_ops::Op::Where, &[c, xf, f]).unwrap();
    g.node_mut(s).unwrap().name = Some("sel\tected".into());
    g.add_output("out", s).unwrap();
    g.add_output("empty", z).unwrap();
    let text = print(&g);
    assert!(
        text.contains("constant mask : bool[3] = [true, false, true]"),
        "{text}"
    );
    assert!(text.contains("[nan, -0.0, inf]"), "{text}");
    assert!(text.contains("as \"sel\\tected\""), "{text}");
    let back = parse(&text).unwrap();
    assert_eq!(print(&back), text);
    assert_eq!(back.inputs[0].name, "input with spaces \"quoted\"");
}

#[test]
fn elided_text_is_short_and_refuses_to_parse() {
    let g = model();
    let text = print_elided(&g, 8);
    assert!(text.contains("[... 48 values]"), "{text}");
    let e = parse(&text).unwrap_err();
    assert!(e.to_string().contains("elided"), "{e}");
    let id = g.outputs[0].1;
    let line = print_node(&g, id);
    assert!(
        line.starts_with(&format!(
            "%{} = cross_entropy[reduction=mean,ignore_index=-100](",
            id.index()
        )),
        "{line}"
    );
}

fn parse_err(text: &str) -> (usize, String) {
    match parse(text) {
        Err(CompileError::Parse { line, reason }) => (line, reason),
        other => panic!("expected a parse error for\n{text}\ngot {other:?}"),
    }
}

#[test]
fn parse_errors_carry_line_numbers() {
    let good =
        "graph {\n  %0 = input x : f32[2,3]\n  %1 = exp(%0) : f32[2,3]\n  output y = %1\n}\n";
    parse(good).unwrap();
    let cases: &[(&str, usize, &str)] = &[
        ("", 1, "graph {"),
        ("grph {\n}", 1, "expected `graph`"),
        ("graph {\n  %0 = input x : f32[2,3]\n", 2, "closing"),
        ("graph {\n}\n%0 = input x : f32[2]", 3, "after the closing"),
        ("graph {\n  %0 = input x : f32[2,3]\n  %1 = exp(%7) : f32[2,3]\n}", 3, "%7 is not defined"),
        ("graph {\n  %0 = input x : f32[2,3]\n  %0 = exp(%0) : f32[2,3]\n}", 3, "defined twice"),
        ("graph {\n  %0 = input x : f32[2,3]\n\n  # comment\n  %1 = exp(%0) : f64[2,3]\n}", 5, "infers f32[2,3]"),
        ("graph {\n  %0 = input x : f32[2,3]\n  %1 = nosuch(%0) : f32[2,3]\n}", 3, "unknown op"),
        ("graph {\n  %0 = input x : f33[2,3]\n}", 2, "unknown dtype"),
        ("graph {\n  %0 = input x : f32[2,3]\n  %1 = matmul(%0, %0) : f32[2,2]\n}", 3, "matmul"),
        ("graph {\n  %0 = constant : f32[2] = [1.0]\n}", 2, "needs 2 values"),
        ("graph {\n  %0 = constant : i32[2] = [1.0, 2]\n}", 2, "not an i32"),
        ("graph {\n  %0 = param w : f32[2] = magic(1)\n}", 2, "unknown initializer"),
        ("graph {\n  %0 = input x : f32[2]\n  output y = %0 extra\n}", 3, "unexpected"),
        ("graph {\n  %0 = input x : f32[2]\n  update x <- %0\n}", 3, "unknown parameter"),
        ("graph {\n  %0 = input x : f32[2]\n  frobnicate\n}", 3, "expected a node"),
        ("graph {\n  %0 = input[index=0,ty=f32:2] : f32[2]\n}", 2, "declarations"),
        ("graph {\n  %0 = input \"unterminated : f32[2]\n}", 2, "unterminated"),
        ("graph {\n  %0 = input x : f32[2]\n  %1 = input x : f32[2]\n}", 3, "declared twice"),
        (
            "graph {\n  %0 = state s : f32[2] = full(0.0)\n  %1 = input x : i64[2]\n  update s <- %1\n}",
            5,
            "update",
        ),
    ];
    for (text, line, needle) in cases {
        let (l, reason) = parse_err(text);
        assert_eq!(l, *line, "{text}\n=> {reason}");
        assert!(
            reason.contains(needle),
            "{text}\n=> `{reason}` lacks `{needle}`"
        );
    }
}

/// A graph with an input and a constant of every dtype (the integer constants at their extremes),
/// each cast to f32 and to i64.
fn every_dtype_graph() -> Graph {
    let mut g = Graph::new();
    for d in DType::ALL {
        let x = g
            .add_input(&format!("x_{d}"), TensorType::new(d, [2]))
            .unwrap();
        // -∞ and +∞ saturate to an integer dtype's minimum and maximum.
        let c = g.add_constant(
            HostTensor::from_vec(vec![f64::NEG_INFINITY, f64::INFINITY, -1.0, 0.0], [2, 2])
                .unwrap()
                .cast(d),
        );
        let xf = g.add(Op::Cast { to: DType::F32 }, &[x]).unwrap();
        let ci = g.add(Op::Cast { to: DType::I64 }, &[c]).unwrap();
        let back = g.add(Op::Cast { to: d }, &[xf]).unwrap();
        g.add_output(&format!("f_{d}"), xf).unwrap();
        g.add_output(&format!("c_{d}"), ci).unwrap();
        g.add_output(&format!("b_{d}"), back).unwrap();
    }
    g
}

#[test]
fn every_dtype_prints_and_parses_back() {
    let g = every_dtype_graph();
    let text = print(&g);
    for (d, want) in [
        (DType::I8, "i8[2,2] = [-128, 127, -1, 0]"),
        (DType::I16, "i16[2,2] = [-32768, 32767, -1, 0]"),
        (DType::U16, "u16[2,2] = [0, 65535, 0, 0]"),
        (DType::U32, "u32[2,2] = [0, 4294967295, 0, 0]"),
        (DType::U64, "u64[2,2] = [0, 18446744073709551615, 0, 0]"),
    ] {
        assert!(text.contains(want), "{d}: {text}");
        assert!(text.contains(&format!("x_{d} : {d}[2]")), "{d}: {text}");
        assert!(text.contains(&format!("cast[to={d}]")), "{d}: {text}");
    }
    let back = parse(&text).unwrap();
    assert_eq!(print(&back), text);
    assert_eq!(back.constants, g.constants);
    // A value out of the dtype's range is an error naming it.
    let bad = text.replace("[-128, 127, -1, 0]", "[-129, 127, -1, 0]");
    let e = parse(&bad).unwrap_err().to_string();
    assert!(e.contains("-129") && e.contains("i8"), "{e}");
}
