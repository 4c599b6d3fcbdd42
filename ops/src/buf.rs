//! [`Buf`]: the element storage of a host tensor, either an owned `Vec` or a read-only view of
//! memory another library owns (a NumPy array, a PyTorch tensor, anything imported through
//! DLPack), so that such memory can be read without a copy.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Arc;

/// Contiguous elements: an owned `Vec<T>`, or a shared region of foreign memory kept alive by
/// an owner (whose drop releases it, on whatever thread drops the last reference).
///
/// A `Buf` reads as a slice (`Deref<Target = [T]>`). Writing through `DerefMut` first copies a
/// foreign region into an owned `Vec` (copy-on-write), so nothing is ever written into memory
/// another library handed over. Cloning a foreign region shares it (the owner's reference count
/// grows); cloning an owned one copies the `Vec`.
pub struct Buf<T> {
    repr: Repr<T>,
}

enum Repr<T> {
    Owned(Vec<T>),
    Foreign {
        ptr: NonNull<T>,
        len: usize,
        owner: Arc<dyn Send + Sync>,
    },
}

// SAFETY: a foreign region is only read (writes copy it first) and its owner is `Send + Sync`,
// so a `Buf<T>` may move to another thread whenever `T` and a `Vec<T>` may.
unsafe impl<T: Send + Sync> Send for Buf<T> {}

// SAFETY: `&Buf<T>` gives out `&[T]` only; shared reads of `T: Sync` are sound on any thread.
unsafe impl<T: Sync> Sync for Buf<T> {}

impl<T> Buf<T> {
    /// Views `len` elements at `ptr` without copying; `owner` keeps the memory alive and
    /// releases it when the last `Buf` sharing it (and the last clone of `owner`) drops.
    ///
    /// # Safety
    ///
    /// For as long as `owner` lives, `ptr` must be aligned for `T` and address `len` initialized
    /// elements, each a valid `T` (for `bool`: bytes 0 or 1), that nobody writes to.
    pub unsafe fn from_foreign(ptr: *const T, len: usize, owner: Arc<dyn Send + Sync>) -> Buf<T> {
        let ptr = if len == 0 {
            NonNull::dangling()
        } else {
            NonNull::new(ptr.cast_mut()).unwrap_or(NonNull::dangling())
        };
        Buf {
            repr: Repr::Foreign { ptr, len, owner },
        }
    }

    /// Whether the elements live in foreign memory (not copied into an owned `Vec`).
    pub fn is_foreign(&self) -> bool {
        matches!(self.repr, Repr::Foreign { .. })
    }

    /// The elements as a slice.
    pub fn as_slice(&self) -> &[T] {
        match &self.repr {
            Repr::Owned(v) => v,
            // SAFETY: `from_foreign`'s contract: `len` valid elements at `ptr` while `owner`,
            // which `self` holds, lives.
            Repr::Foreign { ptr, len, .. } => unsafe {
                std::slice::from_raw_parts(ptr.as_ptr(), *len)
            },
        }
    }
}

impl<T: Clone> Buf<T> {
    /// The elements as an owned `Vec` (a foreign region is copied, and released when no other
    /// `Buf` shares it).
    pub fn into_vec(self) -> Vec<T> {
        match self.repr {
            Repr::Owned(v) => v,
            Repr::Foreign { .. } => self.as_slice().to_vec(),
        }
    }

    /// The owned `Vec`, copying a foreign region into one first.
    pub fn make_owned(&mut self) -> &mut Vec<T> {
        if let Repr::Foreign { .. } = self.repr {
            self.repr = Repr::Owned(self.as_slice().to_vec());
        }
        match &mut self.repr {
            Repr::Owned(v) => v,
            Repr::Foreign { .. } => unreachable!("copied above"),
        }
    }
}

impl<T> Deref for Buf<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T: Clone> DerefMut for Buf<T> {
    /// Copies a foreign region into an owned `Vec` first: foreign memory is never written.
    fn deref_mut(&mut self) -> &mut [T] {
        self.make_owned()
    }
}

impl<T> AsRef<[T]> for Buf<T> {
    fn as_ref(&self) -> &[T] {
        self.as_slice()
    }
}

impl<T> From<Vec<T>> for Buf<T> {
    fn from(v: Vec<T>) -> Buf<T> {
        Buf {
            repr: Repr::Owned(v),
        }
    }
}

impl<T: Clone> From<&[T]> for Buf<T> {
    fn from(v: &[T]) -> Buf<T> {
        Buf::from(v.to_vec())
    }
}

