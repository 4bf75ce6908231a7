//! Widening of stored weight elements (bf16, f16, f32) to f32, scalar and eight at a time.
//!
//! The SIMD paths are chosen at run time ([`Isa::detect`]) so one binary runs everywhere; the
//! scalar path is the reference the SIMD path must agree with bit for bit (widening is exact).

use half::{bf16, f16};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The instruction set a kernel is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// Portable Rust; used where AVX2 is missing and on other architectures.
    Scalar,
    /// AVX2 + FMA + F16C (x86-64-v3).
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    /// The best instruction set this CPU supports (the feature checks are cached by std).
    pub(crate) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            return Isa::Avx2;
        }
        Isa::Scalar
    }

    /// Every instruction set this CPU can run, the portable one first (for tests).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        let mut isas = vec![Isa::Scalar];
        if Isa::detect() != Isa::Scalar {
            isas.push(Isa::detect());
        }
        isas
    }
}

/// An element type weights are stored in.
pub(crate) trait WeightElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;

    /// Loads the eight elements at `p` widened to f32.
    ///
    /// # Safety
    /// `p..p + 8` must be readable and the CPU must support [`Isa::Avx2`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> __m256;
}

impl WeightElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
}

impl WeightElem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // bf16 is the upper half of an f32.
        f32::from_bits((self.to_bits() as u32) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const bf16) -> __m256 {
        let halves = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
    }
}

impl WeightElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

/// `out[i] = src[i] as f32`.
pub(crate) fn widen_into<E: WeightElem>(isa: Isa, src: &[E], out: &mut [f32]) {
    assert_eq!(src.len(), out.len(), "widen_into: length mismatch");
    match isa {
        Isa::Scalar => widen_scalar(src, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only ever constructed after the CPU was checked for it.
        Isa::Avx2 => unsafe { widen_avx2(src, out) },
    }
}

fn widen_scalar<E: WeightElem>(src: &[E], out: &mut [f32]) {
    for (o, &s) in out.iter_mut().zip(src) {
        *o = s.to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_avx2<E: WeightElem>(src: &[E], out: &mut [f32]) {
    let body = src.len() / 8 * 8;
    let mut i = 0;
    while i < body {
        // SAFETY: `i + 8 <= body <= len` for both slices.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i), E::load8(src.as_ptr().add(i))) };
        i += 8;
    }
    widen_scalar(&src[body..], &mut out[body..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_agrees_across_isas() {
        let bits: Vec<u16> = (0..1003u32).map(|i| (i.wrapping_mul(40503) >> 2) as u16).collect();
        let bf: Vec<bf16> = bits.iter().map(|&b| bf16::from_bits(b)).collect();
        let hf: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b)).collect();
        for isa in Isa::available() {
            let mut out = vec![f32::NAN; bits.len()];
            widen_into(isa, &bf, &mut out);
            for (o, &b) in out.iter().zip(&bits) {
                // Exact, NaN payloads included.
                assert_eq!(o.to_bits(), (b as u32) << 16, "bf16 {isa:?}");
            }
            widen_into(isa, &hf, &mut out);
            for (o, x) in out.iter().zip(&hf) {
                // NaN payloads may differ between F16C and software conversion.
                assert!(o.to_bits() == x.to_f32().to_bits() || (o.is_nan() && x.is_nan()), "f16 {isa:?}");
            }
        }
    }
}
