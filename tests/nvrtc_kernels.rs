//! Generated CUDA kernels compile with NVRTC for the architectures the runtime targets, on a
//! machine without a GPU: NVRTC is a library that needs no device. The check runs where NVRTC
//! can be loaded (CI installs it: `scripts/fetch_nvrtc.sh`); with `RUSTYTORCH_TEST_NVRTC=1` a
//! missing NVRTC fails the test instead of skipping it.

use rustytorch::codegen::cuda::{flash, lower_step, source, with_target, Target};
use rustytorch::ops::{AttnLayout, AttnMask, Causal, DType, F64Bits, Op, Shape, TensorType};
use rustytorch::runtime::cuda::compile::KernelCompiler;

/// The compilers for sm_80 (the portable tensor-core path) and sm_90 (the H200), or None (with a
/// notice) where NVRTC is absent and not required.
fn compilers() -> Option<Vec<KernelCompiler>> {
    let required = std::env::var("RUSTYTORCH_TEST_NVRTC").as_deref() == Ok("1");
    let made: Result<Vec<_>, _> = [(8, 0), (9, 0)]
        .into_iter()
        .map(|cc| KernelCompiler::with_dir(cc, None))
        .collect();
    match made {
        Ok(c) => Some(c),
        Err(e) if required => panic!("RUSTYTORCH_TEST_NVRTC=1 but NVRTC is unavailable: {e}"),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// Held by every test that lowers for Hopper: they set the process-wide variables that select
/// the kernels' variants, and a kernel lowered while another test changes one could mix two
/// forms (a descriptor helper of one form called in the other's).
static HOPPER_ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn t(d: DType, dims: &[usize]) -> TensorType {
    TensorType::new(d, Shape::new(dims.to_vec()))
}

/// The layouts to compile for a causal kind: `[B, S, H, D]` (which changes only the addressing)
/// with top-left causality alone, to keep the run short.
fn layouts(causal: Causal) -> Vec<AttnLayout> {
    if causal == Causal::TopLeft {
        vec![AttnLayout::Bhsd, AttnLayout::Bshd]
    } else {
        vec![AttnLayout::Bhsd]
    }
}

/// The attention op of `causal`, `mask` and `layout` (scale 0.125).
fn attention(causal: Causal, mask: AttnMask, layout: AttnLayout) -> Op {
    Op::Attention {
        causal,
        mask,
        scale: F64Bits::new(0.125),
        layout,
    }
}

/// A `[B, H, S, D]` tensor type written in `layout`.
fn heads(d: DType, layout: AttnLayout, bhsd: [usize; 4]) -> TensorType {
    t(d, &layout.from_bhsd(bhsd))
}

/// The flash kernel for every element type, causal kind and mask kind, and the head sizes that
/// change its unrolling (16 to 128, value heads unlike the query's).
#[test]
fn flash_attention_compiles() {
    let Some(compilers) = compilers() else { return };
    let mut sources = vec![];
    for d in [DType::F16, DType::BF16] {
        for &(sq, sk, hd, hv) in &[
            (1, 300, 64, 64),
            (1, 1000, 128, 128),
            (1, 7, 64, 32),
            (100, 37, 80, 80),
            (65, 64, 16, 48),
            (1000, 1000, 128, 128),
            (7, 9, 32, 32),
        ] {
            for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                for (mask, mt, layout) in layouts(causal).into_iter().flat_map(|l| {
                    [
                        (AttnMask::None, None, l),
                        (AttnMask::Additive, Some(t(d, &[sq, sk])), l),
                        (AttnMask::Additive, Some(t(d, &[2, 1, 1, sk])), l),
                        (AttnMask::Bool, Some(t(DType::Bool, &[2, 1, 1, sk])), l),
                    ]
                }) {
                    let mut ins = vec![
                        heads(d, layout, [2, 3, sq, hd]),
                        heads(d, layout, [2, 3, sk, hd]),
                        heads(d, layout, [2, 3, sk, hv]),
                    ];
                    ins.extend(mt);
                    let refs: Vec<&TensorType> = ins.iter().collect();
                    assert!(flash::supported(&refs));
                    let op = attention(causal, mask, layout);
                    let out = rustytorch::ops::infer(&op, &refs).expect("infer");
                    let step = lower_step(&op, &refs, &out).expect("lower");
                    let ls = step.launches();
                    // One query row: the split-key decoding kernels (chunks, then their sum).
                    let names: &[&str] = if sq == 1 {
                        &["flash_decode_split", "flash_decode_combine"]
                    } else {
                        &["flash_attention"]
                    };
                    assert_eq!(ls.len(), names.len());
                    for (l, name) in ls.iter().zip(names) {
                        assert!(l.kernel.name.starts_with(name), "{}", l.kernel.name);
                        sources.push((l.kernel.name.clone(), source(&l.kernel).expect("source")));
                    }
                }
            }
        }
    }
    compile_all(&compilers, sources);
}

/// Compiles distinct sources with every compiler.
fn compile_all(compilers: &[KernelCompiler], mut sources: Vec<(String, String)>) {
    sources.sort();
    sources.dedup();
    for c in compilers {
        c.cubins(&sources)
            .unwrap_or_else(|e| panic!("{}: {e}", c.arch()));
    }
}

/// The flash gradient kernels (the statistics pass, then dQ, dK or dV) for both element types,
/// every causal kind, unmasked and bool-masked, and value heads unlike the query's.
#[test]
fn flash_attention_gradients_compile() {
    let Some(compilers) = compilers() else { return };
    let mut sources = vec![];
    for d in [DType::F16, DType::BF16] {
        for &(sq, sk, hd, hv) in &[(100, 37, 80, 80), (65, 64, 16, 48), (7, 9, 128, 128)] {
            for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                for (mask, mt, layout) in layouts(causal).into_iter().flat_map(|l| {
                    [
                        (AttnMask::None, None, l),
                        (AttnMask::Bool, Some(t(DType::Bool, &[2, 1, 1, sk])), l),
                    ]
                }) {
                    let mut ins = vec![
                        heads(d, layout, [2, 3, sq, hd]),
                        heads(d, layout, [2, 3, sk, hd]),
                        heads(d, layout, [2, 3, sk, hv]),
                    ];
                    ins.extend(mt);
                    ins.push(heads(d, layout, [2, 3, sq, hv]));
                    let refs: Vec<&TensorType> = ins.iter().collect();
                    for wrt in 0..3u8 {
                        let op = Op::AttentionGrad {
                            causal,
                            mask,
                            scale: F64Bits::new(0.125),
                            wrt,
                            layout,
                        };
                        let out = rustytorch::ops::infer(&op, &refs).expect("infer");
                        let step = lower_step(&op, &refs, &out).expect("lower");
                        let ls = step.launches();
                        assert_eq!(ls.len(), 2);
                        assert!(ls[0].kernel.name.starts_with("flash_attention_stats"));
                        assert!(ls[1].kernel.name.starts_with("flash_attention_grad"));
                        for l in ls {
                            sources
                                .push((l.kernel.name.clone(), source(&l.kernel).expect("source")));
                        }
                    }
                }
            }
        }
    }
    compile_all(&compilers, sources);
}

