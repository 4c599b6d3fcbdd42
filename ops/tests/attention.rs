//! Attention and its gradient against float64 references: Sq != Sk, causal alignments, additive and
//! bool masks, fully masked rows, errors, and gradchecks of the rule.

use rustytorch_ops::testing::{
    assert_close, gradcheck, rand_tensor, swap_heads as swap, tolerance, vjp_eager,
};
use rustytorch_ops::{
    eval_cpu, infer, AttnLayout, AttnMask, Causal, DType, HostTensor, Op, OpError, TensorType,
};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

fn ty(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

fn eval(op: &Op, inputs: &[&HostTensor]) -> HostTensor {
    eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{e}"))
}

/// The mask in a plain reference: `None`, additive values or keep flags, with its own dims.
enum RefMask {
    None,
    Add(Vec<f64>, Vec<usize>),
    Keep(Vec<bool>, Vec<usize>),
}

/// Element (b, h, i, j) of a mask of dims `md` broadcast to [B,H,Sq,Sk].
fn mask_at(md: &[usize], c: [usize; 4]) -> usize {
    let off = 4 - md.len();
    let mut p = 0;
    for (k, &d) in md.iter().enumerate() {
        p = p * d + if d == 1 { 0 } else { c[k + off] };
    }
    p
}

/// Plain float64 attention; fully masked rows give zeros.
fn attention_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dims: [usize; 6], // B, H, Sq, Sk, D, Dv
    causal: Causal,
    mask: &RefMask,
    scale: f64,
) -> Vec<f64> {
    let [b, h, sq, sk, d, dv] = dims;
    let mut out = vec![0.0; b * h * sq * dv];
    for bi in 0..b {
        for hi in 0..h {
            let bh = bi * h + hi;
            for i in 0..sq {
                let mut s = vec![f64::NEG_INFINITY; sk];
                for j in 0..sk {
                    let visible = match causal {
                        Causal::None => true,
                        Causal::TopLeft => j <= i,
                        Causal::BottomRight => j as i64 <= i as i64 + sk as i64 - sq as i64,
                    };
                    let c = [bi, hi, i, j];
                    let keep = match mask {
                        RefMask::Keep(m, md) => m[mask_at(md, c)],
                        _ => true,
                    };
                    if !visible || !keep {
                        continue;
                    }
                    let dot: f64 = (0..d)
                        .map(|t| q[(bh * sq + i) * d + t] * k[(bh * sk + j) * d + t])
                        .sum();
                    s[j] = scale * dot;
                    if let RefMask::Add(m, md) = mask {
                        s[j] += m[mask_at(md, c)];
                    }
                }
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue;
                }
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for j in 0..sk {
                    for t in 0..dv {
                        out[(bh * sq + i) * dv + t] += e[j] / z * v[(bh * sk + j) * dv + t];
                    }
                }
            }
        }
    }
    out
}

struct Case {
    b: usize,
    h: usize,
    sq: usize,
    sk: usize,
    d: usize,
    dv: usize,
    causal: Causal,
    mask: AttnMask,
    mask_dims: Vec<usize>,
}

impl Case {
    fn new(sq: usize, sk: usize, causal: Causal, mask: AttnMask, mask_dims: &[usize]) -> Case {
        Case {
            b: 2,
            h: 3,
            sq,
            sk,
            d: 4,
            dv: 3,
            causal,
            mask,
            mask_dims: mask_dims.to_vec(),
        }
    }

    fn op(&self) -> Op {
        Op::Attention {
            causal: self.causal,
            mask: self.mask,
            scale: (1.0 / (self.d as f64).sqrt()).into(),
            layout: AttnLayout::Bhsd,
        }
    }

    /// q, k, v and the mask (if any) in `dtype`.
    fn inputs(&self, dtype: DType, seed: u64) -> Vec<HostTensor> {
        let mut ins = vec![
            rand_tensor(
                &ty(dtype, &[self.b, self.h, self.sq, self.d]),
                seed,
                -2.0,
                2.0,
            ),
            rand_tensor(
                &ty(dtype, &[self.b, self.h, self.sk, self.d]),
                seed + 1,
                -2.0,
                2.0,
            ),
            rand_tensor(
                &ty(dtype, &[self.b, self.h, self.sk, self.dv]),
                seed + 2,
                -1.0,
                1.0,
            ),
        ];
        match self.mask {
            AttnMask::None => {}
            AttnMask::Additive => ins.push(rand_tensor(
                &ty(dtype, &self.mask_dims),
                seed + 3,
                -1.0,
                1.0,
            )),
            AttnMask::Bool => ins.push(rand_tensor(
                &ty(DType::Bool, &self.mask_dims),
                seed + 3,
                0.0,
                1.0,
            )),
        }
        ins
    }

