//! The CUDA elementwise, movement and indexing kernels against the CPU kernels: every op, every
//! dtype it accepts, broadcast and odd shapes, run through the IR interpreter; and snapshots of the
//! printed source of canonical kernels.

use rustytorch_codegen::cuda::{self, elementwise, interp, CudaStep, StepKernels};
use rustytorch_ops::testing::{assert_close, rand_tensor, tolerance};
use rustytorch_ops::{
    eval_cpu, infer, BinaryOp, DType, F64Bits, FusedInstr, FusedKernel, HostTensor, Op, Shape,
    TensorType, UnaryOp,
};

const UNARY: [UnaryOp; 24] = [
    UnaryOp::Neg,
    UnaryOp::Abs,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Sqrt,
    UnaryOp::Rsqrt,
    UnaryOp::Reciprocal,
    UnaryOp::Sin,
    UnaryOp::Cos,
    UnaryOp::Tanh,
    UnaryOp::Sigmoid,
    UnaryOp::Relu,
    UnaryOp::GeluErf,
    UnaryOp::GeluTanh,
    UnaryOp::Silu,
    UnaryOp::Sign,
    UnaryOp::Floor,
    UnaryOp::Ceil,
    UnaryOp::Round,
    UnaryOp::Not,
    UnaryOp::IsNan,
    UnaryOp::IsInf,
    UnaryOp::IsFinite,
    UnaryOp::Erf,
];

const BINARY: [BinaryOp; 15] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Pow,
    BinaryOp::Maximum,
    BinaryOp::Minimum,
    BinaryOp::Eq,
    BinaryOp::Ne,
    BinaryOp::Lt,
    BinaryOp::Le,
    BinaryOp::Gt,
    BinaryOp::Ge,
    BinaryOp::And,
    BinaryOp::Or,
];

/// The dtypes CUDA kernels handle (the others are an error naming the op, tested below).
fn cuda_dtypes() -> impl Iterator<Item = DType> {
    DType::ALL
        .into_iter()
        .filter(|&d| cuda::ir::dtype_supported(d))
}

fn ty(dt: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dt, Shape::new(dims))
}

/// A random tensor: floats uniform in [lo, hi), integers in [lo, hi) (u8 from 0), bools random.
fn rand(dt: DType, dims: &[usize], seed: u64, lo: f64, hi: f64) -> HostTensor {
    let lo = if dt == DType::U8 { lo.max(0.0) } else { lo };
    rand_tensor(&ty(dt, dims), seed, lo, hi)
}

/// Small integer values held in any dtype (so that comparisons see ties).
fn rand_small(dt: DType, dims: &[usize], seed: u64) -> HostTensor {
    rand(DType::I32, dims, seed, -3.0, 4.0).cast(dt)
}

/// Edge values of a dtype: NaN, ±∞, ±0, halves (rounding ties), extremes of the integers.
fn specials(dt: DType) -> HostTensor {
    let v: Vec<f64> = match dt {
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 => vec![
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            0.0,
            -0.0,
            0.5,
            1.5,
            2.5,
            -2.5,
            -1.0,
            3.0,
            1e-3,
            70000.0,
            -7.25,
        ],
        DType::I32 => vec![
            i32::MIN as f64,
            i32::MAX as f64,
            -1.0,
            0.0,
            1.0,
            7.0,
            -7.0,
            100.0,
            65536.0,
            -3.0,
        ],
        DType::I64 => vec![
            i64::MIN as f64,
            9.0e18,
            -1.0,
            0.0,
            1.0,
            7.0,
            -7.0,
            3.0e9,
            -((1u64 << 40) as f64),
            -3.0,
        ],
        DType::U8 => vec![0.0, 1.0, 2.0, 7.0, 127.0, 128.0, 200.0, 255.0],
        DType::Bool => vec![0.0, 1.0],
        other => panic!("{other} has no CUDA kernels"),
    };
    HostTensor::from_f64_slice(&ty(dt, &[v.len()]), &v).unwrap()
}

/// The step's kernels, as the CUDA lowering builds them (reshape lowered as a copy).
fn lower(op: &Op, inputs: &[&HostTensor], out: &TensorType) -> StepKernels {
    let tys: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let refs: Vec<&TensorType> = tys.iter().collect();
    let r = match op {
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Fused(_) => {
            elementwise::lower(op, &refs, out)
        }
        _ => elementwise::lower_movement(op, &refs, out),
    };
    let step = r.unwrap_or_else(|e| panic!("{}: lowering failed: {e}", op.name()));
    for l in &step.launches {
        cuda::source(&l.kernel).unwrap_or_else(|e| panic!("{}: {e}", op.name()));
    }
    step
}