/// The grouped gradient kernels (the fused backward with its dQ buffer kernels: eight warps at
/// head size 128, four at 48), both element types and layouts, the causal kinds, unmasked and
/// additive-masked.
#[test]
fn flash_attention_group_gradients_compile() {
    let Some(compilers) = compilers() else { return };
    let mut sources = vec![];
    // Kept short (NVRTC takes seconds a kernel): f16 with one causal kind.
    for d in [DType::F16, DType::BF16] {
        for &(sq, sk, hd, hv) in &[(100, 37, 48, 64), (7, 9, 128, 128)] {
            for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                if d == DType::F16 && causal != Causal::TopLeft {
                    continue;
                }
                for (mask, mt, layout) in layouts(causal).into_iter().flat_map(|l| {
                    [
                        (AttnMask::None, None, l),
                        (AttnMask::Additive, Some(t(d, &[sq, sk])), l),
                    ]
                }) {
                    let mut ins = vec![
                        heads(d, layout, [2, 3, sq, hd]),
                        heads(d, layout, [2, 3, sk, hd]),
                        heads(d, layout, [2, 3, sk, hv]),
                    ];
                    ins.extend(mt);
                    ins.push(heads(d, layout, [2, 3, sq, hv]));
                    let refs: Vec<&TensorType> = ins.iter().collect();
                    let step =
                        grad_group(Target::Portable, causal, mask, layout, &refs, &[0, 1, 2]);
                    // Statistics, zeroing the dQ buffer, the fused kernel, rounding dQ.
                    assert_eq!(step.launches.len(), 4);
                    assert!(step.launches[2]
                        .kernel
                        .name
                        .starts_with("flash_attention_bwd"));
                    for l in &step.launches {
                        sources.push((l.kernel.name.clone(), source(&l.kernel).expect("source")));
                    }
                }
            }
        }
    }
    compile_all(&compilers, sources);
}

