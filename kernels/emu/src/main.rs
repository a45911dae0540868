//! Prints the folder of the stand-in CUDA driver and cuBLAS (`libcuda.so*`, `libcublas.so*`), for
//! `LD_LIBRARY_PATH`: `LD_LIBRARY_PATH=$(cargo run -q -p kvgate-cuda-emu) cargo test ...`.

fn main() {
    println!("{}", kvgate_cuda_emu::lib_dir().display());
}
