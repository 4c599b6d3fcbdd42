//! Reference model graphs for tests, benchmarks and examples, spelled in primitive ops the way a
//! user who does not know the fused ops would write them (LayerNorm from means and rsqrt, softmax
//! from exp/sum/div, GELU from tanh, attention from matmuls, a causal `where` and softmax), so the
//! optimizer has something to recognize.

pub mod bert;

use crate::{DType, GraphBuilder, Init, Shape, Tensor, TensorType};

/// GPT-2-style decoder configuration.
#[derive(Clone, Copy, Debug)]
pub struct Gpt2Config {
    /// Transformer blocks.
    pub layers: usize,
    /// Batch size.
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
    /// Model width.
    pub d_model: usize,
    /// Attention heads.
    pub heads: usize,
}

impl Gpt2Config {
    /// GPT-2 small (12 layers, d 768, 12 heads) at batch 8, sequence 1024.
    pub fn small() -> Gpt2Config {
        Gpt2Config {
            layers: 12,
            batch: 8,
            seq: 1024,
            d_model: 768,
            heads: 12,
        }
    }
}

/// LayerNorm over the last dim spelled in primitives.
pub fn layer_norm_primitives(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Tensor {
    let mu = x.mean(&[-1], true);
    let xc = x.sub(&mu);
    let var = xc.mul(&xc).mean(&[-1], true);
    xc.mul(&var.add_scalar(eps).rsqrt()).mul(w).add(b)
}

/// RMSNorm over the last dim spelled in primitives.
pub fn rms_norm_primitives(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let ms = x.mul(x).mean(&[-1], true);
    x.mul(&ms.add_scalar(eps).rsqrt()).mul(w)
}

/// GELU's tanh form spelled in primitives.
pub fn gelu_tanh_primitives(x: &Tensor) -> Tensor {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let inner = x.add(&x.mul(x).mul(x).mul_scalar(0.044715)).mul_scalar(c);
    x.mul_scalar(0.5).mul(&inner.tanh().add_scalar(1.0))
}

/// Softmax over the last dim spelled in primitives (max-subtracted).
pub fn softmax_primitives(x: &Tensor) -> Tensor {
    let e = x.sub(&x.max(&[-1], true)).exp();
    e.div(&e.sum(&[-1], true))
}

/// A [S, S] bool mask, true where key j <= query i.
pub fn causal_mask(g: &GraphBuilder, s: usize) -> Tensor {
    let rows = g.iota(0, TensorType::new(DType::I64, Shape::new([s, s])));
    let cols = g.iota(1, TensorType::new(DType::I64, Shape::new([s, s])));
    cols.le(&rows)
}

/// Causal self-attention of q, k, v [B, H, S, D] spelled in primitives.
pub fn causal_attention_primitives(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let dims = q.dims();
    let (s, d) = (dims[2], dims[3]);
    let g = q.builder();
    let scores = q.matmul(&k.t()).mul_scalar(1.0 / (d as f64).sqrt());
    let masked = g.where_(
        &causal_mask(g, s),
        &scores,
        &scores.scalar_like(f64::NEG_INFINITY),
    );
    softmax_primitives(&masked).matmul(v)
}

fn linear(g: &GraphBuilder, name: &str, x: &Tensor, i: usize, o: usize, dt: DType) -> Tensor {
    let ty = |dims: &[usize]| TensorType::new(dt, Shape::new(dims.to_vec()));
    let normal = Init::Normal {
        mean: 0.0,
        std: 0.02,
        seed: g.next_seed(),
    };
    let w = g.param_typed(&format!("{name}.w"), ty(&[i, o]), normal, true);
    let b = g.param_typed(&format!("{name}.b"), ty(&[o]), Init::zeros(), true);
    x.matmul(&w).add(&b)
}

/// One pre-norm transformer block over x [B, S, D]: LayerNorm, causal self-attention and the
/// tanh GELU as the fused ops, the MLP, residual adds (the rest spelled in primitives).
pub fn gpt2_block(g: &GraphBuilder, cfg: &Gpt2Config, layer: usize, x: &Tensor) -> Tensor {
    gpt2_block_typed(g, cfg, layer, x, DType::F32)
}

/// [`gpt2_block`] with parameters of type `dt` (bf16 or f16 for a half-precision model; x must
/// have that type too).
pub fn gpt2_block_typed(
    g: &GraphBuilder,
    cfg: &Gpt2Config,
    layer: usize,
    x: &Tensor,
    dt: DType,
) -> Tensor {
    let (b, s, d, h) = (cfg.batch, cfg.seq, cfg.d_model, cfg.heads);
    let p = |n: &str| format!("h{layer}.{n}");
    let ln = |name: &str, x: &Tensor| {
        let ty = TensorType::new(dt, Shape::new([d]));
        let w = g.param_typed(&p(&format!("{name}.w")), ty.clone(), Init::ones(), true);
        let bb = g.param_typed(&p(&format!("{name}.b")), ty, Init::zeros(), true);
        layer_norm_primitives(x, &w, &bb, 1e-5)
    };
    let a = ln("ln1", x);
    // q, k and v from one linear layer (GPT-2's `c_attn`), split and then into heads.
    let qkv = linear(g, &p("attn.qkv"), &a, d, 3 * d, dt);
    let heads = |j: usize| {
        qkv.slice(-1, j * d, (j + 1) * d, 1)
            .reshape([b, s, h, d / h])
            .permute(&[0, 2, 1, 3])
    };
    let (q, k, v) = (heads(0), heads(1), heads(2));
    // The fused op (as a model calls SDPA), so that autodiff differentiates it as one op
    // (`attention_grad`, the flash backward on CUDA); the optimizer recognizes the same op
    // in `causal_attention_primitives` for graphs that spell it out.
    let att = q
        .attention(&k, &v, None, rustytorch_ops::Causal::TopLeft, None)
        .permute(&[0, 2, 1, 3])
        .reshape([b, s, d]);
    let x = x.add(&linear(g, &p("attn.proj"), &att, d, d, dt));
    let m = ln("ln2", &x);
    // GELU as the fused op (as a model calls `gelu(approximate="tanh")`): autodiff then
    // differentiates one op, whose gradient after the MLP's second matmul the optimizer makes
    // one `matmul_act_grad` (cuBLASLt's DGELU epilogue on CUDA).
    let hdn = linear(g, &p("mlp.fc"), &m, d, 4 * d, dt).gelu_tanh();
    x.add(&linear(g, &p("mlp.proj"), &hdn, 4 * d, d, dt))
}

/// A GPT-2-style decoder stack over embedded input x [B, S, D] (input `x`), with a final LayerNorm;
/// returns (x, hidden states).
pub fn gpt2(g: &GraphBuilder, cfg: &Gpt2Config) -> (Tensor, Tensor) {
    gpt2_typed(g, cfg, DType::F32)
}

/// [`gpt2`] with the input and every parameter of type `dt` (a bf16 or f16 model, as PyTorch's
/// `model.to(torch.bfloat16)`; norms and softmax keep f32 statistics inside their kernels).
pub fn gpt2_typed(g: &GraphBuilder, cfg: &Gpt2Config, dt: DType) -> (Tensor, Tensor) {
    let x = g.input("x", dt, [cfg.batch, cfg.seq, cfg.d_model]);
    let mut h = x.clone();
    for l in 0..cfg.layers {
        h = gpt2_block_typed(g, cfg, l, &h, dt);
    }
    let ty = TensorType::new(dt, Shape::new([cfg.d_model]));
    let w = g.param_typed("ln_f.w", ty.clone(), Init::ones(), true);
    let b = g.param_typed("ln_f.b", ty, Init::zeros(), true);
    (x, layer_norm_primitives(&h, &w, &b, 1e-5))
}

/// A GPT-2 language model's graph: token ids in, next-token loss out.
pub struct Gpt2Lm {
    /// Token ids [B, S] (input `ids`, i64).
    pub ids: Tensor,
    /// The next tokens [B, S] (input `targets`, i64).
    pub targets: Tensor,
    /// Logits [B, S, vocab].
    pub logits: Tensor,
    /// Mean cross entropy of the logits against the targets.
    pub loss: Tensor,
}

/// A GPT-2 language model over a `vocab`-token alphabet: token and position embeddings
/// (`wte` [vocab, D], `wpe` [S, D], normal with std 0.02), the blocks of [`gpt2_block`], a final
/// LayerNorm and logits through the token embedding transposed (tied weights), as GPT-2 does.
pub fn gpt2_lm(g: &GraphBuilder, cfg: &Gpt2Config, vocab: usize) -> Gpt2Lm {
    let (b, s, d) = (cfg.batch, cfg.seq, cfg.d_model);
    let ids = g.input("ids", DType::I64, [b, s]);
    let targets = g.input("targets", DType::I64, [b, s]);
    let normal = |seed| Init::Normal {
        mean: 0.0,
        std: 0.02,
        seed,
    };
    let wte = g.param("wte", [vocab, d], normal(g.next_seed()));
    let wpe = g.param("wpe", [s, d], normal(g.next_seed()));
    let mut h = wte.embedding(&ids).add(&wpe);
    for l in 0..cfg.layers {
        h = gpt2_block(g, cfg, l, &h);
    }
    let w = g.param("ln_f.w", [d], Init::ones());
    let bb = g.param("ln_f.b", [d], Init::zeros());
    let h = layer_norm_primitives(&h, &w, &bb, 1e-5);
    let logits = h.matmul(&wte.t());
    let loss = logits
        .reshape([b * s, vocab])
        .cross_entropy(&targets.reshape([b * s]));
    Gpt2Lm {
        ids,
        targets,
        logits,
        loss,
    }
}
