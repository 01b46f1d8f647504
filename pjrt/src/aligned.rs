//! Host memory a plugin may take as a buffer's own (zero-copy uploads): a tensor's bytes placed
//! at an address aligned as XLA's CPU code needs ([`HOST_ALIGN`]).
//!
//! The bytes live in an ordinary `Vec<u8>` whose first `offset` bytes are padding, so that
//! whoever fills it appends to a `Vec` as usual, and the memory is freed as any `Vec` is: no
//! allocation with a layout of its own.

use crate::{ElementType, Error, HostTensor, Result};

/// The alignment the CPU plugin needs to use host memory in place (Eigen's widest vectors:
/// 64 bytes with AVX-512; it copies memory aligned less).
pub const HOST_ALIGN: usize = 64;

/// A dense row-major tensor whose bytes start at an address aligned to [`HOST_ALIGN`].
#[derive(Debug)]
pub struct AlignedHost {
    pub ty: ElementType,
    pub dims: Vec<i64>,
    /// Padding (`offset` bytes), then the tensor's bytes.
    bytes: Vec<u8>,
    offset: usize,
}

impl AlignedHost {
    /// An empty buffer for `len` bytes: append exactly `len` bytes (it never reallocates up to
    /// there), then [`AlignedHost::from_buffer`].
    pub fn buffer(len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len + HOST_ALIGN - 1);
        let pad = (HOST_ALIGN - v.as_ptr() as usize % HOST_ALIGN) % HOST_ALIGN;
        v.resize(pad, 0);
        v
    }

    /// The tensor of type `ty` and shape `dims` whose bytes end `bytes` (a [`AlignedHost::buffer`]
    /// filled); copied to aligned memory if they are not aligned (a buffer that grew).
    pub fn from_buffer(ty: ElementType, dims: &[i64], bytes: Vec<u8>) -> Result<AlignedHost> {
        let len = ty.byte_size(dims.iter().product::<i64>().max(0) as usize);
        let Some(offset) = bytes.len().checked_sub(len) else {
            return Err(Error::Invalid(format!(
                "host tensor {ty:?} {dims:?} needs {len} bytes but has {}",
                bytes.len()
            )));
        };
        let t = AlignedHost {
            ty,
            dims: dims.to_vec(),
            bytes,
            offset,
        };
        Ok(if t.is_aligned() { t } else { t.realigned() })
    }

    /// A host tensor's bytes, in place when they are aligned, else copied.
    pub fn from_tensor(t: HostTensor) -> AlignedHost {
        let a = AlignedHost {
            ty: t.ty,
            dims: t.dims,
            bytes: t.bytes,
            offset: 0,
        };
        if a.is_aligned() {
            a
        } else {
            a.realigned()
        }
    }

    fn is_aligned(&self) -> bool {
        (self.data().as_ptr() as usize).is_multiple_of(HOST_ALIGN)
    }

    fn realigned(self) -> AlignedHost {
        let mut bytes = AlignedHost::buffer(self.data().len());
        bytes.extend_from_slice(self.data());
        AlignedHost {
            offset: bytes.len() - self.data().len(),
            ty: self.ty,
            dims: self.dims,
            bytes,
        }
    }

    /// The tensor's bytes.
    pub fn data(&self) -> &[u8] {
        &self.bytes[self.offset..]
    }

    /// The memory, padding included (what must outlive a buffer that took it).
    pub(crate) fn into_memory(self) -> Vec<u8> {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_start_aligned_whatever_the_allocation() {
        for n in [0usize, 1, 63, 64, 1000, 1 << 20] {
            let mut b = AlignedHost::buffer(n * 4);
            let cap = b.capacity();
            b.extend((0..n).flat_map(|i| (i as f32).to_le_bytes()));
            assert_eq!(b.capacity(), cap, "no reallocation");
            let t = AlignedHost::from_buffer(ElementType::F32, &[n as i64], b).unwrap();
            assert!(t.is_aligned());
            let want =
                HostTensor::from_f32(&(0..n).map(|i| i as f32).collect::<Vec<_>>(), &[n as i64]);
            assert_eq!(t.data(), &want.bytes[..]);
            let u = AlignedHost::from_tensor(want.clone());
            assert!(u.is_aligned());
            assert_eq!(u.data(), &want.bytes[..]);
        }
        assert!(AlignedHost::from_buffer(ElementType::F32, &[4], vec![0; 15]).is_err());
    }
}
