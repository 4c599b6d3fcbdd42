"""SciPy CSR SpGEMM (C = A @ B), the peer of benches/sparse.rs.

Usage: python3 benches/scipy_spgemm.py DIR [REPS]

DIR holds a.row_ptr.npy, a.col_idx.npy, a.values.npy (and b.*) plus shape.npy ([n, k, m]), as the
Rust bench writes them. Prints one line: `scipy_spgemm ms=<median> sorted_ms=<median> nnz=<nnz>`,
where `sorted_ms` adds `sort_indices()` (SciPy's product leaves each row's columns unsorted; the
Rust kernel's result is sorted).
"""
import sys
import time

import numpy as np
import scipy
import scipy.sparse as sp


def load(d, name, shape):
    rp = np.load(f"{d}/{name}.row_ptr.npy")
    ci = np.load(f"{d}/{name}.col_idx.npy")
    v = np.load(f"{d}/{name}.values.npy")
    return sp.csr_matrix((v, ci, rp), shape=shape)


def median_ms(f, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def main():
    d = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    n, k, m = (int(x) for x in np.load(f"{d}/shape.npy"))
    a = load(d, "a", (n, k))
    b = load(d, "b", (k, m))
    c = a @ b  # warm-up
    ms = median_ms(lambda: a @ b, reps)

    def product_sorted():
        p = a @ b
        p.sort_indices()

    sorted_ms = median_ms(product_sorted, reps)
    print(f"scipy_spgemm ms={ms:.4f} sorted_ms={sorted_ms:.4f} nnz={c.nnz} scipy={scipy.__version__}")


if __name__ == "__main__":
    main()
