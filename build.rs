//! Links the binary to libtorch so it runs without LD_LIBRARY_PATH and finds CUDA, and compiles the small C++ shim
//! (`csrc/`) for what tch does not expose: binding a thread's device, allocator statistics, timing events, the
//! fused AdamW kernel, autograd functions with a leaner backward, flash attention with sinks and windows, CUDA graphs,
//! and the c10d TCPStore hosts rendezvous through.
use std::path::PathBuf;

fn main() {
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB")
            .expect("torch-sys did not report its libtorch lib dir (DEP_TCH_LIBTORCH_LIB)"),
    );
    // Resolve the checkout's `.libtorch` link to the shared per-user install, so a copied binary still finds it.
    let lib = std::fs::canonicalize(&lib).unwrap_or(lib);
    // An rpath to the libtorch the crate was built against: `dflash` starts without LD_LIBRARY_PATH. A loader path
    // set by the user (LD_LIBRARY_PATH) still wins, since the linker writes RUNPATH.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // NVRTC, for the fused kernels (opened at run time), ships beside libtorch in the wheel's nvidia/cu13/lib.
    let nvrtc = lib.join("../../nvidia/cu13/lib");
    if let Ok(dir) = std::fs::canonicalize(nvrtc) {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
    // Nothing references libtorch_cuda's symbols directly, so `--as-needed` would drop it and CUDA would never
    // register. Keep it linked where this libtorch has it (a CPU-only libtorch does not).
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }

    let root = lib.parent().expect("libtorch lib dir has a parent").to_path_buf();
    // The libtorch version, for `dflash --version` (the wheel's torch/version.py).
    let version = std::fs::read_to_string(root.join("version.py")).ok().and_then(|text| {
        let line = text.lines().find(|l| l.starts_with("__version__"))?;
        Some(line.split(['\'', '"']).nth(1)?.to_string())
    });
    println!("cargo:rustc-env=DFLASH_LIBTORCH_VERSION={}", version.as_deref().unwrap_or("(version unknown)"));
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .std("c++17")
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .flag("-Wno-unused-parameter")
        .file("csrc/accel.cpp")
        .file("csrc/attention.cpp")
        .file("csrc/autograd.cpp")
        .file("csrc/graph.cpp")
        .file("csrc/nccl.cpp")
        .file("csrc/staircase.cpp")
        .file("csrc/store.cpp");
    // CUDA graphs (`csrc/graph.cpp`) need libtorch's CUDA library and the CUDA runtime's headers: the wheel ships
    // them beside it (nvidia/cu13/include), all but crt/, which scripts/setup.sh adds (nvidia-cuda-crt).
    let cuda_include = root.join("../nvidia/cu13/include");
    if cuda_include.is_dir() {
        // Built again once setup adds crt/ to a build made without it.
        println!("cargo:rerun-if-changed={}", cuda_include.display());
    }
    if lib.join("libtorch_cuda.so").exists() && cuda_include.join("crt/host_config.h").exists() {
        build.define("DFLASH_CUDA_GRAPHS", None).include(cuda_include);
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
    }
    build.compile("dflash_accel");
    println!("cargo:rerun-if-changed=csrc");
    println!("cargo:rerun-if-changed=build.rs");
}
