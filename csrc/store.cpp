// PyTorch's c10d TCPStore, the key-value store torchrun rendezvouses through, for what crosses hosts: who is in the
// run, each step's quorum, failure notices and the NCCL ids. One process (the rendezvous host) serves it; every
// process holds a client. Stores cross the boundary as `c10::intrusive_ptr<c10d::Store>*`; values are byte strings,
// returned in buffers the caller frees with `dflash_store_free_bytes`. A deadline that passes returns 2 (c10d's
// DistStoreError: a wait or get that timed out); any other failure 1, with the message in `err`.
#include <optional>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <system_error>

#include "shim_error.h"

using StorePtr = c10::intrusive_ptr<c10d::Store>;

namespace {

constexpr int kTimedOut = 2;

// `guard` that tells a passed deadline apart from other failures.
template <typename F>
int guard_store(char* err, size_t len, F&& body) {
  try {
    return body();
  } catch (const c10::DistStoreError& e) {
    write_error(e, err, len);
    return kTimedOut;
  } catch (const std::exception& e) {
    write_error(e, err, len);
  } catch (...) {
    write_error("an unknown C++ exception", err, len);
  }
  return 1;
}

std::vector<uint8_t> bytes(const uint8_t* data, size_t size) { return std::vector<uint8_t>(data, data + size); }

// Hands `value` to the caller in a malloc'd buffer (freed by dflash_store_free_bytes).
void give(const std::vector<uint8_t>& value, uint8_t** out, size_t* out_len) {
  *out_len = value.size();
  *out = static_cast<uint8_t*>(std::malloc(value.empty() ? 1 : value.size()));
  if (*out == nullptr) throw std::bad_alloc();
  if (!value.empty()) std::memcpy(*out, value.data(), value.size());
}

// c10d logs a warning for every read whose deadline passes (two lines each), and here a deadline passing is a
// decision, not a fault: a host polling for its next assignment would log ten lines a second. Unless the user chose
// a level (TORCH_CPP_LOG_LEVEL), libtorch's C++ log shows errors only.
void quiet_timeouts() {
  if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr && FLAGS_caffe2_log_level < 2) FLAGS_caffe2_log_level = 2;
}

// The store's listening socket, on IPv4 (every interface, `port`; 0: any free one). libtorch's own listens
// dual-stack, where an IPv4 peer shows as `::ffff:a.b.c.d`, an address `/etc/hosts` never names: its server's
// lookup of each connecting peer's name (on its one thread, at every accept) then always asks DNS, which stalls
// the whole store for the resolver's timeout where DNS does not answer. On IPv4, `/etc/hosts` names the peers it
// lists (loopback always). The store takes the socket over.
int listen_ipv4(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "opening the store's socket");
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    int e = errno;
    ::close(fd);
    throw std::system_error(e, std::generic_category(), "listening on port " + std::to_string(port));
  }
  return fd;
}

// The port a listening socket is bound to.
int port_of(int fd) {
  sockaddr_in addr{};
  socklen_t len = sizeof addr;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::system_error(errno, std::generic_category(), "reading the store's port");
  }
  return ntohs(addr.sin_port);
}

}  // namespace

extern "C" {

// Serves the store on `port` (0: any free port) when `is_server`, else connects to host:port, retrying until
// `timeout_ms`, which also bounds every later operation unless it gives its own. `bound_port` receives the port.
// While a client connects, c10d logs each failed attempt at ERROR with libtorch's whole C++ stack (some 25 lines)
// before throwing the error this shim returns in one line. Unless the user chose a level (TORCH_CPP_LOG_LEVEL, the
// switch to see them), those lines are kept out: the log shows fatal messages only until the connection is made or
// has failed.
struct QuietConnect {
  int saved = FLAGS_caffe2_log_level;
  bool active = std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr;
  QuietConnect() {
    if (active) FLAGS_caffe2_log_level = 3;
  }
  ~QuietConnect() {
    if (active) FLAGS_caffe2_log_level = saved;
  }
};

int dflash_store_open(const char* host, int port, int is_server, int64_t timeout_ms, void** out, int* bound_port,
                      char* err, size_t len) {
  return guard_store(err, len, [&] {
    quiet_timeouts();
    std::optional<QuietConnect> quiet;
    if (is_server == 0) quiet.emplace();
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(port);
    opts.isServer = is_server != 0;
    if (opts.isServer) {
      int fd = listen_ipv4(port);
      opts.masterListenFd = fd;
      opts.port = static_cast<std::uint16_t>(port_of(fd));
    }
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    *bound_port = store->getPort();
    *out = new StorePtr(std::move(store));
    return 0;
  });
}

// Another connection to the same store, for another thread (a connection serialises its operations).
int dflash_store_clone(void* store, void** out, char* err, size_t len) {
  return guard_store(err, len, [&] {
    *out = new StorePtr((*static_cast<StorePtr*>(store))->clone());
    return 0;
  });
}

// The deadline of later operations without their own, and of connecting a clone.
int dflash_store_set_timeout(void* store, int64_t timeout_ms, char* err, size_t len) {
  return guard_store(err, len, [&] {
    (*static_cast<StorePtr*>(store))->setTimeout(std::chrono::milliseconds(timeout_ms));
    return 0;
  });
}

void dflash_store_close(void* store) { delete static_cast<StorePtr*>(store); }

void dflash_store_free_bytes(uint8_t* data) { std::free(data); }

int dflash_store_set(void* store, const char* key, const uint8_t* data, size_t size, char* err, size_t len) {
  return guard_store(err, len, [&] {
    (*static_cast<StorePtr*>(store))->set(key, bytes(data, size));
    return 0;
  });
}

// Waits up to `timeout_ms` for `key`, then reads it.
int dflash_store_get(void* store, const char* key, int64_t timeout_ms, uint8_t** out, size_t* out_len, char* err,
                     size_t len) {
  return guard_store(err, len, [&] {
    auto& s = *static_cast<StorePtr*>(store);
    s->wait({key}, std::chrono::milliseconds(timeout_ms));
    give(s->get(key), out, out_len);
    return 0;
  });
}

// Adds `delta` to the integer at `key` (0 when absent) and returns the sum: a counter, or a read with delta 0.
int dflash_store_add(void* store, const char* key, int64_t delta, int64_t* out, char* err, size_t len) {
  return guard_store(err, len, [&] {
    *out = (*static_cast<StorePtr*>(store))->add(key, delta);
    return 0;
  });
}

// Sets `key` to `desired` if it holds `expected` (or is absent and `expected` is empty); returns what it holds after.
int dflash_store_compare_set(void* store, const char* key, const uint8_t* expected, size_t expected_len,
                             const uint8_t* desired, size_t desired_len, uint8_t** out, size_t* out_len, char* err,
                             size_t len) {
  return guard_store(err, len, [&] {
    auto now = (*static_cast<StorePtr*>(store))
                   ->compareSet(key, bytes(expected, expected_len), bytes(desired, desired_len));
    give(now, out, out_len);
    return 0;
  });
}

// Whether every key exists, without waiting.
int dflash_store_check(void* store, const char* key, int* out, char* err, size_t len) {
  return guard_store(err, len, [&] {
    *out = (*static_cast<StorePtr*>(store))->check({key}) ? 1 : 0;
    return 0;
  });
}

int dflash_store_delete(void* store, const char* key, char* err, size_t len) {
  return guard_store(err, len, [&] {
    (*static_cast<StorePtr*>(store))->deleteKey(key);
    return 0;
  });
}

}  // extern "C"