    fn reference(&self, ins: &[HostTensor]) -> Vec<f64> {
        let mask = match self.mask {
            AttnMask::None => RefMask::None,
            AttnMask::Additive => RefMask::Add(ins[3].to_f64_vec(), self.mask_dims.clone()),
            AttnMask::Bool => {
                RefMask::Keep(ins[3].to_vec::<bool>().unwrap(), self.mask_dims.clone())
            }
        };
        attention_ref(
            &ins[0].to_f64_vec(),
            &ins[1].to_f64_vec(),
            &ins[2].to_f64_vec(),
            [self.b, self.h, self.sq, self.sk, self.d, self.dv],
            self.causal,
            &mask,
            1.0 / (self.d as f64).sqrt(),
        )
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case::new(5, 7, Causal::None, AttnMask::None, &[]),
        Case::new(5, 7, Causal::TopLeft, AttnMask::None, &[]),
        Case::new(7, 5, Causal::TopLeft, AttnMask::None, &[]),
        Case::new(4, 7, Causal::BottomRight, AttnMask::None, &[]),
        // Sq > Sk bottom-right: the first two query rows see no key.
        Case::new(6, 4, Causal::BottomRight, AttnMask::None, &[]),
        Case::new(5, 7, Causal::None, AttnMask::Additive, &[5, 7]),
        Case::new(5, 7, Causal::TopLeft, AttnMask::Additive, &[2, 1, 5, 7]),
        Case::new(5, 7, Causal::None, AttnMask::Bool, &[1, 3, 5, 7]),
        Case::new(6, 4, Causal::BottomRight, AttnMask::Bool, &[4]),
    ]
}

#[test]
fn attention_matches_reference() {
    for (n, case) in cases().iter().enumerate() {
        for dtype in FLOATS {
            let ins = case.inputs(dtype, 10 * n as u64);
            let refs: Vec<&HostTensor> = ins.iter().collect();
            let y = eval(&case.op(), &refs);
            assert_eq!(y.ty(), ty(dtype, &[case.b, case.h, case.sq, case.dv]));
            let got = y.to_f64_vec();
            assert!(got.iter().all(|v| v.is_finite()));
            assert_close(
                &got,
                &case.reference(&ins),
                tolerance(dtype),
                &format!("case {n} {:?} {dtype}", case.op()),
            );
        }
    }
}

#[test]
fn fully_masked_rows_give_zeros() {
    // Bottom-right with Sq > Sk: rows 0 and 1 see nothing.
    let case = Case::new(6, 4, Causal::BottomRight, AttnMask::None, &[]);
    let ins = case.inputs(DType::F32, 1);
    let refs: Vec<&HostTensor> = ins.iter().collect();
    let y = eval(&case.op(), &refs).to_f64_vec();
    for bh in 0..6 {
        for i in 0..2 {
            let row = &y[(bh * 6 + i) * 3..(bh * 6 + i + 1) * 3];
            assert_eq!(row, &[0.0; 3], "head {bh} row {i}");
        }
    }
    // A bool mask with one row all false, and an additive mask with one row all -inf.
    let (sq, sk) = (3, 4);
    let mut keep = vec![true; sq * sk];
    let mut add = vec![0.5; sq * sk];
    for j in 0..sk {
        keep[sk + j] = false;
        add[2 * sk + j] = f64::NEG_INFINITY;
    }
    let bool_mask = HostTensor::from_vec(keep, [sq, sk]).unwrap();
    let add_mask = HostTensor::from_f64_slice(&ty(DType::F32, &[sq, sk]), &add).unwrap();
    for (mask, m, row) in [
        (AttnMask::Bool, &bool_mask, 1),
        (AttnMask::Additive, &add_mask, 2),
    ] {
        let mut case = Case::new(sq, sk, Causal::None, AttnMask::None, &[]);
        case.mask = mask;
        let ins = case.inputs(DType::F32, 2);
        let op = case.op();
        let y = eval(&op, &[&ins[0], &ins[1], &ins[2], m]).to_f64_vec();
        assert!(y.iter().all(|v| !v.is_nan()), "{mask:?}: NaN in output");
        for bh in 0..6 {
            let r = &y[(bh * sq + row) * 3..(bh * sq + row + 1) * 3];
            assert_eq!(r, &[0.0; 3], "{mask:?} head {bh}");
            let other = &y[(bh * sq) * 3..(bh * sq + 1) * 3];
            assert!(other.iter().any(|&v| v != 0.0));
        }
        // The gradients of a fully masked row are zero, not NaN.
        let g = rand_tensor(&ty(DType::F32, &[2, 3, sq, 3]), 3, -1.0, 1.0);
        let grads = vjp_eager(
            &op,
            &[ins[0].clone(), ins[1].clone(), ins[2].clone(), m.clone()],
            &g,
        )
        .unwrap();
        let dq = grads[0].as_ref().unwrap().to_f64_vec();
        assert!(dq.iter().all(|v| v.is_finite()));
        for bh in 0..6 {
            assert_eq!(&dq[(bh * sq + row) * 4..(bh * sq + row + 1) * 4], &[0.0; 4]);
        }
        for gi in &grads[1..3] {
            assert!(gi
                .as_ref()
                .unwrap()
                .to_f64_vec()
                .iter()
                .all(|v| v.is_finite()));
        }
        assert!(grads[3].is_none(), "masks get no gradient");
    }
}