impl<T> FromIterator<T> for Buf<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Buf<T> {
        Buf::from(iter.into_iter().collect::<Vec<T>>())
    }
}

impl<T: Send> rayon::iter::FromParallelIterator<T> for Buf<T> {
    fn from_par_iter<I: rayon::iter::IntoParallelIterator<Item = T>>(iter: I) -> Buf<T> {
        Buf::from(Vec::from_par_iter(iter))
    }
}

impl<T: Clone> IntoIterator for Buf<T> {
    type Item = T;
    type IntoIter = std::vec::IntoIter<T>;

    fn into_iter(self) -> Self::IntoIter {
        self.into_vec().into_iter()
    }
}

impl<'a, T> IntoIterator for &'a Buf<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

impl<T: Clone> Clone for Buf<T> {
    fn clone(&self) -> Buf<T> {
        match &self.repr {
            Repr::Owned(v) => Buf::from(v.clone()),
            Repr::Foreign { ptr, len, owner } => Buf {
                repr: Repr::Foreign {
                    ptr: *ptr,
                    len: *len,
                    owner: owner.clone(),
                },
            },
        }
    }
}

impl<T: PartialEq> PartialEq for Buf<T> {
    fn eq(&self, other: &Buf<T>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<T: PartialEq> PartialEq<Vec<T>> for Buf<T> {
    fn eq(&self, other: &Vec<T>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<T: PartialEq> PartialEq<[T]> for Buf<T> {
    fn eq(&self, other: &[T]) -> bool {
        self.as_slice() == other
    }
}

impl<T: fmt::Debug> fmt::Debug for Buf<T> {
    /// As a `Vec` prints: the elements in brackets, wherever they live.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_slice(), f)
    }
}

impl<T> Default for Buf<T> {
    fn default() -> Buf<T> {
        Buf::from(Vec::new())
    }
}

impl<T: serde::Serialize> serde::Serialize for Buf<T> {
    /// As a sequence, as a `Vec` serializes.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.as_slice().serialize(s)
    }
}

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for Buf<T> {
    /// From a sequence, into an owned `Vec`.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Buf<T>, D::Error> {
        Vec::<T>::deserialize(d).map(Buf::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Region {
        bytes: Vec<f32>,
        drops: Arc<AtomicUsize>,
    }

    impl Drop for Region {
        fn drop(&mut self) {
            self.drops.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn foreign(vals: &[f32]) -> (Buf<f32>, *const f32, Arc<AtomicUsize>) {
        let drops = Arc::new(AtomicUsize::new(0));
        let region = Arc::new(Region {
            bytes: vals.to_vec(),
            drops: drops.clone(),
        });
        let ptr = region.bytes.as_ptr();
        // SAFETY: `region` owns `vals.len()` f32s at `ptr`, read-only, and lives in the owner.
        let b = unsafe { Buf::from_foreign(ptr, vals.len(), region) };
        (b, ptr, drops)
    }

    #[test]
    fn foreign_regions_are_shared_and_released_once() {
        let (b, ptr, drops) = foreign(&[1.5, -2.0, 3.25]);
        assert!(b.is_foreign());
        assert_eq!(b.as_ptr(), ptr);
        assert_eq!(&*b, &[1.5, -2.0, 3.25]);
        let c = b.clone();
        assert_eq!(c.as_ptr(), ptr, "a clone shares the region");
        drop(b);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        std::thread::spawn(move || drop(c)).join().unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn writes_copy_first() {
        let (mut b, ptr, drops) = foreign(&[1.0, 2.0]);
        let keep = b.clone();
        b[0] = 7.0;
        assert!(!b.is_foreign());
        assert_ne!(b.as_ptr(), ptr);
        assert_eq!(&*b, &[7.0, 2.0]);
        assert_eq!(&*keep, &[1.0, 2.0], "the foreign memory is untouched");
        drop(keep);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn into_vec_equality_and_debug() {
        let (b, _, drops) = foreign(&[0.5, 4.0]);
        assert_eq!(b, Buf::from(vec![0.5f32, 4.0]));
        assert_eq!(format!("{b:?}"), format!("{:?}", vec![0.5f32, 4.0]));
        assert_eq!(b.clone().into_vec(), vec![0.5, 4.0]);
        drop(b);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        let empty: Buf<f32> = [].iter().copied().collect();
        assert!(empty.is_empty() && !empty.is_foreign());
        // SAFETY: zero elements are read.
        let z = unsafe { Buf::<f64>::from_foreign(std::ptr::null(), 0, Arc::new(())) };
        assert_eq!(z.len(), 0);
    }
}