/// Element `i` equal (NaNs matching).
fn assert_exact(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            g == w || (g.is_nan() && w.is_nan()),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

/// Runs `op` through the interpreter and compares with the CPU kernel: exactly for integers,
/// bools and when `exact`, within the dtype's tolerance for floats otherwise. Returns the number of
/// output elements.
fn check_with(op: &Op, inputs: &[&HostTensor], exact: bool, what: &str) -> usize {
    let want = eval_cpu(op, inputs).unwrap_or_else(|e| panic!("{what}: CPU: {e}"));
    let out = want.ty();
    let step = lower(op, inputs, &out);
    let got = interp::run_step(&step, inputs, &out, None)
        .unwrap_or_else(|e| panic!("{what}: interpreter: {e}"));
    assert_eq!(got.ty(), out, "{what}: output type");
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    if out.dtype.is_float() && !exact {
        assert_close(&g, &w, tolerance(out.dtype), what);
    } else {
        assert_exact(&g, &w, what);
    }
    out.shape.numel()
}

fn check(op: &Op, inputs: &[&HostTensor], what: &str) -> usize {
    check_with(op, inputs, false, what)
}

fn accepts(op: &Op, tys: &[TensorType]) -> bool {
    let refs: Vec<&TensorType> = tys.iter().collect();
    infer(op, &refs).is_ok()
}

/// The input range a unary op is tested on.
fn unary_range(u: UnaryOp) -> (f64, f64) {
    match u {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => (0.05, 5.0),
        UnaryOp::Exp => (-5.0, 5.0),
        UnaryOp::GeluErf | UnaryOp::GeluTanh | UnaryOp::Silu | UnaryOp::Sigmoid => (-9.0, 6.0),
        _ => (-100.0, 100.0),
    }
}

#[test]
fn unary_ops_every_dtype() {
    let mut cases = 0;
    for (k, &u) in UNARY.iter().enumerate() {
        let op = Op::Unary(u);
        for dt in cuda_dtypes() {
            if !accepts(&op, &[ty(dt, &[2])]) {
                continue;
            }
            let (lo, hi) = unary_range(u);
            let seed = 100 + k as u64 * 8;
            let shapes: [&[usize]; 4] = [&[], &[1, 7], &[2, 3, 37], &[5, 1, 3]];
            for (s, dims) in shapes.iter().enumerate() {
                let x = rand(dt, dims, seed + s as u64, lo, hi);
                check(&op, &[&x], &format!("{u:?} {dt} {dims:?}"));
            }
            // Larger than one block.
            let x = rand(dt, &[700], seed + 7, lo, hi);
            check(&op, &[&x], &format!("{u:?} {dt} [700]"));
            check(&op, &[&specials(dt)], &format!("{u:?} {dt} edge values"));
            cases += 1;
        }
    }
    // Every unary op has at least one dtype.
    assert!(cases >= UNARY.len(), "{cases} cases");
}

/// Broadcast shape pairs of binary tests.
const PAIRS: [(&[usize], &[usize]); 6] = [
    (&[3, 1, 5], &[4, 5]),
    (&[], &[4, 3]),
    (&[5, 1], &[1, 6]),
    (&[2, 1, 3, 1], &[1, 4, 1, 5]),
    (&[2, 3, 7], &[2, 3, 7]),
    (&[300], &[1]),
];

#[test]
fn binary_ops_every_dtype_with_broadcasting() {
    for (k, &o) in BINARY.iter().enumerate() {
        let op = Op::Binary(o);
        for dt in cuda_dtypes() {
            if !accepts(&op, &[ty(dt, &[2]), ty(dt, &[2])]) {
                continue;
            }
            let seed = 1000 + 16 * k as u64;
            let (alo, ahi, blo, bhi) = match (o, dt.is_float()) {
                (BinaryOp::Pow, true) => (0.1, 3.0, -2.0, 2.0),
                (BinaryOp::Pow, false) => (-5.0, 6.0, -2.0, 7.0),
                (BinaryOp::Div, false) => (-100.0, 100.0, -5.0, 6.0),
                (_, true) => (-3.0, 3.0, -3.0, 3.0),
                (_, false) => (-1e9, 1e9, -1e9, 1e9),
            };
            for (s, (da, db)) in PAIRS.iter().enumerate() {
                let a = rand(dt, da, seed + 2 * s as u64, alo, ahi);
                let b = rand(dt, db, seed + 2 * s as u64 + 1, blo, bhi);
                check(&op, &[&a, &b], &format!("{o:?} {dt} {da:?} {db:?}"));
                check(&op, &[&b, &a], &format!("{o:?} {dt} {db:?} {da:?}"));
            }
            // Ties for comparisons, max/min.
            let a = rand_small(dt, &[4, 1, 9], seed + 20);
            let b = rand_small(dt, &[3, 9], seed + 21);
            check(&op, &[&a, &b], &format!("{o:?} {dt} small integers"));
            // Every pair of edge values.
            let e = specials(dt);
            let n = e.numel();
            let a = e.clone().reshape(vec![n, 1]).unwrap();
            let b = e.reshape(vec![1, n]).unwrap();
            check(&op, &[&a, &b], &format!("{o:?} {dt} edge values"));
        }
    }
}

#[test]
fn where_every_dtype() {
    for dt in cuda_dtypes() {
        let shapes: [[&[usize]; 3]; 4] = [
            [&[3, 1, 5], &[4, 5], &[3, 4, 1]],
            [&[], &[2, 3], &[]],
            [&[600], &[600], &[600]],
            [&[7, 1], &[1], &[1, 9]],
        ];
        for (s, [dc, da, db]) in shapes.iter().enumerate() {
            let c = rand(DType::Bool, dc, 7 + s as u64, 0.0, 1.0);
            let a = rand(dt, da, 17 + s as u64, -50.0, 50.0);
            let b = rand(dt, db, 27 + s as u64, -50.0, 50.0);
            check_with(&Op::Where, &[&c, &a, &b], true, &format!("where {dt} {s}"));
        }
    }
}

/// Values that exercise every cast: rounding ties, saturation, NaN, wrapping, and f64/integer
/// values that round twice through f32 on their way to bf16.
fn cast_sources(dt: DType) -> Vec<HostTensor> {
    let mut v = vec![specials(dt), rand(dt, &[3, 41], 5, -300.0, 300.0)];
    let extra: Vec<f64> = match dt {
        DType::F64 => vec![
            1.0 + 2f64.powi(-8) + 2f64.powi(-30),
            1.0 + 2f64.powi(-8) - 2f64.powi(-30),
            1.0078125 + 2f64.powi(-8) - 2f64.powi(-30),
            -(1.0 + 2f64.powi(-8) + 2f64.powi(-30)),
            3e9,
            -3e9,
            255.9,
            256.0,
            -0.9,
            1e300,
            65519.0,
            65520.0,
        ],
        DType::F32 => vec![
            255.9,
            256.0,
            -0.9,
            3e9,
            -3e9,
            1e30,
            65519.0,
            65520.0,
            1.0 + 2f64.powi(-8),
        ],
        DType::I64 => vec![
            (1u64 << 32) as f64 + (1u64 << 24) as f64 + 1.0,
            (1u64 << 32) as f64 + (1u64 << 24) as f64 - 1.0,
            -((1u64 << 40) as f64 + (1u64 << 32) as f64 + 1.0),
            4294967297.0,
            65520.0,
        ],
        DType::I32 => vec![
            16777217.0,
            16842753.0,
            16908289.0,
            -16842753.0,
            65519.0,
            65520.0,
        ],
        _ => vec![],
    };
    if !extra.is_empty() {
        v.push(HostTensor::from_f64_slice(&ty(dt, &[extra.len()]), &extra).unwrap());
    }
    v
}

#[test]
fn cast_every_pair_of_dtypes() {
    for from in cuda_dtypes() {
        for to in cuda_dtypes() {
            let op = Op::Cast { to };
            for (s, x) in cast_sources(from).iter().enumerate() {
                check_with(&op, &[x], true, &format!("cast {from} -> {to} ({s})"));
            }
        }
    }
}

fn instr(op: Op, args: &[u32], dtype: DType) -> FusedInstr {
    FusedInstr {
        op,
        args: args.to_vec(),
        dtype,
    }
}

fn full(v: f64, dtype: DType) -> FusedInstr {
    instr(
        Op::Full {
            value: F64Bits::new(v),
            ty: ty(dtype, &[]),
        },
        &[],
        dtype,
    )
}

fn un(u: UnaryOp, a: u32, dtype: DType) -> FusedInstr {
    instr(Op::Unary(u), &[a], dtype)
}

fn bi(o: BinaryOp, a: u32, b: u32, dtype: DType) -> FusedInstr {
    instr(Op::Binary(o), &[a, b], dtype)
}

fn fused(k: FusedKernel) -> Op {
    Op::Fused(Box::new(k))
}

fn cast_to(to: DType, a: u32) -> FusedInstr {
    instr(Op::Cast { to }, &[a], to)
}

/// `tanh(silu(a)·b + 0.5·a)·2` over broadcast inputs `a` (value 0) and `b` (value 1) of dtype `dt`.
fn chain(dt: DType, out: &[usize]) -> FusedKernel {
    FusedKernel {
        n_inputs: 2,
        instrs: vec![
            un(UnaryOp::Silu, 0, dt),    // 2
            bi(BinaryOp::Mul, 2, 1, dt), // 3
            full(0.5, dt),               // 4
            bi(BinaryOp::Mul, 4, 0, dt), // 5
            bi(BinaryOp::Add, 3, 5, dt), // 6
            un(UnaryOp::Tanh, 6, dt),    // 7
            full(2.0, dt),               // 8
            bi(BinaryOp::Mul, 7, 8, dt), // 9
        ],
        out: ty(dt, out),
    }
}

#[test]
fn fused_float_chains() {
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let k = fused(chain(dt, &[4, 3, 8]));
        let a = rand(dt, &[4, 1, 8], 1, -3.0, 3.0);
        let b = rand(dt, &[3, 8], 2, -3.0, 3.0);
        check(&k, &[&a, &b], &format!("chain {dt}"));
        // A scalar input, a rank-0 output, and an output larger than a block.
        let k = fused(chain(dt, &[]));
        let s = rand(dt, &[], 3, -3.0, 3.0);
        check(&k, &[&s, &s], &format!("chain {dt} rank 0"));
        let k = fused(chain(dt, &[3, 300]));
        let a = rand(dt, &[3, 300], 4, -3.0, 3.0);
        let b = rand(dt, &[1], 5, -3.0, 3.0);
        check(&k, &[&a, &b], &format!("chain {dt} [3,300]"));
    }
    // Every float unary op, fused between casts from and to f16 (the intermediates stay f32).
    for u in UNARY {
        let op = Op::Unary(u);
        if !accepts(&op, &[ty(DType::F32, &[1])]) {
            continue;
        }
        let out_dt = infer(&op, &[&ty(DType::F32, &[1])]).unwrap().dtype;
        let k = FusedKernel {
            n_inputs: 1,
            instrs: vec![
                cast_to(DType::F32, 0),
                un(u, 1, out_dt),
                cast_to(DType::F16, 2),
            ],
            out: ty(DType::F16, &[5, 23]),
        };
        let (lo, hi) = unary_range(u);
        let x = rand(DType::F16, &[5, 23], 9, lo.max(-10.0), hi.min(10.0));
        check(&fused(k), &[&x], &format!("fused {u:?}"));
        let k = FusedKernel {
            n_inputs: 1,
            instrs: vec![
                cast_to(DType::F32, 0),
                un(u, 1, out_dt),
                cast_to(DType::F16, 2),
            ],
            out: ty(DType::F16, &[14]),
        };
        check(
            &fused(k),
            &[&specials(DType::F16)],
            &format!("fused {u:?} edge values"),
        );
    }
    // Every binary op of floats.
    for o in BINARY {
        for dt in [DType::F32, DType::F64, DType::BF16] {
            let op = Op::Binary(o);
            if !accepts(&op, &[ty(dt, &[1]), ty(dt, &[1])]) {
                continue;
            }
            let res = infer(&op, &[&ty(dt, &[1]), &ty(dt, &[1])]).unwrap().dtype;
            let k = FusedKernel {
                n_inputs: 2,
                instrs: vec![bi(o, 0, 1, res)],
                out: ty(res, &[6, 7]),
            };
            let (a, b) = if o == BinaryOp::Pow {
                (rand(dt, &[6, 1], 3, 0.1, 3.0), rand(dt, &[7], 4, -2.0, 2.0))
            } else {
                (rand_small(dt, &[6, 1], 3), rand_small(dt, &[7], 4))
            };
            check(&fused(k), &[&a, &b], &format!("fused {o:?} {dt}"));
        }
    }
}

