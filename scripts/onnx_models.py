#!/usr/bin/env python3
"""Whole models: the `light_*` CNNs that the `onnx` package ships (AlexNet, DenseNet-121,
Inception v1/v2, ResNet-50, ShuffleNet, SqueezeNet, VGG-19, ZFNet-512, their weights replaced by
ConstantOfShape nodes, which this script replaces with seeded random weights scaled by their fan-in,
so that the outputs are not constant) run through `rustytorch run model.onnx` and through
onnxruntime on the same seeded random input; the outputs must agree (relative to the output's scale: max |a − b| ≤ 1e-3 ·
max |b| + 1e-5). Then the GPT-style model exported from PyTorch (tests/data/onnx/tiny_gpt.onnx) on
its recorded token ids, against onnxruntime and PyTorch's recorded logits (max |a − b| ≤ 1e-5).

    scripts/onnx_models.py            # a line per model; exit 1 if one disagrees or fails
    scripts/onnx_models.py -k resnet  # only models whose name contains `resnet`
"""

import atexit
import shutil
import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort

ort.set_default_logger_severity(3)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT64: np.int64}


def file_stem(name):
    s = "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "_" for c in name)
    return s if s and set(s) != {"."} else "output_" + s


def randomize(model, rng):
    """Replaces each ConstantOfShape of a constant shape by random weights of that shape: 1-D
    tensors (biases, norm scales and variances) uniform in [0.5, 1.5], others normal with
    standard deviation √(2 / fan-in)."""
    from onnx import numpy_helper

    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    keep = []
    for n in model.graph.node:
        if n.op_type == "ConstantOfShape" and n.input[0] in inits:
            shape = [int(v) for v in inits[n.input[0]]]
            if len(shape) <= 1:
                w = rng.uniform(0.5, 1.5, shape)
            else:
                fan = max(1, int(np.prod(shape[1:])))
                w = rng.standard_normal(shape) * np.sqrt(2.0 / fan)
            model.graph.initializer.append(numpy_helper.from_array(w.astype(np.float32), n.output[0]))
        else:
            keep.append(n)
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "debug", "rustytorch"))
    ap.add_argument("-k", dest="pattern", default="")
    args = ap.parse_args()
    light = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    failed = 0
    names = sorted(f for f in os.listdir(light) if f.endswith(".onnx") and args.pattern in f)
    for f in names:
        rng = np.random.default_rng(0)
        model = randomize(onnx.load(os.path.join(light, f)), rng)
        # The randomized model (up to 0.5 GB for VGG-19) lives only as long as its check.
        tmpdir = tempfile.mkdtemp()
        atexit.register(shutil.rmtree, tmpdir, True)
        path = os.path.join(tmpdir, f)
        onnx.save(model, path)
        inits = {i.name for i in model.graph.initializer}
        feeds = {}
        for inp in model.graph.input:
            if inp.name in inits:
                continue
            tt = inp.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else 1 for d in tt.shape.dim]
            feeds[inp.name] = rng.standard_normal(shape).astype(DTYPES[tt.elem_type])
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        want = sess.run(None, feeds)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [args.binary, "run", path, "--out", os.path.join(tmp, "out")]
            for name, arr in feeds.items():
                p = os.path.join(tmp, file_stem(name) + ".npy")
                np.save(p, arr)
                cmd += ["--input", f"{name}={p}"]
            t0 = time.time()
            r = subprocess.run(cmd, capture_output=True, text=True)
            secs = time.time() - t0
            if r.returncode != 0:
                print(f"FAIL {f}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
                failed += 1
                continue
            worst = 0.0
            for out, w in zip(model.graph.output, want):
                got = np.load(os.path.join(tmp, "out", file_stem(out.name) + ".npy"))
                if got.shape != w.shape:
                    worst = float("inf")
                    break
                scale = float(np.abs(w).max()) if w.size else 0.0
                err = float(np.abs(got.astype(np.float64) - w.astype(np.float64)).max()) if w.size else 0.0
                worst = max(worst, err / (1e-3 * scale + 1e-5))
            ok = worst <= 1.0
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {f}: max error {worst:.3g} of the tolerance ({secs:.1f} s with import and compile)")
    if args.pattern in "tiny_gpt.onnx":
        failed += not tiny_gpt(args.binary)
        names.append("tiny_gpt.onnx")
    print(f"{len(names) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


def tiny_gpt(binary):
    """The GPT-style model exported from PyTorch (tests/data/onnx, see tests/onnx_gpt.rs) on its
    recorded token ids: RustyTorch's and onnxruntime's logits against PyTorch's recorded ones and
    against each other (max |a - b| <= 1e-5, the Rust test's tolerance). Prints the differences."""
    data = os.path.join(ROOT, "tests", "data", "onnx")
    path = os.path.join(data, "tiny_gpt.onnx")
    ids = np.load(os.path.join(data, "tiny_gpt_ids.npy"))
    torch_logits = np.load(os.path.join(data, "tiny_gpt_logits.npy")).astype(np.float64)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (ort_logits,) = sess.run(None, {sess.get_inputs()[0].name: ids})
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run(
            [binary, "run", path, "--input", f"ids={os.path.join(data, 'tiny_gpt_ids.npy')}", "--out", tmp],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            print(f"FAIL tiny_gpt.onnx: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
            return False
        outs = [f for f in os.listdir(tmp) if f.endswith(".npy")]
        ours = np.load(os.path.join(tmp, outs[0])).astype(np.float64)
    ort_logits = ort_logits.astype(np.float64)
    if ours.shape != ort_logits.shape or ours.shape != torch_logits.shape:
        print(f"FAIL tiny_gpt.onnx: shapes {ours.shape}, onnxruntime {ort_logits.shape}, PyTorch {torch_logits.shape}")
        return False
    d_ort = float(np.abs(ours - ort_logits).max())
    d_torch = float(np.abs(ours - torch_logits).max())
    d_ref = float(np.abs(ort_logits - torch_logits).max())
    ok = max(d_ort, d_torch) <= 1e-5
    print(
        f"{'ok  ' if ok else 'FAIL'} tiny_gpt.onnx: max |RustyTorch - onnxruntime| {d_ort:.2g}, "
        f"|RustyTorch - PyTorch| {d_torch:.2g}, |onnxruntime - PyTorch| {d_ref:.2g} "
        f"(logits up to {np.abs(torch_logits).max():.3g})"
    )
    return ok


if __name__ == "__main__":
    main()
