//! Row-wise model operations on the device (kernels in `kernels/cuda/ops.cu`): embedding,
//! RMSNorm, RoPE, SiLU-and-multiply, residual add, row gather. One block per row (or token),
//! O(rows * cols) each; out-params take the result's shape, keeping their allocation.

use super::tensor::{CudaTensor, CudaWeight};
use super::upload::Meta;
use super::{grid, launch, strided, Cuda, CudaRope};

impl Cuda {
    /// Device address of `data`, uploaded through the per-step metadata cache.
    pub(crate) fn meta(&self, kind: Meta, data: &[u32]) -> u64 {
        let r =
            self.uploads
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&self.stream, kind, data);
        self.check(r, "metadata upload")
    }

    /// Gives `t` the shape `[rows, cols]`, reallocating only when it must grow.
    pub(crate) fn set_shape(&self, t: &mut CudaTensor, rows: usize, cols: usize) {
        if rows * cols > t.buf.len() {
            t.buf = self.alloc_f32(rows * cols);
        }
        t.rows = rows;
        t.cols = cols;
    }
}

pub(crate) fn embedding(cuda: &Cuda, table: &CudaWeight, ids: &[u32], out: &mut CudaTensor) {
    let dim = table.cols;
    cuda.set_shape(out, ids.len(), dim);
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.rows) {
        panic!("embedding: id {bad} >= vocab {}", table.rows);
    }
    if ids.is_empty() {
        return;
    }
    let (o, t) = (out.ptr(), table.store.ptr());
    let idp = cuda.meta(Meta::Ids, ids);
    let d = dim as i32;
    let name = format!("embedding_{}", table.dtype.name());
    launch!(cuda, name, grid(ids.len(), 256), o, t, idp, d);
}

pub(crate) fn rms_norm(
    cuda: &Cuda,
    x: &CudaTensor,
    w: &CudaWeight,
    eps: f32,
    out: &mut CudaTensor,
) {
    assert_eq!(
        w.rows * w.cols,
        x.cols,
        "rms_norm: weight length != columns"
    );
    cuda.set_shape(out, x.rows, x.cols);
    if x.rows == 0 {
        return;
    }
    let (o, xp, wp) = (out.ptr(), x.ptr(), w.store.ptr());
    let cols = x.cols as i32;
    let name = format!("rms_norm_{}", w.dtype.name());
    launch!(cuda, name, grid(x.rows, 256), o, xp, wp, cols, eps);
}

pub(crate) fn add_assign(cuda: &Cuda, x: &mut CudaTensor, y: &CudaTensor) {
    assert_eq!(
        (x.rows, x.cols),
        (y.rows, y.cols),
        "add_assign: shapes differ"
    );
    let n = x.len();
    if n == 0 {
        return;
    }
    let (xp, yp, len) = (x.ptr(), y.ptr(), n as i64);
    launch!(cuda, "add_assign", strided(n), xp, yp, len);
}

pub(crate) fn gather_rows(cuda: &Cuda, x: &CudaTensor, rows: &[u32], out: &mut CudaTensor) {
    if let Some(&bad) = rows.iter().find(|&&r| r as usize >= x.rows) {
        panic!("gather_rows: row {bad} >= {}", x.rows);
    }
    cuda.set_shape(out, rows.len(), x.cols);
    if rows.is_empty() {
        return;
    }
    let (o, xp) = (out.ptr(), x.ptr());
    let rp = cuda.meta(Meta::Rows, rows);
    let cols = x.cols as i32;
    launch!(cuda, "gather_rows", grid(rows.len(), 256), o, xp, rp, cols);
}

pub(crate) fn apply_rope(cuda: &Cuda, rope: &CudaRope, x: &mut CudaTensor, positions: &[u32]) {
    assert_eq!(positions.len(), x.rows, "apply_rope: one position per row");
    assert_eq!(
        x.cols % rope.head_dim,
        0,
        "apply_rope: columns not whole heads"
    );
    if let Some(&bad) = positions
        .iter()
        .find(|&&p| p as usize >= rope.max_positions)
    {
        panic!(
            "apply_rope: position {bad} >= the table's {}",
            rope.max_positions
        );
    }
    if x.rows == 0 {
        return;
    }
    let xp = x.ptr();
    let pp = cuda.meta(Meta::Positions, positions);
    let (c, s) = (
        super::tensor::dptr(&rope.cos, &cuda.stream),
        super::tensor::dptr(&rope.sin, &cuda.stream),
    );
    let heads = (x.cols / rope.head_dim) as i32;
    let hd = rope.head_dim as i32;
    launch!(
        cuda,
        "rope_rotate_half",
        grid(x.rows, 128),
        xp,
        pp,
        c,
        s,
        heads,
        hd
    );
}

pub(crate) fn silu_mul(cuda: &Cuda, gate_up: &CudaTensor, out: &mut CudaTensor) {
    assert_eq!(gate_up.cols % 2, 0, "silu_mul: odd width");
    let ffn = gate_up.cols / 2;
    cuda.set_shape(out, gate_up.rows, ffn);
    if gate_up.rows == 0 {
        return;
    }
    let (o, g) = (out.ptr(), gate_up.ptr());
    let f = ffn as i32;
    launch!(cuda, "silu_and_mul", grid(gate_up.rows, 256), o, g, f);
}
