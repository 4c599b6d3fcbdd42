//! One declarative test per rule: `input => expected` holds when, after running every rule to
//! saturation on the e-graph of `input`, `expected` is in the same e-class; `input =/> expected`
//! (the `keeps!` form) checks that a rule whose condition fails does not fire.
//!
//! Leaves: `in0:f32:2:3` is input 0 of type f32[2,3], `p0:f32:8` parameter 0, `c0:bool:4:4`
//! constant 0; a bare number is an f32 scalar (`full`).

use rustytorch_compiler::optimize::analysis::TensorAnalysis;
use rustytorch_compiler::optimize::rules::{all_rules, rewrites_to, rewrites_to_with};

macro_rules! rewrites {
    ($($name:ident: $input:expr => $expected:expr;)*) => {$(
        #[test]
        fn $name() {
            let (i, e): (String, String) = ($input.to_string(), $expected.to_string());
            assert_eq!(rewrites_to(all_rules(), &i, &e), Ok(true), "{i}\n  => {e}");
        }
    )*};
}

macro_rules! keeps {
    ($($name:ident: $input:expr => $expected:expr;)*) => {$(
        #[test]
        fn $name() {
            let (i, e): (String, String) = ($input.to_string(), $expected.to_string());
            assert_eq!(rewrites_to(all_rules(), &i, &e), Ok(false), "{i}\n  =/> {e}");
        }
    )*};
}

const X: &str = "in0:f32:2:8";

// ---- algebra ----
rewrites! {
    mul_one: "(mul in0:f32:2:3 1)" => "in0:f32:2:3";
    add_zero: "(add in0:f32:2:3 -0)" => "in0:f32:2:3";
    sub_zero: "(sub in0:f32:2:3 0)" => "in0:f32:2:3";
    div_one: "(div in0:f32:2:3 1)" => "in0:f32:2:3";
    neg_neg: "(neg (neg in0:f32:4))" => "in0:f32:4";
    exp_log: "(exp (log (exp in0:f32:4)))" => "(exp in0:f32:4)";
    mul_const_right: "(mul 2 in0:f32:4)" => "(mul in0:f32:4 2)";
    add_const_right: "(add 0 in0:f32:4)" => "(add in0:f32:4 0)";
    cube_to_pow: "(mul (mul in0:f32:4 in0:f32:4) in0:f32:4)" => "(pow in0:f32:4 3)";
    cube_to_pow_rev: "(mul in0:f32:4 (mul in0:f32:4 in0:f32:4))" => "(pow in0:f32:4 3)";
    permute_compose_identity:
        "(permute[perm=1:2:0] (permute[perm=2:0:1] in0:f32:2:3:4))" => "in0:f32:2:3:4";
    permute_compose:
        "(permute[perm=1:0:2] (permute[perm=0:2:1] in0:f32:2:3:4))" => "(permute[perm=2:0:1] in0:f32:2:3:4)";
    reshape_compose:
        "(reshape[shape=6:4] (reshape[shape=2:12] in0:f32:2:3:4))" => "(reshape[shape=6:4] in0:f32:2:3:4)";
    reshape_compose_identity: "(reshape[shape=2:3:4] (reshape[shape=24] in0:f32:2:3:4))" => "in0:f32:2:3:4";
    cast_identity: "(cast[to=f32] in0:f32:4)" => "in0:f32:4";
    cast_cast_lossless: "(cast[to=f64] (cast[to=f32] in0:f16:4))" => "(cast[to=f64] in0:f16:4)";
    cast_cast_round_trip: "(cast[to=f16] (cast[to=f32] in0:f16:4))" => "in0:f16:4";
    fold_add: "(add 2 3)" => "5";
    fold_exp: "(exp 0)" => "1";
    fold_mul_f64: "(mul 2:f64 0.25:f64)" => "0.5:f64";
    fold_nested: "(mul in0:f32:3 (add 0.5 0.5))" => "in0:f32:3";
}

