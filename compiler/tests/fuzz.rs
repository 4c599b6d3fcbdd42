//! A bounded, deterministic fuzz of both graph formats: structure-aware mutations of valid IR
//! texts and valid graph files (bytes flipped, inserted and deleted; numbers made huge, negative
//! or zero; lines duplicated and dropped; tokens swapped; truncation; bincode bodies corrupted
//! behind a recomputed checksum). Every case must give a graph that verifies or an error: never a
//! panic (not even one caught inside the loaders), an abort or a hang. A valid graph that names
//! dims is also specialized at other sizes, which must verify or be an error.

use rustytorch_compiler::format::{from_bytes, to_bytes, ParamStorage, HEADER_LEN};
use rustytorch_compiler::text::{parse, print};
use rustytorch_compiler::{AdamW, ConvOpts, Graph, GraphBuilder, Init, StepOptions};
use rustytorch_ops::{Causal, DType, HostTensor, TensorType};
use std::cell::Cell;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Cases per format.
const CASES: usize = 4000;
/// The longest one case may take before the run counts as hung.
const CASE_LIMIT: Duration = Duration::from_secs(10);

/// splitmix64: a small deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
}

/// Seed graphs: a small CNN training step (convolutions and their gradients, pooling, pads,
/// slices, concatenation, AdamW state, guards and updates), a graph of generator leaves,
/// movement ops, attention and parameters with values, and a graph over named dims (symbolic
/// shapes through reshapes, concatenation and slices).
fn seeds() -> Vec<Graph> {
    let b = GraphBuilder::new();
    let x = b.input("x", DType::F32, [2, 1, 6, 6]);
    let y = b.input("y", DType::I64, [2]);
    let w1 = b.param("w1", [2, 1, 3, 3], Init::kaiming_uniform(9, 1));
    let w2 = b.param("w2", [2, 2, 3, 3], Init::kaiming_uniform(18, 2));
    let h = x
        .conv(&w1, None, &ConvOpts::default().padding(&[1]))
        .gelu()
        .conv(&w2, None, &ConvOpts::default().padding(&[1]).stride(&[1]))
        .max_pool(&[2, 2], &[2, 2], &[0, 0]);
    let flat = h
        .reshape([2, 18])
        .pad(&[(0, 0), (1, 1)], 0.0)
        .slice(1, 0, 20, 2);
    let feats = b.concat(&[&flat, &flat], 1);
    let wl = b.param("wl", [20, 4], Init::kaiming_uniform(20, 3));
    let logits = feats.matmul(&wl);
    let loss = logits.cross_entropy(&y);
    b.output("loss", &loss);
    b.train_step(&loss, AdamW::new(1e-3), &StepOptions::default())
        .unwrap();
    let cnn = b.graph().unwrap();

    let b = GraphBuilder::new();
    let q = b.input("q", DType::F32, [1, 2, 4, 8]);
    let emb = b.param("emb", [4, 8], Init::Data);
    b.with_graph(|g| {
        g.params[0].data = Some(
            HostTensor::from_vec((0..32).map(|i| i as f32 * 0.25).collect::<Vec<_>>(), [4, 8])
                .unwrap(),
        )
    });
    let ids = b.iota(0, TensorType::new(DType::I64, [4]));
    let e = emb.index_select(0, &ids);
    let r = b.rand_uniform(-1.0, 1.0, 7, TensorType::new(DType::F32, [1, 2, 4, 8]));
    let k = q.add(&r).add(&e.expand([1, 2, 4, 8]));
    let a = q.attention(&k, &k, None, Causal::TopLeft, None);
    let s = a
        .permute(&[0, 2, 1, 3])
        .reshape([4, 16])
        .softmax(-1)
        .sum(&[1], true)
        .avg_pool_1d();
    b.output("s", &s);
    b.output(
        "n",
        &b.rand_normal(0.0, 1.0, 3, TensorType::new(DType::F64, [3])),
    );
    let misc = b.graph().unwrap();

    let b = GraphBuilder::new();
    let batch = b.dim("batch", 4);
    let seq = b.dim("seq", 6);
    let x = b.input_dims("x", DType::F32, &[batch.clone(), seq.clone(), 8.into()]);
    let w = b.param("w", [8, 8], Init::kaiming_uniform(8, 4));
    let h = x.matmul(&w).gelu();
    let flat = h.reshape_infer(&[-1, 8]);
    let heads = x.reshape_dims(&[batch, seq, 2.into(), 4.into()]);
    b.output("t", &h.transpose(0, 1).sum(&[2], false));
    b.output("heads", &heads.softmax(-1));
    b.output("cat", &b.concat(&[&flat, &flat], 0).slice(1, 0, 4, 1));
    let dims = b.graph().unwrap();
    vec![cnn, misc, dims]
}

