// NCCL communicators for the collective across GPUs, through the NCCL that libtorch_cuda already loaded (its symbols
// are looked up at run time, so the binary does not link NCCL itself and still starts where there is none).
// Communicators are non-blocking: initialisation and collectives are polled with a deadline, so a peer that never
// arrives or dies mid-collective is caught by a timeout, and the communicator is aborted instead of hanging its
// thread. Each communicator runs its collectives on a stream of its own, ordered after the caller's current stream
// and before the caller's later work.
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <climits>

#include <chrono>
#include <stdexcept>
#include <thread>

#include "shim_error.h"

// The part of NCCL's C ABI used here (NCCL 2.28's nccl.h; the wheel's CUDA headers are too incomplete to include it).
extern "C" {
typedef struct ncclComm* ncclComm_t;
#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;
typedef enum { ncclSuccess = 0, ncclInProgress = 7 } ncclResult_t;
typedef enum { ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9 } ncclDataType_t;
typedef enum { ncclSum = 0 } ncclRedOp_t;
// ncclConfig_v22800; NCCL reads a configuration by its size and version, so newer libraries accept it.
typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking, cgaClusterSize, minCTAs, maxCTAs;
  const char* netName;
  int splitShare, trafficClass;
  const char* commName;
  int collnetEnable, CTAPolicy, shrinkShare, nvlsCTAs, nChannelsPerNetPeer, nvlinkCentricSched;
} ncclConfig_t;
ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, void* stream);
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, void* stream);
const char* ncclGetErrorString(ncclResult_t result);
const char* ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetVersion(int* version);
}

// The NCCL version whose ncclConfig_t layout is declared above (NCCL codes 2.28.0 as 22800).
constexpr int kConfigLayout = 22800;

// NCCL_CONFIG_INITIALIZER with a non-blocking communicator.
ncclConfig_t nonblocking_config() {
  ncclConfig_t c;
  c.size = sizeof(ncclConfig_t);
  c.magic = 0xcafebeef;
  c.version = 22809;
  c.cgaClusterSize = c.minCTAs = c.maxCTAs = INT_MIN;
  c.netName = nullptr;
  c.splitShare = c.trafficClass = INT_MIN;
  c.commName = nullptr;
  c.collnetEnable = c.CTAPolicy = c.shrinkShare = c.nvlsCTAs = c.nChannelsPerNetPeer = c.nvlinkCentricSched = INT_MIN;
  c.blocking = 0;
  return c;
}

namespace {
struct Api {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) get_async_error = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclCommFinalize) finalize = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetLastError) last_error = nullptr;
  decltype(&ncclGetVersion) version = nullptr;
};

template <typename F>
void resolve(F& slot, const char* name) {
  slot = reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
  if (slot == nullptr) throw std::runtime_error(std::string("NCCL is not loaded in this process (no ") + name + ")");
}

const Api& api() {
  static const Api resolved = [] {
    Api a;
    resolve(a.get_unique_id, "ncclGetUniqueId");
    resolve(a.init_rank_config, "ncclCommInitRankConfig");
    resolve(a.get_async_error, "ncclCommGetAsyncError");
    resolve(a.abort, "ncclCommAbort");
    resolve(a.finalize, "ncclCommFinalize");
    resolve(a.destroy, "ncclCommDestroy");
    resolve(a.all_reduce, "ncclAllReduce");
    resolve(a.broadcast, "ncclBroadcast");
    resolve(a.error_string, "ncclGetErrorString");
    resolve(a.last_error, "ncclGetLastError");
    resolve(a.version, "ncclGetVersion");
    return a;
  }();
  return resolved;
}

std::string describe(ncclResult_t r, ncclComm_t comm) {
  std::string msg = api().error_string(r);
  const char* last = api().last_error(comm);
  if (last != nullptr && *last != '\0') msg += std::string(": ") + last;
  return msg;
}

void check(ncclResult_t r, const char* what, ncclComm_t comm) {
  if (r != ncclSuccess && r != ncclInProgress) throw std::runtime_error(std::string(what) + ": " + describe(r, comm));
}

