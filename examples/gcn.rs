//! A two-layer graph convolutional network (Kipf & Welling, 2017),
//! `logits = Â·relu(Â·X·W1)·W2` with `Â = D^-½ (A + I) D^-½`, trained on a generated stochastic
//! block model: nodes in four communities, edges far denser inside a community than across, and
//! noisy features whose mean depends on the community. Â is a sparse CSR matrix in the graph
//! (its pattern and values are constants; `sparse_matmul` is SpMM), the weights are trained with
//! AdamW on a few labelled nodes per class, and the accuracy on the other nodes is printed next
//! to the accuracy the features alone give (a linear classifier trained the same way).
//!
//! cargo run --release --example gcn -- [EPOCHS] [--device cpu|cuda|cuda:N|auto]

use rustytorch::compiler::CsrPattern;
use rustytorch::ops::{rng::uniform01, CooMatrix, CsrMatrix};
use rustytorch::prelude::*;

const CLASSES: usize = 4;
const PER_CLASS: usize = 300;
const FEATURES: usize = 32;
const HIDDEN: usize = 32;
const TRAIN_PER_CLASS: usize = 20;
/// Edge probabilities inside and across communities.
const P_IN: f64 = 0.03;
const P_OUT: f64 = 0.002;

/// The generated graph: normalized adjacency, features, labels and the labelled node ids.
struct Sbm {
    a_hat: CsrMatrix,
    x: HostTensor,
    labels: Vec<i64>,
    train: Vec<usize>,
    edges: usize,
}

