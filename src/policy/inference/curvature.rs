//! The surrogate's second-order terms fitted by least squares: a fit's normal equations, their
//! 3 × 3 matrix eliminated once a fit and replayed at each of its grid points.
//!
//! Written here rather than taken from a linear-algebra crate: one 3 × 3 system whose
//! elimination must be replayed step for step on many right-hand sides (so that the fit's figures
//! do not move when the matrix is kept), a few dozen lines.

/// The second-order terms' least squares of one fit: `[ln k, q, r]` minimizing
/// `Σ (ln L − shape − ln k − q·y² − r·x·y)² + ridge·(q² + r²)` (`ln k` unpenalized; the
/// surrogate's ridge is its residual spread over the terms' prior spread, squared). Its normal
/// equations' matrix depends on the points alone, so it is summed and eliminated once a fit; each
/// of the fit's thousands of grid points then solves only for its own right-hand side.
pub(super) struct Curvature {
    /// Each point's row, `[1, y², x·y]` (`y = ln b`, `x = ln c`).
    rows: Vec<[f64; 3]>,
    /// The matrix eliminated; None when it is singular.
    elimination: Option<Elimination>,
}

impl Curvature {
    pub(super) fn new(ln_b: &[f64], ln_c: &[f64], ridge: f64) -> Self {
        let rows: Vec<[f64; 3]> = ln_b
            .iter()
            .zip(ln_c)
            .map(|(y, x)| [1.0, y * y, x * y])
            .collect();
        Curvature {
            elimination: Elimination::of(normal_matrix(&rows, ridge)),
            rows,
        }
    }

    /// `[ln k, q, r]` for these shape terms; the mean residual alone, without curvature, when
    /// the matrix is singular or the solution is not finite.
    pub(super) fn solve(&self, ln_l: &[f64], shape: &[f64]) -> [f64; 3] {
        let mut v = [0.0f64; 3];
        for ((row, l), s) in self.rows.iter().zip(ln_l).zip(shape) {
            let t = l - s;
            for j in 0..3 {
                v[j] += row[j] * t;
            }
        }
        let mean = v[0] / (self.rows.len() as f64).max(1.0);
        self.elimination
            .as_ref()
            .and_then(|e| e.solve(v))
            .unwrap_or([mean, 0.0, 0.0])
    }
}

/// The normal equations' matrix of these rows, its ridge included: `Σ rowᵀ·row`, plus `ridge`
/// on `q`'s and `r`'s diagonal.
fn normal_matrix(rows: &[[f64; 3]], ridge: f64) -> [[f64; 3]; 3] {
    let mut a = [[0.0f64; 3]; 3];
    for row in rows {
        for j in 0..3 {
            for k in 0..3 {
                a[j][k] += row[j] * row[k];
            }
        }
    }
    a[1][1] += ridge;
    a[2][2] += ridge;
    a
}

/// Gauss-Jordan elimination with partial pivoting of a 3 × 3 matrix, its steps (each column's
/// pivot row and the factors it subtracted) kept, so that every right-hand side is then solved
/// with the same operations, in the same order, as eliminating the matrix beside it would.
struct Elimination {
    steps: [(usize, [f64; 3]); 3],
    diagonal: [f64; 3],
}

impl Elimination {
    /// None when the matrix is singular (a pivot under 1e-12).
    fn of(mut a: [[f64; 3]; 3]) -> Option<Self> {
        let mut steps = [(0, [0.0; 3]); 3];
        for (col, step) in steps.iter_mut().enumerate() {
            let pivot = (col..3).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))?;
            if a[pivot][col].abs() < 1e-12 {
                return None;
            }
            a.swap(col, pivot);
            let mut factors = [0.0; 3];
            for row in 0..3 {
                if row != col {
                    let f = a[row][col] / a[col][col];
                    let pivot_row = a[col];
                    for (x, p) in a[row].iter_mut().zip(pivot_row) {
                        *x -= f * p;
                    }
                    factors[row] = f;
                }
            }
            *step = (pivot, factors);
        }
        Some(Elimination {
            steps,
            diagonal: [a[0][0], a[1][1], a[2][2]],
        })
    }

    /// `a·s = v`; None when the solution is not finite.
    fn solve(&self, mut v: [f64; 3]) -> Option<[f64; 3]> {
        for (col, (pivot, factors)) in self.steps.iter().enumerate() {
            v.swap(col, *pivot);
            for row in 0..3 {
                if row != col {
                    v[row] -= factors[row] * v[col];
                }
            }
        }
        let d = self.diagonal;
        let s = [v[0] / d[0], v[1] / d[1], v[2] / d[2]];
        s.iter().all(|x| x.is_finite()).then_some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kept elimination solves `a·s = v` for any right-hand side (pivoting included: the
    /// first matrix needs a row swap), and refuses a singular matrix.
    #[test]
    fn an_elimination_kept_solves_every_right_hand_side() {
        let swapped = [[0.0, 2.0, 1.0], [3.0, 1.0, 0.5], [1.0, 0.5, 4.0]];
        let normal = Curvature::new(&[0.0, 1.0, 2.0, 3.5], &[0.0, 0.7, 1.4, 2.1], 25.0);
        let normal_a = normal_matrix(&normal.rows, 25.0);
        for (a, e) in [
            (swapped, Elimination::of(swapped)),
            (normal_a, normal.elimination),
        ] {
            let e = e.expect("not singular");
            for v in [[1.0, 0.0, 0.0], [0.3, -2.0, 5.0], [-1.0, 4.0, 0.25]] {
                let s = e.solve(v).expect("finite");
                for (row, want) in a.iter().zip(v) {
                    let got: f64 = row.iter().zip(s).map(|(x, y)| x * y).sum();
                    assert!(
                        (got - want).abs() < 1e-9,
                        "{a:?} s = {s:?}: {got} for {want}"
                    );
                }
            }
        }
        assert!(Elimination::of([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0]]).is_none());
    }
}