#[test]
fn fused_integer_bool_and_cast_chains() {
    // Integer arithmetic held in floats: truncating division, division by zero, wrapping.
    for dt in [DType::I32, DType::I64, DType::U8] {
        // u8 has no negation.
        let neg = if dt == DType::U8 {
            UnaryOp::Abs
        } else {
            UnaryOp::Neg
        };
        let mk = |out: &[usize]| {
            fused(FusedKernel {
                n_inputs: 2,
                instrs: vec![
                    bi(BinaryOp::Div, 0, 1, dt),     // 2
                    bi(BinaryOp::Mul, 2, 0, dt),     // 3
                    full(-7.0, dt),                  // 4
                    bi(BinaryOp::Add, 3, 4, dt),     // 5
                    un(neg, 5, dt),                  // 6
                    bi(BinaryOp::Maximum, 6, 1, dt), // 7
                    un(UnaryOp::Sign, 7, dt),        // 8
                    bi(BinaryOp::Sub, 7, 8, dt),     // 9
                ],
                out: ty(dt, out),
            })
        };
        let a = rand(dt, &[9, 40], 11, -300.0, 300.0);
        let b = rand(dt, &[40], 12, -4.0, 5.0);
        check(&mk(&[9, 40]), &[&a, &b], &format!("int chain {dt}"));
        let e = specials(dt);
        let n = e.numel();
        let a = e.clone().reshape(vec![n, 1]).unwrap();
        let b = e.reshape(vec![1, n]).unwrap();
        check(
            &mk(&[n, n]),
            &[&a, &b],
            &format!("int chain {dt} edge values"),
        );
    }
    // i32 wrapping of a product beyond 2^31, then a cube.
    let k = FusedKernel {
        n_inputs: 2,
        instrs: vec![
            bi(BinaryOp::Mul, 0, 1, DType::I32),
            full(3.0, DType::I32),
            bi(BinaryOp::Pow, 2, 3, DType::I32),
        ],
        out: ty(DType::I32, &[50]),
    };
    let a = rand(DType::I32, &[50], 13, -70000.0, 70000.0);
    let b = rand(DType::I32, &[50], 14, -70000.0, 70000.0);
    check(&fused(k), &[&a, &b], "i32 wrap");
    // Comparisons, logic and where over mixed dtypes, ending in each kind of output.
    let f = DType::F32;
    let mk = |out: DType| FusedKernel {
        n_inputs: 3,
        instrs: vec![
            bi(BinaryOp::Lt, 0, 1, DType::Bool),   // 3
            un(UnaryOp::IsFinite, 0, DType::Bool), // 4
            bi(BinaryOp::And, 3, 4, DType::Bool),  // 5
            bi(BinaryOp::Or, 5, 2, DType::Bool),   // 6
            un(UnaryOp::Not, 6, DType::Bool),      // 7
            instr(Op::Where, &[7, 0, 1], f),       // 8
            cast_to(DType::I32, 8),                // 9
            cast_to(DType::U8, 9),                 // 10
            cast_to(out, 10),                      // 11
        ],
        out: ty(out, &[4, 3, 5]),
    };
    let a = rand(f, &[4, 3, 5], 15, -400.0, 400.0);
    let b = rand(f, &[3, 5], 16, -400.0, 400.0);
    let c = rand(DType::Bool, &[4, 1, 1], 17, 0.0, 1.0);
    for out in [DType::U8, DType::BF16, DType::Bool, DType::I64] {
        check_with(
            &fused(mk(out)),
            &[&a, &b, &c],
            true,
            &format!("logic -> {out}"),
        );
    }
    // Wide chains: an f64 input makes every value f64; casts round to bf16/f32 on the way.
    for out in [DType::BF16, DType::F16, DType::F32, DType::I32, DType::U8] {
        let k = FusedKernel {
            n_inputs: 2,
            instrs: vec![
                bi(BinaryOp::Mul, 0, 0, DType::F64), // 2
                cast_to(DType::BF16, 2),             // 3
                cast_to(DType::F32, 1),              // 4
                cast_to(DType::F64, 3),              // 5
                cast_to(DType::F64, 4),              // 6
                bi(BinaryOp::Add, 5, 6, DType::F64), // 7
                cast_to(out, 7),                     // 8
            ],
            out: ty(out, &[6, 11]),
        };
        let a = rand(DType::F64, &[6, 11], 18, -12.0, 12.0);
        let b = rand(DType::I64, &[11], 19, -1000.0, 1000.0);
        check_with(&fused(k), &[&a, &b], true, &format!("wide -> {out}"));
    }
    // An unused input and a result computed from constants only.
    let k = FusedKernel {
        n_inputs: 2,
        instrs: vec![full(1.5, DType::F16), un(UnaryOp::Exp, 2, DType::F16)],
        out: ty(DType::F16, &[3, 2]),
    };
    let a = rand(DType::F16, &[3, 2], 20, -1.0, 1.0);
    check(&fused(k), &[&a, &a], "constant");
}

