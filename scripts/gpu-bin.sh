# Sourced by the scripts/gpu-*.sh that run `make gpu-bin`'s binaries on the GPU machine, with `what` (the stages
# asked for) set: results go to $OUT (or ./gpu-out) as `$out`; the binaries of .gpu-bin/ decompressed into `$bin`
# once per machine; libtorch and NVRTC (the device's torch wheel) on the library path; the GPU named in gpu.txt;
# `want STAGE` says whether a stage was asked for.
out=${OUT:-gpu-out}
bin=/tmp/dflash-bin
mkdir -p "$out" "$bin"
torch_lib=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$torch_lib:$torch_lib/../../nvidia/cu13/lib
for f in .gpu-bin/*.xz; do
  name=$(basename "$f" .xz)
  [ -x "$bin/$name" ] || { python3 -c "import lzma,sys;open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$f" "$bin/$name"; chmod +x "$bin/$name"; }
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
want() { [ "$what" = all ] || [[ ",$what," == *",$1,"* ]]; }
