#!/usr/bin/env python3
"""Checks `rustytorch embed` of all-MiniLM-L6-v2 on CUDA (f32, f16, bf16) against CPU f32.

    # on the build machine: a model copy with float16 weights (about 46 MB) and 64 sentences
    python3 scripts/minilm_gpu_check.py stage STAGEDIR [MODEL_DIR]

    # on the GPU machine: the embeddings, then the comparison
    bash scripts/minilm_gpu_check.sh BIN STAGEDIR OUTDIR

    # the comparison alone: DIR/cpu_f32.npy against DIR/cuda_{f32,f16,bf16}.npy (or NAME.npy ...)
    python3 scripts/minilm_gpu_check.py compare DIR [NAME ...]

`stage` writes STAGEDIR/model/ (the model folder's small json/txt files and model.safetensors
with every floating tensor rounded to float16) and STAGEDIR/sentences.txt (one sentence a line:
one word, punctuation, accents, CJK, emoji, and long lines past the 256-token limit).
`compare` prints, per file, the lowest and mean cosine similarity of its rows to the reference
rows and the largest absolute difference, and exits 1 when a file fails or is missing:
f32 needs cosine >= 0.99999 and max abs <= 1e-4, f16 and bf16 need cosine >= 0.999.
Needs numpy (and safetensors for `stage`).
"""
import os, random, shutil, sys

import numpy as np

DEFAULT_MODEL = os.path.join(
    os.environ.get("RUSTYTORCH_MODEL_DIR", os.path.expanduser("~/.cache/rustytorch/models")),
    "all-MiniLM-L6-v2")
WORDS = """the a of and to in is was for on with as by at from that this it an be are were
model data network system results value time people city river mountain music history science
language computer student teacher market energy water light garden kitchen window morning
evening government committee hospital research experiment measurement temperature pressure
quickly slowly carefully although however because before after during between without under
run write read build measure travel discover explain compare improve remember forget decide
red green blue small large ancient modern electric quiet bright heavy fragile transparent
photosynthesis thermodynamics interoperability counterintuitive electroencephalography
misunderstanding bioluminescence cryptocurrency anthropomorphic idiosyncratic
Paris Tokyo Amazon Beethoven Einstein Kilimanjaro Mississippi 1987 42 3.14 2024""".split()
FIXED = [
    "Hello",
    "What?!... No way -- that's (really) [weird]; isn't it? #hashtag @user 100% & more...",
    "!!! ??? ... ;;; ::: --- ((( ))) [[[ ]]] {{{ }}} <<< >>> *** /// \\\\\\ ||| ~~~ ^^^",
    "e-mail: someone@example.com, url: https://example.org/path?q=1&r=2#frag, tel: +1-555-0100.",
    "Café déjà vu: naïve coöperation, Straße, smörgåsbord, señor, façade, Ærø, Łódź.",
    "東京は日本の首都です。人口は約千四百万人です。",
    "我喜欢在早上喝茶，然后去公园散步。",
    "한국어 문장도 포함되어 있습니다.",
    "Emoji test 🙂🚀🎉 and math ∑ x² ≤ ∞, π ≈ 3.14159, α β γ δ.",
    "Привет, как дела? Всё хорошо, спасибо.",
    "مرحبا بالعالم",
    "   leading and trailing spaces   ",
]


def sentences():
    rng = random.Random(1234)

    def text(n):
        words = [rng.choice(WORDS) for _ in range(n)]
        out = []
        for i, w in enumerate(words):
            out.append(w)
            if i + 1 < n and rng.random() < 0.08:
                out[-1] += rng.choice([",", ";", " -", ":"])
        s = " ".join(out)
        return s[0].upper() + s[1:] + rng.choice([".", "!", "?", "..."])

    long_lines = [text(rng.randint(150, 250)) for _ in range(6)]
    short_lines = [text(rng.randint(2, 40)) for _ in range(64 - len(FIXED) - len(long_lines))]
    out = FIXED + long_lines + short_lines
    rng.shuffle(out)
    return out


def stage(outdir, model_dir=DEFAULT_MODEL):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    dst = os.path.join(outdir, "model")
    os.makedirs(dst, exist_ok=True)
    for root, _, files in os.walk(model_dir):
        for f in files:
            src = os.path.join(root, f)
            if f.endswith((".json", ".txt")) and os.path.getsize(src) < 4 << 20:
                rel = os.path.relpath(src, model_dir)
                os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
                shutil.copyfile(src, os.path.join(dst, rel))
    weights = os.path.join(model_dir, "model.safetensors")
    with safe_open(weights, "np") as f:
        meta = f.metadata()
    tensors = load_file(weights)
    for name, t in tensors.items():
        if t.dtype.kind == "f":
            h = t.astype(np.float16)
            if not np.isfinite(h).all():
                sys.exit(f"{name}: values out of float16 range")
            tensors[name] = h
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata=meta)
    lines = sentences()
    assert len(lines) == 64 and all(s and "\n" not in s and "\r" not in s for s in lines)
    with open(os.path.join(outdir, "sentences.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{outdir}: model/ and sentences.txt ({len(lines)} sentences)")


def compare(d, names):
    if not os.path.isfile(os.path.join(d, "cpu_f32.npy")):
        print("cpu_f32    MISSING")
        return False
    ref = np.load(os.path.join(d, "cpu_f32.npy")).astype(np.float64)
    found = sorted(f[:-4] for f in os.listdir(d) if f.startswith("cuda_") and f.endswith(".npy"))
    names = list(names) or ["cuda_f32", "cuda_f16", "cuda_bf16"]
    names += [n for n in found if n not in names]
    ok = True
    print(f"reference cpu_f32: {ref.shape[0]} x {ref.shape[1]}")
    for name in names:
        path = os.path.join(d, name + ".npy")
        if not os.path.isfile(path):
            print(f"{name:10s} MISSING")
            ok = False
            continue
        x = np.load(path).astype(np.float64)
        if x.shape != ref.shape or not np.isfinite(x).all():
            print(f"{name:10s} FAIL shape {x.shape}, finite {np.isfinite(x).all()}")
            ok = False
            continue
        cos = (x * ref).sum(1) / np.maximum(
            np.linalg.norm(x, axis=1) * np.linalg.norm(ref, axis=1), 1e-30)
        mad = np.abs(x - ref).max()
        good = cos.min() >= 0.99999 and mad <= 1e-4 if name.endswith("f32") else cos.min() >= 0.999
        ok &= bool(good)
        print(f"{name:10s} min_cos {cos.min():.7f}  max_abs {mad:.3e}  mean_cos {cos.mean():.7f}  "
              f"{'PASS' if good else 'FAIL'}")
    return ok


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "stage":
        stage(*sys.argv[2:4])
    elif len(sys.argv) >= 3 and sys.argv[1] == "compare":
        sys.exit(0 if compare(sys.argv[2], sys.argv[3:]) else 1)
    else:
        sys.exit(__doc__)