#[test]
fn permute_expand_slice_reshape() {
    let perms: [&[usize]; 5] = [&[0, 2, 1], &[2, 0, 1], &[1, 0, 2], &[2, 1, 0], &[0, 1, 2]];
    for (s, dt) in cuda_dtypes().enumerate() {
        let x = rand(dt, &[5, 7, 33], s as u64, -100.0, 100.0);
        for p in perms {
            let op = Op::Permute { perm: p.to_vec() };
            check_with(&op, &[&x], true, &format!("permute {p:?} {dt}"));
        }
        let x4 = rand(dt, &[2, 1, 3, 4], 50 + s as u64, -100.0, 100.0);
        let op = Op::Permute {
            perm: vec![3, 1, 0, 2],
        };
        check_with(&op, &[&x4], true, &format!("permute 4-d {dt}"));
        let x1 = rand(dt, &[3, 1, 4], 60 + s as u64, -100.0, 100.0);
        for shape in [vec![2, 3, 5, 4], vec![3, 6, 4], vec![3, 1, 4]] {
            let op = Op::Expand {
                shape: Shape::new(shape.clone()),
            };
            check_with(&op, &[&x1], true, &format!("expand {shape:?} {dt}"));
        }
        let sc = rand(dt, &[], 70, -100.0, 100.0);
        let op = Op::Expand {
            shape: Shape::new(vec![300]),
        };
        check_with(&op, &[&sc], true, &format!("expand scalar {dt}"));
        let slices = [
            (vec![1, 2, 3], vec![5, 7, 30], vec![2, 1, 4]),
            (vec![0, 0, 0], vec![5, 7, 33], vec![1, 1, 1]),
            (vec![4, 6, 32], vec![5, 7, 33], vec![1, 3, 5]),
            (vec![0, 3, 0], vec![5, 3, 33], vec![1, 1, 1]),
        ];
        for (starts, ends, steps) in slices {
            let what = format!("slice {starts:?}..{ends:?} by {steps:?} {dt}");
            let op = Op::Slice {
                starts,
                ends,
                steps,
            };
            check_with(&op, &[&x], true, &what);
        }
        let op = Op::Reshape {
            shape: Shape::new(vec![35, 33]),
        };
        check_with(&op, &[&x], true, &format!("reshape {dt}"));
    }
}