/// Sizes to specialize a graph with named dims at, besides the defaults it verified at: small,
/// and large enough that products of two dims leave the limits.
const SIZES: &[usize] = &[1, 3, 1 << 20, 1 << 40];

/// Specializes a valid graph that names dims at each of [`SIZES`] for every dim: a graph that
/// verifies or an error.
fn specialize_all(g: &Graph) -> Result<(), String> {
    if g.dims.named.is_empty() {
        return Ok(());
    }
    for &n in SIZES {
        let sizes = vec![n; g.dims.named.len()];
        if let Ok(at) = g.specialize(&sizes) {
            at.verify()
                .map_err(|e| format!("specialized at {n} but invalid: {e}"))?;
        }
    }
    Ok(())
}

/// Pooling over a rank-3 view, to cover pooling in the second seed.
trait AvgPool1d {
    fn avg_pool_1d(&self) -> Self;
}

impl AvgPool1d for rustytorch_compiler::Tensor {
    fn avg_pool_1d(&self) -> Self {
        self.reshape([1, 1, 4]).avg_pool(&[2], &[1], &[1], true)
    }
}

const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "-1",
    "-9223372036854775808",
    "64",
    "65",
    "4294967296",
    "1099511627776",
    "1099511627777",
    "281474976710656",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999",
    "1e308",
    "nan",
];