// Polls the communicator's state until it leaves ncclInProgress or `timeout_s` passes (then ncclInProgress).
ncclResult_t settle(ncclComm_t comm, double timeout_s) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (true) {
    ncclResult_t state = ncclInProgress;
    auto r = api().get_async_error(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (std::chrono::steady_clock::now() >= deadline) return ncclInProgress;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

struct Comm {
  ncclComm_t comm;
  c10::Stream stream;
  c10::Event done;
  c10::DeviceIndex device;
};

c10::Device cuda(c10::DeviceIndex index) { return c10::Device(c10::DeviceType::CUDA, index); }

ncclDataType_t nccl_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kBFloat16: return ncclBfloat16;
    case at::kHalf: return ncclFloat16;
    case at::kDouble: return ncclFloat64;
    default:
      throw std::runtime_error(std::string("an NCCL collective of ") + c10::toString(t.scalar_type()) +
                               " is not supported");
  }
}
}  // namespace

extern "C" {

// Status codes: 0 done, 1 failed (message in `err`), 2 timed out.

int dflash_nccl_version(int* out, char* err, size_t len) {
  return guard(1, err, len, [&] {
    check(api().version(out), "ncclGetVersion", nullptr);
    return 0;
  });
}

int dflash_nccl_unique_id(char* out, char* err, size_t len) {
  return guard(1, err, len, [&] {
    ncclUniqueId id;
    check(api().get_unique_id(&id), "ncclGetUniqueId", nullptr);
    std::memcpy(out, id.internal, NCCL_UNIQUE_ID_BYTES);
    return 0;
  });
}

// Joins communicator `id` as `rank` of `nranks` on CUDA device `device`, waiting at most `timeout_s` for the other
// ranks; on a timeout or failure the half-built communicator is aborted and *out stays null.
int dflash_nccl_init(const char* id, int rank, int nranks, int device, double timeout_s, void** out, char* err,
                     size_t len) {
  *out = nullptr;
  return guard(1, err, len, [&] {
    const auto& nccl = api();
    // The configuration below has the layout of NCCL 2.28 (ncclConfig_v22800): newer libraries read it by its size
    // and version, older ones would misread it.
    int loaded = 0;
    check(nccl.version(&loaded), "ncclGetVersion", nullptr);
    if (loaded < kConfigLayout) {
      throw std::runtime_error("the NCCL loaded in this process is " + std::to_string(loaded) +
                               ", older than 2.28 (" + std::to_string(kConfigLayout) +
                               "), whose communicator configuration this build passes: use the NCCL of torch 2.11 "
                               "(2.28 or newer)");
    }
    auto index = static_cast<c10::DeviceIndex>(device);
    at::accelerator::setDeviceIndex(index);
    ncclUniqueId unique;
    std::memcpy(unique.internal, id, NCCL_UNIQUE_ID_BYTES);
    auto config = nonblocking_config();
    ncclComm_t comm = nullptr;
    auto r = nccl.init_rank_config(&comm, nranks, unique, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      if (comm != nullptr) nccl.abort(comm);
      throw std::runtime_error("ncclCommInitRankConfig: " + describe(r, comm));
    }
    auto state = settle(comm, timeout_s);
    if (state != ncclSuccess) {
      auto msg = state == ncclInProgress ? std::string("the other ranks did not join in time") : describe(state, comm);
      nccl.abort(comm);
      if (state == ncclInProgress) {
        write_error(std::runtime_error(msg), err, len);
        return 2;
      }
      throw std::runtime_error("NCCL communicator: " + msg);
    }
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    auto stream = impl->getStreamFromGlobalPool(cuda(index), /*isHighPriority=*/false);
    *out = new Comm{comm, stream, c10::Event(c10::DeviceType::CUDA), index};
    return 0;
  });
}

}  // extern "C"