/// The Hopper flash forward (warpgroup MMA, built for `sm_90a`) for both element types, head
/// sizes 64 and 128 (value heads unlike the query's), every causal kind, the mask kinds, and
/// its statistics form (the first kernel of the gradients).
#[test]
fn flash_attention_hopper_compiles() {
    let Some(compilers) = compilers() else { return };
    let _env = HOPPER_ENV.lock().unwrap_or_else(|e| e.into_inner());
    let hopper: Vec<KernelCompiler> = compilers
        .into_iter()
        .filter(|c| c.arch() == "sm_90a")
        .collect();
    assert_eq!(hopper.len(), 1, "the sm_90 device compiles for sm_90a");
    let mut sources = vec![];
    for d in [DType::F16, DType::BF16] {
        for &(sq, sk, hd, hv) in &[
            (1000, 1000, 128, 128),
            (100, 37, 64, 64),
            (130, 300, 64, 128),
        ] {
            for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                for (mask, mt, layout) in layouts(causal).into_iter().flat_map(|l| {
                    [
                        (AttnMask::None, None, l),
                        (AttnMask::Additive, Some(t(d, &[2, 1, 1, sk])), l),
                        (AttnMask::Bool, Some(t(DType::Bool, &[sq, sk])), l),
                    ]
                }) {
                    let mut ins = vec![
                        heads(d, layout, [2, 3, sq, hd]),
                        heads(d, layout, [2, 3, sk, hd]),
                        heads(d, layout, [2, 3, sk, hv]),
                    ];
                    ins.extend(mt);
                    let refs: Vec<&TensorType> = ins.iter().collect();
                    let op = attention(causal, mask, layout);
                    let out = rustytorch::ops::infer(&op, &refs).expect("infer");
                    let step = with_target(Target::Hopper, || lower_step(&op, &refs, &out))
                        .expect("lower");
                    let ls = step.launches();
                    assert_eq!(ls.len(), 1);
                    assert!(ls[0].kernel.name.starts_with("flash_attention_sm90"));
                    assert!(ls[0].kernel.smem > 48 * 1024);
                    // By default the producer copies by bulk tensor copies through three
                    // tensor maps and the consumers write the output through a fourth, one
                    // argument a parameter.
                    let maps: Vec<&str> = ls[0]
                        .kernel
                        .params
                        .iter()
                        .filter(|p| p.map.is_some())
                        .map(|p| p.name.as_str())
                        .collect();
                    assert_eq!(maps, ["qmap", "kmap", "vmap", "omap"]);
                    assert_eq!(ls[0].args.len(), ls[0].kernel.params.len());
                    sources.push((
                        ls[0].kernel.name.clone(),
                        source(&ls[0].kernel).expect("source"),
                    ));
                    if causal == Causal::TopLeft && mask == AttnMask::None {
                        let mut g = ins.clone();
                        g.push(heads(d, layout, [2, 3, sq, hv]));
                        let refs: Vec<&TensorType> = g.iter().collect();
                        let op = Op::AttentionGrad {
                            causal,
                            mask,
                            scale: F64Bits::new(0.125),
                            wrt: 0,
                            layout,
                        };
                        let out = rustytorch::ops::infer(&op, &refs).expect("infer");
                        let step = with_target(Target::Hopper, || lower_step(&op, &refs, &out))
                            .expect("lower");
                        let ls = step.launches();
                        assert!(ls[0].kernel.name.starts_with("flash_attention_stats_sm90"));
                        sources.push((
                            ls[0].kernel.name.clone(),
                            source(&ls[0].kernel).expect("source"),
                        ));
                    }
                }
            }
        }
    }
    // The measurement knobs: the two-warpgroup kernel (with its other block shape, key tiles of
    // 64, at head size 64), and the warp-specialized one with two consumers at head size 64,
    // three buffers, or key tiles of 176 or 192. The variables are process-wide; no other test
    // here lowers for Hopper. The producer copying by `cp.async` (bulk tensor copies off), at
    // both head sizes and with two and three consumers; consumers skipping the tiles their rows
    // do not see wherever there are any, and never; tiles taken at run time over a bounded
    // grid, and at head size 128. The output written by each thread's stores instead of bulk
    // tensor copies, with three and two consumers and at head size 128. A share of the
    // exponentials by a polynomial, with one chain and with two. Each descriptor computed in
    // full (the default builds them as a base plus a constant per step), in both kernels. Two
    // query-tile buffers, with two and three consumers. Consumers running on from tile to
    // tile, with two and three.
    let knobs: [&[(&str, &str)]; 33] = [
        &[
            ("RUSTYTORCH_HOPPER_KERNEL", "skew"),
            ("RUSTYTORCH_HOPPER_TILE", "2x64"),
        ],
        &[("RUSTYTORCH_HOPPER_KERNEL", "skew")],
        &[("RUSTYTORCH_HOPPER_WS", "2")],
        &[
            ("RUSTYTORCH_HOPPER_WS_STAGES", "3"),
            ("RUSTYTORCH_HOPPER_PINGPONG", "0"),
        ],
        &[("RUSTYTORCH_HOPPER_TMA", "0")],
        &[("RUSTYTORCH_HOPPER_TMA", "0")],
        &[("RUSTYTORCH_HOPPER_CHAINS", "4")],
        &[
            ("RUSTYTORCH_HOPPER_CHAINS", "2"),
            ("RUSTYTORCH_HOPPER_GRID", "4"),
        ],
        &[
            ("RUSTYTORCH_HOPPER_WS", "2"),
            ("RUSTYTORCH_HOPPER_TMA", "0"),
        ],
        &[
            ("RUSTYTORCH_HOPPER_KEYS", "192"),
            ("RUSTYTORCH_HOPPER_WS", "2"),
        ],
        &[
            ("RUSTYTORCH_HOPPER_KEYS", "192"),
            ("RUSTYTORCH_HOPPER_WS", "2"),
            ("RUSTYTORCH_HOPPER_CHAINS", "4"),
        ],
        &[("RUSTYTORCH_HOPPER_KEYS", "176")],
        &[
            ("RUSTYTORCH_HOPPER_SKIP", "1"),
            ("RUSTYTORCH_HOPPER_WS", "3"),
        ],
        &[
            ("RUSTYTORCH_HOPPER_SKIP", "0"),
            ("RUSTYTORCH_HOPPER_WS", "3"),
        ],
        &[
            ("RUSTYTORCH_HOPPER_GRID", "4"),
            ("RUSTYTORCH_HOPPER_WS", "3"),
        ],
        &[("RUSTYTORCH_HOPPER_QUEUE", "1")],
        &[("RUSTYTORCH_HOPPER_STORE", "thread")],
        &[("RUSTYTORCH_HOPPER_STORE", "thread")],
        &[("RUSTYTORCH_HOPPER_STORE", "thread")],
        &[("RUSTYTORCH_HOPPER_EXP_POLY", "4")],
        &[
            ("RUSTYTORCH_HOPPER_EXP_POLY", "3"),
            ("RUSTYTORCH_HOPPER_CHAINS", "2"),
        ],
        &[("RUSTYTORCH_HOPPER_DESC", "full")],
        &[("RUSTYTORCH_HOPPER_DESC", "full")],
        &[
            ("RUSTYTORCH_HOPPER_DESC", "full"),
            ("RUSTYTORCH_HOPPER_KERNEL", "skew"),
        ],
        &[("RUSTYTORCH_HOPPER_ROWSUM", "mma")],
        &[
            ("RUSTYTORCH_HOPPER_ROWSUM", "mma"),
            ("RUSTYTORCH_HOPPER_DESC", "full"),
        ],
        &[("RUSTYTORCH_HOPPER_ROWSUM", "mma")],
        &[("RUSTYTORCH_HOPPER_EDGE", "lean")],
        &[("RUSTYTORCH_HOPPER_EDGE", "lean")],
        &[("RUSTYTORCH_HOPPER_QSTAGES", "2")],
        &[("RUSTYTORCH_HOPPER_QSTAGES", "2")],
        &[("RUSTYTORCH_HOPPER_FUSE", "1")],
        &[("RUSTYTORCH_HOPPER_FUSE", "1")],
    ];
    for (knob, (hd, causal)) in knobs.iter().zip([
        (64, Causal::None),
        (128, Causal::BottomRight),
        (64, Causal::TopLeft),
        (128, Causal::None),
        (128, Causal::TopLeft),
        (64, Causal::BottomRight),
        (64, Causal::TopLeft),
        (128, Causal::None),
        (64, Causal::None),
        (64, Causal::None),
        (64, Causal::TopLeft),
        (64, Causal::None),
        (64, Causal::TopLeft),
        (64, Causal::BottomRight),
        (64, Causal::TopLeft),
        (128, Causal::TopLeft),
        (64, Causal::None),
        (64, Causal::TopLeft),
        (128, Causal::BottomRight),
        (64, Causal::None),
        (64, Causal::TopLeft),
        (64, Causal::None),
        (128, Causal::TopLeft),
        (128, Causal::BottomRight),
        (64, Causal::None),
        (64, Causal::TopLeft),
        (128, Causal::BottomRight),
        (64, Causal::TopLeft),
        (128, Causal::BottomRight),
        (64, Causal::TopLeft),
        (64, Causal::None),
        (64, Causal::TopLeft),
        (64, Causal::None),
    ]) {
        for (k, v) in knob.iter() {
            std::env::set_var(k, v);
        }
        let ins = [
            t(DType::BF16, &[2, 3, 300, hd]),
            t(DType::BF16, &[2, 3, 77, hd]),
            t(DType::BF16, &[2, 3, 77, hd]),
        ];
        let refs: Vec<&TensorType> = ins.iter().collect();
        let op = attention(causal, AttnMask::None, AttnLayout::Bhsd);
        let out = rustytorch::ops::infer(&op, &refs).expect("infer");
        let step = with_target(Target::Hopper, || lower_step(&op, &refs, &out)).expect("lower");
        let k = &step.launches()[0].kernel;
        let src = source(k).expect("source");
        // Threads: two warpgroups, or a producer and two consumers (three at head size 64 but
        // for causal rows this short, unless told).
        let threads = if knob.iter().any(|kv| kv.0 == "RUSTYTORCH_HOPPER_KERNEL") {
            256
        } else if hd == 64
            && !knob.contains(&("RUSTYTORCH_HOPPER_WS", "2"))
            && (causal == Causal::None || knob.contains(&("RUSTYTORCH_HOPPER_WS", "3")))
        {
            512
        } else {
            384
        };
        assert_eq!(k.block, threads, "{knob:?}");
        // The score tile's keys: 64 with the skewed kernel's small tile, else 128, 176 or 192.
        let keys = if let Some((_, n)) = knob.iter().find(|kv| kv.0 == "RUSTYTORCH_HOPPER_KEYS") {
            ["m64n", n, "k16"].concat()
        } else if hd == 64 && threads == 256 {
            "m64n64k16".to_string()
        } else {
            "m64n128k16".to_string()
        };
        assert!(src.contains(&keys), "{knob:?}");
        let maps: Vec<&str> = k
            .params
            .iter()
            .filter(|p| p.map.is_some())
            .map(|p| p.name.as_str())
            .collect();
        // Three buffers and the skewed kernel leave out bulk tensor copies.
        let tma = !knob.iter().any(|kv| {
            matches!(
                *kv,
                ("RUSTYTORCH_HOPPER_TMA", "0")
                    | ("RUSTYTORCH_HOPPER_WS_STAGES", _)
                    | ("RUSTYTORCH_HOPPER_KERNEL", _)
            )
        });
        // With bulk output stores (the default) a fourth map, over the output, which the
        // kernel writes through.
        let bulk_out = !knob.contains(&("RUSTYTORCH_HOPPER_STORE", "thread"));
        if tma && bulk_out {
            assert_eq!(maps, ["qmap", "kmap", "vmap", "omap"], "{knob:?}");
            assert!(src.contains("tma_store_tile(&omap"), "{knob:?}");
        } else if tma {
            assert_eq!(maps, ["qmap", "kmap", "vmap"], "{knob:?}");
        } else {
            assert!(maps.is_empty(), "{knob:?}");
            assert!(
                src.contains("cp.async.mbarrier") || threads == 256,
                "{knob:?}"
            );
        }
        // Descriptors as a base plus a constant (the warp-specialized kernel's consumer index
        // broadcast) by default, each in full where asked.
        let uniform = !knob.contains(&("RUSTYTORCH_HOPPER_DESC", "full"));
        assert_eq!(
            src.contains("unsigned lbo, unsigned off"),
            uniform,
            "{knob:?}"
        );
        assert_eq!(
            src.contains("const int cw = __shfl_sync("),
            uniform && threads != 256,
            "{knob:?}"
        );
        // A share of the exponentials by the polynomial where asked, else none.
        let poly = knob.iter().any(|kv| kv.0 == "RUSTYTORCH_HOPPER_EXP_POLY");
        assert_eq!(src.contains("auto ex2p"), poly, "{knob:?}");
        assert_eq!(src.contains("= ex2s("), poly, "{knob:?}");
        // The rows' sums on the tensor cores where asked (their adds and shuffles gone).
        let mma_sums = knob.contains(&("RUSTYTORCH_HOPPER_ROWSUM", "mma"));
        assert_eq!(src.contains("RT_WGMMA_L(pa[0][0]"), mma_sums, "{knob:?}");
        assert_eq!(
            src.contains("__shfl_xor_sync(0xffffffffu, l0, 1)"),
            !mma_sums,
            "{knob:?}"
        );
        // The lean edge where asked (no mask here, a positive scale); in chunks by default
        // with two consumers, unless split reductions, the polynomial or key tiles that are
        // no multiple of 32 keep the whole edge; else the scaled one.
        let lean = knob.contains(&("RUSTYTORCH_HOPPER_EDGE", "lean"));
        let chunked = threads == 384
            && !lean
            && !knob.iter().any(|kv| {
                matches!(
                    kv.0,
                    "RUSTYTORCH_HOPPER_EDGE"
                        | "RUSTYTORCH_HOPPER_CHAINS"
                        | "RUSTYTORCH_HOPPER_EXP_POLY"
                )
            })
            && !knob.contains(&("RUSTYTORCH_HOPPER_KEYS", "176"));
        assert_eq!(
            src.contains("const int d0 = (i0 < 300 ? lim0 : 0)"),
            lean || chunked,
            "{knob:?}"
        );
        assert_eq!(src.contains("nch = __shfl_sync("), chunked, "{knob:?}");
        assert_eq!(
            src.contains("float x = s[n][e] * "),
            !lean && !chunked,
            "{knob:?}"
        );
        // Split reductions keep their partials apart; a bounded grid still walks every tile.
        let chains = knob.iter().find(|kv| kv.0 == "RUSTYTORCH_HOPPER_CHAINS");
        assert_eq!(src.contains("ls0_1"), chains.is_some(), "{knob:?}");
        // At head size 64 with bulk tensor copies the blocks take their tiles from a counter,
        // unless told.
        let queued = tma
            && threads != 256
            && (hd == 64 || knob.contains(&("RUSTYTORCH_HOPPER_QUEUE", "1")))
            && !knob.contains(&("RUSTYTORCH_HOPPER_QUEUE", "0"));
        assert_eq!(
            src.contains("atomicAdd(&rt_queue[0], 1ull)"),
            queued,
            "{knob:?}"
        );
        // A warp-specialized consumer computes only the key tiles its rows see where that
        // skips at least a fifth of the products: 300 queries against 77 keys bottom-right
        // (half), not top-left or full (a sixth, the consumer past the end), unless told or
        // the tiles are taken at run time (then wherever it can), and never where the
        // consumers run on from tile to tile.
        if threads != 256 {
            let skip = !knob.contains(&("RUSTYTORCH_HOPPER_FUSE", "1"))
                && (knob.contains(&("RUSTYTORCH_HOPPER_SKIP", "1"))
                    || ((causal == Causal::BottomRight || queued)
                        && !knob.contains(&("RUSTYTORCH_HOPPER_SKIP", "0"))));
            assert_eq!(src.contains("row_c >= 300"), skip, "{knob:?}");
            assert_eq!(
                src.contains("if (pending) {"),
                knob.contains(&("RUSTYTORCH_HOPPER_FUSE", "1")),
                "{knob:?}"
            );
        }
        if knob.contains(&("RUSTYTORCH_HOPPER_GRID", "4")) {
            assert_eq!(step.launches()[0].grid, 4, "{knob:?}");
            // Both the producer's and the consumers' loops walk by rounds, or take the tiles
            // handed out.
            let rounds = if queued { 0 } else { 2 };
            assert_eq!(src.matches("++round_)").count(), rounds, "{knob:?}");
            assert!(!src.contains("tile += gridDim.x"));
        } else {
            assert_eq!(
                step.launches()[0].grid,
                2 * 3 * 300usize.div_ceil(if threads == 512 { 192 } else { 128 }) as u32,
                "{knob:?}"
            );
        }
        sources.push((k.name.clone(), src));
        for (k, _) in knob.iter() {
            std::env::remove_var(k);
        }
    }
    compile_all(&hopper, sources);
}

