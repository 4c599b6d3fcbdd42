//! DLPack: the ABI's layout, exports and imports of every dtype (versioned and legacy structs),
//! strided, offset, broadcast, negative-stride, rank-0 and zero-size views from another producer,
//! deleters called exactly once (from another thread too), host memory of other libraries
//! viewed in place (shared pointer, copy-on-write, copies with a reason where the layout or the
//! alignment does not allow a view), and executables run on imported tensors. The CUDA paths run where `RUSTYTORCH_TEST_CUDA=1` (the GPU machine).

use rustytorch::dlpack::{
    contiguous_strides, host_data_ptr, DLDataType, DLDevice, DLDeviceType, DLManagedTensor,
    DLManagedTensorVersioned, DLPackVersion, DLTensor, DlpackTensor, RawManaged,
    DLPACK_FLAG_BITMASK_READ_ONLY, DLPACK_VERSION,
};
use rustytorch::ops::testing::rand_tensor;
use rustytorch::ops::Data;
use rustytorch::prelude::*;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const DTYPES: [DType; 13] = DType::ALL;

fn cuda() -> bool {
    std::env::var("RUSTYTORCH_TEST_CUDA").as_deref() == Ok("1")
}

/// A random tensor of `dtype` (integers and bools over a range that gives varied values).
fn sample(dtype: DType, dims: &[usize], seed: u64) -> HostTensor {
    let (lo, hi) = match dtype {
        DType::Bool => (0.0, 2.0),
        DType::U8 => (0.0, 250.0),
        DType::I8 => (-120.0, 120.0),
        d if d.is_unsigned_int() => (0.0, 60000.0),
        d if d.is_int() => (-1000.0, 1000.0),
        _ => (-3.0, 3.0),
    };
    let t = rand_tensor(&TensorType::new(DType::F64, dims.to_vec()), seed, lo, hi);
    // Floor first so that integer and bool casts see whole numbers.
    let v: Vec<f64> = t.to_f64_vec().iter().map(|x| x.floor()).collect();
    let f = HostTensor::from_vec(v, dims.to_vec()).unwrap();
    if dtype.is_float() {
        t.cast(dtype)
    } else {
        f.cast(dtype)
    }
}

#[test]
fn layout_matches_dlpack_h() {
    use std::mem::{offset_of, size_of};
    assert_eq!(size_of::<DLDevice>(), 8);
    assert_eq!(size_of::<DLDataType>(), 4);
    assert_eq!(size_of::<DLTensor>(), 48);
    assert_eq!(offset_of!(DLTensor, ndim), 16);
    assert_eq!(offset_of!(DLTensor, shape), 24);
    assert_eq!(offset_of!(DLTensor, byte_offset), 40);
    assert_eq!(size_of::<DLManagedTensor>(), 64);
    assert_eq!(offset_of!(DLManagedTensor, deleter), 56);
    assert_eq!(size_of::<DLManagedTensorVersioned>(), 80);
    assert_eq!(offset_of!(DLManagedTensorVersioned, manager_ctx), 8);
    assert_eq!(offset_of!(DLManagedTensorVersioned, deleter), 16);
    assert_eq!(offset_of!(DLManagedTensorVersioned, flags), 24);
    assert_eq!(offset_of!(DLManagedTensorVersioned, dl_tensor), 32);
}