namespace {

// Runs one collective (`enqueue` puts it on the stream it is given) on the communicator's stream, after the caller's
// current stream's work, and waits at most `timeout_s` for it; the caller's stream then waits for its result.
// Returns 2 on a timeout (the communicator must then be aborted: a peer is missing or stuck), with the message in
// `err`; throws on a failure.
template <typename F>
int run_collective(Comm* c, const char* what, double timeout_s, char* err, size_t len, F&& enqueue) {
  const auto& nccl = api();
  auto current = at::accelerator::getCurrentStream(c->device);
  c10::Event ready(c10::DeviceType::CUDA);
  ready.record(current);
  ready.block(c->stream);
  check(enqueue(c->stream.native_handle()), what, c->comm);
  auto state = settle(c->comm, timeout_s);
  if (state == ncclInProgress) {
    write_error(std::runtime_error(std::string("enqueueing the ") + what + " did not finish in time"), err, len);
    return 2;
  }
  if (state != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + describe(state, c->comm));
  c->done.record(c->stream);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (!c->done.query()) {
    ncclResult_t async = ncclSuccess;
    nccl.get_async_error(c->comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      throw std::runtime_error(std::string(what) + " failed: " + describe(async, c->comm));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      write_error(std::runtime_error(std::string("the ") + what + " did not complete in time"), err, len);
      return 2;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  c->done.block(current);
  return 0;
}

bool on_comm(const Comm* c, const at::Tensor& t) { return t.is_contiguous() && t.device() == cuda(c->device); }

}  // namespace

extern "C" {

// Sums `send` over the ranks into `recv` (the same tensor for in place) on the communicator's stream, after the
// caller's current stream's work, and waits at most `timeout_s` for it. The caller's stream waits for the result.
// On a timeout (2) the communicator must be aborted: a peer is missing or stuck.
int dflash_nccl_all_reduce_sum(void* handle, const at::Tensor* send, at::Tensor* recv, double timeout_s, char* err,
                               size_t len) {
  return guard(1, err, len, [&] {
    auto* c = static_cast<Comm*>(handle);
    if (!on_comm(c, *send) || !on_comm(c, *recv) || send->numel() != recv->numel() ||
        send->scalar_type() != recv->scalar_type()) {
      throw std::runtime_error(
          "all-reduce needs two contiguous tensors of one shape and dtype on the communicator's device");
    }
    return run_collective(c, "all-reduce", timeout_s, err, len, [&](void* stream) {
      return api().all_reduce(send->data_ptr(), recv->data_ptr(), static_cast<size_t>(send->numel()),
                              nccl_type(*send), ncclSum, c->comm, stream);
    });
  });
}

// Copies rank `root`'s `tensor` into every other rank's `tensor` (in place), as dflash_nccl_all_reduce_sum runs.
int dflash_nccl_broadcast(void* handle, at::Tensor* tensor, int root, double timeout_s, char* err, size_t len) {
  return guard(1, err, len, [&] {
    auto* c = static_cast<Comm*>(handle);
    if (!on_comm(c, *tensor)) throw std::runtime_error("broadcast needs a contiguous tensor on the communicator's device");
    return run_collective(c, "broadcast", timeout_s, err, len, [&](void* stream) {
      return api().broadcast(tensor->data_ptr(), tensor->data_ptr(), static_cast<size_t>(tensor->numel()),
                             nccl_type(*tensor), root, c->comm, stream);
    });
  });
}

void dflash_nccl_abort(void* handle);

// Closes the communicator gracefully: waits at most `timeout_s` for what it still has in flight (over the network
// transport a rank's collective can complete while its proxy still sends to a peer: an abort then cuts the peer's
// receive off), then destroys it; a failure or timeout aborts it instead. Frees it either way.
int dflash_nccl_finalize(void* handle, double timeout_s, char* err, size_t len) {
  auto* c = static_cast<Comm*>(handle);
  int status = guard(1, err, len, [&] {
    const auto& nccl = api();
    check(nccl.finalize(c->comm), "ncclCommFinalize", c->comm);
    auto state = settle(c->comm, timeout_s);
    if (state == ncclInProgress) {
      write_error(std::runtime_error("finalizing the communicator did not finish in time"), err, len);
      return 2;
    }
    if (state != ncclSuccess) throw std::runtime_error("ncclCommFinalize: " + describe(state, c->comm));
    auto destroyed = nccl.destroy(c->comm);
    delete c;
    c = nullptr;  // destroyed (or not destroyable): never aborted after this
    if (destroyed != ncclSuccess && destroyed != ncclInProgress) {
      throw std::runtime_error(std::string("ncclCommDestroy: ") + nccl.error_string(destroyed));
    }
    return 0;
  });
  if (c != nullptr) dflash_nccl_abort(c);
  return status;
}

// Aborts the communicator (its in-flight collectives are cancelled) and frees it.
void dflash_nccl_abort(void* handle) {
  auto* c = static_cast<Comm*>(handle);
  if (c == nullptr) return;
  try {
    api().abort(c->comm);
  } catch (...) {
  }
  delete c;
}

}  // extern "C"