/// The forward that saves its statistics (the Hopper kernel for sm_90a, the portable one for
/// both) and the gradients that read them (their first kernel derives `rowsum(dO ∘ O)` from the
/// saved O), both element types, head sizes 48, 64, 80 and 128 (a row of the statistics
/// kernel read by 8, 8, 16 and 16 lanes), both layouts.
#[test]
fn flash_attention_saving_compiles() {
    let Some(compilers) = compilers() else { return };
    let _env = HOPPER_ENV.lock().unwrap_or_else(|e| e.into_inner());
    let mut portable = vec![];
    let mut hopper = vec![];
    for d in [DType::F16, DType::BF16] {
        for &(sq, sk, hd) in &[(1000, 1000, 128), (100, 37, 64), (65, 40, 80), (33, 20, 48)] {
            for layout in [AttnLayout::Bhsd, AttnLayout::Bshd] {
                let qkv = vec![
                    heads(d, layout, [2, 3, sq, hd]),
                    heads(d, layout, [2, 3, sk, hd]),
                    heads(d, layout, [2, 3, sk, hd]),
                ];
                let refs: Vec<&TensorType> = qkv.iter().collect();
                let op = attention(Causal::TopLeft, AttnMask::None, layout);
                let out = rustytorch::ops::infer(&op, &refs).expect("infer");
                let at = rustytorch::compiler::plan::stats_offset(&out);
                for (target, into) in [
                    (Target::Hopper, &mut hopper),
                    (Target::Portable, &mut portable),
                ] {
                    let step = with_target(target, || flash::lower_saving(&op, &refs, &out, at))
                        .expect("lower");
                    let k = &step.launches[0].kernel;
                    assert!(k.name.starts_with("flash_attention_saving"));
                    into.push((k.name.clone(), source(k).expect("source")));
                }
                let mut g = qkv.clone();
                g.push(out.clone());
                let refs: Vec<&TensorType> = g.iter().collect();
                let ops: Vec<Op> = (0..3).map(|w| op.attention_grad(w).unwrap()).collect();
                let outs: Vec<TensorType> = ops
                    .iter()
                    .map(|o| rustytorch::ops::infer(o, &refs).expect("infer"))
                    .collect();
                let saved = flash::Saved {
                    o: rustytorch::codegen::cuda::ArgRef::Value(0),
                    stats_at: at,
                };
                // The statistics kernel (which also zeroes the dQ buffer), the fused backward
                // and the rounding of dQ.
                let step = flash::lower_grad_group_saved(
                    &ops.iter().collect::<Vec<_>>(),
                    &refs,
                    &outs.iter().collect::<Vec<_>>(),
                    Some(saved),
                )
                .expect("lower");
                assert_eq!(step.launches.len(), 3);
                let k = &step.launches[0].kernel;
                assert!(k.name.starts_with("flash_attention_delta"));
                assert_eq!(step.launches[0].args[1], saved.o);
                assert!(k.params.iter().any(|p| p.name == "dq_acc"));
                portable.push((k.name.clone(), source(k).expect("source")));
            }
        }
    }
    for c in &compilers {
        let mut all = portable.clone();
        if c.arch() == "sm_90a" {
            all.extend(hopper.iter().cloned());
        }
        compile_all(std::slice::from_ref(c), all);
    }
}