/// Whether a step's kernel stages through shared memory (the tiled transpose).
fn tiled(step: &StepKernels) -> bool {
    step.launches.iter().any(|l| {
        l.kernel
            .body
            .iter()
            .any(|s| matches!(s, cuda::ir::Stmt::Shared { .. }))
    })
}

#[test]
fn tiled_transposes() {
    let perms3: [&[usize]; 6] = [
        &[0, 1, 2],
        &[0, 2, 1],
        &[1, 0, 2],
        &[1, 2, 0],
        &[2, 0, 1],
        &[2, 1, 0],
    ];
    let perms4: [&[usize]; 4] = [&[0, 3, 1, 2], &[3, 2, 1, 0], &[1, 0, 3, 2], &[2, 3, 0, 1]];
    let mut n_tiled = 0;
    for (s, dt) in cuda_dtypes().enumerate() {
        let x = rand(dt, &[3, 37, 41], 500 + s as u64, -100.0, 100.0);
        let x4 = rand(dt, &[2, 9, 5, 40], 510 + s as u64, -100.0, 100.0);
        for (x, perms) in [(&x, &perms3[..]), (&x4, &perms4[..])] {
            for p in perms {
                let op = Op::Permute { perm: p.to_vec() };
                let want = eval_cpu(&op, &[x]).unwrap();
                n_tiled += tiled(&lower(&op, &[x], &want.ty())) as usize;
                check_with(
                    &op,
                    &[x],
                    true,
                    &format!("permute {p:?} of {} {dt}", x.shape()),
                );
            }
        }
    }
    // Two of each rank's permutes move the unit-stride dim before a last dim of 8 or more.
    assert_eq!(n_tiled, 8 * 4, "tiled transposes");
    // A plain 2-d transpose.
    let x = rand(DType::F32, &[40, 64], 520, -1.0, 1.0);
    let op = Op::Permute { perm: vec![1, 0] };
    let step = lower(&op, &[&x], &ty(DType::F32, &[64, 40]));
    assert!(tiled(&step));
}

#[test]
fn concat_and_pad() {
    for (s, dt) in cuda_dtypes().enumerate() {
        let seed = 200 + 10 * s as u64;
        for axis in 0..3 {
            let mut dims = [vec![2, 3, 4], vec![2, 3, 4], vec![2, 3, 4], vec![2, 3, 4]];
            for (k, d) in dims.iter_mut().enumerate() {
                d[axis] = [1, 5, 0, 2][k];
            }
            let xs: Vec<HostTensor> = dims
                .iter()
                .enumerate()
                .map(|(k, d)| rand(dt, d, seed + k as u64, -100.0, 100.0))
                .collect();
            let refs: Vec<&HostTensor> = xs.iter().collect();
            let op = Op::Concat { axis };
            check_with(&op, &refs, true, &format!("concat axis {axis} {dt}"));
            check_with(&op, &refs[..1], true, &format!("concat one input {dt}"));
        }
        let x = rand(dt, &[3, 4, 5], seed + 5, -100.0, 100.0);
        let pads = [
            vec![(1, 2), (0, 0), (3, 1)],
            vec![(0, 0), (2, 2), (0, 0)],
            vec![(0, 0), (0, 0), (0, 0)],
            vec![(2, 0), (0, 1), (0, 0)],
        ];
        for (k, p) in pads.into_iter().enumerate() {
            let value = [0.0, -1.5, 7.0, 300.7][k];
            let what = format!("pad {p:?} {value} {dt}");
            let op = Op::Pad {
                pads: p,
                value: F64Bits::new(value),
            };
            check_with(&op, &[&x], true, &what);
        }
        // Rank 0, an empty input, an output larger than a block.
        let s0 = rand(dt, &[], seed + 6, -100.0, 100.0);
        let op = Op::Pad {
            pads: vec![],
            value: F64Bits::new(1.0),
        };
        check_with(&op, &[&s0], true, &format!("pad rank 0 {dt}"));
        let e = rand(dt, &[2, 0], seed + 7, -100.0, 100.0);
        let op = Op::Pad {
            pads: vec![(1, 0), (2, 3)],
            value: F64Bits::new(f64::INFINITY),
        };
        check_with(&op, &[&e], true, &format!("pad empty {dt}"));
        let big = rand(dt, &[17, 1, 31], seed + 8, -100.0, 100.0);
        let op = Op::Pad {
            pads: vec![(0, 1), (1, 1), (5, 0)],
            value: F64Bits::new(2.0),
        };
        check_with(&op, &[&big], true, &format!("pad large {dt}"));
    }
}

