//! Counter-based random numbers: element `i` of a seeded tensor depends only on `(seed, i)`, so
//! initializers are reproducible across machines and thread counts, and can run in parallel.

/// SplitMix64 finalizer: a bijective 64-bit mix.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

/// A uniform f64 in [0, 1) for stream position `i` of `seed` (53 random bits).
#[inline]
pub fn uniform01(seed: u64, i: u64) -> f64 {
    let z =
        mix64(mix64(seed ^ 0x9e3779b97f4a7c15).wrapping_add(i.wrapping_mul(0x9e3779b97f4a7c15)));
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A standard normal f64 for stream position `i` of `seed` (Box–Muller on positions 2i, 2i+1).
#[inline]
pub fn normal(seed: u64, i: u64) -> f64 {
    let u1 = 1.0 - uniform01(seed, 2 * i); // (0, 1]
    let u2 = uniform01(seed, 2 * i + 1);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments() {
        let n = 100_000u64;
        let m: f64 = (0..n).map(|i| uniform01(7, i)).sum::<f64>() / n as f64;
        assert!((m - 0.5).abs() < 0.01, "{m}");
        let (s, s2) = (0..n)
            .map(|i| normal(7, i))
            .fold((0.0, 0.0), |(a, b), x| (a + x, b + x * x));
        let mean = s / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(
            mean.abs() < 0.02 && (var - 1.0).abs() < 0.03,
            "{mean} {var}"
        );
        assert_ne!(uniform01(1, 0), uniform01(2, 0));
    }
}
