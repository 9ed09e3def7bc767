// CUDA graphs, which tch does not expose: a fixed sequence of kernels captured once and replayed with one launch.
// Batch-1 decoding launches some 600 small kernels a step, and launching them costs more than running them.
// Needs a libtorch with CUDA (build.rs); in a build without, `dflash_graph_available` answers 0 and every other
// function fails with a message saying so.
// The graph is captured on a stream of its own from libtorch's pool (capture refuses the default stream), in
// thread-local mode (other threads of the process keep allocating and launching meanwhile), into the graph's own
// memory pool; tensors allocated during the capture and still held afterwards are where every replay writes.
#include <optional>

#ifdef DFLASH_CUDA_GRAPHS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/StreamGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "shim_error.h"

#ifdef DFLASH_CUDA_GRAPHS
struct DflashGraph {
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream stream;
  // The device-agnostic guard (libtorch's CUDA one is inline code that calls the CUDA runtime directly).
  std::optional<c10::StreamGuard> on_stream;
  explicit DflashGraph(c10::cuda::CUDAStream s) : stream(s) {}
};

// Runs `body` on graph `g` under `guard`: 0, or 1 with the message.
template <typename F>
static int on_graph(void* g, char* err, size_t len, F&& body) {
  return guard(1, err, len, [&] {
    body(*static_cast<DflashGraph*>(g));
    return 0;
  });
}
#endif

extern "C" {

int dflash_graph_available() {
#ifdef DFLASH_CUDA_GRAPHS
  return 1;
#else
  return 0;
#endif
}

#ifdef DFLASH_CUDA_GRAPHS
int dflash_graph_new(int device, void** out, char* err, size_t len) {
  return guard(1, err, len, [&] {
    *out = new DflashGraph(c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device)));
    return 0;
  });
}

// Makes the graph's stream the calling thread's current one (warm-up and capture run there) until `leave`.
int dflash_graph_enter(void* g, char* err, size_t len) {
  return on_graph(g, err, len, [](DflashGraph& graph) { graph.on_stream.emplace(graph.stream.unwrap()); });
}

int dflash_graph_leave(void* g, char* err, size_t len) {
  return on_graph(g, err, len, [](DflashGraph& graph) { graph.on_stream.reset(); });
}

int dflash_graph_capture_begin(void* g, char* err, size_t len) {
  return on_graph(g, err, len, [](DflashGraph& graph) {
    graph.graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
  });
}

int dflash_graph_capture_end(void* g, char* err, size_t len) {
  return on_graph(g, err, len, [](DflashGraph& graph) { graph.graph.capture_end(); });
}

// Replays on the calling thread's current stream.
int dflash_graph_replay(void* g, char* err, size_t len) {
  return on_graph(g, err, len, [](DflashGraph& graph) { graph.graph.replay(); });
}

void dflash_graph_free(void* g) {
  try {
    delete static_cast<DflashGraph*>(g);
  } catch (...) {
  }
}
#else
static int absent(char* err, size_t len) {
  write_error("CUDA graphs are not in this build (its libtorch has no CUDA)", err, len);
  return 1;
}
int dflash_graph_new(int, void**, char* err, size_t len) { return absent(err, len); }
int dflash_graph_enter(void*, char* err, size_t len) { return absent(err, len); }
int dflash_graph_leave(void*, char* err, size_t len) { return absent(err, len); }
int dflash_graph_capture_begin(void*, char* err, size_t len) { return absent(err, len); }
int dflash_graph_capture_end(void*, char* err, size_t len) { return absent(err, len); }
int dflash_graph_replay(void*, char* err, size_t len) { return absent(err, len); }
void dflash_graph_free(void*) {}
#endif
}