#[test]
fn every_dtype_round_trips_without_a_copy() {
    for (k, dtype) in DTYPES.into_iter().enumerate() {
        for legacy in [false, true] {
            let t = Arc::new(sample(dtype, &[3, 5], k as u64 + 1));
            let e = if legacy {
                DlpackTensor::from_host_legacy(t.clone())
            } else {
                DlpackTensor::from_host(t.clone())
            };
            assert_eq!(e.version(), (!legacy).then_some(DLPACK_VERSION));
            assert_eq!(e.device(), DLDevice::CPU);
            assert_eq!(e.dtype().unwrap(), dtype);
            assert_eq!(e.shape(), &[3, 5]);
            assert_eq!(e.strides(), Some(&[5i64, 1][..]));
            assert!(e.is_contiguous() && !e.is_read_only());
            assert_eq!(e.ty().unwrap(), t.ty());
            // The export points into the tensor's own storage.
            let storage = match t.data() {
                rustytorch::ops::Data::F32(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::F64(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::F16(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::BF16(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::I32(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::I64(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::U8(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::Bool(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::I8(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::I16(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::U16(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::U32(v) => v.as_ptr() as u64,
                rustytorch::ops::Data::U64(v) => v.as_ptr() as u64,
            };
            assert_eq!(e.data_ptr(), storage, "{dtype}");
            // A copy reads the same elements.
            assert_eq!(&e.to_host().unwrap(), &*t, "{dtype} legacy={legacy}");
            assert_eq!(Arc::strong_count(&t), 2, "the export holds the tensor");
            // Importing our own export shares the tensor.
            let back = e.into_host().unwrap();
            assert!(back.copied.is_none(), "{dtype}");
            assert!(Arc::ptr_eq(&back.tensor, &t), "{dtype}");
            drop(back);
            assert_eq!(Arc::strong_count(&t), 1, "the deleter released the tensor");
        }
    }
}

#[test]
fn zero_size_and_rank_zero_tensors() {
    for dims in [vec![0usize], vec![3, 0, 2], vec![]] {
        for dtype in DTYPES {
            let t = Arc::new(sample(dtype, &dims, 7));
            let e = DlpackTensor::from_host(t.clone());
            assert_eq!(e.shape().len(), dims.len());
            assert_eq!(e.to_host().unwrap(), *t);
            let back = e.into_host().unwrap();
            assert!(back.copied.is_none());
            assert_eq!(back.tensor.dims(), &dims[..]);
        }
    }
}

/// A managed tensor made the way another library would: its own buffer, shape, strides and a
/// deleter that counts its calls.
struct Foreign {
    /// The elements' bytes in 8-byte words, so that the buffer is aligned for every dtype.
    words: Vec<u64>,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    calls: Arc<AtomicUsize>,
}

unsafe extern "C" fn foreign_delete(p: *mut DLManagedTensorVersioned) {
    // SAFETY: made by `foreign` below: the context is a boxed `Foreign`, released once here.
    let ctx = unsafe { Box::from_raw((*p).manager_ctx.cast::<Foreign>()) };
    ctx.calls.fetch_add(1, Ordering::SeqCst);
    // SAFETY: the managed struct itself was boxed by `foreign`.
    drop(unsafe { Box::from_raw(p) });
}

unsafe extern "C" fn foreign_delete_legacy(p: *mut DLManagedTensor) {
    // SAFETY: as in `foreign_delete`.
    let ctx = unsafe { Box::from_raw((*p).manager_ctx.cast::<Foreign>()) };
    ctx.calls.fetch_add(1, Ordering::SeqCst);
    // SAFETY: as above.
    drop(unsafe { Box::from_raw(p) });
}

/// `bytes` in 8-byte words (zero-padded).
fn words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            u64::from_ne_bytes(w)
        })
        .collect()
}

/// A foreign tensor over `bytes` (elements of `dtype` start `byte_offset` bytes in).
fn foreign(
    bytes: Vec<u8>,
    dtype: DLDataType,
    shape: &[i64],
    strides: Option<&[i64]>,
    byte_offset: u64,
    version: DLPackVersion,
) -> (DlpackTensor, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let mut ctx = Box::new(Foreign {
        words: words(&bytes),
        shape: shape.to_vec(),
        strides: strides.map(|s| s.to_vec()),
        calls: calls.clone(),
    });
    let tensor = DLTensor {
        data: ctx.words.as_mut_ptr().cast::<c_void>(),
        device: DLDevice::CPU,
        ndim: shape.len() as i32,
        dtype,
        shape: ctx.shape.as_mut_ptr(),
        strides: ctx
            .strides
            .as_mut()
            .map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()),
        byte_offset,
    };
    let m = Box::new(DLManagedTensorVersioned {
        version,
        manager_ctx: Box::into_raw(ctx).cast(),
        deleter: Some(foreign_delete),
        flags: DLPACK_FLAG_BITMASK_READ_ONLY,
        dl_tensor: tensor,
    });
    let p = NonNull::new(Box::into_raw(m)).unwrap();
    // SAFETY: a live managed tensor handed over once.
    match unsafe { DlpackTensor::from_raw_versioned(p) } {
        Ok(t) => (t, calls),
        Err(e) => panic!("{e} (calls: {})", calls.load(Ordering::SeqCst)),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

#[test]
fn strided_views_from_another_library_are_copied_compact_ones_viewed_and_released_once() {
    let base: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
    let f32_ty = DLDataType::of(DType::F32);
    // (shape, strides, offset in elements, expected element i of the result as a base index)
    type Case = (
        Vec<i64>,
        Option<Vec<i64>>,
        usize,
        Box<dyn Fn(&[usize]) -> usize>,
    );
    let cases: Vec<Case> = vec![
        // compact, null strides (row-major)
        (vec![4, 6], None, 0, Box::new(|i| i[0] * 6 + i[1])),
        // a transpose of a 4x6 matrix
        (
            vec![6, 4],
            Some(vec![1, 6]),
            0,
            Box::new(|i| i[1] * 6 + i[0]),
        ),
        // every second column, from element 1 (byte_offset)
        (
            vec![4, 3],
            Some(vec![6, 2]),
            1,
            Box::new(|i| 1 + i[0] * 6 + i[1] * 2),
        ),
        // rows reversed: a negative stride from the last row
        (
            vec![4, 6],
            Some(vec![-6, 1]),
            18,
            Box::new(|i| 18 - i[0] * 6 + i[1]),
        ),
        // a broadcast row: stride 0
        (vec![3, 6], Some(vec![0, 1]), 6, Box::new(|i| 6 + i[1])),
        // rank 3 with a size-1 dim of any stride
        (
            vec![2, 1, 6],
            Some(vec![12, 99, 1]),
            0,
            Box::new(|i| i[0] * 12 + i[2]),
        ),
    ];
    for (shape, strides, offset, at) in cases {
        let (t, calls) = foreign(
            f32_bytes(&base),
            f32_ty,
            &shape,
            strides.as_deref(),
            (offset * 4) as u64,
            DLPACK_VERSION,
        );
        assert!(t.is_read_only());
        let compact = t.is_contiguous();
        let address = t.data_ptr();
        let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        let mut want = Vec::new();
        let mut idx = vec![0usize; dims.len()];
        for _ in 0..dims.iter().product::<usize>() {
            want.push(base[at(&idx)]);
            for d in (0..dims.len()).rev() {
                idx[d] += 1;
                if idx[d] < dims[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        let got = t.into_host().unwrap();
        if compact {
            assert_eq!(got.copied, None, "{shape:?} {strides:?}: viewed in place");
            assert_eq!(host_data_ptr(&got.tensor), address);
            assert_eq!(calls.load(Ordering::SeqCst), 0, "the view holds the tensor");
        } else {
            let why = got.copied.as_deref().unwrap_or_default();
            assert!(why.contains("strided"), "{shape:?} {strides:?}: {why}");
            assert_eq!(calls.load(Ordering::SeqCst), 1, "released after the copy");
        }
        assert_eq!(got.tensor.dims(), &dims[..]);
        assert_eq!(
            got.tensor.to_vec::<f32>().unwrap(),
            want,
            "{shape:?} {strides:?}"
        );
        drop(got);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "deleter once");
    }
}

#[test]
fn every_dtype_imports_from_another_library() {
    for (k, dtype) in DTYPES.into_iter().enumerate() {
        let t = sample(dtype, &[2, 3], 40 + k as u64);
        // The elements' bytes as another library lays them out (bool: one byte each).
        let bytes = rustytorch::compiler::format::tensor_bytes(&t);
        assert_eq!(bytes.len(), 6 * dtype.size_bytes());
        let (d, calls) = foreign(
            bytes,
            DLDataType::of(dtype),
            &[2, 3],
            Some(&[3, 1]),
            0,
            DLPACK_VERSION,
        );
        let address = d.data_ptr();
        let got = d.into_host().unwrap();
        assert_eq!(got.copied, None, "{dtype}");
        assert_eq!(host_data_ptr(&got.tensor), address, "{dtype}: shared");
        assert_eq!(*got.tensor, t, "{dtype}");
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        drop(got);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
    // Any nonzero byte is `true`: no byte pattern makes an invalid `bool`.
    let (d, _) = foreign(
        vec![0, 1, 2, 255],
        DLDataType::of(DType::Bool),
        &[4],
        None,
        0,
        DLPACK_VERSION,
    );
    assert_eq!(
        d.to_host().unwrap().to_vec::<bool>().unwrap(),
        vec![false, true, true, true]
    );
}

#[test]
fn unsupported_types_and_versions_are_errors_and_still_released() {
    // complex64 has no dtype here.
    let (d, calls) = foreign(
        vec![0; 16],
        DLDataType {
            code: 5,
            bits: 64,
            lanes: 1,
        },
        &[2],
        None,
        0,
        DLPACK_VERSION,
    );
    let e = d.into_host().unwrap_err().to_string();
    assert!(e.contains("code 5, 64 bits"), "{e}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // A major version this build does not read: refused, and the deleter runs at once.
    let calls = Arc::new(AtomicUsize::new(0));
    let ctx = Box::new(Foreign {
        words: vec![],
        shape: vec![],
        strides: None,
        calls: calls.clone(),
    });
    let m = Box::new(DLManagedTensorVersioned {
        version: DLPackVersion { major: 2, minor: 0 },
        manager_ctx: Box::into_raw(ctx).cast(),
        deleter: Some(foreign_delete),
        flags: 0,
        dl_tensor: DLTensor {
            data: std::ptr::null_mut(),
            device: DLDevice::CPU,
            ndim: 0,
            dtype: DLDataType::of(DType::F32),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
    });
    // SAFETY: a live managed tensor handed over once.
    let r = unsafe { DlpackTensor::from_raw_versioned(NonNull::new(Box::into_raw(m)).unwrap()) };
    let e = r.unwrap_err().to_string();
    assert!(e.contains("DLPack 2.0"), "{e}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // Device memory is not host memory.
    let t = Arc::new(sample(DType::F32, &[2], 3));
    // SAFETY: `keep` holds the tensor whose storage the export names; nothing reads the
    // pretend device address.
    let d = unsafe {
        DlpackTensor::from_device(
            0x1000,
            &t.ty(),
            DLDevice {
                device_type: DLDeviceType::CUDA,
                device_id: 0,
            },
            Box::new(t.clone()),
            0,
            false,
        )
    };
    assert_eq!(Arc::strong_count(&t), 2);
    let e = d.to_host().unwrap_err().to_string();
    assert!(e.contains("not host memory"), "{e}");
    drop(d);
    assert_eq!(Arc::strong_count(&t), 1, "the device keeper dropped once");
    // A device type that is neither host memory nor CUDA (Vulkan, 7).
    // SAFETY: as above.
    let d = unsafe {
        DlpackTensor::from_device(
            0x1000,
            &t.ty(),
            DLDevice {
                device_type: DLDeviceType(7),
                device_id: 0,
            },
            Box::new(t.clone()),
            0,
            false,
        )
    };
    let e = d.into_host().unwrap_err().to_string();
    assert!(e.contains("neither host memory nor CUDA"), "{e}");
    assert_eq!(Arc::strong_count(&t), 1);
}

#[test]
fn deleters_run_once_on_another_thread() {
    // Our export, released on another thread.
    let t = Arc::new(sample(DType::F32, &[64, 64], 5));
    let exports: Vec<DlpackTensor> = (0..8)
        .map(|i| {
            if i % 2 == 0 {
                DlpackTensor::from_host(t.clone())
            } else {
                DlpackTensor::from_host_legacy(t.clone())
            }
        })
        .collect();
    assert_eq!(Arc::strong_count(&t), 9);
    let handles: Vec<_> = exports
        .into_iter()
        .map(|e| std::thread::spawn(move || drop(e)))
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(Arc::strong_count(&t), 1);

    // Another library's tensor, released on another thread.
    let (d, calls) = foreign(
        f32_bytes(&[1.0, 2.0]),
        DLDataType::of(DType::F32),
        &[2],
        None,
        0,
        DLPACK_VERSION,
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    std::thread::spawn(move || {
        assert_eq!(
            d.to_host().unwrap().to_vec::<f32>().unwrap(),
            vec![1.0, 2.0]
        );
    })
    .join()
    .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn raw_hand_over_passes_ownership() {
    let t = Arc::new(sample(DType::I64, &[4], 9));
    // Versioned: a consumer takes the raw pointer and calls the deleter itself.
    let RawManaged::Versioned(p) = DlpackTensor::from_host(t.clone()).into_raw() else {
        panic!("a versioned export");
    };
    assert_eq!(Arc::strong_count(&t), 2, "into_raw does not release");
    // SAFETY: the consumer owns `p` now and releases it once.
    unsafe {
        assert_eq!((*p.as_ptr()).dl_tensor.ndim, 1);
        ((*p.as_ptr()).deleter.unwrap())(p.as_ptr());
    }
    assert_eq!(Arc::strong_count(&t), 1);
    // Legacy: back into an owner, which releases once.
    let RawManaged::Legacy(p) = DlpackTensor::from_host_legacy(t.clone()).into_raw() else {
        panic!("a legacy export");
    };
    // SAFETY: handed back once.
    let owned = unsafe { DlpackTensor::from_raw_legacy(p) };
    assert_eq!(owned.to_host().unwrap(), *t);
    drop(owned);
    assert_eq!(Arc::strong_count(&t), 1);

    // A legacy tensor from another producer: its deleter runs once.
    let calls = Arc::new(AtomicUsize::new(0));
    let mut ctx = Box::new(Foreign {
        words: words(&f32_bytes(&[4.0, 5.0, 6.0])),
        shape: vec![2],
        strides: None,
        calls: calls.clone(),
    });
    let m = Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data: ctx.words.as_mut_ptr().cast(),
            device: DLDevice::CPU,
            ndim: 1,
            dtype: DLDataType::of(DType::F32),
            shape: ctx.shape.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 4,
        },
        manager_ctx: std::ptr::null_mut(),
        deleter: Some(foreign_delete_legacy),
    });
    let m = Box::into_raw(m);
    // SAFETY: `m` is live; the context is set before the hand-over.
    unsafe { (*m).manager_ctx = Box::into_raw(ctx).cast() };
    // SAFETY: handed over once; two floats from byte 4 are in the buffer.
    let d = unsafe { DlpackTensor::from_raw_legacy(NonNull::new(m).unwrap()) };
    assert_eq!(d.version(), None);
    let got = d.into_host().unwrap();
    assert_eq!(got.copied, None, "compact and aligned from byte 4: viewed");
    assert_eq!(got.tensor.to_vec::<f32>().unwrap(), vec![5.0, 6.0]);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    drop(got);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn contiguity_and_strides() {
    assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
    assert_eq!(contiguous_strides(&[]), Vec::<i64>::new());
    assert_eq!(contiguous_strides(&[5, 0, 2]), vec![0, 2, 1]);
    let (t, _) = foreign(
        vec![0; 48],
        DLDataType::of(DType::F32),
        &[3, 4],
        Some(&[1, 3]),
        0,
        DLPACK_VERSION,
    );
    assert!(!t.is_contiguous());
    let (t, _) = foreign(
        vec![0; 48],
        DLDataType::of(DType::F32),
        &[1, 12],
        Some(&[7, 1]),
        0,
        DLPACK_VERSION,
    );
    assert!(t.is_contiguous(), "a size-1 dim may have any stride");
}

/// x·w + b, relu: a small graph with a parameter.
fn mlp(device: Device) -> Executable {
    mlp_with(device, &CompileOptions::default())
}

fn mlp_with(device: Device, opts: &CompileOptions) -> Executable {
    let g = GraphBuilder::new();
    let x = g.input("x", DType::F32, [4, 6]);
    let w = g.param("w", [6, 3], Init::kaiming_uniform(6, 3));
    let b = g.param("b", [3], Init::zeros());
    let y = x.matmul(&w).add(&b).relu();
    rustytorch::compile_with(&g, &[&y], device, opts).unwrap()
}

/// x·w + b, relu, computed in f64 on the host.
fn mlp_reference(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; 12];
    for i in 0..4 {
        for j in 0..3 {
            let mut acc = b[j] as f64;
            for k in 0..6 {
                acc += x[i * 6 + k] as f64 * w[k * 3 + j] as f64;
            }
            out[i * 3 + j] = acc.max(0.0) as f32;
        }
    }
    out
}

#[test]
fn executables_run_on_imported_tensors_and_export_outputs() {
    let mut exe = mlp(Device::Cpu);
    assert_eq!(exe.input_types()[0].0, "x");
    let names: Vec<&str> = exe.param_types().iter().map(|(n, _)| *n).collect();
    assert_eq!(names, vec!["w", "b"]);
    let w = exe.param("w").unwrap().to_vec::<f32>().unwrap();
    let b = exe.param("b").unwrap().to_vec::<f32>().unwrap();
    // x arrives transposed from another library: a 4x6 view of a 6x4 buffer.
    let xt: Vec<f32> = (0..24)
        .map(|i| ((i * 7) % 11) as f32 * 0.25 - 1.0)
        .collect();
    let x: Vec<f32> = (0..24).map(|i| xt[(i % 6) * 4 + i / 6]).collect();
    let (view, calls) = foreign(
        f32_bytes(&xt),
        DLDataType::of(DType::F32),
        &[4, 6],
        Some(&[1, 4]),
        0,
        DLPACK_VERSION,
    );
    let imported = view.into_host().unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let out = exe.run_shared(&[("x", imported.tensor.clone())]).unwrap();
    let want = mlp_reference(&x, &w, &b);
    let got = out[0].to_vec::<f32>().unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{got:?} vs {want:?}"
        );
    }
    assert!(want.iter().any(|&v| v > 0.0), "a test that can fail");
    // The output goes out without a copy and comes back as the same tensor.
    let y = Arc::new(out.into_vec().remove(0));
    let e = DlpackTensor::from_host(y.clone());
    let again = e.into_host().unwrap();
    assert!(again.copied.is_none() && Arc::ptr_eq(&again.tensor, &y));
    // A shared input of the wrong type is refused with the graph's words.
    let bad = Arc::new(HostTensor::zeros(&TensorType::new(DType::F64, vec![4, 6])));
    let e = exe.run_shared(&[("x", bad)]).unwrap_err().to_string();
    assert!(e.contains("expected f32[4,6]"), "{e}");
}

#[test]
fn executables_take_and_give_dlpack_tensors() {
    let mut exe = mlp(Device::Cpu);
    let w = sample(DType::F32, &[6, 3], 21);
    // Parameters in and out through DLPack (another library's tensor in, ours out).
    let (wd, calls) = foreign(
        rustytorch::compiler::format::tensor_bytes(&w),
        DLDataType::of(DType::F32),
        &[6, 3],
        None,
        0,
        DLPACK_VERSION,
    );
    exe.set_param_dlpack("w", wd).unwrap();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the session keeps a copy, not the producer's memory"
    );
    let got = exe.param_dlpack("w").unwrap();
    assert_eq!(got.device(), DLDevice::CPU);
    assert_eq!(got.to_host().unwrap(), w);
    assert!(exe.param_dlpack("nope").is_err());
    let b = exe.param("b").unwrap().to_vec::<f32>().unwrap();

    // One input from another library (viewed in place), then our own export (shared).
    let x = sample(DType::F32, &[4, 6], 22);
    let (xd, _) = foreign(
        rustytorch::compiler::format::tensor_bytes(&x),
        DLDataType::of(DType::F32),
        &[4, 6],
        None,
        0,
        DLPACK_VERSION,
    );
    let r = exe.run_dlpack(vec![("x", xd)]).unwrap();
    assert!(r.copied.is_empty(), "{:?}", r.copied);
    assert_eq!(r.outputs.len(), 1);
    let (name, y) = &r.outputs[0];
    assert_eq!(
        name, "output0",
        "a builder graph names its outputs by position"
    );
    assert_eq!(y.version(), Some(DLPACK_VERSION));
    let want = mlp_reference(&x.to_vec::<f32>().unwrap(), &w.to_vec::<f32>().unwrap(), &b);
    assert_eq!(
        y.to_host().unwrap().to_vec::<f32>().unwrap().len(),
        want.len()
    );
    for (g, w) in y
        .to_host()
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .zip(&want)
    {
        assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()));
    }
    let own = DlpackTensor::from_host(Arc::new(x));
    let r = exe.run_dlpack(vec![("x", own)]).unwrap();
    assert!(
        r.copied.is_empty(),
        "our own host export runs without a copy"
    );
}

#[test]
fn cuda_tensors_round_trip_through_the_device() {
    if !cuda() {
        return;
    }
    use rustytorch::dlpack::cuda;
    for (k, dtype) in DTYPES.into_iter().enumerate() {
        let t = sample(dtype, &[5, 7], 60 + k as u64);
        for legacy in [false, true] {
            let d = cuda::export_to_device(&t, 0, legacy).unwrap();
            assert_eq!(d.tensor.device().device_type, DLDeviceType::CUDA);
            assert_eq!(d.tensor.dtype().unwrap(), dtype);
            // The consumer's stream (here the legacy default) waits for the upload.
            // SAFETY: the export's stream and the legacy default stream are live in the bound
            // context.
            unsafe { cuda::hand_over(d.stream, cuda::ConsumerStream::Legacy) }.unwrap();
            assert_eq!(
                cuda::to_host(&d.tensor).unwrap(),
                t,
                "{dtype} legacy={legacy}"
            );
            // Not host memory: the host path refuses it.
            assert!(d.tensor.to_host().is_err());
        }
    }
    // A transposed view of device memory is gathered on the host.
    let t = sample(DType::F32, &[3, 4], 77);
    let d = cuda::export_to_device(&t, 0, false).unwrap();
    let ptr = d.tensor.data_ptr();
    let ty = TensorType::new(DType::F32, vec![4, 3]);
    // SAFETY: the view's memory is owned by `d.tensor`, kept alive by `keep` until the view drops.
    let view = unsafe {
        DlpackTensor::from_device(ptr, &ty, d.tensor.device(), Box::new(d.tensor), 0, false)
    };
    // Make it a transpose by hand: strides (1, 4).
    let RawManaged::Versioned(p) = view.into_raw() else {
        panic!("versioned")
    };
    // SAFETY: `p` is live and ours; its strides array holds two entries.
    let view = unsafe {
        let s = (*p.as_ptr()).dl_tensor.strides;
        s.write(1);
        s.add(1).write(4);
        DlpackTensor::from_raw_versioned(p).unwrap()
    };
    let got = cuda::to_host(&view).unwrap().to_vec::<f32>().unwrap();
    let src = t.to_vec::<f32>().unwrap();
    let want: Vec<f32> = (0..12).map(|i| src[(i % 3) * 4 + i / 3]).collect();
    assert_eq!(got, want);
}

#[test]
fn cuda_executables_run_on_device_tensors_in_place() {
    if !cuda() {
        return;
    }
    use rustytorch::dlpack::cuda;
    let mut exe = mlp(Device::Cuda(0));
    let w = exe.param("w").unwrap().to_vec::<f32>().unwrap();
    let b = exe.param("b").unwrap().to_vec::<f32>().unwrap();
    let p = exe.param_dlpack("w").unwrap();
    assert_eq!(p.device().device_type, DLDeviceType::CUDA);
    assert_eq!(cuda::to_host(&p).unwrap().to_vec::<f32>().unwrap(), w);
    let check = |x: &HostTensor, y: &DlpackTensor| {
        let got = cuda::to_host(y).unwrap().to_vec::<f32>().unwrap();
        let want = mlp_reference(&x.to_vec::<f32>().unwrap(), &w, &b);
        assert!(want.iter().any(|&v| v > 0.0), "a test that can fail");
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "{got:?} vs {want:?}"
            );
        }
    };
    // Run 1 (eager): the input is read where it is, the output is a block of its own.
    let x1 = sample(DType::F32, &[4, 6], 91);
    let d1 = cuda::export_to_device(&x1, 0, false).unwrap();
    let r1 = exe.run_dlpack_cuda(&[("x", &d1.tensor)]).unwrap();
    assert!(r1.copied.is_empty(), "{:?}", r1.copied);
    let y1 = &r1.outputs[0].1;
    assert_eq!(y1.tensor.device().device_type, DLDeviceType::CUDA);
    assert_eq!(y1.memory.as_ref().unwrap().addr(), y1.tensor.data_ptr());
    check(&x1, &y1.tensor);
    // Run 2 (captures the CUDA graph, then replays it): the input is copied into the captured
    // buffer, which the result reports; run 1's output is neither moved nor overwritten.
    let x2 = sample(DType::F32, &[4, 6], 92);
    let d2 = cuda::export_to_device(&x2, 0, false).unwrap();
    let r2 = exe.run_dlpack_cuda(&[("x", &d2.tensor)]).unwrap();
    let y2 = &r2.outputs[0].1;
    assert_ne!(y1.tensor.data_ptr(), y2.tensor.data_ptr());
    check(&x2, &y2.tensor);
    check(&x1, &y1.tensor);
    if exe.graph_replays() > 0 {
        assert!(
            r2.copied
                .iter()
                .any(|(n, why)| n == "x" && why.contains("graph")),
            "{:?}",
            r2.copied
        );
    }
    // With replay off every run is in place; outputs dropped on other threads give their blocks
    // back (the pool's allocated bytes return to where they were).
    let mut exe = mlp_with(
        Device::Cuda(0),
        &CompileOptions {
            graph_replay: false,
            ..CompileOptions::default()
        },
    );
    exe.set_param("w", HostTensor::from_vec(w.clone(), vec![6, 3]).unwrap())
        .unwrap();
    let before = exe.memory_stats().unwrap();
    let handles: Vec<_> = (0..4)
        .map(|k| {
            let x = sample(DType::F32, &[4, 6], 100 + k);
            let d = cuda::export_to_device(&x, 0, false).unwrap();
            let r = exe.run_dlpack(vec![("x", d.tensor)]).unwrap();
            assert!(r.copied.is_empty(), "{:?}", r.copied);
            check(&x, &r.outputs[0].1);
            let y = r.outputs.into_iter().next().unwrap().1;
            std::thread::spawn(move || drop(y))
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let after = exe.memory_stats().unwrap();
    assert_eq!(
        before.allocated_bytes.current,
        after.allocated_bytes.current
    );
}

#[test]
fn device_inputs_are_refused_where_they_cannot_run() {
    use rustytorch::dlpack::cuda;
    // A CPU executable takes no device inputs; host memory is not a device input.
    let mut exe = mlp(Device::Cpu);
    let x = Arc::new(sample(DType::F32, &[4, 6], 93));
    let e = DlpackTensor::from_host(x.clone());
    let why = cuda::device_input(&e, 0).unwrap().unwrap_err();
    assert!(why.contains("not CUDA memory"), "{why}");
    let err = exe.run_dlpack_cuda(&[("x", &e)]).unwrap_err().to_string();
    assert!(err.contains("CUDA executable"), "{err}");
    let d = rustytorch::runtime::device::DeviceInput {
        ptr: 0x1000,
        ty: TensorType::new(DType::F32, vec![4, 6]),
        ordinal: 0,
        stream: None,
    };
    let err = exe.run_device(&[("x", d)]).unwrap_err().to_string();
    assert!(err.contains("need a CUDA session"), "{err}");
    // The host path still runs the host export without a copy.
    let r = exe.run_dlpack(vec![("x", e)]).unwrap();
    assert!(r.copied.is_empty());
}

#[test]
fn integer_dtypes_use_dlpacks_int_and_uint_codes() {
    // kDLInt is 0 and kDLUInt 1, with the width in bits (dlpack.h).
    for (dtype, code, bits) in [
        (DType::I8, 0, 8),
        (DType::I16, 0, 16),
        (DType::I32, 0, 32),
        (DType::I64, 0, 64),
        (DType::U8, 1, 8),
        (DType::U16, 1, 16),
        (DType::U32, 1, 32),
        (DType::U64, 1, 64),
    ] {
        let t = DLDataType::of(dtype);
        assert_eq!((t.code, t.bits, t.lanes), (code, bits, 1), "{dtype}");
        assert_eq!(t.dtype().unwrap(), dtype);
    }
}

#[test]
fn host_memory_of_another_library_is_viewed_until_the_last_reference_drops() {
    let vals: Vec<f32> = (0..12).map(|i| i as f32 * 0.75 - 4.0).collect();
    let (d, calls) = foreign(
        f32_bytes(&vals),
        DLDataType::of(DType::F32),
        &[3, 4],
        None,
        0,
        DLPACK_VERSION,
    );
    let address = d.data_ptr();
    let im = d.into_host().unwrap();
    assert_eq!(im.copied, None);
    assert_eq!(host_data_ptr(&im.tensor), address);
    assert!(matches!(im.tensor.data(), Data::F32(b) if b.is_foreign()));
    assert_eq!(im.tensor.to_vec::<f32>().unwrap(), vals);
    // Clones of the tensor share the memory; the deleter waits for the last one, which drops on
    // another thread.
    let copies: Vec<HostTensor> = (0..4).map(|_| (*im.tensor).clone()).collect();
    assert!(copies.iter().all(|c| host_data_ptr(c) == address));
    drop(im);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    let handles: Vec<_> = copies
        .into_iter()
        .map(|c| std::thread::spawn(move || drop(c)))
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "deleter once, on the last drop"
    );
}

#[test]
fn writes_to_a_view_copy_and_leave_the_foreign_memory_untouched() {
    let vals = [1.5f32, -2.0, 3.25, 8.0];
    let (d, calls) = foreign(
        f32_bytes(&vals),
        DLDataType::of(DType::F32),
        &[4],
        None,
        0,
        DLPACK_VERSION,
    );
    let address = d.data_ptr();
    let im = d.into_host().unwrap();
    let keep = im.tensor.clone();
    let Data::F32(mut b) = Arc::unwrap_or_clone(im.tensor).into_data() else {
        panic!("f32 storage");
    };
    assert!(b.is_foreign());
    b[1] = 42.0;
    assert!(!b.is_foreign(), "the write copied first");
    assert_ne!(b.as_ptr() as u64, address);
    assert_eq!(&b[..], &[1.5, 42.0, 3.25, 8.0]);
    // SAFETY: `keep` holds the foreign tensor, whose 4 f32s live at `address`.
    let foreign_now = unsafe { std::slice::from_raw_parts(address as usize as *const f32, 4) };
    assert_eq!(foreign_now, &vals, "the producer's memory is unchanged");
    assert_eq!(keep.to_vec::<f32>().unwrap(), vals);
    drop(keep);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(b.into_vec(), vec![1.5, 42.0, 3.25, 8.0]);
}

#[test]
fn misaligned_strided_and_odd_bool_inputs_are_copied_with_a_reason() {
    let vals: Vec<f32> = (0..8).map(|i| i as f32 - 2.5).collect();
    // Compact f32 elements starting 2 bytes into the buffer: not aligned for f32.
    let mut bytes = vec![0u8, 0];
    bytes.extend(f32_bytes(&vals));
    let (d, calls) = foreign(
        bytes,
        DLDataType::of(DType::F32),
        &[2, 4],
        None,
        2,
        DLPACK_VERSION,
    );
    let im = d.into_host().unwrap();
    let why = im.copied.clone().unwrap_or_default();
    assert!(why.contains("not aligned for f32"), "{why}");
    assert_eq!(im.tensor.to_vec::<f32>().unwrap(), vals);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "released after the copy");
    // Aligned with an offset of whole elements: viewed.
    let (d, _) = foreign(
        f32_bytes(&vals),
        DLDataType::of(DType::F32),
        &[6],
        Some(&[1]),
        8,
        DLPACK_VERSION,
    );
    let im = d.into_host().unwrap();
    assert_eq!(im.copied, None);
    assert_eq!(im.tensor.to_vec::<f32>().unwrap(), &vals[2..]);
    // A transposed view: copied, strides named.
    let (d, _) = foreign(
        f32_bytes(&vals),
        DLDataType::of(DType::F32),
        &[4, 2],
        Some(&[1, 4]),
        0,
        DLPACK_VERSION,
    );
    let im = d.into_host().unwrap();
    let why = im.copied.clone().unwrap_or_default();
    assert!(why.contains("strided") && why.contains("[1, 4]"), "{why}");
    // Bool bytes other than 0 and 1 are read as nonzero = true, in a copy.
    let (d, calls) = foreign(
        vec![0, 1, 2, 255],
        DLDataType::of(DType::Bool),
        &[4],
        None,
        0,
        DLPACK_VERSION,
    );
    let im = d.into_host().unwrap();
    assert!(im.copied.as_deref().unwrap_or_default().contains("bool"));
    assert_eq!(
        im.tensor.to_vec::<bool>().unwrap(),
        vec![false, true, true, true]
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn zero_size_imports_copy_nothing_and_release_at_once() {
    for dtype in DTYPES {
        for shape in [vec![0i64], vec![3, 0, 2]] {
            let (d, calls) = foreign(
                Vec::new(),
                DLDataType::of(dtype),
                &shape,
                None,
                0,
                DLPACK_VERSION,
            );
            let im = d.into_host().unwrap();
            assert_eq!(im.copied, None, "{dtype} {shape:?}");
            assert_eq!(im.tensor.numel(), 0);
            assert_eq!(im.tensor.dtype(), dtype);
            assert_eq!(calls.load(Ordering::SeqCst), 1, "nothing to hold");
        }
    }
}

#[test]
fn executables_read_viewed_inputs_in_place() {
    let mut exe = mlp(Device::Cpu);
    let w = exe.param("w").unwrap().to_vec::<f32>().unwrap();
    let b = exe.param("b").unwrap().to_vec::<f32>().unwrap();
    let x: Vec<f32> = (0..24).map(|i| ((i * 5) % 13) as f32 * 0.3 - 1.7).collect();
    let (d, calls) = foreign(
        f32_bytes(&x),
        DLDataType::of(DType::F32),
        &[4, 6],
        None,
        0,
        DLPACK_VERSION,
    );
    let out = exe.run_dlpack(vec![("x", d)]).unwrap();
    assert!(out.copied.is_empty(), "{:?}", out.copied);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "released after the run");
    let got = out.outputs[0].1.to_host().unwrap().to_vec::<f32>().unwrap();
    let want = mlp_reference(&x, &w, &b);
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{got:?} vs {want:?}"
        );
    }
    assert!(want.iter().any(|&v| v > 0.0), "a test that can fail");
}