/// Random indices in `0..n` of an index dtype.
fn indices(dt: DType, dims: &[usize], seed: u64, n: usize) -> HostTensor {
    rand(dt, dims, seed, 0.0, n as f64)
}

#[test]
fn gather_and_index_select() {
    for (s, dt) in cuda_dtypes().enumerate() {
        for idt in [DType::I32, DType::I64] {
            let seed = 300 + 10 * s as u64;
            let x = rand(dt, &[4, 6, 5], seed, -100.0, 100.0);
            for axis in 0..3 {
                let n = x.dims()[axis];
                let mut id = vec![3, 5, 4];
                id[axis] = 7;
                let idx = indices(idt, &id, seed + 1 + axis as u64, n);
                let what = format!("gather axis {axis} {dt} {idt}");
                check_with(&Op::Gather { axis }, &[&x, &idx], true, &what);
                let idx = indices(idt, &[9], seed + 4 + axis as u64, n);
                let what = format!("index_select axis {axis} {dt} {idt}");
                check_with(&Op::IndexSelect { axis }, &[&x, &idx], true, &what);
            }
            // An embedding lookup larger than a block.
            let table = rand(dt, &[50, 16], seed + 8, -100.0, 100.0);
            let ids = indices(idt, &[40], seed + 9, 50);
            let what = format!("embedding {dt} {idt}");
            check_with(&Op::IndexSelect { axis: 0 }, &[&table, &ids], true, &what);
        }
    }
}

#[test]
fn scatter_add_and_index_add() {
    for (s, dt) in cuda_dtypes().enumerate() {
        if dt == DType::Bool {
            continue;
        }
        for idt in [DType::I32, DType::I64] {
            let seed = 400 + 10 * s as u64;
            let base = rand(dt, &[4, 6, 5], seed, -100.0, 100.0);
            for axis in 0..3 {
                let n = base.dims()[axis];
                let mut id = vec![3, 5, 4];
                id[axis] = 9;
                // More source elements than targets along the axis: duplicate indices.
                let idx = indices(idt, &id, seed + 1 + axis as u64, n);
                let src = rand(dt, &id, seed + 4 + axis as u64, -100.0, 100.0);
                check(
                    &Op::ScatterAdd { axis },
                    &[&base, &idx, &src],
                    &format!("scatter_add axis {axis} {dt} {idt}"),
                );
                let idx = indices(idt, &[11], seed + 7 + axis as u64, n);
                let mut sd = vec![4, 6, 5];
                sd[axis] = 11;
                let src = rand(dt, &sd, seed + 8 + axis as u64, -100.0, 100.0);
                check(
                    &Op::IndexAdd { axis },
                    &[&base, &idx, &src],
                    &format!("index_add axis {axis} {dt} {idt}"),
                );
            }
            // An embedding gradient: many rows into few.
            let base = rand(dt, &[7, 9], seed + 9, -10.0, 10.0);
            let ids = indices(idt, &[60], seed + 10, 7);
            let src = rand(dt, &[60, 9], seed + 11, -10.0, 10.0);
            check(
                &Op::IndexAdd { axis: 0 },
                &[&base, &ids, &src],
                &format!("embedding grad {dt} {idt}"),
            );
        }
    }
}

#[test]
fn out_of_range_indices_read_zero_and_add_nothing() {
    let x = HostTensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], vec![2, 3]).unwrap();
    let idx = HostTensor::from_vec(vec![2i64, -1, 3, 0], vec![4]).unwrap();
    let out = ty(DType::F32, &[2, 4]);
    let step = lower(&Op::IndexSelect { axis: 1 }, &[&x, &idx], &out);
    let got = interp::run_step(&step, &[&x, &idx], &out, None).unwrap();
    assert_eq!(
        got.to_vec::<f32>().unwrap(),
        vec![3.0, 0.0, 0.0, 1.0, 6.0, 0.0, 0.0, 4.0]
    );
    let gidx = HostTensor::from_vec(vec![0i32, 5, -2, 1, 1, 2], vec![2, 3]).unwrap();
    let out = ty(DType::F32, &[2, 3]);
    let step = lower(&Op::Gather { axis: 1 }, &[&x, &gidx], &out);
    let got = interp::run_step(&step, &[&x, &gidx], &out, None).unwrap();
    assert_eq!(
        got.to_vec::<f32>().unwrap(),
        vec![1.0, 0.0, 0.0, 5.0, 5.0, 6.0]
    );
    let src = HostTensor::from_vec(vec![10.0f32; 6], vec![2, 3]).unwrap();
    let step = lower(&Op::ScatterAdd { axis: 1 }, &[&x, &gidx, &src], &out);
    let got = interp::run_step(&step, &[&x, &gidx, &src], &out, None).unwrap();
    assert_eq!(
        got.to_vec::<f32>().unwrap(),
        vec![11.0, 2.0, 3.0, 4.0, 25.0, 16.0]
    );
}