#[test]
fn attention_large_parallel() {
    let mut case = Case::new(64, 80, Causal::TopLeft, AttnMask::None, &[]);
    case.d = 32;
    case.dv = 16;
    let ins = case.inputs(DType::F32, 40);
    let refs: Vec<&HostTensor> = ins.iter().collect();
    let y = eval(&case.op(), &refs);
    assert_close(
        &y.to_f64_vec(),
        &case.reference(&ins),
        1e-5,
        "attention large",
    );
}

/// The gradient kernels of every dtype against the f64 kernel (itself gradchecked below) on the
/// same rounded inputs.
#[test]
fn attention_grad_every_dtype_matches_f64() {
    for (n, case) in cases().iter().enumerate() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let mut ins = case.inputs(dtype, 100 + n as u64);
            ins.push(rand_tensor(
                &ty(dtype, &[case.b, case.h, case.sq, case.dv]),
                7,
                -1.0,
                1.0,
            ));
            let wide: Vec<HostTensor> = ins
                .iter()
                .map(|t| {
                    if t.dtype() == DType::Bool {
                        t.clone()
                    } else {
                        t.cast(DType::F64)
                    }
                })
                .collect();
            for wrt in 0..3u8 {
                let op = case.op().attention_grad(wrt).unwrap();
                let refs: Vec<&HostTensor> = ins.iter().collect();
                let got = eval(&op, &refs);
                assert_eq!(got.ty(), ins[wrt as usize].ty());
                let wrefs: Vec<&HostTensor> = wide.iter().collect();
                let want = eval(&op, &wrefs).to_f64_vec();
                assert_close(
                    &got.to_f64_vec(),
                    &want,
                    tolerance(dtype) * 2.0,
                    &format!("case {n} wrt {wrt} {dtype}"),
                );
            }
        }
    }
}

