//! A small deterministic pseudo-random generator for simulations, tests, benches and the
//! example workloads: the same seed gives the same sequence on every machine and run. Not for
//! anything that needs unpredictability. Touches nothing.

/// The golden-ratio increment: spreads small seeds (1, 2, 3) over the state space.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// A deterministic generator with the range helpers every simulation here needs. Two streams:
/// xorshift64* (Marsaglia's xorshift with a multiplied output; [`Rng::new`], [`Rng::scrambled`])
/// and splitmix64 ([`Rng::splitmix`]). Both are kept because seeded figures were recorded on
/// each: the right-sizing benchmark and tests on xorshift64*, the layout search's seed table on
/// splitmix64.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
    stream: Stream,
}

#[derive(Debug, Clone, Copy)]
enum Stream {
    XorShift,
    SplitMix,
}

impl Rng {
    /// xorshift64* from `seed` as the state itself (0, which xorshift cannot leave, becomes 1).
    pub fn new(seed: u64) -> Self {
        Self {
            state: seed.max(1),
            stream: Stream::XorShift,
        }
    }

    /// xorshift64* from `seed` multiplied by the golden-ratio constant, so that neighbouring
    /// small seeds give unrelated sequences from the first draw.
    pub fn scrambled(seed: u64) -> Self {
        Self::new(seed.wrapping_mul(GOLDEN))
    }

    /// splitmix64 (Steele, Lea and Flood's generator): any seed, 0 included.
    pub fn splitmix(seed: u64) -> Self {
        Self {
            state: seed,
            stream: Stream::SplitMix,
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        match self.stream {
            Stream::XorShift => {
                let mut x = self.state;
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                self.state = x;
                x.wrapping_mul(0x2545_f491_4f6c_dd1d)
            }
            Stream::SplitMix => {
                self.state = self.state.wrapping_add(GOLDEN);
                let mut z = self.state;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^ (z >> 31)
            }
        }
    }

    /// Uniform in [0, 1): the top 53 bits, which an f64 holds exactly.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform integer in [lo, hi] (`lo <= hi`).
    pub fn int(&mut self, lo: u32, hi: u32) -> u32 {
        let span = u64::from(hi - lo) + 1;
        // The remainder is below `span`, which is at most 2^32: it fits.
        lo + u32::try_from(self.next_u64() % span).unwrap_or(0)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// 1 ± `rel`, uniform: multiplicative measurement noise.
    pub fn jitter(&mut self, rel: f64) -> f64 {
        1.0 + rel * (2.0 * self.unit() - 1.0)
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.unit().max(1e-300);
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Exponential with `rate` per unit of time: the gap between Poisson arrivals.
    pub fn exponential(&mut self, rate: f64) -> f64 {
        let u = 1.0 - self.unit(); // (0, 1]
        -u.ln() / rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_ranges_hold() {
        for make in [Rng::new, Rng::scrambled, Rng::splitmix] {
            let draws = |mut r: Rng| (0..100).map(|_| r.next_u64()).collect::<Vec<_>>();
            assert_eq!(draws(make(7)), draws(make(7)));
            let mut a = make(7);
            for _ in 0..1000 {
                let u = a.unit();
                assert!((0.0..1.0).contains(&u));
                let i = a.int(3, 10);
                assert!((3..=10).contains(&i));
                let j = a.jitter(0.1);
                assert!((0.9..=1.1).contains(&j));
                assert!(a.exponential(2.0) >= 0.0);
            }
        }
        assert_eq!(Rng::new(0).next_u64(), Rng::new(1).next_u64());
        assert_eq!(Rng::new(0).int(5, 5), 5);
    }
}