#[test]
fn empty_outputs_launch_nothing() {
    let x = ty(DType::F32, &[3, 0]);
    let step = elementwise::lower(&Op::Unary(UnaryOp::Exp), &[&x], &x).unwrap();
    assert!(step.launches.is_empty());
    let out = ty(DType::F32, &[0, 3]);
    let op = Op::Permute { perm: vec![1, 0] };
    let step = elementwise::lower_movement(&op, &[&x], &out).unwrap();
    assert!(step.launches.is_empty());
    // An output type that does not match the op is an error, not a kernel.
    let bad = ty(DType::F16, &[3, 0]);
    assert!(elementwise::lower(&Op::Unary(UnaryOp::Exp), &[&x], &bad).is_err());
}

#[test]
fn lower_step_dispatches_elementwise_and_movement() {
    let x = ty(DType::F32, &[4, 5]);
    let y = ty(DType::F32, &[5, 4]);
    for (op, out) in [
        (Op::Unary(UnaryOp::Relu), &x),
        (Op::Permute { perm: vec![1, 0] }, &y),
    ] {
        match cuda::lower_step(&op, &[&x], out).unwrap() {
            CudaStep::Kernels(k) => assert_eq!(k.launches.len(), 1),
            other => panic!("{}: {other:?}", op.name()),
        }
    }
}

/// The one kernel of a lowered step.
fn only_kernel(step: &StepKernels) -> &cuda::ir::Kernel {
    assert_eq!(step.launches.len(), 1);
    &step.launches[0].kernel
}

#[test]
fn snapshot_fused_f32_chain_with_broadcasting() {
    let k = chain(DType::F32, &[4, 3, 8]);
    let (a, b) = (ty(DType::F32, &[4, 1, 8]), ty(DType::F32, &[3, 8]));
    let out = k.out.clone();
    let step = elementwise::lower(&fused(k), &[&a, &b], &out).unwrap();
    let src = cuda::source(only_kernel(&step)).unwrap();
    insta::assert_snapshot!("fused_f32_chain", src);
}

#[test]
fn snapshot_bf16_cast() {
    let x = ty(DType::F32, &[64, 33]);
    let out = ty(DType::BF16, &[64, 33]);
    let step = elementwise::lower(&Op::Cast { to: DType::BF16 }, &[&x], &out).unwrap();
    let src = cuda::source(only_kernel(&step)).unwrap();
    insta::assert_snapshot!("cast_f32_bf16", src);
}

#[test]
fn snapshot_permute_021() {
    let x = ty(DType::F32, &[4, 64, 48]);
    let out = ty(DType::F32, &[4, 48, 64]);
    let op = Op::Permute {
        perm: vec![0, 2, 1],
    };
    let step = elementwise::lower_movement(&op, &[&x], &out).unwrap();
    let src = cuda::source(only_kernel(&step)).unwrap();
    insta::assert_snapshot!("permute_021", src);
}

/// Whether a step's kernels use vector accesses.
fn vectorized(step: &StepKernels) -> bool {
    step.launches
        .iter()
        .any(|l| cuda::source(&l.kernel).unwrap().contains("rt_vec<"))
}

/// Runs `op` on `inputs`, checks it against the CPU and returns whether its kernel is vectorized.
fn check_vector(op: &Op, inputs: &[&HostTensor], what: &str) -> bool {
    check(op, inputs, what);
    let out = eval_cpu(op, inputs).unwrap().ty();
    vectorized(&lower(op, inputs, &out))
}