keeps! {
    mul_one_that_broadcasts: "(mul in0:f32:3 1:f32:2:3)" => "in0:f32:3";
    add_positive_zero: "(add in0:f32:4 0)" => "in0:f32:4";
    exp_log_of_any_sign: "(exp (log in0:f32:4))" => "in0:f32:4";
    log_exp_overflows: "(log (exp in0:f32:4))" => "in0:f32:4";
    cast_cast_lossy: "(cast[to=f32] (cast[to=f16] in0:f32:4))" => "in0:f32:4";
    mul_const_right_needs_a_constant: "(mul in1:f32:4 in0:f32:4)" => "(mul in0:f32:4 in1:f32:4)";
}

// ---- layout ----
rewrites! {
    matmul_fold_trans_b: "(matmul in0:f32:4:8 (permute[perm=1:0] in1:f32:16:8))" => "(matmul[trans_b] in0:f32:4:8 in1:f32:16:8)";
    matmul_fold_trans_a: "(matmul (permute[perm=1:0] in0:f32:8:4) in1:f32:8:16)" => "(matmul[trans_a] in0:f32:8:4 in1:f32:8:16)";
    matmul_fold_trans_batched:
        "(matmul in0:f32:2:4:8 (permute[perm=0:2:1] in1:f32:2:16:8))" => "(matmul[trans_b] in0:f32:2:4:8 in1:f32:2:16:8)";
    matmul_fold_both:
        "(matmul (permute[perm=1:0] in0:f32:8:4) (permute[perm=1:0] in1:f32:16:8))" => "(matmul[trans_a,trans_b] in0:f32:8:4 in1:f32:16:8)";
    permute_identity: "(permute[perm=0:1] in0:f32:2:3)" => "in0:f32:2:3";
    reshape_identity: "(reshape[shape=2:3] in0:f32:2:3)" => "in0:f32:2:3";
    expand_identity: "(expand[shape=2:3] in0:f32:2:3)" => "in0:f32:2:3";
    expand_past_exp: "(exp (expand[shape=4:3] in0:f32:1:3))" => "(expand[shape=4:3] (exp in0:f32:1:3))";
    expand_past_cast: "(cast[to=f64] (expand[shape=4:3] in0:f32:1:3))" => "(expand[shape=4:3] (cast[to=f64] in0:f32:1:3))";
    expand_past_add:
        "(add (expand[shape=4:3] in0:f32:1:3) (expand[shape=4:3] in1:f32:1:3))" => "(expand[shape=4:3] (add in0:f32:1:3 in1:f32:1:3))";
    expand_past_mul_left: "(mul (expand[shape=4:3] in0:f32:1:3) 2)" => "(expand[shape=4:3] (mul in0:f32:1:3 2))";
    expand_past_sub_right: "(sub in1:f32:3 (expand[shape=4:3] in0:f32:1:3))" => "(expand[shape=4:3] (sub in1:f32:3 in0:f32:1:3))";
}

keeps! {
    matmul_no_fold_other_permutes:
        "(matmul in0:f32:2:4:8 (permute[perm=1:0:2] in1:f32:8:2:16))" => "(matmul in0:f32:2:4:8 in1:f32:8:2:16)";
    expand_not_past_full_size:
        "(add (expand[shape=4:3] in0:f32:1:3) in1:f32:4:3)" => "(expand[shape=4:3] (add in0:f32:1:3 in1:f32:4:3))";
}

// ---- recognition: GELU, SiLU ----
fn gelu_spelled(x: &str, c: f64, k: f64) -> String {
    format!("(mul (mul {x} 0.5) (add (tanh (mul (add {x} (mul (pow {x} 3) {k})) {c})) 1))")
}

