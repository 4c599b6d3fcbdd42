//! Declarative tests of the `matmul-dgelu-tanh` rules: a matmul's result times the tanh GELU's
//! derivative, spelled as its gradient rule spells it, becomes `matmul_act_grad[act=gelu_tanh]`;
//! wrong constants and a pre-activation of another shape do not.
//!
//! Leaves as in `rules.rs`: `in0:f32:2:3` is input 0 of type f32[2,3], `p0:f32:8` parameter 0, a
//! bare number an f32 scalar.

use rustytorch_compiler::optimize::rules::{all_rules, rewrites_to};

/// `gelu_tanh'(x)` as the elementwise family's gradient rule spells it (constants on the left of
/// `add` as emitted; `k` = √(2/π), `c` = 0.044715 unless overridden), its scalars of type `dt`.
fn dgelu_typed(x: &str, k: f64, c: f64, dt: &str) -> String {
    let s = |v: f64| format!("{v}:{dt}");
    let one = s(1.0);
    let t = format!(
        "(tanh (mul (mul {x} (add {one} (mul (mul {x} {x}) {c}))) {k}))",
        c = s(c),
        k = s(k)
    );
    format!(
        "(add (mul (add {one} {t}) {h}) (mul (mul (mul {x} (sub {one} (mul {t} {t}))) (add {one} (mul (mul {x} {x}) {c3}))) {hk}))",
        h = s(0.5),
        c3 = s(3.0 * c),
        hk = s(0.5 * k)
    )
}

fn dgelu(x: &str, k: f64, c: f64) -> String {
    dgelu_typed(x, k, c, "f32")
}

const K: f64 = 0.797_884_560_802_865_4;
const C: f64 = 0.044715;
/// `dy` [4, 8] times `W2ᵀ` (W2 [16, 8]) gives dh [4, 16]; `pre` is the pre-activation [4, 16].
const DY: &str = "in0:f32:4:8";
const W2: &str = "p0:f32:16:8";
const PRE: &str = "in1:f32:4:16";

fn check(input: String, expected: String, want: bool) {
    assert_eq!(
        rewrites_to(all_rules(), &input, &expected),
        Ok(want),
        "{input}\n  {} {expected}",
        if want { "=>" } else { "=/>" }
    );
}

#[test]
fn matmul_times_dgelu_tanh() {
    let mm = format!("(matmul[trans_b] {DY} {W2})");
    check(
        format!("(mul {mm} {})", dgelu(PRE, K, C)),
        format!("(matmul_act_grad[trans_b,act=gelu_tanh] {DY} {W2} {PRE})"),
        true,
    );
}

#[test]
fn matmul_times_dgelu_tanh_rev() {
    let mm = format!("(matmul {DY} p0:f32:8:16)");
    check(
        format!("(mul {} {mm})", dgelu(PRE, K, C)),
        format!("(matmul_act_grad[act=gelu_tanh] {DY} p0:f32:8:16 {PRE})"),
        true,
    );
}

#[test]
fn the_transpose_of_a_permuted_operand_is_carried_over() {
    let mm = format!("(matmul {DY} (permute[perm=1:0] {W2}))");
    check(
        format!("(mul {mm} {})", dgelu(PRE, K, C)),
        format!("(matmul_act_grad[trans_b,act=gelu_tanh] {DY} {W2} {PRE})"),
        true,
    );
}

#[test]
fn batched_bf16() {
    let (dy, w, pre) = ("in0:bf16:2:4:8", "p0:bf16:16:8", "in1:bf16:2:4:16");
    let d = dgelu_typed(pre, K, C, "bf16");
    check(
        format!("(mul (matmul[trans_b] {dy} {w}) {d})"),
        format!("(matmul_act_grad[trans_b,act=gelu_tanh] {dy} {w} {pre})"),
        true,
    );
}

#[test]
fn wrong_constants_do_not_match() {
    let mm = format!("(matmul[trans_b] {DY} {W2})");
    let want = format!("(matmul_act_grad[trans_b,act=gelu_tanh] {DY} {W2} {PRE})");
    check(
        format!("(mul {mm} {})", dgelu(PRE, K, 0.05)),
        want.clone(),
        false,
    );
    check(format!("(mul {mm} {})", dgelu(PRE, 0.7, C)), want, false);
}

#[test]
fn a_broadcast_pre_activation_does_not_match() {
    // pre [16] broadcasts against dh [4, 16]: the op needs the product's shape.
    let pre = "p1:f32:16";
    let mm = format!("(matmul[trans_b] {DY} {W2})");
    check(
        format!("(mul {mm} {})", dgelu(pre, K, C)),
        format!("(matmul_act_grad[trans_b,act=gelu_tanh] {DY} {W2} {pre})"),
        false,
    );
}