/// Byte ranges of the number-like tokens (ASCII digit runs, with a leading `-`).
fn numbers(text: &str) -> Vec<(usize, usize)> {
    let b = text.as_bytes();
    let mut out = vec![];
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() {
            let start = if i > 0 && b[i - 1] == b'-' { i - 1 } else { i };
            let mut j = i;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            out.push((start, j));
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// One structure-aware mutation of IR text (the result may be invalid UTF-8, then is made valid
/// lossily, as a reader of bytes would).
fn mutate_text(text: &str, rng: &mut Rng) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    if lines.is_empty() {
        return format!("{text}graph {{");
    }
    match rng.below(9) {
        0 => {
            let mut b = text.as_bytes().to_vec();
            let i = rng.below(b.len());
            b[i] ^= 1 << rng.below(8);
            String::from_utf8_lossy(&b).into_owned()
        }
        1 => {
            let mut b = text.as_bytes().to_vec();
            let i = rng.below(b.len() + 1);
            b.insert(i, *rng.pick(b"%[](),=:-0123456789 \n\"\\x"));
            String::from_utf8_lossy(&b).into_owned()
        }
        2 => {
            let mut b = text.as_bytes().to_vec();
            let i = rng.below(b.len());
            let n = 1 + rng.below(8);
            b.drain(i..(i + n).min(b.len()));
            String::from_utf8_lossy(&b).into_owned()
        }
        3 | 4 => {
            // Several numbers at once, so that shapes and attributes change together.
            let mut t = text.to_string();
            for _ in 0..1 + rng.below(3) {
                let spans = numbers(&t);
                if spans.is_empty() {
                    break;
                }
                let (s, e) = *rng.pick(&spans);
                let n = *rng.pick(NUMBERS);
                t.replace_range(s..e, n);
            }
            t
        }
        5 => {
            let i = rng.below(lines.len());
            let l = lines[i].clone();
            lines.insert(rng.below(lines.len() + 1), l);
            lines.join("\n")
        }
        6 => {
            let i = rng.below(lines.len());
            lines.remove(i);
            lines.join("\n")
        }
        7 => {
            let i = rng.below(lines.len());
            let mut toks: Vec<&str> = lines[i].split(' ').collect();
            let (a, b) = (rng.below(toks.len()), rng.below(toks.len()));
            toks.swap(a, b);
            let l = toks.join(" ");
            lines[i] = l;
            lines.join("\n")
        }
        _ => {
            let mut b = text.as_bytes().to_vec();
            b.truncate(rng.below(b.len()));
            String::from_utf8_lossy(&b).into_owned()
        }
    }
}

fn with_checksum(file: &[u8], body: &[u8]) -> Vec<u8> {
    let mut out = file[..HEADER_LEN.min(file.len())].to_vec();
    if out.len() < HEADER_LEN {
        return out;
    }
    out[12..20].copy_from_slice(&(body.len() as u64).to_le_bytes());
    out[20..24].copy_from_slice(&crc32fast::hash(body).to_le_bytes());
    out.extend_from_slice(body);
    out
}

const WORDS: &[u64] = &[
    0,
    1,
    2,
    3,
    64,
    65,
    u32::MAX as u64,
    1 << 32,
    1 << 40,
    (1 << 40) + 1,
    1 << 48,
    1 << 62,
    i64::MAX as u64,
    u64::MAX,
];

/// One mutation of a graph file: mostly of the body behind a recomputed checksum, sometimes of the
/// raw bytes (which the header check must refuse).
fn mutate_file(file: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut body = file[HEADER_LEN.min(file.len())..].to_vec();
    if body.is_empty() {
        return file[..file.len() / 2].to_vec();
    }
    match rng.below(8) {
        0 => {
            let mut f = file.to_vec();
            let i = rng.below(f.len());
            f[i] ^= 1 << rng.below(8);
            return f;
        }
        1 => {
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(body.len());
                body[i] ^= 1 << rng.below(8);
            }
        }
        2 => {
            let i = rng.below(body.len() + 1);
            for _ in 0..1 + rng.below(8) {
                body.insert(i, rng.next() as u8);
            }
        }
        3 => {
            let i = rng.below(body.len());
            let n = 1 + rng.below(16);
            body.drain(i..(i + n).min(body.len()));
        }
        4 | 5 => {
            // Numbers: 8-byte little-endian words holding small values (counts, dims, attributes,
            // node ids) become huge, zero or off by one.
            let small: Vec<usize> = (0..body.len().saturating_sub(7))
                .filter(|&i| {
                    let w = u64::from_le_bytes(body[i..i + 8].try_into().unwrap());
                    (1..=64).contains(&w)
                })
                .collect();
            for _ in 0..1 + rng.below(2) {
                if let Some(&i) = small.get(rng.below(small.len())) {
                    let w = u64::from_le_bytes(body[i..i + 8].try_into().unwrap());
                    let v = match rng.below(3) {
                        0 => w.wrapping_add(1),
                        1 => w.wrapping_sub(1),
                        _ => *rng.pick(WORDS),
                    };
                    body[i..i + 8].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        6 => {
            let i = rng.below(body.len());
            let n = 4 + rng.below(60);
            let chunk: Vec<u8> = body[i..(i + n).min(body.len())].to_vec();
            let at = rng.below(body.len() + 1);
            body.splice(at..at, chunk);
        }
        _ => body.truncate(rng.below(body.len())),
    }
    with_checksum(file, &body)
}

thread_local! {
    /// Panics on this thread, counted by the hook even when the loaders catch them.
    static PANICS: Cell<usize> = const { Cell::new(0) };
}

fn count_panics() {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.with(|p| p.set(p.get() + 1));
        prev(info);
    }));
}