/// Elementwise kernels over same-shape (or one-element) operands move 16-byte vectors: every
/// dtype, unary/binary/where/cast/fused, sizes with and without a scalar tail, against the CPU.
#[test]
fn vectorized_elementwise_kernels() {
    for dt in cuda_dtypes() {
        let w = 16 / dt.size_bytes();
        for n in [256 * w, 256 * w + w - 1, 3 * 256 * w + 1] {
            let what = |s: &str| format!("{s} {dt} [{n}]");
            let x = rand_small(dt, &[n], 11);
            let y = rand_small(dt, &[n], 12);
            let one = rand_small(dt, &[1], 13);
            let (unary, binary) = if dt == DType::Bool {
                (UnaryOp::Not, BinaryOp::Or)
            } else {
                (UnaryOp::Abs, BinaryOp::Maximum)
            };
            if accepts(&Op::Unary(unary), &[x.ty()]) {
                assert!(check_vector(&Op::Unary(unary), &[&x], &what("unary")));
            }
            assert!(check_vector(
                &Op::Binary(binary),
                &[&x, &y],
                &what("binary")
            ));
            // A one-element operand is loaded once; the result keeps the vector's shape.
            let op = Op::Binary(binary);
            assert!(check_vector(
                &op,
                &[&one, &x],
                &what("binary with a scalar")
            ));
            let c = rand(DType::Bool, &[n], 14, 0.0, 1.0);
            assert!(check_vector(&Op::Where, &[&c, &x, &y], &what("where")));
            for to in [DType::F32, DType::BF16, DType::U8, DType::F64] {
                let op = Op::Cast { to };
                assert!(check_vector(&op, &[&x], &what(&format!("cast to {to}"))));
            }
        }
    }
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let w = 16 / dt.size_bytes();
        let n = 512 * w + 3;
        let a = rand(dt, &[n], 21, -3.0, 3.0);
        let b = rand(dt, &[n], 22, -3.0, 3.0);
        let k = fused(chain(dt, &[n]));
        assert!(check_vector(&k, &[&a, &b], &format!("fused chain {dt}")));
    }
    // Broadcast operands whose last dim is the output's (a bias row) or 1 (a per-row
    // statistic) are read in vectors too when the output's last dim is a multiple of the width:
    // every float dtype, broadcasts at the front and in the middle, a wider row operand.
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let w = 16 / dt.size_bytes();
        let (r, c) = (64usize, 4 * w);
        let x = rand(dt, &[2, r, c], 41, -2.0, 2.0);
        let row = rand(dt, &[c], 42, -2.0, 2.0);
        let mid = rand(dt, &[2, 1, c], 43, -2.0, 2.0);
        let stat = rand(dt, &[2, r, 1], 44, -2.0, 2.0);
        let lead = rand(dt, &[r, c], 45, -2.0, 2.0);
        let add = Op::Binary(BinaryOp::Add);
        assert!(check_vector(&add, &[&x, &row], &format!("row {dt}")));
        assert!(check_vector(&add, &[&mid, &x], &format!("middle {dt}")));
        assert!(check_vector(
            &Op::Binary(BinaryOp::Sub),
            &[&x, &stat],
            &format!("per-row {dt}")
        ));
        assert!(check_vector(&add, &[&lead, &x], &format!("leading {dt}")));
        let c3 = rand(DType::Bool, &[2, r, 1], 46, 0.0, 1.0);
        assert!(check_vector(
            &Op::Where,
            &[&c3, &row, &stat],
            &format!("where of broadcasts {dt}")
        ));
        // The LayerNorm affine as fusion makes it: (x - mean) · rstd · w + b.
        let k = FusedKernel {
            n_inputs: 5,
            instrs: vec![
                bi(BinaryOp::Sub, 0, 1, dt),
                bi(BinaryOp::Mul, 5, 2, dt),
                bi(BinaryOp::Mul, 6, 3, dt),
                bi(BinaryOp::Add, 7, 4, dt),
            ],
            out: ty(dt, &[2, r, c]),
        };
        let rstd = rand(dt, &[2, r, 1], 47, 0.5, 2.0);
        let bias = rand(dt, &[c], 48, -1.0, 1.0);
        assert!(check_vector(
            &fused(k),
            &[&x, &stat, &rstd, &row, &bias],
            &format!("fused affine {dt}")
        ));
    }
    // bf16 output and an f32 row: the f32 operand sets the width (4).
    let x = rand(DType::BF16, &[64, 32], 51, -1.0, 1.0);
    let wide = rand(DType::F32, &[32], 52, -1.0, 1.0);
    let k = FusedKernel {
        n_inputs: 2,
        instrs: vec![
            cast_to(DType::F32, 0),
            bi(BinaryOp::Mul, 2, 1, DType::F32),
            cast_to(DType::BF16, 3),
        ],
        out: ty(DType::BF16, &[64, 32]),
    };
    assert!(check_vector(
        &fused(k),
        &[&x, &wide],
        "f32 row of a bf16 kernel"
    ));
    // A last dim that is not a multiple of the width keeps the strided loop.
    let a = rand(DType::F32, &[512, 30], 31, -1.0, 1.0);
    let b = rand(DType::F32, &[30], 32, -1.0, 1.0);
    assert!(!check_vector(
        &Op::Binary(BinaryOp::Add),
        &[&a, &b],
        "row broadcast, last dim 30"
    ));
    let b = rand(DType::F32, &[512, 1], 34, -1.0, 1.0);
    assert!(!check_vector(
        &Op::Binary(BinaryOp::Mul),
        &[&a, &b],
        "per-row broadcast, last dim 30"
    ));
    // So does a tensor too small to fill one block of vectors.
    let s = rand(DType::F32, &[1000], 33, -1.0, 1.0);
    assert!(!check_vector(&Op::Unary(UnaryOp::Neg), &[&s], "small"));
}

/// The benchmarked chain `tanh(silu(a)·b + 0.5·a)·2` in bf16 at 32768×4096: 8 elements a thread
/// in 16-byte accesses.
#[test]
fn snapshot_bf16_chain_vectorized() {
    let k = chain(DType::BF16, &[32768, 4096]);
    let t = ty(DType::BF16, &[32768, 4096]);
    let out = k.out.clone();
    let step = elementwise::lower(&fused(k), &[&t, &t], &out).unwrap();
    let src = cuda::source(only_kernel(&step)).unwrap();
    assert_eq!(step.launches[0].grid, 65_535);
    insta::assert_snapshot!("bf16_chain_vectorized", src);
}

#[test]
fn integer_dtypes_without_kernels_are_unsupported_naming_the_op() {
    use rustytorch_codegen::cuda::reduce;
    use rustytorch_ops::ReduceKind;
    for dt in [DType::I8, DType::I16, DType::U16, DType::U32, DType::U64] {
        assert!(!cuda::ir::dtype_supported(dt));
        let x = ty(dt, &[2, 3]);
        let cases: [(Op, Vec<TensorType>); 4] = [
            (Op::Binary(BinaryOp::Add), vec![x.clone(), x.clone()]),
            (Op::Cast { to: DType::F32 }, vec![ty(DType::F32, &[2, 3])]),
            (Op::Permute { perm: vec![1, 0] }, vec![x.clone()]),
            (
                Op::Reduce {
                    kind: ReduceKind::Sum,
                    axes: vec![1],
                    keep_dims: false,
                },
                vec![x.clone()],
            ),
        ];
        for (op, ins) in cases {
            // A cast *to* the dtype is refused as well as an operand of it.
            let op = match op {
                Op::Cast { .. } => Op::Cast { to: dt },
                op => op,
            };
            let refs: Vec<&TensorType> = ins.iter().collect();
            let out = infer(&op, &refs).unwrap();
            let r = match &op {
                Op::Reduce { .. } => reduce::lower(&op, &refs, &out),
                Op::Permute { .. } => elementwise::lower_movement(&op, &refs, &out),
                _ => elementwise::lower(&op, &refs, &out),
            };
            let e = r.unwrap_err();
            assert!(
                matches!(e, rustytorch_codegen::CodegenError::Unsupported { .. }),
                "{e}"
            );
            let e = e.to_string();
            assert!(e.contains(op.name()) && e.contains(dt.name()), "{e}");
        }
    }
}