#[test]
fn errors() {
    let op = Op::Attention {
        causal: Causal::None,
        mask: AttnMask::None,
        scale: 0.5.into(),
        layout: AttnLayout::Bhsd,
    };
    let q = ty(DType::F32, &[2, 3, 4, 8]);
    let k = ty(DType::F32, &[2, 3, 5, 8]);
    let v = ty(DType::F32, &[2, 3, 5, 6]);
    assert_eq!(
        infer(&op, &[&q, &k, &v]).unwrap(),
        ty(DType::F32, &[2, 3, 4, 6])
    );

    let kb = ty(DType::F32, &[1, 3, 5, 8]);
    let e = infer(&op, &[&q, &kb, &v]).unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("attention") && msg.contains("f32[1,3,5,8]") && msg.contains("f32[2,3,4,8]"),
        "{msg}"
    );

    let kd = ty(DType::F32, &[2, 3, 5, 7]);
    assert!(matches!(
        infer(&op, &[&q, &kd, &v]).unwrap_err(),
        OpError::Shape { .. }
    ));
    let vs = ty(DType::F32, &[2, 3, 4, 6]);
    assert!(matches!(
        infer(&op, &[&q, &k, &vs]).unwrap_err(),
        OpError::Shape { .. }
    ));
    let kh = ty(DType::F16, &[2, 3, 5, 8]);
    let e = infer(&op, &[&q, &kh, &v]).unwrap_err();
    assert!(matches!(e, OpError::DType { .. }), "{e}");
    assert!(e.to_string().contains("f16[2,3,5,8]"), "{e}");
    let qi = ty(DType::I32, &[2, 3, 4, 8]);
    assert!(matches!(
        infer(&op, &[&qi, &qi, &qi]).unwrap_err(),
        OpError::DType { .. }
    ));
    assert!(matches!(
        infer(&op, &[&q, &k]).unwrap_err(),
        OpError::Arity { .. }
    ));

    let bool_op = Op::Attention {
        causal: Causal::None,
        mask: AttnMask::Bool,
        scale: 0.5.into(),
        layout: AttnLayout::Bhsd,
    };
    let mf = ty(DType::F32, &[4, 5]);
    assert!(matches!(
        infer(&bool_op, &[&q, &k, &v, &mf]).unwrap_err(),
        OpError::DType { .. }
    ));
    let mb = ty(DType::Bool, &[5, 4]);
    let e = infer(&bool_op, &[&q, &k, &v, &mb]).unwrap_err();
    assert!(matches!(e, OpError::Shape { .. }), "{e}");
    assert!(e.to_string().contains("bool[5,4]"), "{e}");
    assert!(infer(&bool_op, &[&q, &k, &v, &ty(DType::Bool, &[2, 1, 4, 1])]).is_ok());

    let grad = Op::AttentionGrad {
        causal: Causal::None,
        mask: AttnMask::None,
        scale: 0.5.into(),
        wrt: 1,
        layout: AttnLayout::Bhsd,
    };
    let go = ty(DType::F32, &[2, 3, 4, 6]);
    assert_eq!(infer(&grad, &[&q, &k, &v, &go]).unwrap(), k);
    let bad_go = ty(DType::F32, &[2, 3, 4, 8]);
    assert!(matches!(
        infer(&grad, &[&q, &k, &v, &bad_go]).unwrap_err(),
        OpError::Shape { .. }
    ));
    let grad3 = Op::AttentionGrad {
        causal: Causal::None,
        mask: AttnMask::None,
        scale: 0.5.into(),
        wrt: 3,
        layout: AttnLayout::Bhsd,
    };
    assert!(matches!(
        infer(&grad3, &[&q, &k, &v, &go]).unwrap_err(),
        OpError::Attribute { .. }
    ));
}

#[test]
fn gradcheck_attention() {
    let f64_cases = vec![
        Case::new(3, 5, Causal::None, AttnMask::None, &[]),
        Case::new(3, 5, Causal::TopLeft, AttnMask::None, &[]),
        Case::new(5, 3, Causal::TopLeft, AttnMask::None, &[]),
        Case::new(3, 5, Causal::BottomRight, AttnMask::None, &[]),
        Case::new(5, 3, Causal::BottomRight, AttnMask::None, &[]),
        Case::new(3, 5, Causal::None, AttnMask::Additive, &[3, 5]),
        Case::new(4, 3, Causal::BottomRight, AttnMask::Bool, &[1, 2, 4, 3]),
    ];
    for (n, mut case) in f64_cases.into_iter().enumerate() {
        case.b = 1;
        case.h = 2;
        let ins = case.inputs(DType::F64, 200 + n as u64);
        gradcheck(&case.op(), &ins, &[0, 1, 2], 300 + n as u64).unwrap();
    }
}

#[test]
fn second_order_is_an_error() {
    let case = Case::new(2, 3, Causal::None, AttnMask::None, &[]);
    let mut ins = case.inputs(DType::F64, 1);
    ins.push(rand_tensor(&ty(DType::F64, &[2, 3, 2, 3]), 2, -1.0, 1.0));
    let op = Op::AttentionGrad {
        causal: Causal::None,
        mask: AttnMask::None,
        scale: 0.5.into(),
        wrt: 0,
        layout: AttnLayout::Bhsd,
    };
    let cot = rand_tensor(&ty(DType::F64, &[2, 3, 2, 4]), 3, -1.0, 1.0);
    let e = vjp_eager(&op, &ins, &cot).unwrap_err();
    assert!(matches!(e, OpError::NotDifferentiable { .. }), "{e}");
}