/// Standard normal samples from the counter-based generator (Box–Muller).
fn normal(seed: u64, i: u64) -> f64 {
    let u1 = uniform01(seed, 2 * i).max(1e-300);
    let u2 = uniform01(seed, 2 * i + 1);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn stochastic_block_model(seed: u64) -> Result<Sbm, Box<dyn std::error::Error>> {
    let n = CLASSES * PER_CLASS;
    let labels: Vec<i64> = (0..n).map(|i| (i / PER_CLASS) as i64).collect();
    // Undirected edges, each pair once, plus self loops (A + I).
    let (mut rows, mut cols) = (vec![], vec![]);
    let mut pair = 0u64;
    let mut edges = 0;
    for i in 0..n {
        rows.push(i as i64);
        cols.push(i as i64);
        for j in i + 1..n {
            let p = if labels[i] == labels[j] { P_IN } else { P_OUT };
            if uniform01(seed, pair) < p {
                rows.extend([i as i64, j as i64]);
                cols.extend([j as i64, i as i64]);
                edges += 1;
            }
            pair += 1;
        }
    }
    let mut degree = vec![0.0f64; n];
    for &r in &rows {
        degree[r as usize] += 1.0;
    }
    let vals: Vec<f32> = rows
        .iter()
        .zip(&cols)
        .map(|(&r, &c)| (1.0 / (degree[r as usize] * degree[c as usize]).sqrt()) as f32)
        .collect();
    let nnz = vals.len();
    let a_hat = CooMatrix::new(
        n,
        n,
        HostTensor::from_vec(rows, [nnz])?,
        HostTensor::from_vec(cols, [nnz])?,
        HostTensor::from_vec(vals, [nnz])?,
    )?
    .to_csr()?;
    // Features: a random mean per class plus noise twice its scale.
    let means: Vec<f64> = (0..CLASSES * FEATURES)
        .map(|k| 0.5 * normal(seed + 1, k as u64))
        .collect();
    let x: Vec<f32> = (0..n * FEATURES)
        .map(|k| {
            let (i, f) = (k / FEATURES, k % FEATURES);
            (means[labels[i] as usize * FEATURES + f] + 1.0 * normal(seed + 2, k as u64)) as f32
        })
        .collect();
    let train = (0..CLASSES)
        .flat_map(|c| (0..TRAIN_PER_CLASS).map(move |k| c * PER_CLASS + k * 7))
        .collect();
    Ok(Sbm {
        a_hat,
        x: HostTensor::from_vec(x, [n, FEATURES])?,
        labels,
        train,
        edges,
    })
}

/// Trains for `epochs` full-graph steps; returns the accuracy on the unlabelled nodes.
/// `graph_conv` off gives the baseline: the same two layers without Â.
fn train(
    data: &Sbm,
    device: Device,
    epochs: usize,
    graph_conv: bool,
) -> Result<f64, Box<dyn std::error::Error>> {
    let n = data.labels.len();
    let g = GraphBuilder::new();
    let a = CsrPattern::constant(&g, &data.a_hat);
    let a_vals = g.constant(data.a_hat.values().clone());
    let propagate = |h: &Tensor| {
        if graph_conv {
            a.matmul(&a_vals, h)
        } else {
            h.clone()
        }
    };
    let x = g.constant(data.x.clone());
    let w1 = g.param("w1", [FEATURES, HIDDEN], Init::kaiming_uniform(FEATURES, 1));
    let b1 = g.param("b1", [HIDDEN], Init::zeros());
    let w2 = g.param("w2", [HIDDEN, CLASSES], Init::kaiming_uniform(HIDDEN, 2));
    // Â·(X·W1) and Â·(H·W2): the dense product first keeps the sparse one narrow.
    let h = propagate(&x.matmul(&w1)).add(&b1).relu();
    let logits = propagate(&h.matmul(&w2));
    let train_ids: Vec<i64> = data.train.iter().map(|&i| i as i64).collect();
    let train_labels: Vec<i64> = data.train.iter().map(|&i| data.labels[i]).collect();
    let k = train_ids.len();
    let ids = g.constant(HostTensor::from_vec(train_ids, [k])?);
    let y = g.constant(HostTensor::from_vec(train_labels, [k])?);
    let loss = logits.index_select(0, &ids).cross_entropy(&y);
    let pred = logits.argmax(-1, false);
    g.train_step(
        &loss,
        AdamW::new(1e-2).weight_decay(5e-4),
        &StepOptions::default(),
    )?;
    let mut exe = compile(&g, &[&loss, &pred], device)?;
    let mut last = vec![];
    for epoch in 0..epochs {
        let out = exe.run(&[])?;
        last = out[1].to_vec::<i64>()?;
        if graph_conv && (epoch % 50 == 0 || epoch + 1 == epochs) {
            println!("  epoch {epoch:4}: loss {:.4}", out[0].to_vec::<f32>()?[0]);
        }
    }
    let is_train: std::collections::HashSet<usize> = data.train.iter().copied().collect();
    let test: Vec<usize> = (0..n).filter(|i| !is_train.contains(i)).collect();
    let correct = test.iter().filter(|&&i| last[i] == data.labels[i]).count();
    Ok(correct as f64 / test.len() as f64)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut epochs = 200;
    let mut device = Device::Cpu;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let value = match a.strip_prefix("--device") {
            Some("") => it.next().ok_or("--device needs a value")?,
            Some(v) if v.starts_with('=') => v[1..].to_string(),
            _ => {
                epochs = a.parse()?;
                continue;
            }
        };
        device = Device::parse(&value).ok_or_else(|| {
            format!("--device `{value}`: expected `cpu`, `cuda`, `cuda:N` or `auto`")
        })?;
    }
    let data = stochastic_block_model(7)?;
    println!(
        "stochastic block model: {} nodes in {CLASSES} communities, {} edges, Â has {} nonzeros; \
         {} labelled nodes; {epochs} epochs on {device}",
        data.labels.len(),
        data.edges,
        data.a_hat.nnz(),
        data.train.len()
    );
    let gcn = train(&data, device, epochs, true)?;
    let mlp = train(&data, device, epochs, false)?;
    println!(
        "test accuracy: GCN {:.2}%, features alone (MLP) {:.2}%",
        100.0 * gcn,
        100.0 * mlp
    );
    Ok(())
}