rewrites! {
    gelu_tanh_half_first: gelu_spelled(X, 0.7978845608, 0.044715) => format!("(gelu_tanh {X})");
    gelu_tanh_constants_left_and_cube:
        format!("(mul (mul 0.5 {X}) (add 1 (tanh (mul 0.79788456 (add {X} (mul 0.044715 (mul (mul {X} {X}) {X})))))))")
        => format!("(gelu_tanh {X})");
    gelu_tanh_half_last:
        format!("(mul (mul {X} (add (tanh (mul (add (mul (pow {X} 3) 0.044715) {X}) 0.7978846)) 1)) 0.5)")
        => format!("(gelu_tanh {X})");
    gelu_tanh_half_inner:
        format!("(mul {X} (mul (add (tanh (mul (add {X} (mul (pow {X} 3) 0.044715)) 0.7978846)) 1) 0.5))")
        => format!("(gelu_tanh {X})");
    silu: format!("(mul {X} (sigmoid {X}))") => format!("(silu {X})");
    silu_rev: format!("(mul (sigmoid {X}) {X})") => format!("(silu {X})");
    silu_div: format!("(div {X} (add (exp (neg {X})) 1))") => format!("(silu {X})");
}

rewrites! {
    gelu_erf_mul:
        format!("(mul (mul {X} 0.5) (add (erf (mul {X} 0.70710678)) 1))") => format!("(gelu {X})");
    gelu_erf_div:
        format!("(mul (mul {X} (add (erf (div {X} 1.41421356)) 1)) 0.5)") => format!("(gelu {X})");
}

keeps! {
    gelu_erf_wrong_scale: format!("(mul (mul {X} 0.5) (add (erf (mul {X} 0.5)) 1))") => format!("(gelu {X})");
    gelu_tanh_wrong_constant: gelu_spelled(X, 0.7978845608, 0.05) => format!("(gelu_tanh {X})");
    gelu_tanh_wrong_scale: gelu_spelled(X, 0.9, 0.044715) => format!("(gelu_tanh {X})");
}

// ---- recognition: softmax ----
fn softmax_spelled(x: &str, max_axis: usize, sum_axis: usize) -> String {
    let e = format!("(exp (sub {x} (reduce_max[axes={max_axis},keep] {x})))");
    format!("(div {e} (reduce_sum[axes={sum_axis},keep] {e}))")
}

rewrites! {
    softmax: softmax_spelled(X, 1, 1) => format!("(softmax[axis=1] {X})");
    softmax_first_axis: softmax_spelled(X, 0, 0) => format!("(softmax[axis=0] {X})");
    softmax_recip: {
        let e = format!("(exp (sub {X} (reduce_max[axes=1,keep] {X})))");
        format!("(mul {e} (reciprocal (reduce_sum[axes=1,keep] {e})))")
    } => format!("(softmax[axis=1] {X})");
    softmax_no_max: format!("(div (exp {X}) (reduce_sum[axes=1,keep] (exp {X})))") => format!("(softmax[axis=1] {X})");
    log_softmax: {
        let m = format!("(sub {X} (reduce_max[axes=1,keep] {X}))");
        format!("(sub {m} (log (reduce_sum[axes=1,keep] (exp {m}))))")
    } => format!("(log_softmax[axis=1] {X})");
    log_softmax_no_max: format!("(sub {X} (log (reduce_sum[axes=1,keep] (exp {X}))))") => format!("(log_softmax[axis=1] {X})");
    log_of_softmax: format!("(log (softmax[axis=1] {X}))") => format!("(log_softmax[axis=1] {X})");
}

keeps! {
    softmax_mismatched_axes: softmax_spelled(X, 0, 1) => format!("(softmax[axis=1] {X})");
    softmax_without_keep_dims:
        format!("(div (exp {X}) (reshape[shape=2:1] (reduce_sum[axes=1] (exp {X}))))") => format!("(softmax[axis=1] {X})");
}

// ---- recognition: LayerNorm, RMSNorm ----
fn xc(x: &str, axis: usize) -> String {
    format!("(sub {x} (reduce_mean[axes={axis},keep] {x}))")
}

fn layer_norm_spelled(x: &str, axis: usize, form: &str) -> String {
    let c = xc(x, axis);
    let var = format!("(reduce_mean[axes={axis},keep] (mul {c} {c}))");
    let var_pow = format!("(reduce_mean[axes={axis},keep] (pow {c} 2))");
    match form {
        "mul-rsqrt" => format!("(mul {c} (rsqrt (add {var} 1e-5)))"),
        "rsqrt-mul" => format!("(mul (rsqrt (add {var} 1e-5)) {c})"),
        "div-sqrt" => format!("(div {c} (sqrt (add {var} 1e-5)))"),
        "pow" => format!("(mul {c} (rsqrt (add {var_pow} 1e-5)))"),
        _ => unreachable!(),
    }
}

