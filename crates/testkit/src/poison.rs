//! Poison and guard regions: buffers filled with NaN before a call (so an
//! element a kernel should have written and did not stands out), and canary
//! bytes around an output (so a write past either end stands out).

use kvjit_core::{DType, PagedKVCacheCollection, Tensor};

/// Fill every element of a float tensor with NaN.
///
/// # Panics
///
/// For a u32 tensor.
pub fn poison(t: &mut Tensor) {
    t.fill_f32(f32::NAN).expect("a float tensor");
}

/// Fill the output and the whole cache (an FP8 cache's scales too) with
/// NaN; return the poisoned cache
/// bytes (what every untouched cache byte must still be afterwards).
///
/// # Panics
///
/// For u32 buffers.
pub fn poison_all(output: &mut Tensor, cache: &mut PagedKVCacheCollection) -> Vec<u8> {
    poison(output);
    cache.fill_blocks_f32(f32::NAN).expect("a float cache");
    cache.fill_scales(f32::NAN).expect("f32 scales");
    cache.blocks().as_bytes().to_vec()
}

/// `count` elements of `dtype` holding the quiet NaN `fill_f32(NaN)` writes.
///
/// # Panics
///
/// For u32.
pub fn nan_bytes(dtype: DType, count: usize) -> Vec<u8> {
    let mut t = Tensor::zeros(dtype, &[count]).expect("a tensor");
    poison(&mut t);
    t.as_bytes().to_vec()
}

/// The canary byte at position `i` of a guard region: position-dependent,
/// so a shifted or partial copy into a guard is caught too.
pub fn canary(i: usize) -> u8 {
    (i as u8).wrapping_mul(151).wrapping_add(0x3d)
}

/// A byte buffer laid out `[front guard | body | back guard]`, the guards
/// filled with [`canary`] bytes: hand [`body_mut`](Self::body_mut) to a
/// kernel as its output (or [`all`](Self::all) to a device upload), then
/// [`assert_guards`](Self::assert_guards).
#[derive(Clone, Debug, PartialEq)]
pub struct Guarded {
    bytes: Vec<u8>,
    front: usize,
    body: usize,
}

impl Guarded {
    /// `front` canary bytes, a copy of `body`, `back` canary bytes.
    pub fn new(front: usize, body: &[u8], back: usize) -> Self {
        let mut bytes: Vec<u8> = (0..front + body.len() + back).map(canary).collect();
        bytes[front..front + body.len()].copy_from_slice(body);
        Self { bytes, front, body: body.len() }
    }

    /// The body.
    pub fn body(&self) -> &[u8] {
        &self.bytes[self.front..self.front + self.body]
    }

    /// The body, writable.
    pub fn body_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[self.front..self.front + self.body]
    }

    /// Guards and body together.
    pub fn all(&self) -> &[u8] {
        &self.bytes
    }

    /// Guards and body together, writable (a device download's destination).
    pub fn all_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }

    /// Panics (naming `what` and the first touched byte) unless both guards
    /// still hold their canary bytes.
    pub fn assert_guards(&self, what: &str) {
        let end = self.front + self.body;
        for (i, &byte) in self.bytes.iter().enumerate() {
            if (i < self.front || i >= end) && byte != canary(i) {
                let (side, at) = if i < self.front {
                    ("front", i as isize - self.front as isize)
                } else {
                    ("back", (i - end) as isize)
                };
                panic!("{what}: {side} guard byte at {at:+} from the output's edge was overwritten ({byte:#04x})");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_catch_a_write_on_either_side() {
        let mut g = Guarded::new(3, &[1, 2, 3, 4], 5);
        g.body_mut().copy_from_slice(&[9, 9, 9, 9]);
        g.assert_guards("body writes are fine");
        assert_eq!(g.body(), &[9, 9, 9, 9]);
        assert_eq!(g.all().len(), 12);
        for at in [2, 7] {
            let mut bad = g.clone();
            bad.all_mut()[at] ^= 1;
            let err = std::panic::catch_unwind(|| bad.assert_guards("t")).unwrap_err();
            let msg = err.downcast_ref::<String>().unwrap();
            let side = if at < 3 { "front guard byte at -1" } else { "back guard byte at +0" };
            assert!(msg.contains(side), "{msg}");
        }
    }

    #[test]
    fn poisoned_bytes_are_nan() {
        for dtype in DType::FLOATS {
            let t = Tensor::from_le_bytes(dtype, &[3], &nan_bytes(dtype, 3)).unwrap();
            assert!(t.to_f32_vec().unwrap().iter().all(|v| v.is_nan()), "{dtype}");
        }
    }
}
