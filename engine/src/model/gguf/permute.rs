//! Undoing llama.cpp's row permutation of the query and key projections.
//!
//! Hugging Face Llama checkpoints rotate pairs `(i, i + head_dim/2)` of each head ("rotate
//! half"); llama.cpp's RoPE rotates adjacent pairs `(2i, 2i + 1)`, so its converter reorders
//! the rows of `q_proj` / `k_proj` as `reshape(n_head, 2, head_dim/2, cols).swapaxes(1, 2)`.
//! The inverse reshapes the GGUF matrix as `(n_head, head_dim/2, 2, cols)` and swaps axes 1 and
//! 2: HF row `h*head_dim + s*head_dim/2 + i` is GGUF row `h*head_dim + 2*i + s`.
//! One copy of the matrix, O(rows * cols).

/// Why a matrix could not be un-permuted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PermuteError {
    #[error("{rows} rows do not split into {n_head} heads of an even size")]
    Heads { rows: usize, n_head: usize },
    #[error("{len} values are not a {rows} x {cols} matrix")]
    Size {
        len: usize,
        rows: usize,
        cols: usize,
    },
}

/// Returns the HF ("rotate half") row order of a row-major `(rows, cols)` matrix that llama.cpp
/// permuted for `n_head` heads. Also correct for a bias vector with `cols == 1`.
pub fn unpermute_qk(
    data: &[f32],
    rows: usize,
    cols: usize,
    n_head: usize,
) -> Result<Vec<f32>, PermuteError> {
    if rows.checked_mul(cols) != Some(data.len()) {
        return Err(PermuteError::Size {
            len: data.len(),
            rows,
            cols,
        });
    }
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        return Err(PermuteError::Heads { rows, n_head });
    }
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = Vec::with_capacity(data.len());
    for h in 0..n_head {
        for s in 0..2 {
            for i in 0..half {
                let src = h * head_dim + 2 * i + s;
                out.extend_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The llama.cpp converter's forward permutation, written independently as index maths:
    /// GGUF row `h*hd + 2*i + s` holds HF row `h*hd + s*hd/2 + i`.
    fn permute_like_llama_cpp(hf: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
        let hd = rows / n_head;
        let mut out = vec![0.0; hf.len()];
        for r in 0..rows {
            let (h, within) = (r / hd, r % hd);
            let (i, s) = (within / 2, within % 2);
            let hf_row = h * hd + s * (hd / 2) + i;
            out[r * cols..(r + 1) * cols].copy_from_slice(&hf[hf_row * cols..(hf_row + 1) * cols]);
        }
        out
    }

    #[test]
    fn inverts_the_converter_permutation() {
        for (rows, cols, n_head) in [(8, 3, 2), (12, 5, 3), (4, 1, 1), (24, 2, 2)] {
            let hf: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
            let gguf = permute_like_llama_cpp(&hf, rows, cols, n_head);
            assert_eq!(unpermute_qk(&gguf, rows, cols, n_head).unwrap(), hf);
        }
    }

    #[test]
    fn matches_the_explicit_index_formula() {
        let (n_head, hd, cols) = (3, 6, 4);
        let rows = n_head * hd;
        let gguf: Vec<f32> = (0..rows * cols).map(|v| v as f32 * 0.5).collect();
        let out = unpermute_qk(&gguf, rows, cols, n_head).unwrap();
        for h in 0..n_head {
            for s in 0..2 {
                for i in 0..hd / 2 {
                    for c in 0..cols {
                        let hf_row = h * hd + s * hd / 2 + i;
                        let gguf_row = h * hd + 2 * i + s;
                        assert_eq!(out[hf_row * cols + c], gguf[gguf_row * cols + c]);
                    }
                }
            }
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(matches!(
            unpermute_qk(&[0.0; 6], 6, 1, 4),
            Err(PermuteError::Heads { .. })
        ));
        assert!(matches!(
            unpermute_qk(&[0.0; 3], 3, 1, 3),
            Err(PermuteError::Heads { .. })
        ));
        assert!(matches!(
            unpermute_qk(&[0.0; 5], 2, 3, 1),
            Err(PermuteError::Size { .. })
        ));
        assert!(matches!(
            unpermute_qk(&[], 0, 0, 0),
            Err(PermuteError::Heads { .. })
        ));
    }
}