fn rms_spelled(x: &str, form: &str) -> String {
    match form {
        "mul-rsqrt" => {
            format!("(mul {x} (rsqrt (add (reduce_mean[axes=1,keep] (mul {x} {x})) 1e-6)))")
        }
        "div-sqrt" => {
            format!("(div {x} (sqrt (add (reduce_mean[axes=1,keep] (mul {x} {x})) 1e-6)))")
        }
        "pow" => format!("(mul (rsqrt (add (reduce_mean[axes=1,keep] (pow {x} 2)) 1e-6)) {x})"),
        _ => unreachable!(),
    }
}

rewrites! {
    layer_norm_mul_rsqrt: layer_norm_spelled(X, 1, "mul-rsqrt") => format!("(layer_norm[eps=1e-5] {X})");
    layer_norm_rsqrt_mul: layer_norm_spelled(X, 1, "rsqrt-mul") => format!("(layer_norm[eps=1e-5] {X})");
    layer_norm_div_sqrt: layer_norm_spelled(X, 1, "div-sqrt") => format!("(layer_norm[eps=1e-5] {X})");
    layer_norm_square_as_pow: layer_norm_spelled(X, 1, "pow") => format!("(layer_norm[eps=1e-5] {X})");
    layer_norm_affine:
        format!("(add (mul {} p0:f32:8) p1:f32:8)", layer_norm_spelled(X, 1, "mul-rsqrt"))
        => format!("(layer_norm[eps=1e-5,weight,bias] {X} p0:f32:8 p1:f32:8)");
    layer_norm_weight:
        format!("(mul {} p0:f32:8)", layer_norm_spelled(X, 1, "div-sqrt")) => format!("(layer_norm[eps=1e-5,weight] {X} p0:f32:8)");
    layer_norm_weight_rev:
        format!("(mul p0:f32:8 {})", layer_norm_spelled(X, 1, "div-sqrt")) => format!("(layer_norm[eps=1e-5,weight] {X} p0:f32:8)");
    layer_norm_bias:
        format!("(add {} p1:f32:8)", layer_norm_spelled(X, 1, "div-sqrt")) => format!("(layer_norm[eps=1e-5,bias] {X} p1:f32:8)");
    layer_norm_weight_bias:
        "(add (layer_norm[eps=1e-5,weight] in0:f32:2:8 p0:f32:8) p1:f32:8)" => "(layer_norm[eps=1e-5,weight,bias] in0:f32:2:8 p0:f32:8 p1:f32:8)";
    rms_norm_mul_rsqrt: rms_spelled(X, "mul-rsqrt") => format!("(rms_norm[eps=1e-6] {X})");
    rms_norm_div_sqrt: rms_spelled(X, "div-sqrt") => format!("(rms_norm[eps=1e-6] {X})");
    rms_norm_square_as_pow: rms_spelled(X, "pow") => format!("(rms_norm[eps=1e-6] {X})");
    rms_norm_weight: format!("(mul {} p0:f32:8)", rms_spelled(X, "mul-rsqrt")) => format!("(rms_norm[eps=1e-6,weight] {X} p0:f32:8)");
    rms_norm_weight_rev: format!("(mul p0:f32:8 {})", rms_spelled(X, "mul-rsqrt")) => format!("(rms_norm[eps=1e-6,weight] {X} p0:f32:8)");
}

keeps! {
    layer_norm_not_over_first_axis: layer_norm_spelled(X, 0, "mul-rsqrt") => format!("(layer_norm[eps=1e-5] {X})");
    layer_norm_affine_needs_last_dim_weight:
        format!("(mul {} p0:f32:2:8)", layer_norm_spelled(X, 1, "mul-rsqrt")) => format!("(layer_norm[eps=1e-5,weight] {X} p0:f32:2:8)");
}