/// The Hopper fused backward (warpgroup MMA, built for `sm_90a`) at head sizes 64 and 128, both
/// element types, the causal kinds, unmasked and masked, all three gradients and `dQ` with one
/// of the others.
/// The gradients `wrts` of one attention over `refs` as one group, lowered for `target`.
fn grad_group(
    target: Target,
    causal: Causal,
    mask: AttnMask,
    layout: AttnLayout,
    refs: &[&TensorType],
    wrts: &[u8],
) -> rustytorch::codegen::cuda::StepKernels {
    let ops: Vec<Op> = wrts
        .iter()
        .map(|&wrt| Op::AttentionGrad {
            causal,
            mask,
            scale: F64Bits::new(0.125),
            wrt,
            layout,
        })
        .collect();
    let outs: Vec<TensorType> = ops
        .iter()
        .map(|op| rustytorch::ops::infer(op, refs).expect("infer"))
        .collect();
    with_target(target, || {
        flash::lower_grad_group(
            &ops.iter().collect::<Vec<_>>(),
            refs,
            &outs.iter().collect::<Vec<_>>(),
        )
    })
    .expect("lower")
}

#[test]
fn flash_attention_hopper_backward_compiles() {
    let Some(compilers) = compilers() else { return };
    // The variables that select the variants below are process-wide: the other tests that
    // lower for Hopper wait for the whole of this one.
    let _env = HOPPER_ENV.lock().unwrap_or_else(|e| e.into_inner());
    let hopper: Vec<KernelCompiler> = compilers
        .into_iter()
        .filter(|c| c.arch() == "sm_90a")
        .collect();
    let mut sources = vec![];
    for d in [DType::F16, DType::BF16] {
        for &(sq, sk, hd) in &[(1000, 777, 128), (100, 37, 64)] {
            for causal in [Causal::None, Causal::TopLeft, Causal::BottomRight] {
                for (mask, mt) in [
                    (AttnMask::None, None),
                    (AttnMask::Bool, Some(t(DType::Bool, &[2, 1, 1, sk]))),
                ] {
                    if d == DType::F16 && (causal != Causal::TopLeft || mask != AttnMask::None) {
                        continue;
                    }
                    let layout = AttnLayout::Bhsd;
                    let mut ins = vec![
                        heads(d, layout, [2, 3, sq, hd]),
                        heads(d, layout, [2, 3, sk, hd]),
                        heads(d, layout, [2, 3, sk, hd]),
                    ];
                    ins.extend(mt);
                    ins.push(heads(d, layout, [2, 3, sq, hd]));
                    let refs: Vec<&TensorType> = ins.iter().collect();
                    for wrts in [&[0u8, 1, 2][..], &[0, 2]] {
                        let step = grad_group(Target::Hopper, causal, mask, layout, &refs, wrts);
                        let k = &step.launches[2].kernel;
                        assert!(k.name.starts_with("flash_attention_bwd_sm90"), "{}", k.name);
                        // Two computing warpgroups and a producer one, which by default
                        // copies by bulk tensor copies through four tensor maps; one more
                        // over each of dK and dV it computes, which the block stores by bulk
                        // tensor copies.
                        assert_eq!(k.block, 384);
                        let maps = k.params.iter().filter(|p| p.map.is_some()).count();
                        assert_eq!(maps, 4 + wrts.iter().filter(|&&w| w > 0).count());
                        sources.push((k.name.clone(), source(k).expect("source")));
                    }
                }
            }
        }
    }
    // The variants without bulk tensor copies: the producer copying by `cp.async`, and no
    // producer (two warpgroups copying between block-wide barriers), in both layouts.
    for (vars, threads) in [
        (
            &[
                ("RUSTYTORCH_HOPPER_BWD_TMA", "0"),
                ("RUSTYTORCH_HOPPER_BWD_WS", "1"),
            ],
            384,
        ),
        (
            &[
                ("RUSTYTORCH_HOPPER_BWD_TMA", "0"),
                ("RUSTYTORCH_HOPPER_BWD_WS", "0"),
            ],
            256,
        ),
        // One dSᵀ buffer (two named barriers a tile).
        (
            &[
                ("RUSTYTORCH_HOPPER_BWD_DS2", "0"),
                ("RUSTYTORCH_HOPPER_BWD_TMA", "1"),
            ],
            384,
        ),
        // Keys and values released apart, the next tile's values copied first.
        (
            &[
                ("RUSTYTORCH_HOPPER_BWD_EARLY", "1"),
                ("RUSTYTORCH_HOPPER_BWD_TMA", "1"),
            ],
            384,
        ),
        // dK and dV written by each thread's stores instead of bulk tensor copies.
        (
            &[
                ("RUSTYTORCH_HOPPER_BWD_STORE", "thread"),
                ("RUSTYTORCH_HOPPER_BWD_TMA", "1"),
            ],
            384,
        ),
        // Each key tile's walk over the query tiles rotated.
        (
            &[
                ("RUSTYTORCH_HOPPER_BWD_ROTATE", "1"),
                ("RUSTYTORCH_HOPPER_BWD_TMA", "1"),
            ],
            384,
        ),
        // The default kernel on a bounded grid, walking its tiles by rounds.
        (
            &[
                ("RUSTYTORCH_HOPPER_GRID", "4"),
                ("RUSTYTORCH_HOPPER_BWD_TMA", "1"),
            ],
            384,
        ),
        // Each descriptor computed in full, with and without a producer.
        (
            &[
                ("RUSTYTORCH_HOPPER_DESC", "full"),
                ("RUSTYTORCH_HOPPER_BWD_TMA", "1"),
            ],
            384,
        ),
        (
            &[
                ("RUSTYTORCH_HOPPER_DESC", "full"),
                ("RUSTYTORCH_HOPPER_BWD_WS", "0"),
            ],
            256,
        ),
    ] {
        let bounded = vars[0].0 == "RUSTYTORCH_HOPPER_GRID";
        let tma = vars.contains(&("RUSTYTORCH_HOPPER_BWD_TMA", "1"));
        for (k, v) in vars {
            std::env::set_var(k, v);
        }
        for (layout, hd, causal) in [
            (AttnLayout::Bhsd, 128, Causal::TopLeft),
            (AttnLayout::Bshd, 64, Causal::None),
        ] {
            let (sq, sk) = (300, 257);
            let ins = [
                heads(DType::BF16, layout, [2, 3, sq, hd]),
                heads(DType::BF16, layout, [2, 3, sk, hd]),
                heads(DType::BF16, layout, [2, 3, sk, hd]),
                heads(DType::BF16, layout, [2, 3, sq, hd]),
            ];
            let refs: Vec<&TensorType> = ins.iter().collect();
            let step = grad_group(
                Target::Hopper,
                causal,
                AttnMask::None,
                layout,
                &refs,
                &[0, 1, 2],
            );
            let l = &step.launches[2];
            let maps = l.kernel.params.iter().filter(|p| p.map.is_some()).count();
            // Two more, over dK and dV, where the kernel writes them by bulk copies (with the
            // tensor memory accelerator, unless the keys and values are released apart).
            let out_maps = tma
                && !matches!(
                    vars[0].0,
                    "RUSTYTORCH_HOPPER_BWD_STORE" | "RUSTYTORCH_HOPPER_BWD_EARLY"
                );
            assert_eq!(
                maps,
                if out_maps {
                    6
                } else if tma {
                    4
                } else {
                    0
                }
            );
            assert_eq!(l.args.len(), l.kernel.params.len());
            assert_eq!(l.kernel.block, threads);
            let src = source(&l.kernel).expect("source");
            assert_eq!(
                src.contains("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group"),
                out_maps
            );
            assert_eq!(src.contains("cp.async.bulk.tensor.4d"), tma);
            assert_eq!(
                src.contains("copy_keys"),
                vars[0].0 == "RUSTYTORCH_HOPPER_BWD_EARLY"
            );
            // The computing warpgroups meet at one named barrier a tile with two dSᵀ buffers
            // (the default), at two with one; bulk stores of dK and dV add two a key tile.
            if tma {
                let barriers = if vars[0].0 == "RUSTYTORCH_HOPPER_BWD_DS2" {
                    2
                } else {
                    1
                } + if out_maps { 2 } else { 0 };
                assert_eq!(src.matches("bar.sync 3, 256").count(), barriers);
            }
            assert_eq!(
                src.contains("(step - it0 + (int)(tile % "),
                vars[0].0 == "RUSTYTORCH_HOPPER_BWD_ROTATE"
            );
            if bounded {
                assert_eq!(l.grid, 4);
                assert_eq!(src.matches("++round_)").count(), 2);
            }
            sources.push((l.kernel.name.clone(), src));
        }
        for (k, _) in vars {
            std::env::remove_var(k);
        }
    }
    compile_all(&hopper, sources);
}