/// Runs `check` on every case in a worker thread, failing on a panic (caught or not) or on a case
/// that runs past [`CASE_LIMIT`].
fn run_cases<C: Send + 'static>(
    what: &str,
    cases: Vec<C>,
    describe: fn(&C) -> String,
    check: fn(&C) -> Result<bool, String>,
) {
    count_panics();
    let n = cases.len();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for (k, c) in cases.iter().enumerate() {
            let before = PANICS.with(Cell::get);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(c)))
                .unwrap_or_else(|_| Err("panicked".into()));
            let r = match r {
                Ok(_) if PANICS.with(Cell::get) != before => {
                    Err("panicked inside the loader".into())
                }
                r => r,
            };
            if tx
                .send((k, r.map_err(|e| format!("{e}\n{}", describe(c)))))
                .is_err()
            {
                return;
            }
        }
    });
    let start = Instant::now();
    let mut loaded = 0;
    for k in 0..n {
        match rx.recv_timeout(CASE_LIMIT) {
            Ok((_, Ok(l))) => loaded += l as usize,
            Ok((j, Err(e))) => panic!("{what} case {j}: {e}"),
            Err(_) => panic!("{what} case {k} ran past {CASE_LIMIT:?} (or the worker died)"),
        }
    }
    eprintln!(
        "{what}: {n} cases ({loaded} valid graphs) in {:.2?}",
        start.elapsed()
    );
}

#[test]
fn mutated_ir_texts_parse_or_fail_cleanly() {
    let seeds: Vec<String> = seeds().iter().map(print).collect();
    for s in &seeds {
        parse(s).unwrap().verify().unwrap();
    }
    let mut rng = Rng(0x7e57_0001);
    let cases: Vec<String> = (0..CASES)
        .map(|k| {
            let mut t = seeds[k % seeds.len()].clone();
            for _ in 0..1 + usize::from(rng.below(4) == 0) {
                t = mutate_text(&t, &mut rng);
            }
            t
        })
        .collect();
    run_cases(
        "IR text",
        cases,
        |t| format!("--- text ---\n{t}"),
        |t| match parse(t) {
            Ok(g) => {
                g.verify().map_err(|e| format!("parsed but invalid: {e}"))?;
                specialize_all(&g)?;
                let again = parse(&print(&g)).map_err(|e| format!("reprint: {e}"))?;
                again.verify().map_err(|e| e.to_string())?;
                Ok(true)
            }
            Err(_) => Ok(false),
        },
    );
}

#[test]
fn mutated_graph_files_load_or_fail_cleanly() {
    let files: Vec<Vec<u8>> = seeds()
        .iter()
        .map(|g| to_bytes(g, ParamStorage::Embedded).unwrap())
        .collect();
    for f in &files {
        from_bytes(f).unwrap().verify().unwrap();
    }
    let mut rng = Rng(0x7e57_0002);
    let cases: Vec<Vec<u8>> = (0..CASES)
        .map(|k| {
            let mut f = files[k % files.len()].clone();
            for _ in 0..1 + usize::from(rng.below(4) == 0) {
                f = mutate_file(&f, &mut rng);
            }
            f
        })
        .collect();
    run_cases(
        "graph file",
        cases,
        |f| format!("--- {} bytes ---\n{f:?}", f.len()),
        |f| match from_bytes(f) {
            Ok(g) => {
                g.verify().map_err(|e| format!("loaded but invalid: {e}"))?;
                specialize_all(&g)?;
                let again = to_bytes(&g, ParamStorage::Embedded)
                    .and_then(|b| from_bytes(&b))
                    .map_err(|e| format!("re-save: {e}"))?;
                again.verify().map_err(|e| e.to_string())?;
                Ok(true)
            }
            Err(_) => Ok(false),
        },
    );
}