// ---- recognition: matmul epilogues ----
const A: &str = "in0:f32:4:8";
const W: &str = "p0:f32:8:16";
const B: &str = "p1:f32:16";

rewrites! {
    matmul_bias: format!("(add (matmul {A} {W}) {B})") => format!("(matmul_epilogue[bias,act=none] {A} {W} {B})");
    matmul_bias_rev: format!("(add {B} (matmul {A} {W}))") => format!("(matmul_epilogue[bias,act=none] {A} {W} {B})");
    matmul_bias_batched:
        format!("(add (matmul in0:f32:2:4:8 {W}) {B})") => format!("(matmul_epilogue[bias,act=none] in0:f32:2:4:8 {W} {B})");
    matmul_bias_transposed:
        format!("(add (matmul {A} (permute[perm=1:0] p0:f32:16:8)) {B})") => format!("(matmul_epilogue[trans_b,bias,act=none] {A} p0:f32:16:8 {B})");
    epilogue_bias_gelu_tanh:
        format!("(gelu_tanh (add (matmul {A} {W}) {B}))") => format!("(matmul_epilogue[bias,act=gelu_tanh] {A} {W} {B})");
    epilogue_bias_gelu: format!("(gelu (add (matmul {A} {W}) {B}))") => format!("(matmul_epilogue[bias,act=gelu] {A} {W} {B})");
    epilogue_bias_relu: format!("(relu (add (matmul {A} {W}) {B}))") => format!("(matmul_epilogue[bias,act=relu] {A} {W} {B})");
    epilogue_relu: format!("(relu (matmul {A} {W}))") => format!("(matmul_epilogue[act=relu] {A} {W})");
    epilogue_gelu_tanh_spelled:
        gelu_spelled(&format!("(add (matmul {A} {W}) {B})"), 0.7978845608, 0.044715)
        => format!("(matmul_epilogue[bias,act=gelu_tanh] {A} {W} {B})");
}

keeps! {
    matmul_bias_needs_1d_bias: format!("(add (matmul {A} {W}) p1:f32:4:16)") => format!("(matmul_epilogue[bias,act=none] {A} {W} p1:f32:4:16)");
    matmul_bias_not_over_rows: format!("(add (matmul {A} {W}) p1:f32:4:1)") => format!("(matmul_epilogue[bias,act=none] {A} {W} p1:f32:4:1)");
}

// ---- recognition: convolution activations ----
const CX: &str = "in0:f32:1:2:5:5";
const CW: &str = "p0:f32:3:2:3:3";
const CB: &str = "p1:f32:3";
const CONV: &str = "conv[stride=1:1,padding=1:1,dilation=1:1,groups=1";

rewrites! {
    conv_bias_relu: format!("(relu ({CONV},bias] {CX} {CW} {CB}))") => format!("({CONV},bias,act=relu] {CX} {CW} {CB})");
    conv_bias_gelu: format!("(gelu ({CONV},bias] {CX} {CW} {CB}))") => format!("({CONV},bias,act=gelu] {CX} {CW} {CB})");
    conv_bias_gelu_tanh: format!("(gelu_tanh ({CONV},bias] {CX} {CW} {CB}))") => format!("({CONV},bias,act=gelu_tanh] {CX} {CW} {CB})");
    conv_relu: format!("(relu ({CONV}] {CX} {CW}))") => format!("({CONV},act=relu] {CX} {CW})");
    conv_gelu: format!("(gelu ({CONV}] {CX} {CW}))") => format!("({CONV},act=gelu] {CX} {CW})");
    conv_gelu_tanh: format!("(gelu_tanh ({CONV}] {CX} {CW}))") => format!("({CONV},act=gelu_tanh] {CX} {CW})");
    conv_gelu_spelled:
        gelu_spelled(&format!("({CONV},bias] {CX} {CW} {CB})"), 0.7978845608, 0.044715)
        => format!("({CONV},bias,act=gelu_tanh] {CX} {CW} {CB})");
}