/// The Hopper kernels keep their warpgroup MMAs asynchronous: ptxas serializes them (its notes
/// C7511 and C7512, every `wgmma` then waited for before the next issues) where a kernel's
/// live registers do not fit or an accumulator is touched between them, which compiles and
/// computes right but runs far slower. The default
/// forward at head sizes 64 and 128 and backward at 128, and the backward at 64 without the
/// overlapped `dK` product (with it, it is serialized: see `hopper_bwd::Variant::overlap`),
/// full and causal, all three gradients and `dQ` with `dV`.
#[test]
fn flash_attention_hopper_wgmma_stays_asynchronous() {
    let Some(compilers) = compilers() else { return };
    let hopper = compilers
        .into_iter()
        .find(|c| c.arch() == "sm_90a")
        .expect("the sm_90 device compiles for sm_90a");
    let _env = HOPPER_ENV.lock().unwrap_or_else(|e| e.into_inner());
    let d = DType::BF16;
    let mut kernels = vec![];
    for hd in [64, 128] {
        for causal in [Causal::None, Causal::TopLeft] {
            let (sq, sk) = (1024, 1024);
            let ins = [
                t(d, &[2, 4, sq, hd]),
                t(d, &[2, 4, sk, hd]),
                t(d, &[2, 4, sk, hd]),
                t(d, &[2, 4, sq, hd]),
            ];
            let refs: Vec<&TensorType> = ins.iter().collect();
            let op = attention(causal, AttnMask::None, AttnLayout::Bhsd);
            let out = rustytorch::ops::infer(&op, &refs[..3]).expect("infer");
            let step =
                with_target(Target::Hopper, || flash::lower(&op, &refs[..3], &out)).expect("lower");
            for l in &step.launches {
                kernels.push((format!("forward d{hd} {causal:?}"), l.kernel.clone()));
            }
            // The backward as it runs by default (at head size 64 without the overlapped dK,
            // dK and dV stored by bulk tensor copies, no fence after the bulk-copied tiles), and
            // with the threads' stores and the fence.
            let threads = [
                ("RUSTYTORCH_HOPPER_BWD_STORE", "thread"),
                ("RUSTYTORCH_HOPPER_BWD_FENCE", "1"),
            ];
            for vars in [vec![], threads.to_vec()] {
                for (k, v) in &vars {
                    std::env::set_var(k, v);
                }
                for wrts in [&[0u8, 1, 2][..], &[0, 2]] {
                    let step = grad_group(
                        Target::Hopper,
                        causal,
                        AttnMask::None,
                        AttnLayout::Bhsd,
                        &refs,
                        wrts,
                    );
                    for l in step.launches {
                        if l.kernel.name.starts_with("flash_attention_bwd_sm90") {
                            kernels.push((
                                format!("backward d{hd} {causal:?} {wrts:?} {vars:?}"),
                                l.kernel,
                            ));
                        }
                    }
                }
                for (k, _) in &vars {
                    std::env::remove_var(k);
                }
            }
        }
    }
    // With each descriptor computed in full (the default builds them as a base plus a constant
    // per step, in uniform registers), at head size 64 where the forward is bound by its
    // instructions: the forward and all three gradients.
    std::env::set_var("RUSTYTORCH_HOPPER_DESC", "full");
    let ins = [
        t(d, &[2, 4, 1024, 64]),
        t(d, &[2, 4, 1024, 64]),
        t(d, &[2, 4, 1024, 64]),
        t(d, &[2, 4, 1024, 64]),
    ];
    let refs: Vec<&TensorType> = ins.iter().collect();
    let op = attention(Causal::None, AttnMask::None, AttnLayout::Bhsd);
    let out = rustytorch::ops::infer(&op, &refs[..3]).expect("infer");
    let step = with_target(Target::Hopper, || flash::lower(&op, &refs[..3], &out)).expect("lower");
    let grads = grad_group(
        Target::Hopper,
        Causal::None,
        AttnMask::None,
        AttnLayout::Bhsd,
        &refs,
        &[0, 1, 2],
    );
    std::env::remove_var("RUSTYTORCH_HOPPER_DESC");
    for l in step.launches.into_iter().chain(grads.launches) {
        if l.kernel.name.starts_with("flash_attention_sm90")
            || l.kernel.name.starts_with("flash_attention_bwd_sm90")
        {
            assert!(!source(&l.kernel)
                .expect("source")
                .contains("unsigned lbo, unsigned off"));
            kernels.push(("full descriptors d64".to_string(), l.kernel));
        }
    }
    // With the rows' sums on the tensor cores (the forward only), alone and with each
    // descriptor in full; with the lean edge, whole and in chunks (the default with two
    // consumers, forced with three), and scaled; with the turns opened at every query tile.
    // Each with a line of source only it has.
    for (vars, mark) in [
        (&[("RUSTYTORCH_HOPPER_ROWSUM", "mma")][..], "RT_WGMMA_L("),
        (
            &[
                ("RUSTYTORCH_HOPPER_ROWSUM", "mma"),
                ("RUSTYTORCH_HOPPER_DESC", "full"),
            ],
            "RT_WGMMA_L(",
        ),
        (&[("RUSTYTORCH_HOPPER_EDGE", "lean")], "const int d0 = "),
        (
            &[("RUSTYTORCH_HOPPER_EDGE", "chunks")],
            "nch = __shfl_sync(0xffffffffu, min(max(wlim - kb + 31, 0) / 32, 4), 0);",
        ),
        (
            &[("RUSTYTORCH_HOPPER_EDGE", "scaled")],
            "float x = s[n][e] * ",
        ),
        (&[("RUSTYTORCH_HOPPER_TURNS", "tile")], "        if (cw != "),
    ] {
        for (k, v) in vars {
            std::env::set_var(k, v);
        }
        for causal in [Causal::None, Causal::TopLeft] {
            let op = attention(causal, AttnMask::None, AttnLayout::Bhsd);
            let step =
                with_target(Target::Hopper, || flash::lower(&op, &refs[..3], &out)).expect("lower");
            for l in step.launches {
                let src = source(&l.kernel).expect("source");
                assert!(src.contains(mark), "{vars:?} {causal:?}");
                kernels.push((format!("forward variant {causal:?} {vars:?}"), l.kernel));
            }
        }
        for (k, _) in vars {
            std::env::remove_var(k);
        }
    }
    assert!(kernels.iter().any(|(w, _)| w.starts_with("backward d64")));
    for (what, k) in kernels {
        let report = hopper
            .assembler_report(&k.name, &source(&k).expect("source"))
            .expect("compile");
        // C7510 to C7515 name the reasons the assembler serializes warpgroup MMAs (C7511:
        // too few registers for their pipeline, C7512: an accumulator touched between them).
        assert!(
            !report.contains("wgmma.mma_async instructions are serialized")
                && !report.contains("(C751"),
            "{what}: wgmma serialized\n{report}"
        );
    }
}