/// The same op in the `[B, S, H, D]` layout.
fn bshd(op: &Op) -> Op {
    op.with_attn_layout(AttnLayout::Bshd)
}

/// Attention and its gradients in the `[B, S, H, D]` layout are the `[B, H, S, D]` ones on
/// transposed operands, transposed (masks unchanged); the gradient rule keeps the layout.
#[test]
fn bshd_layout_is_the_transposed_bhsd() {
    for (n, case) in cases().iter().enumerate() {
        let mut ins = case.inputs(DType::F64, 500 + n as u64);
        ins.push(rand_tensor(
            &ty(DType::F64, &[case.b, case.h, case.sq, case.dv]),
            9,
            -1.0,
            1.0,
        ));
        let has_mask = case.mask != AttnMask::None;
        let moved: Vec<HostTensor> = ins
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if has_mask && i == 3 {
                    t.clone()
                } else {
                    swap(t)
                }
            })
            .collect();
        let fwd = case.op();
        let n_fwd = ins.len() - 1;
        let want = swap(&eval(&fwd, &ins[..n_fwd].iter().collect::<Vec<_>>()));
        let got = eval(&bshd(&fwd), &moved[..n_fwd].iter().collect::<Vec<_>>());
        assert_eq!(got.ty(), want.ty(), "case {n}");
        assert_close(
            &got.to_f64_vec(),
            &want.to_f64_vec(),
            1e-12,
            &format!("case {n}"),
        );
        let Op::Attention {
            causal,
            mask,
            scale,
            ..
        } = fwd
        else {
            unreachable!()
        };
        for wrt in 0..3u8 {
            let op = Op::AttentionGrad {
                causal,
                mask,
                scale,
                wrt,
                layout: AttnLayout::Bhsd,
            };
            let want = swap(&eval(&op, &ins.iter().collect::<Vec<_>>()));
            let got = eval(&bshd(&op), &moved.iter().collect::<Vec<_>>());
            assert_eq!(got.ty(), moved[wrt as usize].ty(), "case {n} wrt {wrt}");
            assert_close(
                &got.to_f64_vec(),
                &want.to_f64_vec(),
                1e-12,
                &format!("case {n} wrt {wrt}"),
            );
        }
    }
}

/// Finite differences through the `[B, S, H, D]` layout (its gradient ops keep the layout).
#[test]
fn gradcheck_attention_bshd() {
    for (n, mut case) in [
        Case::new(3, 5, Causal::TopLeft, AttnMask::None, &[]),
        Case::new(4, 3, Causal::BottomRight, AttnMask::Additive, &[4, 3]),
    ]
    .into_iter()
    .enumerate()
    {
        case.b = 1;
        case.h = 2;
        let ins: Vec<HostTensor> = case
            .inputs(DType::F64, 600 + n as u64)
            .iter()
            .enumerate()
            .map(|(i, t)| if i == 3 { t.clone() } else { swap(t) })
            .collect();
        gradcheck(&bshd(&case.op()), &ins, &[0, 1, 2], 700 + n as u64).unwrap();
    }
}

/// Shapes in the `[B, S, H, D]` layout are checked as such, with an error that says so.
#[test]
fn bshd_shape_errors_name_the_layout() {
    let op = bshd(&Case::new(2, 3, Causal::None, AttnMask::None, &[]).op());
    let q = ty(DType::F32, &[2, 5, 3, 4]);
    let k = ty(DType::F32, &[2, 7, 3, 4]);
    assert_eq!(
        infer(&op, &[&q, &k, &k]).unwrap(),
        ty(DType::F32, &[2, 5, 3, 4])
    );
    // Heads mismatched (dim 2 in this layout).
    let k_bad = ty(DType::F32, &[2, 7, 2, 4]);
    let e = infer(&op, &[&q, &k_bad, &k_bad]).unwrap_err().to_string();
    assert!(e.contains("B, H must match"), "{e}");
    let e = infer(&op, &[&q, &k, &ty(DType::F32, &[2, 7, 3])])
        .unwrap_err()
        .to_string();
    assert!(e.contains("[B,Sq,H,D]"), "{e}");
}