keeps! {
    conv_with_an_activation_takes_no_second: format!("(relu ({CONV},act=gelu] {CX} {CW}))") => format!("({CONV},act=relu] {CX} {CW})");
}

// ---- recognition: attention ----
const Q: &str = "in0:f32:1:2:4:8";
const K: &str = "in1:f32:1:2:4:8";
const V: &str = "in2:f32:1:2:4:8";

fn scores(op: &str, c: &str) -> String {
    format!("({op} (matmul {Q} (permute[perm=0:1:3:2] {K})) {c})")
}

fn attn(s: &str) -> String {
    format!("(matmul (softmax[axis=3] {s}) {V})")
}

fn keep(cmp: &str, a: usize, b: usize) -> String {
    format!("({cmp} (iota[axis={a},ty=i64:4:4]) (iota[axis={b},ty=i64:4:4]))")
}

rewrites! {
    attention_mul: attn(&scores("mul", "0.25")) => format!("(attention[causal=none,mask=none,scale=0.25] {Q} {K} {V})");
    attention_div: attn(&scores("div", "4")) => format!("(attention[causal=none,mask=none,scale=0.25] {Q} {K} {V})");
    attention_unscaled:
        attn(&format!("(matmul {Q} (permute[perm=0:1:3:2] {K}))")) => format!("(attention[causal=none,mask=none,scale=1.0] {Q} {K} {V})");
    attention_additive:
        attn(&format!("(add {} in3:f32:1:1:4:4)", scores("mul", "0.25")))
        => format!("(attention[causal=none,mask=additive,scale=0.25] {Q} {K} {V} in3:f32:1:1:4:4)");
    attention_causal:
        attn(&format!("(where {} {} -inf)", keep("ge", 0, 1), scores("mul", "0.25")))
        => format!("(attention[causal=top_left,mask=none,scale=0.25] {Q} {K} {V})");
    attention_causal_le:
        attn(&format!("(where {} {} -1e9)", keep("le", 1, 0), scores("mul", "0.25")))
        => format!("(attention[causal=top_left,mask=none,scale=0.25] {Q} {K} {V})");
    attention_causal_drop:
        attn(&format!("(where {} -inf {})", keep("lt", 0, 1), scores("div", "4")))
        => format!("(attention[causal=top_left,mask=none,scale=0.25] {Q} {K} {V})");
    attention_softmax_spelled:
        format!("(matmul {} {V})", softmax_spelled(&scores("mul", "0.25"), 3, 3))
        => format!("(attention[causal=none,mask=none,scale=0.25] {Q} {K} {V})");
}

keeps! {
    attention_anti_causal_mask:
        attn(&format!("(where {} {} -inf)", keep("le", 0, 1), scores("mul", "0.25")))
        => format!("(attention[causal=top_left,mask=none,scale=0.25] {Q} {K} {V})");
    attention_small_fill:
        attn(&format!("(where {} {} -1)", keep("ge", 0, 1), scores("mul", "0.25")))
        => format!("(attention[causal=top_left,mask=none,scale=0.25] {Q} {K} {V})");
    attention_softmax_not_last_axis:
        format!("(matmul (softmax[axis=2] {}) {V})", scores("mul", "0.25"))
        => format!("(attention[causal=none,mask=none,scale=0.25] {Q} {K} {V})");
}

#[test]
fn attention_causal_constant_mask() {
    let analysis = TensorAnalysis {
        causal_constants: [0].into_iter().collect(),
        ..Default::default()
    };
    let input = attn(&format!(
        "(where c0:bool:4:4 {} -inf)",
        scores("mul", "0.25")
    ));
    let expected = format!("(attention[causal=top_left,mask=none,scale=0.25] {Q} {K} {V})");
    assert_eq!(
        rewrites_to_with(analysis, all_rules(), &input, &expected),
        Ok(true)
    );
    // The same constant, not known to be causal, is not recognized.
    assert_eq!(rewrites_to(all_rules(), &input, &expected), Ok(false));
}

#[test]
fn every_rule_has_a_unique_name() {
    let mut names: Vec<String> = all_rules().iter().map(|r| r.name.to_string()).collect();
    let n = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), n);
}
